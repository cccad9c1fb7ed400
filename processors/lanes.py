"""The vectorized tree and label path: one decode step of all plain tree and single-label rows of a batch.

A batch's rows are :class:`processors.RowCursor` objects (each the truth about its row). Rows of the *vector
lane* are masked and advanced with a few array operations over all of them at once instead of one
``cursor.step()`` / ``cursor.advance()`` call per row:

* a row whose constraint cursor says it walks :class:`~processors.tables.MaskTables` in the lane
  (:meth:`processors.base.Cursor.vector_lane`, asked once per row: a tree or single-label row without
  per-request item controls; a token budget is fine: the budget rule is one more vector comparison);
* and no think block (a think row keeps the per-row path, as do grammar rows and rows with item controls).

Per step, for the lane rows: their states are read from the cursors with one ``map`` (no Python code per row),
the allowed ids of every row are one CSR gather (``tokens[offsets[s]:offsets[s+1]]`` for all ``s`` at once), the
budget rule masks an edge whose target needs more tokens than are left (``min_remaining[target] <= remaining``,
``DONE`` counting 0 and ``LEAF`` 1: the rule the cursors apply one by one), and the result goes into the
batch's :class:`~processors.masks.MaskBatch` next to the per-row steps of the other rows. Advancing is one
``searchsorted`` of ``state * vocab_size + token`` into sorted keys the lane makes for small tables (:func:`_lane_keys`),
else one batched search of every row's token among its state's edges (``MaskTables.find_edges``); rows whose token is an ordinary
edge into a state get their new state written back with one ``map(setattr, ...)``; the rare rest (the end token,
an invalid token, an edge into ``LEAF``, a budget running out) go through the row's own ``advance``, so every
semantic detail (errors, fallbacks, finished rows) stays the cursor's. Rows of different scenarios are grouped by
their tables (one group per distinct scenario in the batch, not per row).

:func:`mask_rows` and :func:`advance_rows` are what the engines call; ``vectorized=False`` gives the per-row
path (the reference the property tests compare with).
"""

from __future__ import annotations

import logging
from itertools import repeat
from operator import attrgetter, is_
from typing import Any, Sequence

import numpy as np
import torch

from .base import LANE_BUDGET, LANE_FILTER, LANE_OFF, LANE_PLAIN, Cursor
from .masks import FREE, MaskBatch, MaskBuffer, Step, apply_steps
from .tables import DONE, MaskTables, item_metrics

logger = logging.getLogger(__name__)

__all__ = ["advance_rows", "lane_code", "lane_of", "mask_rows"]

# lane codes: per-row path, vector lane, with a token budget, under a request's filter (and maybe a budget)
OFF, PLAIN, BUDGET, FILTER = LANE_OFF, LANE_PLAIN, LANE_BUDGET, LANE_FILTER

_FILTER_BYTE = bytes([FILTER])


def _any_filter(codes: np.ndarray) -> bool:
    """Whether some row of ``codes`` (int8 lane codes) takes the filter lane: a byte search of the codes, no numpy
    pass (each costs microseconds at the start of a step, with the caches just emptied by the fill)."""
    return _FILTER_BYTE in codes.tobytes()


_constraint = attrgetter("constraint")
_done = attrgetter("done")
_state = attrgetter("state")
_remaining = attrgetter("remaining")
_generated = attrgetter("generated")
_lane_code = attrgetter("_lane_code")
_request = attrgetter("request")


def lane_of(row) -> int:
    """The lane code of a row: the one its :class:`RowCursor` computed at construction; ``OFF`` for anything else."""
    return getattr(row, "_lane_code", OFF)


def lane_code(row) -> int:
    """Which path a freshly built :class:`RowCursor` takes (after its item controls are bound); copies keep it: its
    constraint's own answer (:meth:`~processors.base.Cursor.vector_lane`), for a row without a think block."""
    if getattr(row, "think", None) is not None or getattr(row, "compiled", None) is None:
        return OFF
    c = getattr(row, "constraint", None)
    return c.vector_lane() if isinstance(c, Cursor) else OFF  # grammar and multi-label rows: per row


