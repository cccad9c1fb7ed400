"""Catalog tables at scale: the service's ``MaskTables`` (``processors.kinds.tree.tables.compile.catalog_tables``)
against a STATIC-style kernel, in one run.

For each ``--items`` size, a random catalog of 4-token semantic ids (``--codebook`` codes per level, each level its
own range of token ids below 49,152, as semantic-id tokens are added to a vocabulary) is built. Each table format is
compiled in its own subprocess so its compile time and peak memory are its own; then, in this process, on the same
items:

* bytes per item of each format (``MaskTables``: its arrays and the per-state item metrics, what a replica holds;
  ``manager_bytes_per_item`` adds the ``max_remaining`` the manager keeps for deltas);
* the beam step's table work for ``--beams`` rows at random states of each depth: gathering every row's children
  (tokens and targets, what ``engines/transformers/tree_beams.py`` does) and advancing every row by one of its
  children (what the cursors do), for ``MaskTables`` (CSR gather; ``MaskTables.find_edges``, the service's batched
  search inside each row's edges, and beside it the global ``state * V + token`` keys searchsorted that the service
  used before it dropped that array, the keys built here outside the timing) and a STATIC-style kernel written here from the paper's
  description (the first two levels dense: a ``codebook x codebook`` table of child ids; deeper levels CSR with an
  explicit target per edge);
* the whole candidate ranking of the step on top (the children's logits gathered from a ``beams x 49,152`` logits
  matrix, the row scores added, top ``2 x beams``), so the table work is seen against the step it is part of.

The result is one JSON object (``rows``: one per size); progress on stderr.

    python bench/catalog_scale.py [--items 1000000,10000000,100000000] [--beams 256] [--codebook 256] [--repeat 20]
        [--whole-max 10000000] [--no-step]

``MaskTables`` are compiled as the service compiles them (``catalog_tables``: in chunks of the root's subtrees above
``tables.chunks.CHUNK_IDS`` ids) at every size, and up to ``--whole-max`` items also whole, every item at once (the
compile before the chunked one: about 260 bytes per item at its peak, 26 GB at 10^8), so the two compare in one run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import emit, log, peak_rss_bytes, ratio, run_json_subprocess  # noqa: E402

VOCAB = 49_152
END = 2
DEPTH = 4


def make_ids(n: int, codebook: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    ids = np.empty((n, DEPTH), dtype=np.int32)
    for level in range(DEPTH):  # each level its own token range; column by column (10^8 items: 1.6 GB, not 3.2)
        ids[:, level] = rng.integers(0, codebook, size=n, dtype=np.int32) + (1000 + level * codebook)
    return ids


class _Items:
    def __init__(self, ids: np.ndarray):
        self.start_token_id, self.end_token_id = 1, END
        self.flat = ids.reshape(-1)
        self.lengths = np.full(ids.shape[0], ids.shape[1], dtype=np.int64)

    def __len__(self) -> int:
        return int(self.lengths.size)


def build(fmt: str, ids: np.ndarray):
    if fmt == "whole":  # every item compiled at once: the service's compile before the chunked one
        from processors.kinds.tree.tables.trie import whole_tables

        return whole_tables(_Items(ids), VOCAB)
    from processors.kinds.tree.tables.compile import catalog_tables

    return catalog_tables(_Items(ids), VOCAB)  # the items deduplicated by the caller (as a catalog's are)


def mask_tables_bytes(tables) -> tuple[int, int]:
    """(what a replica holds: the arrays and the item metrics; what the manager holds: that and ``max_remaining``,
    which it keeps for deltas and never sends)."""
    from processors.tables import item_metrics

    min_rem, counts, _, _ = item_metrics(tables)
    extra = tables.__dict__.get("_max_remaining")
    replica = int(tables.nbytes + min_rem.nbytes + counts.nbytes)
    own = extra is not None and not np.shares_memory(extra, min_rem)  # (a uniform catalog's is min_remaining itself)
    return replica, replica + (int(extra.nbytes) if own else 0)


def compile_child(fmt: str, n: int, codebook: int) -> dict:
    """In a subprocess: compile one format, report its time and this process's peak memory above the items."""
    ids = _distinct(make_ids(n, codebook))  # a catalog's items are distinct before its tables are compiled
    before = peak_rss_bytes()
    t0 = time.perf_counter()
    tables = build(fmt, ids)
    seconds = time.perf_counter() - t0
    nbytes, manager_bytes = mask_tables_bytes(tables)
    return {"compile_s": round(seconds, 3), "peak_rss_mb": round(peak_rss_bytes() / 2**20),
            "peak_above_items_mb": round((peak_rss_bytes() - before) / 2**20), "bytes": nbytes,
            "manager_bytes": manager_bytes}


