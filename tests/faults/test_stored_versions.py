"""A stored version means the same tokens forever, across manager restarts (real Redis, real tokenizer).

A tree given by ``path`` is read once, at the PUT; its content is stored with the version, and every later
compile (a restart, ``inspect``, a rollback) uses the stored content, never the file as it is today. A
manager that starts while the current version in Redis is unusable serves the newest usable earlier one.
A restart here is what Serve does after a crash: a new ``ConfigManager`` on the same Redis.
"""

from __future__ import annotations

import json
import os

import pytest

from manager_helpers import make_manager, run_closing

from deployments.manager import ConfigManager
from deployments.protocol import ServiceError
from deployments.storage.redis_server import connect_redis
from deployments.storage.store import ScenarioStore

pytestmark = pytest.mark.faults

ROOT, END = 1, 2


def tree_file(path: str, candidates: list[int]) -> None:
    """A tree whose root allows ``candidates``, each followed by the end token."""
    prefix = {str(ROOT): candidates, **{f"{ROOT}_{c}": [END] for c in candidates}}
    with open(path, "w", encoding="utf-8") as handle:
        json.dump({"start_token_id": ROOT, "end_token_id": END, "prefix_dict": prefix}, handle)


async def root_ids(manager: ConfigManager, name: str, version: int | None = None) -> list[int]:
    """The ids a fresh row may emit first (the console's tree view) for ``version`` (None: the served one)."""
    report = await manager.inspect(name, version, [], limit=100, last_only=True)
    return [e["id"] for e in report["steps"][-1]["allowed"]]


def served_root_ids(manager: ConfigManager, name: str) -> tuple[int, list[int]]:
    """What the manager hands to replicas for ``name``: (version, root candidates of those tables)."""
    served = manager.scenarios.served[name]
    tables = served.compiled.constraint
    return served.version, sorted(int(c) for c in tables.allowed(tables.root))


def test_tree_by_path_is_stored_and_survives_file_changes_and_restarts(tokenizer, data_dir):
    trees = os.path.join(data_dir, "trees")
    os.makedirs(trees, exist_ok=True)
    path = os.path.join(trees, "t.json")
    body = {"type": "tree", "path": "t.json"}

    tree_file(path, [10, 11])
    first = make_manager(tokenizer, data_dir)

    async def write_two_versions():
        assert (await first.put("t", body))["version"] == 1
        tree_file(path, [20, 21])
        assert (await first.put("t", body))["version"] == 2
        assert await root_ids(first, "t") == [20, 21]
        assert await root_ids(first, "t", 1) == [10, 11]

    run_closing(first, write_two_versions)
    tree_file(path, [30, 31])  # the file changes again after the last PUT

    # A restart compiles what was stored, not today's file: the served tables, inspect of every version.
    second = make_manager(tokenizer, data_dir)
    assert served_root_ids(second, "t") == (2, [20, 21])

    async def after_restart():
        assert await root_ids(second, "t") == [20, 21]
        assert await root_ids(second, "t", 2) == [20, 21]
        assert await root_ids(second, "t", 1) == [10, 11]
        record = await second.get("t", 1)
        assert record["scenario"]["path"] == path  # where the content was read from, for display
        assert record["scenario"]["content_sha256"] != (await second.get("t", 2))["scenario"]["content_sha256"]
        # A rollback restores the stored content of version 1.
        assert (await second.rollback("t", 1))["version"] == 3
        assert await root_ids(second, "t") == [10, 11]

    run_closing(second, after_restart)
    assert served_root_ids(second, "t") == (3, [10, 11])

    # With the file gone, a restart still serves the stored version, and every version can be inspected.
    os.remove(path)
    third = make_manager(tokenizer, data_dir)
    assert served_root_ids(third, "t") == (3, [10, 11])
    assert not third.scenarios.errors

    async def without_the_file():
        assert await root_ids(third, "t", 2) == [20, 21]
        # A new PUT by path with the file gone is refused; nothing is stored.
        with pytest.raises(ServiceError) as info:
            await third.put("t", body)
        assert info.value.status == 400 and "t.json" in info.value.message
        assert [v["version"] for v in await third.versions("t")] == [1, 2, 3]

    run_closing(third, without_the_file)


def test_stored_body_can_be_put_again_and_means_the_same_content(tokenizer, data_dir):
    """``GET`` a version and ``PUT`` its body back: the stored content, not the file, is what it means."""
    trees = os.path.join(data_dir, "trees")
    os.makedirs(trees, exist_ok=True)
    path = os.path.join(trees, "t.json")
    tree_file(path, [10, 11])
    manager = make_manager(tokenizer, data_dir)

    async def body():
        await manager.put("t", {"type": "tree", "path": "t.json"})
        stored = (await manager.get("t"))["scenario"]
        tree_file(path, [40, 41])
        assert (await manager.put("t", stored))["version"] == 2
        assert await root_ids(manager, "t") == [10, 11]
        # A content hash nothing was stored under is refused.
        with pytest.raises(ServiceError) as info:
            await manager.put("t", {**stored, "content_sha256": "0" * 64})
        assert info.value.status == 422 and "content_sha256" in info.value.message

    run_closing(manager, body)


def test_unusable_current_version_at_start_serves_the_last_good_one(tokenizer, data_dir):
    manager = make_manager(tokenizer, data_dir)
    good = {"type": "labels", "labels": ["yes", "no"]}

    async def put_good():
        assert (await manager.put("s", good))["version"] == 1
        assert (await manager.put("u", good))["version"] == 1

    run_closing(manager, put_good)
    # Another tool writes garbage as version 2 of "s" and a body that does not compile as version 2 of "u".
    raw = ScenarioStore(connect_redis(None, data_dir))
    raw.client.hset(raw.version_key("s", 2), mapping={"version": 2, "action": "put", "scenario": "{not json"})
    raw.client.rpush("cs:s:s:history", 2)
    raw.client.set(raw.current_key("s"), 2)
    raw.put("u", {"type": "labels", "labels": ["<|im_end|>"]})

    restarted = make_manager(tokenizer, data_dir)

    async def check():
        listing = await restarted.list()
        assert listing == [{"name": "s", "type": "labels", "version": 1}, {"name": "u", "type": "labels", "version": 1}]
        health = await restarted.health()
        assert health["status"] == "degraded"
        assert health["scenarios"] == {"s": 1, "u": 1}
        assert health["errors"]["s"]["version"] == 2 and health["errors"]["u"]["version"] == 2
        assert health["errors"]["s"]["serving"] == 1 and health["errors"]["u"]["serving"] == 1
        report = await restarted.inspect("s", None, [], last_only=True)
        assert report["version"] == 1
        # A good write repairs it.
        assert (await restarted.put("s", good))["version"] == 3
        assert "s" not in (await restarted.health())["errors"]

    run_closing(restarted, check)


def test_start_does_not_resurrect_a_deleted_scenario(tokenizer, data_dir):
    """The fallback looks back only to the last delete: before it, the scenario did not exist."""
    manager = make_manager(tokenizer, data_dir)

    async def history():
        await manager.put("d", {"type": "labels", "labels": ["yes", "no"]})
        await manager.delete("d")

    run_closing(manager, history)
    raw = ScenarioStore(connect_redis(None, data_dir))
    raw.put("d", {"type": "labels", "labels": []})  # invalid, written around the manager

    restarted = make_manager(tokenizer, data_dir)

    async def check():
        assert await restarted.list() == []
        health = await restarted.health()
        assert health["errors"]["d"]["version"] == 3 and health["errors"]["d"].get("serving") is None

    run_closing(restarted, check)
