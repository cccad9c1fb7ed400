"""The vector lane's beam step: ranking the beams of a request on a tree's (or a label trie's) tables straight from
them, the candidates the allowed children only. It serves any kind whose rows take the vector lane
(:meth:`processors.base.Cursor.vector_lane`, :mod:`processors.lanes`); the engines import it, never a kind.

A beam request of ``B`` rows over a plain tree (no item controls, no think block: the rows of the vector lane,
:mod:`processors.lanes`) needs, per step, the ``2B`` best ``(row, child)`` pairs by ``row score + log p(child)``,
where ``log p`` is the model's log-probability (HF beam search's score, restricted to the tree). Masking ``B`` rows
of the whole vocabulary, taking their log-softmax and ranking ``B x vocab`` scores costs several passes over
``B x vocab`` floats (200 MB each at 1,024 beams of a 49k vocabulary) for a few thousand allowed children.

Here, as array operations over all rows at once (no loop over beams):

1. the rows' tree states are read from their cursors (one ``map``), and each row's children are one CSR gather of
   the tables (``tokens[offsets[s]:offsets[s+1]]`` for every row);
2. each child's score is ``row score + logit - logsumexp(row)``: one gather of the children's logits and one
   ``logsumexp`` per row (the log-softmax's normalizer, over the raw logits as the masked path computes it);
3. the ``2B`` best are one ``topk`` over the children, returned as ``(scores, row * vocab + token)`` like the
   masked path's candidates, so the engine's selection (ended hypotheses, survivors) is shared by both paths.

A row whose state has no children (a fallback), is finished, or sits outside the tables makes the request take
the masked path for that step (:func:`plan_tree_beams` returns ``None``); the results are the same either way.
"""

from __future__ import annotations

from operator import attrgetter

import numpy as np
import torch

from processors.lanes import BUDGET, FILTER, PLAIN, lane_of
from processors.tables import DONE, item_metrics

__all__ = ["plan_tree_beams", "row_logsumexp", "tree_beam_candidates"]

_constraint = attrgetter("constraint")
_state = attrgetter("state")
_done = attrgetter("done")


class TreeBeamPlan:
    """The children of every row of one beam request: ``row`` (local row of each child), ``token``."""

    __slots__ = ("row", "token")

    def __init__(self, row: np.ndarray, token: np.ndarray):
        self.row = row
        self.token = token


def plan_tree_beams(cursors: list) -> TreeBeamPlan | None:
    """The children of each row when all ``cursors`` (one beam request's rows) take the plain tree path and sit on a
    state with children; ``None`` otherwise (the request takes the masked path)."""
    if not cursors or any(lane_of(c) not in (PLAIN, BUDGET, FILTER) for c in cursors):
        return None
    if any(map(_done, cursors)):
        return None
    cons = list(map(_constraint, cursors))
    tables = cons[0].tables
    if any(c.tables is not tables for c in cons):
        return None
    states = np.fromiter(map(_state, cons), dtype=np.int64, count=len(cons))
    if (states < 0).any():
        return None
    offsets = tables.offsets
    lo = offsets[states]
    lens = offsets[states + 1] - lo
    if not lens.all():
        return None
    ends = np.cumsum(lens)
    edge = np.arange(int(ends[-1]), dtype=np.int64) + np.repeat(lo + lens - ends, lens)
    row = np.repeat(np.arange(states.size, dtype=np.int64), lens)
    bases = {id(c.request.base): c.request.base for c in cons if c.request is not None and c.request.base is not None}
    if bases:  # a request's filter: only edges toward an item that passes (its rows share one book)
        if len(bases) != 1 or any(c.request is None for c in cons):
            return None
        deep = item_metrics(tables)[3]
        if any(c.remaining is not None and c.remaining <= deep for c in cons):
            return None  # the budget could bind: which passing items fit, the cursors answer (masked path)
        return _plan(tables, edge, row, next(iter(bases.values())).edges_ok(tables, edge), states.size)
    budget = [c.remaining for c in cons if c.remaining is not None]
    if budget:
        if len(budget) != len(cons):
            return None
        # the token budget (TreeCursor._filter): an edge whose target cannot reach an item's end within the tokens
        # left is not allowed (DONE needs 0 more tokens, LEAF 1)
        left = np.asarray(budget, dtype=np.int64)
        nxt = tables.next_state[edge].astype(np.int64)
        need = np.where(nxt >= 0, item_metrics(tables)[0][np.maximum(nxt, 0)], np.where(nxt == DONE, 0, 1))
        return _plan(tables, edge, row, need <= left[row], states.size)
    return TreeBeamPlan(row, tables.tokens[edge].astype(np.int64))


def _plan(tables, edge: np.ndarray, row: np.ndarray, ok: np.ndarray, rows: int) -> TreeBeamPlan | None:
    """The plan of the edges ``ok`` keeps; ``None`` when a row is left with none (nothing but its end token: the
    masked path decides it)."""
    if not ok.all():
        if np.bincount(row[ok], minlength=rows).min() == 0:
            return None
        edge, row = edge[ok], row[ok]
    return TreeBeamPlan(row, tables.tokens[edge].astype(np.int64))


def _rows(logits: torch.Tensor, idxs: list[int]) -> torch.Tensor:
    """``logits[idxs]``, as a view when the rows are contiguous (a beam request's rows are)."""
    if idxs[-1] - idxs[0] + 1 == len(idxs) and idxs == list(range(idxs[0], idxs[-1] + 1)):
        return logits[idxs[0] : idxs[-1] + 1]
    return logits[idxs]


def row_logsumexp(logits: torch.Tensor, idxs: list[int]) -> torch.Tensor:
    """The log-softmax normalizer of each of ``idxs``'s rows, over the raw logits (call it before any masking)."""
    return torch.logsumexp(_rows(logits, idxs), dim=-1)


def tree_beam_candidates(plan: TreeBeamPlan, logits: torch.Tensor, idxs: list[int], lse: torch.Tensor,
                         scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The best ``k`` children of the request as ``(scores, local row * vocab + token)``, float64, on the device.

    Args:
        plan: the rows' children (:func:`plan_tree_beams`).
        logits: the batch's logits; the request's rows are ``idxs``.
        lse: :func:`row_logsumexp` of those rows, taken before masking.
        scores: each row's beam score so far (sum of its tokens' log-probabilities).
    """
    sub = _rows(logits, idxs)
    device = sub.device
    row = torch.from_numpy(plan.row).to(device)
    token = torch.from_numpy(plan.token).to(device)
    cand = sub[row, token].float() - lse[row].float() + scores.to(device)[row]
    top, pos = torch.topk(cand, min(k, cand.numel()))
    flat = row[pos] * sub.shape[1] + token[pos]
    return top.double(), flat.double()
