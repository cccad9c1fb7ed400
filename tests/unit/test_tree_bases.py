"""The manager's read of a served inline tree's items for its first PATCH (``processors/kinds/tree/inline_bases.py``):
it waits while writes keep coming, starts by itself once none has come for ``idle_s``, starts at once when a PATCH
asks first, and gives the tree's exact items. Real tokenizer, a real compiled tree, real threads."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from deployments.examples import build_phrase_tree, chat_root_token_id
from processors.kinds.tree.inline_bases import InlineTreeBases
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
        assert bases.stats == {"idle_reads": 0, "patch_reads": 0}
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
        assert bases.stats == {"idle_reads": 0, "patch_reads": 1}
        bases.note_installed("shop", 2, None)  # deleted: nothing held
        assert bases.held("shop", 2, log) is None
        bases.close()
