"""The rows' grammar masks: each row's allowed set in a decode step, with the rows' grammar masks settled within
``mask_step_budget_ms`` (:class:`processors.mask_budget.MaskBudget`), and the rows that sit out a step while their
mask computes.

:class:`GrammarRows` is the engine's part for this: it owns the step's mask budget (``mask_budget``: the pool that
computes the masks off the decode thread) and the per-step mask data (``mask_buffer``, host memory reused from step to
step); it adds to ``held_row_steps`` of the engine's shared ``stats``. It reads no other part: what it needs of the
batch (whether other work shares the step, how many rows are padded rows) its callers pass."""

from __future__ import annotations

import logging
from typing import Iterable

import torch

from processors.mask_budget import STEP_WAIT_MS, MaskBudget
from processors.masks import FREE, MaskBuffer, Step

from .jobs import FREE_STEP, HELD, Row

logger = logging.getLogger(__name__)

__all__ = ["GrammarRows"]


class GrammarRows:
    """The rows' steps and grammar masks.

    Args:
        mask_step_budget_ms: the CPU time one row's grammar mask may take in one step (0: no budget).
        device: where the masks are applied (the mask buffer is pinned host memory on a GPU).
        stats: the engine's counters.
    """

    def __init__(self, mask_step_budget_ms: float, device, stats: dict):
        # grammar masks of a step: in parallel off the decode thread, each within its budget (processors.mask_budget)
        self.mask_budget = MaskBudget(mask_step_budget_ms)
        # the per-step mask data: host memory reused from step to step (pinned on a GPU), one copy to the device
        self.mask_buffer = MaskBuffer(device)
        self._stats = stats

    def close(self) -> None:
        self.mask_budget.close()

    def row_steps(self, rows: list[Row], skip: set[int] = frozenset(),  # type: ignore[assignment]
                  defer: Iterable[int] = (), *, alone: bool = False) -> tuple[list[Step], dict[int, str], set[int]]:
        """Each row's allowed set (rows in ``skip``: none, they are ranked from their tables; rows left out of the
        step because their grammar mask is still being computed: none either); a cursor that raises fails its row
        only, as does a grammar mask over its budget (:meth:`settle_masks`). Returns ``(steps, failed, waiting)``."""
        steps: list[Step] = []
        failed, waiting = self.settle_masks(rows, skip, defer, alone=alone)
        for i, row in enumerate(rows):
            if i in skip or i in waiting:
                steps.append(FREE_STEP)
                continue
            try:
                steps.append(row.cursor.step())
            except Exception as exc:
                logger.exception("a row's constraint failed")
                failed[i] = f"constraint failed: {type(exc).__name__}: {exc}"
                steps.append(Step(FREE, None, row.cursor.end_token_id))
        return steps, failed, waiting

    def settle_masks(self, rows: list[Row], skip: set[int] = frozenset(),  # type: ignore[assignment]
                     defer: Iterable[int] = (), *, alone: bool = False) -> tuple[dict[int, str], set[int]]:
        """Compute the rows' due grammar masks in parallel within ``mask_step_budget_ms``. Returns ``(late,
        waiting)``: ``{row: message}`` for those late (their cursors now allow only their end token; the caller
        fails the rows), and the rows of ``defer`` whose mask is still being computed after a short wait (they sit
        out this step, :meth:`hold`). When no other work would share the step (``alone``: no wide request in the
        engine), it waits for them instead."""
        budget = self.mask_budget
        cursors = [row.cursor for row in rows]
        late, waiting = budget.settle(cursors, skip, defer=defer, wait_ms=min(STEP_WAIT_MS, budget.budget_ms / 20))
        if waiting and len(waiting) + len(late) + len(skip) >= len(rows) and alone:
            more, waiting = budget.settle(cursors, set(skip) | set(late))  # nobody else to serve: wait for them
            late.update(more)
        if late:
            logger.warning("%d row(s) ended: grammar mask over %s ms (mask_step_budget_ms)", len(late),
                           f"{budget.budget_ms:g}")
        return late, waiting

    @staticmethod
    def deferrable(rows: list[Row], narrow_rows: int) -> list[int]:
        """The rows a step may leave out while their grammar mask computes: one-row requests' rows (the padded
        batch, its first ``narrow_rows`` rows: a row sits out with a masked column) that sat out fewer steps than
        their token limit (so a row's steps stay within twice its token limit, which the batch's width was admitted
        for)."""
        return [i for i in range(min(narrow_rows, len(rows))) if rows[i].deferred < rows[i].job.max_new_tokens]

    def hold(self, i: int, row: Row, logits: torch.Tensor) -> tuple[int, Row, int]:
        """Leave row ``i`` out of this step: it keeps its logits for the next one and reads no token (a masked
        column of the padded batch, :meth:`.batch.Batch.forward`)."""
        row.held = logits[i].clone()
        row.deferred += 1
        self._stats["held_row_steps"] += 1
        return i, row, HELD
