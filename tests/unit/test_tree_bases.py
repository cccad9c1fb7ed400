"""The manager's read of a served inline tree's items for its first PATCH (``processors/kinds/tree/store/inline_bases.py``):
it waits while writes keep coming, starts by itself once none has come for ``idle_s``, starts at once when a PATCH
asks first, and gives the tree's exact items. Real tokenizer, a real compiled tree, real threads."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from deployments.examples import build_phrase_tree, chat_root_token_id
from processors.kinds.tree.store.inline_bases import InlineTreeBases
from processors import compile_scenario
from processors.scenarios import load_scenario

PHRASES = ["red apple", "green pear", "blue sky at night", "red wine"]
log = logging.getLogger(__name__)


@pytest.fixture(scope="module")
def served(tokenizer):
    dot = tokenizer.encode(".", add_special_tokens=False)[0]
    tree = build_phrase_tree(tokenizer, PHRASES, root=chat_root_token_id(tokenizer), end=dot)
    body = {"type": "tree", "tree": tree}
    compiled = compile_scenario(load_scenario(body), tokenizer)
    expected = sorted(tuple(tokenizer.encode(" " + p, add_special_tokens=False)) for p in PHRASES)  # (no end token)
    return body, tree, compiled, expected


def _items(catalog) -> list[tuple[int, ...]]:
    return sorted(tuple(item) for item in catalog.items)


def test_the_read_waits_while_writes_come_and_starts_when_none_does(tokenizer, served):
    body, tree, compiled, expected = served
    with ThreadPoolExecutor(2) as pool:
        bases = InlineTreeBases(pool, lambda: len(tokenizer), idle_s=0.4)
        bases.note_form("shop", compiled, body, tree["start_token_id"])
        bases.note_installed("shop", 3, compiled)
        for _ in range(6):  # a write every 0.2 s: never idle for 0.4 s
            time.sleep(0.2)
            bases.postpone()
        assert bases.stats == {"idle_reads": 0, "patch_reads": 0, "stopped": 0}
        deadline = time.monotonic() + 10
        while bases.stats["idle_reads"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert bases.stats["idle_reads"] == 1
        held = bases.held("shop", 3, log)
        assert held is not None and held.version == 3 and held.kind == "tree" and held.items == len(PHRASES)
        assert _items(held.base[0]) == expected
        assert bases.stats["patch_reads"] == 0  # the PATCH found it read
        assert bases.held("shop", 4, log) is None  # another version is current: the PATCH reads the stored body
        bases.close()


def test_a_patch_that_comes_first_starts_the_read_at_once(tokenizer, served):
    body, tree, compiled, expected = served
    with ThreadPoolExecutor(2) as pool:
        bases = InlineTreeBases(pool, lambda: len(tokenizer), idle_s=3600)
        bases.note_form("shop", compiled, body, tree["start_token_id"])
        bases.note_installed("shop", 1, compiled)
        held = bases.held("shop", 1, log)
        assert held is not None and _items(held.base[0]) == expected
        assert bases.stats == {"idle_reads": 0, "patch_reads": 1, "stopped": 0}
        bases.note_installed("shop", 2, None)  # deleted: nothing held
        assert bases.held("shop", 2, log) is None
        bases.close()


def test_a_write_stops_a_running_idle_read_and_it_starts_again_when_idle(tokenizer):
    """A read started by the idle timer is stopped by a write (its work dropped), does not start while the write runs,
    and is read again once idle; a read a PATCH waits for is not stopped by a write. 400,000 random items: the read runs long enough to be caught."""
    import types

    import numpy as np

    from processors.kinds.tree.catalog.catalog import Catalog
    from processors.kinds.tree.tables.compile import catalog_tables

    rng = np.random.default_rng(5)
    rows = np.unique(rng.integers(1000, 40000, size=(400_000, 4)), axis=0)
    items = [tuple(r) for r in rows.tolist()]
    tables = catalog_tables(Catalog.from_items(7, 2, items), len(tokenizer))
    compiled = types.SimpleNamespace(constraint=tables)  # what the bases read: the served tables
    with ThreadPoolExecutor(2) as pool:
        bases = InlineTreeBases(pool, lambda: len(tokenizer), idle_s=0.2)
        bases.note_form("big", compiled, {"type": "tree"}, 7)
        bases.note_installed("big", 1, compiled)
        deadline = time.monotonic() + 30
        while bases.stats["idle_reads"] == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        bases.write_started()  # a write while it runs: stopped, and none starts while the write runs
        assert bases.stats["stopped"] == 1
        time.sleep(1.0)
        assert bases.stats["idle_reads"] == 1
        bases.write_ended()
        while bases.stats["idle_reads"] < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert bases.stats["idle_reads"] == 2  # read again once idle
        held = bases.held("big", 1, log)  # a PATCH waits for it (a write meanwhile does not stop it)
        assert held is not None and held.items == len(items)
        assert sorted(held.base[0].items) == items
        assert held.base[1].version == tables.version  # the catalog tables of the same items
        bases.postpone()
        assert bases.stats["stopped"] == 1
        bases.close()