_tables = attrgetter("tables")
_NO_ROWS = np.zeros(0, dtype=np.int64)
_INT64_MAX = np.iinfo(np.int64).max


def _lane_info(tables: MaskTables) -> tuple[Any, int]:
    """Per tables, computed once and kept on them: edges per state (int64) and the largest ``min_remaining`` (a row
    with more tokens left than that is never limited by the budget rule)."""
    info = tables.__dict__.get("_lane_info")
    if info is None:
        base = tables.__dict__.get("overlay_base")
        if base is not None:  # an overlay version: its base's counts (kept on the base) and the appended states'
            from processors.kinds.tree.tables.stacked import Stacked

            tail = tables.__dict__["offsets"].tail
            lens: Any = Stacked(_lane_info(base)[0], np.diff(tail, prepend=base.offsets[-1]).astype(np.int64))
        else:
            lens = np.diff(tables.offsets).astype(np.int64)
        info = (lens, -1)
        object.__setattr__(tables, "_lane_info", info)
    return info


def _max_min_remaining(tables: MaskTables) -> int:
    lens, top = _lane_info(tables)
    if top < 0:
        mins = tables.min_remaining  # type: ignore[attr-defined]
        top = max(int(mins.max()) if mins.size else 1, 1)
        object.__setattr__(tables, "_lane_info", (lens, top))
    return top


def _split(rows: Sequence) -> tuple[np.ndarray, list[int]]:
    """(lane row indices, other row indices)."""
    n = len(rows)
    try:
        codes = np.fromiter(map(_lane_code, rows), dtype=np.int8, count=n)
    except AttributeError:  # some row is not a RowCursor
        codes = np.fromiter(map(lane_of, rows), dtype=np.int8, count=n)
    if _any_filter(codes):
        # a filtered row whose token budget could bind this step takes its own path: which items fit is then a
        # question about the items that pass, which the cursor answers (TreeCursor._filter)
        for i in np.flatnonzero(codes == FILTER).tolist():
            c = rows[i].constraint
            if c.remaining is not None and c.remaining <= item_metrics(c.tables)[3]:
                codes[i] = OFF
    if n and codes.all():
        return np.arange(n, dtype=np.int64), []
    return np.flatnonzero(codes).astype(np.int64), np.flatnonzero(codes == 0).tolist()


def _groups(cons: list) -> list[tuple[np.ndarray | None, MaskTables]]:
    """Lane positions grouped by their tables: [(positions or None for all, tables)], one entry per scenario."""
    tabs = list(map(_tables, cons))
    first = tabs[0]
    if all(map(is_, tabs, repeat(first))):
        return [(None, first)]
    ids = np.fromiter(map(id, tabs), dtype=np.int64, count=len(tabs))
    _, index, inverse = np.unique(ids, return_index=True, return_inverse=True)
    return [(np.flatnonzero(inverse == g), tabs[int(i)]) for g, i in enumerate(index)]


# --------------------------------------------------------------------------- masking


def mask_rows(scores: torch.Tensor, rows: Sequence, buffer: MaskBuffer | None = None, *,
              vectorized: bool = True, strict: bool = False) -> dict[int, str]:
    """Mask ``scores`` (one row per cursor in ``rows``) in place; returns ``{row: message}`` for rows whose
    cursor raised (their logits are left free; the caller fails them). ``strict``: let such an exception out."""
    n = len(rows)
    width = scores.shape[1]
    failed: dict[int, str] = {}
    if vectorized and n:
        lane, others = _split(rows)
    else:
        lane, others = _NO_ROWS, list(range(n))
    batch = MaskBatch(n, width)
    if lane.size:
        try:
            extra = _lane_masks(batch, [rows[i] for i in lane.tolist()] if lane.size < n else list(rows), lane, width)
        except Exception:  # never let one bad row take the batch's masks down: the per-row path decides
            logger.exception("the vector lane failed; masking its rows one by one")
            batch = MaskBatch(n, width)
            extra = lane.tolist()
        if extra:
            others = sorted(others + extra)
    if others:
        steps: list[Step] = []
        for i in others:
            try:
                steps.append(rows[i].step())
            except Exception as exc:
                if strict:
                    raise
                logger.exception("a row's constraint failed")
                failed[i] = f"constraint failed: {type(exc).__name__}: {exc}"
                steps.append(Step(FREE, None, 0))
        if len(others) == n:  # no row went through the lane: apply_steps (the CPU keeps its direct path there)
            apply_steps(scores, steps, buffer)
            return failed
        batch.add_steps(steps, others)
    batch.apply(scores, buffer)
    return failed


