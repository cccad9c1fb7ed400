"""Each row's allowed set in a decode step, with the rows' grammar masks settled within ``mask_step_budget_ms``
(:class:`processors.mask_budget.MaskBudget`), and the rows that sit out a step while their mask computes. Part of
:class:`.engine.DecodeEngine` (its state: ``_mask_budget``, ``_groups``, ``_stats``)."""

from __future__ import annotations

import logging
from typing import Iterable

import torch

from processors.mask_budget import STEP_WAIT_MS
from processors.masks import FREE, Step

from .jobs import FREE_STEP, HELD, Row

logger = logging.getLogger(__name__)

__all__ = ["GrammarRowsMixin"]


class GrammarRowsMixin:
    """The rows' steps and grammar masks (see :class:`.engine.DecodeEngine` for its state)."""

    def _row_steps(self, rows: list[Row], skip: set[int] = frozenset(),  # type: ignore[assignment]
                   defer: Iterable[int] = ()) -> tuple[list[Step], dict[int, str], set[int]]:
        """Each row's allowed set (rows in ``skip``: none, they are ranked from their tables; rows left out of the
        step because their grammar mask is still being computed: none either); a cursor that raises fails its row
        only, as does a grammar mask over its budget (:meth:`_settle_masks`). Returns ``(steps, failed, waiting)``."""
        steps: list[Step] = []
        failed, waiting = self._settle_masks(rows, skip, defer)
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

    def _settle_masks(self, rows: list[Row], skip: set[int] = frozenset(),  # type: ignore[assignment]
                      defer: Iterable[int] = ()) -> tuple[dict[int, str], set[int]]:
        """Compute the rows' due grammar masks in parallel within ``mask_step_budget_ms``. Returns ``(late,
        waiting)``: ``{row: message}`` for those late (their cursors now allow only their end token; the caller
        fails the rows), and the rows of ``defer`` whose mask is still being computed after a short wait (they sit
        out this step, :meth:`_hold`). When no other work would share the step, it waits for them instead."""
        budget = self._mask_budget
        cursors = [row.cursor for row in rows]
        late, waiting = budget.settle(cursors, skip, defer=defer, wait_ms=min(STEP_WAIT_MS, budget.budget_ms / 20))
        if waiting and len(waiting) + len(late) + len(skip) >= len(rows) and not self._groups:
            more, waiting = budget.settle(cursors, set(skip) | set(late))  # nobody else to serve: wait for them
            late.update(more)
        if late:
            logger.warning("%d row(s) ended: grammar mask over %s ms (mask_step_budget_ms)", len(late),
                           f"{budget.budget_ms:g}")
        return late, waiting

    def _deferrable(self, rows: list[Row]) -> list[int]:
        """The rows a step may leave out while their grammar mask computes: one-row requests' rows (the padded
        batch: a row sits out with a masked column) that sat out fewer steps than their token limit (so a row's
        steps stay within twice its token limit, which the batch's width was admitted for)."""
        return [i for i in range(min(self._narrow_rows, len(rows))) if rows[i].deferred < rows[i].job.max_new_tokens]

    def _hold(self, i: int, row: Row, logits: torch.Tensor) -> tuple[int, Row, int]:
        """Leave row ``i`` out of this step: it keeps its logits for the next one and reads no token (a masked
        column of the padded batch, :meth:`_forward_step`)."""
        row.held = logits[i].clone()
        row.deferred += 1
        self._stats["held_row_steps"] += 1
        return i, row, HELD
