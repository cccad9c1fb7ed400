"""Request filters over item metadata: what resolving a filter costs and what it adds to a decode step, against the
alternative users have today (one stored scenario per rule, its tables compiled from the items the rule keeps).

For each ``--items`` size a random catalog of 4-token semantic ids (``--codebook`` codes per level) gets metadata
columns (``region``: 8 values, ``stock``: 0-99, ``published``: a timestamp over a year; built as columns,
``ItemMetadata.from_columns``) and its ``MaskTables`` (``catalog_tables``). Then, for filters of three clauses that
pass about 50%, 1% and 0.01% of the items:

* **resolve**: ``parse_filter`` + ``Filter.mask`` (the items that pass) and ``filter_book`` (per state the items left
  out: the whole resolve the lazy one replaced), in ms; the items' terminals (``item_terminals``) and the slot index
  (``SlotIndex.build``), once per catalog version, not per filter, are reported on their own;
* **lazy, cold**: what the service does for a filter new to a version (``LazyFilter`` over the ``SlotIndex``): the
  filter checked, its blocks, the root's count a 16-beam ``n`` 10 request's admission asks (cap 17) and the beam plan
  of 16 beams at every depth of random passing items, once (``lazy_cold_16_beams_ms``, the median of 3); and the
  lane step and the 256-beam plan with the lazy book (``lazy_lane_step_ratio``, ``lazy_beam_plan_ratio``, against
  the same unfiltered steps);
* **step**: the table work of one decode step of ``--rows`` rows (``TreeCursor.step`` + ``advance`` of each row
  along a random path; the per-row path that item controls take), with the filter's book against without a filter:
  ``step_ratio`` against the same per-row path with an ``exclude`` book that leaves nothing out (what a request
  with item controls costs today), ``step_ratio_vs_bare`` against rows with no item controls at all;
* **lane**: the vector lane's step as the engine runs it for a batch of ``--rows`` sampled rows (``mask_rows`` on a
  logits batch + ``advance_rows``; filtered rows read the filter's edge mask), filtered against unfiltered
  (``lane_step_ratio``); **beam plan**: the beam step's table work for 256 beams (``plan_tree_beams``), filtered
  against unfiltered (``beam_plan_ratio``);
* **per-rule scenario** (today's alternative): the tables of only the items that pass, compiled (``catalog_tables``),
  their time and bytes: what a ``PUT`` of one scenario per rule costs, for each rule.

One JSON object on stdout (``rows``), progress on stderr.

    python bench/filters.py [--items 1000000,10000000] [--codebook 256] [--rows 16] [--steps 200]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import emit, log, ratio  # noqa: E402

VOCAB = 49_152
END = 2
DEPTH = 4
REGIONS = ["eu", "us", "apac", "latam", "mena", "cis", "africa", "oceania"]
#: filters of three clauses and the share of items each passes (about)
FILTERS = {
    "50%": {"region": {"$in": ["eu", "us", "apac", "latam"]}, "stock": {"$gte": 0}, "published": {"$gte": 0}},
    "1%": {"region": "eu", "stock": {"$lt": 8}, "published": {"$gte": 1}},
    "0.01%": {"region": "eu", "stock": {"$eq": 7}, "published": {"$gte": 31_536_000 * 0.875}},
}


class _Items:
    def __init__(self, ids: np.ndarray):
        self.start_token_id, self.end_token_id = 1, END
        self.flat = ids.reshape(-1).astype(np.int64)
        self.lengths = np.full(ids.shape[0], ids.shape[1], dtype=np.int64)

    def __len__(self) -> int:
        return int(self.lengths.size)


def make_catalog(n: int, codebook: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    ids = np.empty((n, DEPTH), dtype=np.int32)
    for level in range(DEPTH):
        ids[:, level] = rng.integers(0, codebook, size=n, dtype=np.int32) + (1000 + level * codebook)
    ids = np.unique(ids, axis=0)
    m = ids.shape[0]
    columns = {
        "region": (REGIONS, rng.integers(0, len(REGIONS), size=m)),
        "stock": rng.integers(0, 100, size=m).astype(np.float64),
        "published": rng.integers(0, 31_536_000, size=m).astype(np.float64),
    }
    return ids, columns


def ms(seconds: float) -> float:
    return round(seconds * 1000, 2)


def step_seconds(tables, ids: np.ndarray, rows: int, steps: int, request_of, seed: int = 1) -> float:
    """Seconds of ``TreeCursor.step`` + ``advance`` for ``rows`` rows along random items' paths, ``steps`` steps in
    all (rows restart at the root when their item ends)."""
    from processors.tree import TreeCursor

    rng = np.random.default_rng(seed)
    picks = ids[rng.integers(0, ids.shape[0], size=rows * (steps // DEPTH + 2))]
    cursors = [TreeCursor(tables).bind(request=request_of()) for _ in range(rows)]
    positions = [0] * rows
    paths = [list(picks[i]) + [END] for i in range(rows)]
    next_pick = rows
    t0 = time.perf_counter()
    for _ in range(steps):
        for r, cursor in enumerate(cursors):
            cursor.step()
            token = int(paths[r][positions[r]])
            cursor.advance(token)
            positions[r] += 1
            if token == END:
                cursors[r] = TreeCursor(tables).bind(request=request_of())
                paths[r], positions[r] = list(picks[next_pick % len(picks)]) + [END], 0
                next_pick += 1
    return time.perf_counter() - t0


def lane_seconds(tables, ids: np.ndarray, rows: int, steps: int, request_of, seed: int = 2) -> float:
    """Seconds of the vector lane's step (``mask_rows`` on a ``rows x vocab`` logits batch + ``advance_rows``) for
    ``rows`` sampled rows walking random items (a row restarts when its item ends), ``steps`` steps: what the
    engine runs per decode step for a batch of tree rows (``request_of()``: each row's item controls)."""
    import torch

    from processors import CompiledScenario, RowCursor
    from processors.lanes import advance_rows, mask_rows

    compiled = CompiledScenario(kind="tree", constraint=tables, think=None, eos_token_ids=(END,), vocab_size=VOCAB)
    rng = np.random.default_rng(seed)
    picks = ids[rng.integers(0, ids.shape[0], size=rows * (steps // DEPTH + 2))]

    def row():
        return RowCursor(compiled, None, eos_token_ids=(END,), max_new_tokens=64, items=request_of())

    cursors = [row() for _ in range(rows)]
    paths = [list(picks[i]) + [END] for i in range(rows)]
    positions = [0] * rows
    next_pick = rows
    scores = torch.zeros(rows, VOCAB)
    spent = 0.0
    for _ in range(steps):
        tokens = [int(paths[r][positions[r]]) for r in range(rows)]
        t0 = time.perf_counter()
        mask_rows(scores, cursors)
        advance_rows(cursors, tokens)
        spent += time.perf_counter() - t0
        for r in range(rows):
            positions[r] += 1
            if tokens[r] == END:
                cursors[r] = row()
                paths[r], positions[r] = list(picks[next_pick % len(picks)]) + [END], 0
                next_pick += 1
    return spent


def beam_plan_seconds(tables, ids: np.ndarray, beams: int, request, repeats: int = 20, seed: int = 3) -> float:
    """Seconds of the beam step's table work (``plan_tree_beams``: every beam's allowed children at once) for
    ``beams`` beams at each depth of random items' paths, ``repeats`` times per depth."""
    from processors import CompiledScenario, RowCursor
    from processors.lane_beams import plan_tree_beams
    from processors.lanes import advance_rows

    compiled = CompiledScenario(kind="tree", constraint=tables, think=None, eos_token_ids=(END,), vocab_size=VOCAB)
    rng = np.random.default_rng(seed)
    picks = ids[rng.integers(0, ids.shape[0], size=beams)]
    cursors = [RowCursor(compiled, None, eos_token_ids=(END,), max_new_tokens=64, items=request) for _ in range(beams)]
    spent = 0.0
    for depth in range(DEPTH):
        t0 = time.perf_counter()
        for _ in range(repeats):
            assert plan_tree_beams(cursors) is not None
        spent += time.perf_counter() - t0
        advance_rows(cursors, [int(p[depth]) for p in picks])
    return spent


def run_size(n: int, codebook: int, rows: int, steps: int) -> dict:
    from processors.items import ItemBook, ItemRequest
    from processors.kinds.tree.tables.compile import catalog_tables
    from processors.kinds.tree.filters.edges import filter_book, item_terminals
    from processors.kinds.tree.filters.language import parse_filter
    from processors.kinds.tree.filters.metadata import ItemMetadata

    log(f"{n:,} items: catalog and metadata")
    ids, columns = make_catalog(n, codebook)
    items = _Items(ids)
    t0 = time.perf_counter()
    tables = catalog_tables(items, VOCAB)
    compile_all = time.perf_counter() - t0
    metadata = ItemMetadata.from_columns(ids.shape[0], columns)
    t0 = time.perf_counter()
    terminals = item_terminals(tables, items.flat, items.lengths)
    terminals_s = time.perf_counter() - t0
    assert (terminals >= 0).all()
    from processors.kinds.tree.filters.edges import TreeParents

    t0 = time.perf_counter()
    TreeParents.of(tables)  # each state's parent edge, once per tables (the walk up from the passing items)
    levels_s = time.perf_counter() - t0
    # an ItemBook that is never empty but excludes nothing reachable: the per-row path without a filter
    empty = ItemBook()
    empty.add([tables.n_states + 10])

    def plain_request():
        return ItemRequest(empty)

    base = step_seconds(tables, ids, rows, steps, plain_request)
    bare = step_seconds(tables, ids, rows, steps, lambda: None)
    lane_bare = lane_seconds(tables, ids, rows, steps, lambda: None)
    beams_bare = beam_plan_seconds(tables, ids, 256, None)
    from processors.kinds.tree.filters.lazy import FilterView, LazyFilter
    from processors.kinds.tree.filters.slots import SlotIndex

    t0 = time.perf_counter()
    slots = SlotIndex.build(tables, metadata, terminals)
    slots_s = time.perf_counter() - t0
    out = {"items": int(ids.shape[0]), "compile_all_s": round(compile_all, 2), "terminals_once_ms": ms(terminals_s),
           "slots_once_ms": ms(slots_s),
           "parents_once_ms": ms(levels_s), "step_exclude_path_ms": ms(base / steps), "step_bare_ms": ms(bare / steps),
           "lane_step_bare_ms": ms(lane_bare / steps), "beam_plan_256_bare_ms": ms(beams_bare / (DEPTH * 20)),
           "filters": {}}
    for name, flt in FILTERS.items():
        t0 = time.perf_counter()
        passing = parse_filter(flt, metadata).mask(metadata)
        t1 = time.perf_counter()
        book = filter_book(tables, terminals, passing)
        t2 = time.perf_counter()
        share = float(passing.mean())
        filtered = step_seconds(tables, ids[passing], rows, steps, lambda: ItemRequest(base=book))
        book.edge_ok(tables)  # once per resolved filter (the replica's resolve), not per step
        lane = lane_seconds(tables, ids[passing], rows, steps, lambda: ItemRequest(base=book))
        beams = beam_plan_seconds(tables, ids[passing], 256, ItemRequest(base=book))
        t3 = time.perf_counter()
        own = catalog_tables(_Items(ids[passing]), VOCAB)
        rule_s = time.perf_counter() - t3
        # the lazy resolve, cold (a new version's first request with this filter): the filter checked and its
        # blocks, then what a 16-beam request reads over its decode (every depth's beam plan, once), and the
        # root count its admission asks (n 10, 16 beams: cap 17)
        cold = []
        passing_ids = ids[passing]
        for repeat in range(3):
            t4 = time.perf_counter()
            lazy = LazyFilter(slots, tables, parse_filter(flt, slots.schema))
            view = FilterView(lazy, 17)
            view.passing()
            beam_plan_seconds(tables, passing_ids, 16, ItemRequest(base=view), repeats=1, seed=10 + repeat)
            cold.append(time.perf_counter() - t4)
        lazy_view = FilterView(LazyFilter(slots, tables, parse_filter(flt, slots.schema)), 17)
        lazy_lane = lane_seconds(tables, ids[passing], rows, steps, lambda: ItemRequest(base=lazy_view))
        lazy_beams = beam_plan_seconds(tables, ids[passing], 256, ItemRequest(base=lazy_view))
        row = {"passing": round(share, 6), "mask_ms": ms(t1 - t0), "book_ms": ms(t2 - t1),
               "resolve_ms": ms(t2 - t0), "lazy_cold_16_beams_ms": ms(sorted(cold)[1]),
               "lazy_cold_vs_whole": ratio(sorted(cold)[1], t2 - t0),
               "lazy_lane_step_ratio": ratio(lazy_lane, lane_bare), "lazy_beam_plan_ratio": ratio(lazy_beams, beams_bare), "step_ms": ms(filtered / steps), "step_ratio": ratio(filtered, base),
               "step_ratio_vs_bare": ratio(filtered, bare),
               "lane_step_ms": ms(lane / steps), "lane_step_ratio": ratio(lane, lane_bare),
               "beam_plan_256_ms": ms(beams / (DEPTH * 20)), "beam_plan_ratio": ratio(beams, beams_bare),
               "per_rule_compile_s": round(rule_s, 3), "per_rule_table_mb": round(own.nbytes / 2**20, 1),
               "book_mb": round(book.counts_array.nbytes / 2**20 + book.ends.flags.nbytes / 2**20, 1)}
        out["filters"][name] = row
        log(f"  {name}: {row}")
    out["all_items_table_mb"] = round(tables.nbytes / 2**20, 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", default="1000000,10000000")
    parser.add_argument("--codebook", type=int, default=256)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    rows = [run_size(int(n), args.codebook, args.rows, args.steps) for n in args.items.split(",")]
    emit({"bench": "filters", "rows": rows})


if __name__ == "__main__":
    main()