def _distinct(ids: np.ndarray) -> np.ndarray:
    """The distinct rows of ``ids`` (a catalog's items are distinct), sorted: one sort of each row packed into an
    int64 (``np.unique(axis=0)`` of 10^8 rows would take many times the items' memory)."""
    codes = ids - ids.min(axis=0)
    bits = max(int(codes.max()), 1).bit_length()
    assert bits * ids.shape[1] <= 63, "rows too wide to pack in one int64"
    key = np.zeros(ids.shape[0], dtype=np.int64)
    for c in range(ids.shape[1]):
        key <<= bits
        key |= codes[:, c].astype(np.int64)
    del codes
    key.sort()
    keep = np.ones(key.size, dtype=bool)
    keep[1:] = key[1:] != key[:-1]
    key = key[keep]
    out = np.empty((key.size, ids.shape[1]), dtype=ids.dtype)
    mask = (1 << bits) - 1
    for c in range(ids.shape[1] - 1, -1, -1):
        out[:, c] = (key & mask) + ids[:, c].min()
        key >>= bits
    return out


# -- the step's table work --------------------------------------------------------------------------------------
def old_children(tables, states: np.ndarray):
    offsets = tables.offsets
    lo = offsets[states]
    lens = offsets[states + 1] - lo
    ends = np.cumsum(lens)
    edge = np.arange(int(ends[-1]), dtype=np.int64) + np.repeat(lo + lens - ends, lens)
    row = np.repeat(np.arange(states.size, dtype=np.int64), lens)
    return row, tables.tokens[edge].astype(np.int64), tables.next_state[edge]


