"""Rows after their token is chosen: sampling row by row when the batched sampler failed, a ``distinct`` row's
redraw, advancing the cursors, and finishing rows (their events; the request's ``DoneEvent`` with its last row). Part
of :class:`.engine.DecodeEngine`."""

from __future__ import annotations

import logging

import torch

from processors import apply_steps
from processors.lanes import advance_rows, lane_of

from ..protocol import DoneEvent, FinishedEvent, TokenEvent
from ..sampling import sample_row
from .jobs import Row

logger = logging.getLogger(__name__)

__all__ = ["RowsMixin"]


class RowsMixin:
    """What happens to a row once its token is chosen (see :class:`.engine.DecodeEngine` for its state)."""

    def _redraw(self, i: int, row: Row, logits: torch.Tensor) -> int:
        """A ``distinct`` row whose sampled token lost its item to another row of its request earlier in this step:
        draw again under its new mask (its allowed set only shrank; the rows of a request advance in order)."""
        sub = logits[i : i + 1].clone()
        apply_steps(sub, [row.cursor.step()])
        return int(sample_row(sub[0], row.job.sampling, row.generator))

    def _sample_each(self, rows: list[Row], sampled: list[int], logits: torch.Tensor) -> torch.Tensor:
        """Row-by-row sampling after the batched sampler failed: a row that fails alone gets NaN."""
        out = []
        for i in sampled:
            try:
                out.append(float(sample_row(logits[i], rows[i].job.sampling, rows[i].generator)))
            except Exception as exc:
                logger.exception("sampling a row failed")
                self._fail_row(rows[i], f"sampling failed: {type(exc).__name__}: {exc}")
                out.append(float("nan"))
        return torch.tensor(out, dtype=torch.float64, device=logits.device)

    def _advance_lane(self, rows: list[Row], sampled: list[int], host: list) -> dict[int, str | None]:
        """Advance the sampled rows of the vector lane together (no item controls: their order does not matter);
        returns row -> None, or the message of a cursor that raised."""
        picked = [(i, int(t)) for i, t in zip(sampled, host[: len(sampled)]) if t == t and lane_of(rows[i].cursor)]
        if not picked:
            return {}
        failed = advance_rows([rows[i].cursor for i, _ in picked], [t for _, t in picked])
        return {i: failed.get(k) for k, (i, _) in enumerate(picked)}

    def _advance_sampled(self, i: int, row: Row, token: int, *, advanced: bool = False,
                         error: str | None = None) -> list[tuple[int, Row, int]]:
        job = row.job
        if error is not None:
            self._fail_row(row, error)
            return []
        if not advanced:
            try:
                row.cursor.advance(token)
            except Exception as exc:
                logger.exception("a row's constraint failed")
                self._fail_row(row, f"constraint failed: {type(exc).__name__}: {exc}")
                return []
        row.tokens.append(token)
        job.on_event(TokenEvent(row.index, token))
        if row.cursor.finished:
            self._finish(row, "error" if row.cursor.error else "stop", row.cursor.error)
        elif len(row.tokens) >= job.max_new_tokens:
            self._finish(row, "length", row.cursor.error)
        else:
            return [(i, row, token)]
        return []

    def _fail_row(self, row: Row, message: str) -> None:
        self._stats["failed_rows"] += 1
        self._finish(row, "error", message)

    def _finish(self, row: Row, reason: str, error: str | None) -> None:
        if row.cursor.fell_back:
            self._stats["fallback_rows"] += 1
        job = row.job
        job.on_event(FinishedEvent(row.index, list(row.tokens), reason, error, row.cursor.fell_back))
        job.remaining -= 1
        if job.remaining == 0:
            if reason == "error" and error == "cancelled":
                self._stats["cancelled_jobs"] += 1
            job.on_event(DoneEvent())