def _lane_masks(batch: MaskBatch, lane_rows: list, lane: np.ndarray, width: int) -> list[int]:
    """Add the lane rows' allowed ids to ``batch``; returns the row indices left to the per-row path."""
    cons = list(map(_constraint, lane_rows))
    m = len(cons)
    states = np.fromiter(map(_state, cons), dtype=np.int64, count=m)
    done = np.fromiter(map(_done, lane_rows), dtype=bool, count=m)
    codes = np.fromiter(map(_lane_code, lane_rows), dtype=np.int8, count=m)
    budget = None
    if (codes == BUDGET).any():
        budget = np.full(m, _INT64_MAX, dtype=np.int64)
        at = np.flatnonzero(codes == BUDGET)
        budget[at] = np.fromiter(map(_remaining, [cons[i] for i in at.tolist()]), dtype=np.int64, count=at.size)
    keep_parts: list[np.ndarray] = []
    fill_parts: list[np.ndarray] = []
    per_row: list[int] = []
    for pos, tables in _groups(cons):
        if pos is None:
            s, rows_g, d = states, lane, done
        else:
            s, rows_g, d = states[pos], lane[pos], done[pos]
        offsets = tables.offsets
        lens_of, _ = _lane_info(tables)
        live = s >= 0
        if d.any():
            live &= ~d
        if live.all():  # the common case: every row inside the tables
            lo = offsets[s]
            lens = lens_of[s]
        else:
            s0 = np.where(live, s, 0)
            lo = offsets[s0]
            lens = np.where(live, lens_of[s0], 0)
        ended = ~live  # finished or LEAF/DONE: only the end token
        if not lens.all():
            empty = live & (lens == 0)  # a state without edges: the cursor marks its fallback, let it do so
            if empty.any():
                per_row.extend(rows_g[empty].tolist())
                live = live & ~empty
        # CSR gather of every row's edges: edge k of row r is lo[r] + k
        ends = np.cumsum(lens)
        edge = np.arange(int(ends[-1]) if ends.size else 0, dtype=np.int64) + np.repeat(lo + lens - ends, lens)
        ids = tables.tokens[edge]
        row_base = np.repeat(rows_g * width, lens)
        c_g = codes if pos is None else codes[pos]
        if _any_filter(c_g):
            # a filtered row: only the edges toward an item that passes (one gather of its filter's edge mask)
            keep = np.ones(ids.size, dtype=bool)
            rows_of_edge = np.repeat(np.arange(rows_g.size), lens)
            g_cons = cons if pos is None else [cons[k] for k in pos.tolist()]
            books: dict[int, tuple] = {}
            for k in np.flatnonzero(c_g == FILTER).tolist():
                base = g_cons[k].request.base
                books.setdefault(id(base), (base, []))[1].append(k)
            for base, members in books.values():
                sel = np.isin(rows_of_edge, members)
                keep[sel] = base.edges_ok(tables, edge[sel])
            if not keep.all():
                ids, row_base, edge = ids[keep], row_base[keep], edge[keep]
                lens = np.bincount(rows_of_edge[keep], minlength=rows_g.size)  # edges each row keeps
                ended = ended | (live & (lens == 0))
        if budget is not None:
            left = budget[pos] if pos is not None else budget
            tight = left <= _max_min_remaining(tables)
            if tight.any():
                # the budget rule (the cursors' own, per row): the target's shortest way to an item's
                # end (DONE 0, LEAF 1) must fit in the tokens left; rows with more left than any such way skip it
                nxt = tables.next_state[edge]
                need = np.where(nxt >= 0, tables.min_remaining[np.maximum(nxt, 0)],  # type: ignore[attr-defined]
                                np.where(nxt == DONE, 0, 1))
                ok = need <= np.repeat(left, lens)
                if not ok.all():
                    ids, row_base = ids[ok], row_base[ok]
                    # a row left with nothing allowed gets its end token, as an empty ALLOW step does
                    kept = np.bincount(np.repeat(np.arange(rows_g.size), lens)[ok], minlength=rows_g.size)
                    ended = ended | (live & (kept == 0))
        keep_parts.append(row_base + ids)
        if ended.any():
            keep_parts.append(rows_g[ended] * width + tables.end_token_id)
            fill_parts.append(rows_g[live | ended])
        else:
            fill_parts.append(rows_g[live] if not live.all() else rows_g)
    if keep_parts:
        batch.add_allowed(fill_parts[0] if len(fill_parts) == 1 else np.concatenate(fill_parts),
                          keep_parts[0] if len(keep_parts) == 1 else np.concatenate(keep_parts))
    return per_row