def old_advance(tables, states: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    i = tables.find_edges(states, tokens)
    return np.where(i >= 0, tables.next_state[np.maximum(i, 0)], -1)


def global_keys(tables) -> np.ndarray:
    """``state * V + token`` per edge: the array MaskTables kept (8 bytes per edge) until ``find_edges``."""
    return np.repeat(np.arange(tables.n_states, dtype=np.int64) * tables.vocab_size, np.diff(tables.offsets)) + tables.tokens


def keys_advance(tables, keys: np.ndarray, states: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    want = states * tables.vocab_size + tokens
    i = np.minimum(np.searchsorted(keys, want), keys.size - 1)
    return np.where(keys[i] == want, tables.next_state[i], -1)


class StaticKernel:
    """STATIC-style tables for the bench: levels 0 and 1 dense (child id per code, -1 absent), deeper levels CSR
    with tokens and an explicit target per edge (int32), states numbered per level."""

    def __init__(self, ids: np.ndarray, codebook: int):
        ids = _distinct(ids)
        base = 1000 + np.arange(DEPTH) * codebook
        c = ids - base
        self.codebook, self.base = codebook, base
        self.dense1 = np.full((1, codebook), -1, dtype=np.int32)  # root -> level-1 state (= code)
        self.dense1[0, np.unique(c[:, 0])] = np.unique(c[:, 0])
        self.dense2 = np.full((codebook, codebook), -1, dtype=np.int32)  # level-1 state x code -> level-2 state
        pair = np.unique(c[:, 0] * codebook + c[:, 1])
        self.dense2.reshape(-1)[pair] = np.arange(pair.size, dtype=np.int32)
        s2 = np.searchsorted(pair, c[:, 0] * codebook + c[:, 1])
        # level 2 -> 3 CSR, level 3 -> leaf CSR
        k3 = np.unique(s2.astype(np.int64) * codebook + c[:, 2])
        self.off2 = np.zeros(pair.size + 1, dtype=np.int64)
        np.cumsum(np.bincount(k3 // codebook, minlength=pair.size), out=self.off2[1:])
        self.tok2 = (k3 % codebook + base[2]).astype(np.int32)
        self.nxt2 = np.arange(k3.size, dtype=np.int32)
        s3 = np.searchsorted(k3, s2.astype(np.int64) * codebook + c[:, 2])
        k4 = np.unique(s3.astype(np.int64) * codebook + c[:, 3])
        self.off3 = np.zeros(k3.size + 1, dtype=np.int64)
        np.cumsum(np.bincount(k4 // codebook, minlength=k3.size), out=self.off3[1:])
        self.tok3 = (k4 % codebook + base[3]).astype(np.int32)
        self.nxt3 = np.full(k4.size, -1, dtype=np.int32)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.dense1, self.dense2, self.off2, self.tok2, self.nxt2, self.off3,
                                      self.tok3, self.nxt3))

    def children(self, level: int, states: np.ndarray):
        if level == 0:
            row, code = np.nonzero(self.dense1[np.zeros(states.size, dtype=np.int64)] >= 0)
            return row, code + self.base[0], self.dense1[0, code]
        if level == 1:
            rows = self.dense2[states]
            row, code = np.nonzero(rows >= 0)
            return row, code + self.base[1], rows[row, code]
        off, tok, nxt = (self.off2, self.tok2, self.nxt2) if level == 2 else (self.off3, self.tok3, self.nxt3)
        lo = off[states]
        lens = off[states + 1] - lo
        ends = np.cumsum(lens)
        edge = np.arange(int(ends[-1]), dtype=np.int64) + np.repeat(lo + lens - ends, lens)
        return np.repeat(np.arange(states.size), lens), tok[edge], nxt[edge]


def timed(fn, repeat: int) -> float:
    fn()
    best = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best.append(time.perf_counter() - t0)
    best.sort()
    return best[len(best) // 2]


def rank(row: np.ndarray, token: np.ndarray, logits, scores, k: int):
    import torch

    r = torch.from_numpy(row)
    t = torch.from_numpy(np.asarray(token, dtype=np.int64))
    cand = logits[r, t] + scores[r]
    return torch.topk(cand, min(k, cand.numel()))


def step_rows(n: int, codebook: int, beams: int, repeat: int) -> dict:
    import torch

    ids = make_ids(n, codebook)
    old = build("old", _distinct(ids))
    keys = global_keys(old)
    static = StaticKernel(ids, codebook)
    rng = np.random.default_rng(1)
    logits = torch.randn(beams, VOCAB)
    scores = torch.randn(beams)
    out = {}
    for level in range(DEPTH):
        # the same `beams` paths in each format: the states reached by random items' first `level` tokens
        pick = ids[rng.integers(0, n, size=beams)]
        o_states = np.full(beams, old.root, dtype=np.int64)
        s_states = np.zeros(beams, dtype=np.int64)
        for d in range(level):
            o_states = np.asarray([old.step(int(s), int(t)) for s, t in zip(o_states, pick[:, d])])
            if d == 0:
                s_states = pick[:, 0] - static.base[0]
            elif d == 1:
                s_states = static.dense2[s_states, pick[:, 1] - static.base[1]].astype(np.int64)
        o_row, o_tok, _ = old_children(old, o_states)
        nxt_tok = pick[:, level]
        t_old = timed(lambda: old_children(old, o_states), repeat)
        t_old_adv = timed(lambda: old_advance(old, o_states, nxt_tok), repeat)
        t_keys_adv = timed(lambda: keys_advance(old, keys, o_states, nxt_tok), repeat)
        assert np.array_equal(old_advance(old, o_states, nxt_tok), keys_advance(old, keys, o_states, nxt_tok))
        row = {"children": int(o_tok.size),
               "gather_ms": {"mask_tables": round(t_old * 1e3, 3)},
               "advance_ms": {"mask_tables": round(t_old_adv * 1e3, 3), "global_keys": round(t_keys_adv * 1e3, 3)},
               "find_edges_vs_global_keys": ratio(t_old_adv, t_keys_adv)}
        if level < 2:
            t_static = timed(lambda: static.children(level, s_states), repeat)
            row["gather_ms"]["static"] = round(t_static * 1e3, 3)
            row["static_vs_mask_tables_gather"] = ratio(t_static, t_old)
        t_rank_old = timed(lambda: rank(*old_children(old, o_states)[:2], logits, scores, 2 * beams), repeat)
        row["step_ms"] = {"mask_tables": round(t_rank_old * 1e3, 3)}
        out[f"depth_{level}"] = row
        log(f"  depth {level}: {row}")
    # the STATIC kernel's CSR levels, timed on its own state numbering (random states of each level)
    for level, off in ((2, static.off2), (3, static.off3)):
        states = rng.integers(0, off.size - 1, size=beams)
        out[f"depth_{level}"]["gather_ms"]["static"] = round(timed(lambda: static.children(level, states), repeat) * 1e3, 3)
    out["static_bytes_per_item"] = round(static.nbytes / n, 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", default="1000000,10000000,100000000")
    ap.add_argument("--beams", type=int, default=256)
    ap.add_argument("--codebook", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--whole-max", type=int, default=10_000_000,
                    help="largest size at which the whole compile (every item at once, the compile before the "
                         "chunked one) runs too: about 260 bytes of compile peak per item")
    ap.add_argument("--no-step", action="store_true", help="compile rows only (no beam-step timing)")
    ap.add_argument("--child", nargs=3, metavar=("FORMAT", "ITEMS", "CODEBOOK"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        emit(compile_child(args.child[0], int(args.child[1]), int(args.child[2])))
        return
    rows = []
    for n in [int(x) for x in args.items.split(",")]:
        log(f"{n:,} items")
        row: dict = {"items": n}
        formats = ["mask_tables"] + (["whole"] if n <= args.whole_max else [])
        for fmt in formats:
            res = run_json_subprocess([__file__, "--child", fmt, str(n), str(args.codebook)], timeout=3600)
            res["bytes_per_item"] = round(res.pop("bytes") / n, 2)
            res["manager_bytes_per_item"] = round(res.pop("manager_bytes") / n, 2)
            row[fmt] = res
            log(f"  {fmt}: {res}")
        if "whole" not in row:
            row["whole"] = f"not compiled above --whole-max {args.whole_max:,} items"
        else:
            row["chunked_vs_whole"] = {"compile": ratio(row["mask_tables"]["compile_s"], row["whole"]["compile_s"]),
                                       "peak_above_items": ratio(row["mask_tables"]["peak_above_items_mb"],
                                                                 row["whole"]["peak_above_items_mb"])}
        if not args.no_step:
            row["step"] = step_rows(n, args.codebook, args.beams, args.repeat)
        rows.append(row)
    emit({"bench": "catalog_scale", "beams": args.beams, "codebook": args.codebook, "depth": DEPTH, "rows": rows})


if __name__ == "__main__":
    main()
