"""Rows after their token is chosen: sampling row by row when the batched sampler failed, a ``distinct`` row's
redraw, advancing the cursors, and finishing rows (their events; the request's ``DoneEvent`` with its last row).

Plain functions of the engine's parts: they hold no state of their own; the counters they touch (``failed_rows``,
``fallback_rows``, ``cancelled_jobs``) are in the engine's shared ``stats`` dict, passed in."""

from __future__ import annotations

import logging

import torch

from processors import apply_steps
from processors.lanes import advance_rows, lane_of

from ..protocol import DoneEvent, ErrorEvent, FinishedEvent, TokenEvent
from ..sampling import sample_row
from .jobs import Job, Row

logger = logging.getLogger(__name__)

__all__ = ["advance_lane", "advance_sampled", "cancelled", "fail_row", "finish", "redraw", "sample_each"]


def redraw(i: int, row: Row, logits: torch.Tensor) -> int:
    """A ``distinct`` row whose sampled token lost its item to another row of its request earlier in this step:
    draw again under its new mask (its allowed set only shrank; the rows of a request advance in order)."""
    sub = logits[i : i + 1].clone()
    apply_steps(sub, [row.cursor.step()])
    return int(sample_row(sub[0], row.job.sampling, row.generator))


def sample_each(rows: list[Row], sampled: list[int], logits: torch.Tensor, stats: dict) -> torch.Tensor:
    """Row-by-row sampling after the batched sampler failed: a row that fails alone gets NaN."""
    out = []
    for i in sampled:
        try:
            out.append(float(sample_row(logits[i], rows[i].job.sampling, rows[i].generator)))
        except Exception as exc:
            logger.exception("sampling a row failed")
            fail_row(rows[i], f"sampling failed: {type(exc).__name__}: {exc}", stats)
            out.append(float("nan"))
    return torch.tensor(out, dtype=torch.float64, device=logits.device)


def advance_lane(rows: list[Row], sampled: list[int], host: list) -> dict[int, str | None]:
    """Advance the sampled rows of the vector lane together (no item controls: their order does not matter);
    returns row -> None, or the message of a cursor that raised."""
    picked = [(i, int(t)) for i, t in zip(sampled, host[: len(sampled)]) if t == t and lane_of(rows[i].cursor)]
    if not picked:
        return {}
    failed = advance_rows([rows[i].cursor for i, _ in picked], [t for _, t in picked])
    return {i: failed.get(k) for k, (i, _) in enumerate(picked)}


def advance_sampled(i: int, row: Row, token: int, stats: dict, *, advanced: bool = False,
                    error: str | None = None) -> list[tuple[int, Row, int]]:
    """Advance a sampled row by ``token`` (or take the lane's result: ``advanced``, ``error``) and send its token;
    returns ``[(i, row, token)]`` when it goes on, ``[]`` when it finished."""
    job = row.job
    if error is not None:
        fail_row(row, error, stats)
        return []
    if not advanced:
        try:
            row.cursor.advance(token)
        except Exception as exc:
            logger.exception("a row's constraint failed")
            fail_row(row, f"constraint failed: {type(exc).__name__}: {exc}", stats)
            return []
    row.tokens.append(token)
    job.on_event(TokenEvent(row.index, token))
    if row.cursor.finished:
        finish(row, "error" if row.cursor.error else "stop", row.cursor.error, stats)
    elif len(row.tokens) >= job.max_new_tokens:
        finish(row, "length", row.cursor.error, stats)
    else:
        return [(i, row, token)]
    return []


def fail_row(row: Row, message: str, stats: dict) -> None:
    stats["failed_rows"] += 1
    finish(row, "error", message, stats)


def finish(row: Row, reason: str, error: str | None, stats: dict) -> None:
    if row.cursor.fell_back:
        stats["fallback_rows"] += 1
    job = row.job
    job.on_event(FinishedEvent(row.index, list(row.tokens), reason, error, row.cursor.fell_back))
    job.remaining -= 1
    if job.remaining == 0:
        if reason == "error" and error == "cancelled":
            stats["cancelled_jobs"] += 1
        job.on_event(DoneEvent())


def cancelled(job: Job, stats: dict) -> None:
    """A request cancelled before or between its rows' steps: counted, and told once."""
    stats["cancelled_jobs"] += 1
    job.on_event(ErrorEvent("cancelled"))