# --------------------------------------------------------------------------- advancing


def advance_rows(rows: Sequence, tokens: Sequence[int] | np.ndarray, *, vectorized: bool = True,
                 strict: bool = False) -> dict[int, str]:
    """Advance each row's cursor by its token; returns ``{row: message}`` for rows whose cursor raised
    (``strict``: let the exception out)."""
    n = len(rows)
    toks = np.asarray(tokens, dtype=np.int64)
    failed: dict[int, str] = {}
    others: list[int]
    if vectorized and n:
        lane, others = _split(rows)
        if lane.size:
            try:
                rest = _lane_advance([rows[i] for i in lane.tolist()] if lane.size < n else list(rows), lane, toks[lane])
            except Exception:  # computed before anything is written: the per-row path starts from the same states
                logger.exception("the vector lane failed; advancing its rows one by one")
                rest = lane.tolist()
            if rest:
                others = sorted(others + rest)
    else:
        others = list(range(n))
    if others:
        tl = toks.tolist()
        for i in others:
            try:
                rows[i].advance(tl[i])
            except Exception as exc:
                if strict:
                    raise
                logger.exception("a row's constraint failed")
                failed[i] = f"constraint failed: {type(exc).__name__}: {exc}"
    return failed


def _lane_advance(lane_rows: list, lane: np.ndarray, toks: np.ndarray) -> list[int]:
    """Advance the rows whose token is an ordinary edge into a state; returns the rest (row indices)."""
    cons = list(map(_constraint, lane_rows))
    m = len(cons)
    states = np.fromiter(map(_state, cons), dtype=np.int64, count=m)
    done = np.fromiter(map(_done, lane_rows), dtype=bool, count=m)
    groups = _groups(cons)
    if len(groups) == 1:
        simple, new_state, edges = _group_advance(groups[0][1], lane_rows[0], states, toks, done)
    else:
        simple = np.zeros(m, dtype=bool)
        new_state = np.zeros(m, dtype=np.int64)
        edges = np.zeros(m, dtype=np.int64)
        for pos, tables in groups:
            assert pos is not None
            simple[pos], new_state[pos], edges[pos] = _group_advance(
                tables, lane_rows[int(pos[0])], states[pos], toks[pos], done[pos])
    codes = np.fromiter(map(_lane_code, lane_rows), dtype=np.int8, count=m)
    tracked = codes >= BUDGET  # rows whose cursor keeps its path and last edge (budget and filter rows)
    any_tracked = bool(tracked.any())  # (plain rows only: no more passes for any of this)
    left = None
    if any_tracked:
        budget = codes == BUDGET
        if _any_filter(codes):
            for k in np.flatnonzero(codes == FILTER).tolist():
                budget[k] = cons[k].remaining is not None
        if budget.any():
            left = np.full(m, _INT64_MAX, dtype=np.int64)
            at = np.flatnonzero(budget)
            left[at] = np.fromiter(map(_remaining, [cons[k] for k in at.tolist()]), dtype=np.int64, count=at.size)
            simple &= left > 1  # the budget runs out with this token: the cursor settles the item
    go = np.flatnonzero(simple)
    if go.size:
        if go.size == m:
            g_cons, g_rows = cons, lane_rows
        else:
            g_list = go.tolist()
            g_cons, g_rows = [cons[k] for k in g_list], [lane_rows[k] for k in g_list]
        states_new = new_state[go].tolist()
        list(map(setattr, g_cons, repeat("state"), states_new))
        gen = np.fromiter(map(_generated, g_rows), dtype=np.int64, count=go.size) + 1
        list(map(setattr, g_rows, repeat("generated"), gen.tolist()))
        if left is not None:
            b = budget[go]
            if b.any():
                bl = np.flatnonzero(b)
                b_cons = [g_cons[k] for k in bl.tolist()]
                list(map(setattr, b_cons, repeat("remaining"), (left[go][bl] - 1).tolist()))
        t = tracked[go] if any_tracked else None
        if t is not None and t.any():
            tl = np.flatnonzero(t)
            t_cons = [g_cons[k] for k in tl.tolist()]
            list(map(setattr, t_cons, repeat("last_edge"), edges[go][tl].tolist()))
            list(map(list.append, map(_path, t_cons), new_state[go][tl].tolist()))
    return lane[~simple].tolist()


