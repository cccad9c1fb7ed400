"""Background folds of catalog overlay tables (``processors/kinds/tree/store/folds.py``): none while a write runs, the newest
overlay of a chain only, the result kept only where the overlay still is, and byte for byte the full compile."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from processors.kinds.tree.store.folds import BackgroundFolds
from processors.kinds.tree.tables.overlay import is_overlay, overlay_tables

from test_tree_delta import assert_same, full


def chain(n_steps: int, seed: int = 0):
    rnd = random.Random(seed)
    items = {tuple(rnd.randint(3, 30) for _ in range(3)) for _ in range(300)}
    tables, out = full(items), []
    for _ in range(n_steps):
        remove = rnd.sample(sorted(items), 5)
        add = [tuple(rnd.randint(31, 60) for _ in range(3)) for _ in range(5)]
        tables = overlay_tables(tables, add, remove)
        items = (items - set(remove)) | set(add)
        out.append((tables, set(items)))
    return out


@pytest.fixture
def pool():
    with ThreadPoolExecutor(2) as executor:
        yield executor


def wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_fold_waits_for_writes_and_idle_and_keeps_the_newest_of_a_chain(pool):
    kept: dict[str, object] = {}
    done = threading.Event()

    def replace(sha, overlay, folded):
        if kept.get(sha) is overlay:
            kept[sha] = folded
        done.set()

    folds = BackgroundFolds(pool, replace, idle_s=0.05)
    steps = chain(3)
    folds.write_started()
    for k, (tables, _) in enumerate(steps):
        kept[f"v{k}"] = tables
        folds.schedule(f"v{k}", tables)
    time.sleep(0.3)
    assert not done.is_set()  # a write runs: nothing starts
    folds.write_ended()
    wait_for(done.is_set)
    time.sleep(0.2)
    assert folds.stats["folded"] == 1  # the newest of the chain only
    assert is_overlay(kept["v0"]) and is_overlay(kept["v1"])
    assert not is_overlay(kept["v2"])
    assert_same(kept["v2"], steps[2][1])
    folds.close()


def test_a_fold_whose_overlay_was_replaced_meanwhile_is_dropped(pool):
    kept: dict[str, object] = {}

    def replace(sha, overlay, folded):
        if kept.get(sha) is overlay:
            kept[sha] = folded

    folds = BackgroundFolds(pool, replace, idle_s=0.05)
    (tables, _), = chain(1)
    kept["v"] = tables
    folds.schedule("v", tables)
    kept["v"] = "something newer"
    wait_for(lambda: folds.stats["folded"] == 1)
    assert kept["v"] == "something newer"
    folds.close()


def test_closed_folds_start_nothing(pool):
    folds = BackgroundFolds(pool, lambda *a: pytest.fail("folded after close"), idle_s=0.02)
    folds.close()
    (tables, _), = chain(1)
    folds.schedule("v", tables)
    time.sleep(0.2)
    assert folds.stats == {"folded": 0, "stopped": 0}
