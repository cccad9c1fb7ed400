"""The packed tables of a fixed-depth catalog (``processors/kinds/tree/packed.py``) answer as the ``MaskTables``
compiled from the same items (``processors.kinds.tree.catalog_tables.catalog_tables``): walked along every item and off it, for
random catalogs of several depths, widths and token ranges. No model needed."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from processors.kinds.tree.catalog_tables import catalog_tables
from processors.kinds.tree.packed import DONE, LEAF, PackedTree
from processors.tables import item_metrics

END = 2


@dataclass
class Items:
    start_token_id: int
    end_token_id: int
    flat: np.ndarray
    lengths: np.ndarray

    def __len__(self) -> int:
        return int(self.lengths.size)


def _catalog(rng, n: int, depth: int, width: int, low: int, vocab: int) -> np.ndarray:
    codes = rng.choice(np.arange(low, vocab), size=(depth, width), replace=False) if width * depth < vocab - low \
        else rng.integers(low, vocab, size=(depth, width))
    cols = [codes[d][rng.integers(0, width, size=n)] for d in range(depth)]
    return np.stack(cols, axis=1).astype(np.int64)


CASES = [  # (items drawn, depth, codes per level, smallest token id, vocabulary)
    (1, 1, 1, 10, 100),
    (50, 1, 40, 10, 100),
    (300, 2, 20, 3, 1000),
    (2000, 3, 16, 1000, 49152),
    (4000, 4, 8, 100, 151_000),
    (3000, 4, 64, 3, 151_000),  # token spans wider than 65,536: int32 codes
]


@pytest.mark.parametrize("n,depth,width,low,vocab", CASES)
def test_packed_tables_answer_as_the_compiled_tables(n, depth, width, low, vocab):
    rng = np.random.default_rng(n * 31 + depth)
    ids = _catalog(rng, n, depth, width, low, vocab)
    packed = PackedTree.from_items(ids, END, vocab)
    unique = np.unique(ids, axis=0)
    old = catalog_tables(Items(1, END, unique.reshape(-1).astype(np.int32), np.full(len(unique), depth)), vocab)
    min_rem, counts, _, _ = item_metrics(old)
    assert packed.n_items == len(unique)
    assert packed.n_inner == old.n_states and packed.n_edges == old.n_edges
    assert packed.item_count(np.asarray([packed.root]))[0] == len(unique) == counts[old.root]
    for item in unique[rng.permutation(len(unique))[:300]]:
        a, b = old.root, packed.root
        for pos, token in enumerate(item.tolist()):
            assert packed.allowed(b).tolist() == old.allowed(a).tolist()
            assert packed.item_count(np.asarray([b]))[0] == counts[a]
            assert packed.min_remaining(np.asarray([b]))[0] == min_rem[a] == depth + 1 - pos
            for wrong in (0, END, low - 1, vocab - 1, int(token) + 1):
                assert packed.step(b, wrong) == old.step(a, wrong)
            a, b = old.step(a, int(token)), packed.step(b, int(token))
            assert (a >= 0) == (b >= 0) and (a < 0) <= (a == b)
        assert a == b == LEAF
        assert packed.step(b, END) == old.step(a, END) == DONE


@pytest.mark.parametrize("n,depth,width,low,vocab", CASES)
def test_many_rows_at_once_match_one_at_a_time(n, depth, width, low, vocab):
    rng = np.random.default_rng(n + depth)
    packed = PackedTree.from_items(_catalog(rng, n, depth, width, low, vocab), END, vocab)
    states = rng.integers(0, packed.n_inner, size=257)
    row, token, nxt = packed.children(states)
    for r, s in enumerate(states.tolist()):
        assert token[row == r].tolist() == packed.allowed(s).tolist()
        assert nxt[row == r].tolist() == [packed.step(s, int(t)) for t in token[row == r]]
    # transitions: every child token, some tokens without an edge, the end token, LEAF and DONE rows
    pick = rng.integers(0, token.size, size=300)
    rows = np.concatenate([states[row[pick]], states[:40], states[:10], [LEAF, DONE, LEAF]])
    toks = np.concatenate([token[pick], rng.integers(0, vocab, size=40), np.full(10, END), [5, 5, END]])
    expected = [packed.step(int(s), int(t)) for s, t in zip(rows, toks)]
    assert packed.advance(rows, toks).tolist() == expected
    counts = packed.item_count(states)
    assert counts.tolist() == [int(packed.item_count(np.asarray([s]))[0]) for s in states.tolist()]


def test_bad_items_are_refused():
    with pytest.raises(ValueError, match="end token"):
        PackedTree.from_items([[5, END]], END, 100)
    with pytest.raises(ValueError, match=r"\[0, 100\)"):
        PackedTree.from_items([[5, 100]], END, 100)
    with pytest.raises(ValueError, match="non-empty"):
        PackedTree.from_items(np.zeros((0, 3), dtype=np.int64), END, 100)


def test_bytes_per_item_of_four_token_ids():
    rng = np.random.default_rng(7)
    packed = PackedTree.from_items(rng.integers(1000, 2024, size=(200_000, 4)), END, 49152)
    assert packed.codes.dtype == np.uint16 and packed.offsets.dtype == np.uint32
    assert packed.nbytes / packed.n_items < 16  # about 77 for MaskTables with its keys, targets and metrics


def test_wide_token_spans_take_the_lexsort_path():
    """Columns whose spans do not fit 63 bits together are sorted column by column: the same tables."""
    rng = np.random.default_rng(3)
    ids = rng.integers(3, 151_000, size=(5000, 5))  # 5 x 18 bits: over 63
    ids[::7] = ids[1::7][: ids[::7].shape[0]]  # some duplicates
    packed = PackedTree.from_items(ids, END, 151_000)
    unique = np.unique(ids, axis=0)
    assert packed.n_items == len(unique)
    for item in unique[:200]:
        state = packed.root
        for token in item.tolist():
            assert token in packed.allowed(state).tolist()
            state = packed.step(state, token)
        assert state == LEAF