_path = attrgetter("path")


def _lane_keys(tables: MaskTables) -> np.ndarray | None:
    """Per tables of at most :data:`_LANE_KEYS_EDGES` edges, made at their first lane advance and kept on them (never
    pickled): ``state * vocab_size + token`` per edge, sorted, so that a batch's advance is one ``searchsorted``
    (a label set, a small tree; larger tables search each row's edges, :meth:`MaskTables.find_edges`)."""
    keys = tables.__dict__.get("_lane_keys", False)
    if keys is False:
        keys = None
        if 0 < tables.n_edges <= _LANE_KEYS_EDGES:
            lens, _ = _lane_info(tables)
            keys = np.repeat(np.arange(tables.n_states, dtype=np.int64) * int(tables.vocab_size), np.asarray(lens))
            keys += np.asarray(tables.tokens)
            keys.setflags(write=False)
        object.__setattr__(tables, "_lane_keys", keys)
    return keys


_LANE_KEYS_EDGES = 1 << 16  # (8 bytes per edge: at most 512 KiB per tables)


def _group_advance(tables: MaskTables, row, s: np.ndarray, t: np.ndarray, done: np.ndarray):
    """(ordinary edge into a state?, target, edge index) per row of one group."""
    keys = _lane_keys(tables)
    if keys is not None:  # small tables: one search of the rows' keys (the fewest numpy passes: this is per step)
        kb = tables.vocab_size
        ok = (s >= 0) & (t != tables.end_token_id) & (t >= 0) & (t < kb)
        if done.any():
            ok &= ~done
        want = s * kb + t
        if not ok.all():
            want = np.where(ok, want, 0)
        i = keys.searchsorted(want)
        np.minimum(i, keys.size - 1, out=i)
        nxt = tables.next_state[i]
        ok &= (keys[i] == want) & (nxt >= 0)
    else:
        ok = (s >= 0) & (t != tables.end_token_id)
        if done.any():
            ok &= ~done
        if not tables.n_edges:
            return np.zeros(s.size, dtype=bool), np.zeros(s.size, dtype=np.int64), np.zeros(s.size, dtype=np.int64)
        i = tables.find_edges(np.where(ok, s, -1), t)
        ok &= i >= 0
        np.maximum(i, 0, out=i)
        nxt = tables.next_state[i]
        ok &= nxt >= 0
    # a token that also stops the row (the model's EOS listed as a tree candidate) ends it: per row
    stops = [x for x in row.compiled.stop_token_ids if x != tables.end_token_id]
    if stops:
        ok &= ~np.isin(t, stops)
    return ok, nxt, i
