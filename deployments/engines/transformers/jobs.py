"""The engine's bookkeeping of a request: its :class:`Job` (request, callback, cancel flag), its rows (:class:`Row`: a
cursor, a generator, the tokens so far, a beam score), the ended hypotheses of a beam request (:class:`Beams`) and a
job waiting to join the batch (:class:`Pending`)."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import torch
from transformers import DynamicCache

from processors import RowCursor
from processors.masks import FREE, Step

from ..protocol import EngineEvent, EngineRequest, RequestTicket

__all__ = ["FREE_STEP", "HELD", "UNMASKED", "Beams", "Feed", "Job", "Pending", "Row"]

FREE_STEP = Step(FREE, None, 0)


class Unmasked:
    """Stands for a row the chain must leave alone this step (a tree beam ranked from its tables)."""

    @staticmethod
    def step() -> Step:
        return FREE_STEP


UNMASKED = Unmasked()
#: the token of a row that sits out a step (its grammar mask still computing): it reads none
HELD = -1


class Job(RequestTicket):
    """A submitted :class:`EngineRequest` inside this engine: the request, its callback and its cancel flag."""

    def __init__(self, request: EngineRequest, on_event: Callable[[EngineEvent], None]):
        self.request = request
        self.on_event = on_event
        self.cancelled = threading.Event()
        self.remaining = 0
        r = request
        self.prompt_ids, self.compiled, self.max_new_tokens = r.prompt_ids, r.compiled, r.max_new_tokens
        self.sampling, self.n, self.num_beams = r.sampling, r.n, r.num_beams

    def cancel(self) -> None:
        self.cancelled.set()

    @property
    def width(self) -> int:
        """Rows this job holds in the batch."""
        return self.num_beams if self.num_beams > 1 else self.n


class Row:
    __slots__ = ("job", "index", "cursor", "generator", "tokens", "score", "held", "deferred")

    def __init__(self, job: Job, index: int, cursor: RowCursor, generator: torch.Generator | None,
                 tokens: list[int] | None = None, score: float = 0.0):
        self.job = job
        self.index = index
        self.cursor = cursor
        self.generator = generator
        self.tokens: list[int] = tokens if tokens is not None else []
        self.score = score  # beam rows: sum of the log-probabilities of ``tokens``
        self.held: torch.Tensor | None = None  # its logits while it sits out a step (its grammar mask computing)
        self.deferred = 0  # steps it sat out


class Beams:
    """Ended hypotheses of one beam request: ``(normalized score, tokens, finish_reason)``, best first. The normalized
    score is the summed log-probability divided by the number of tokens, the end token included (HF beam search's
    ``sequences_scores`` at ``length_penalty`` 1); the request's outputs report it (``FinishedEvent.score``)."""

    __slots__ = ("hyps",)

    def __init__(self):
        self.hyps: list[tuple[float, list[int], str]] = []

    def add(self, score: float, tokens: list[int], reason: str, keep: int) -> None:
        self.hyps.append((score / max(len(tokens), 1), tokens, reason))
        self.hyps.sort(key=lambda h: -h[0])
        del self.hyps[keep:]

    def worst(self) -> float:
        return self.hyps[-1][0]


class Feed:
    """The next step of a wide request (a :class:`.shared_kv.SharedGroup`) while its rows are read in chunks of at most
    ``wide_step_rows`` rows per forward, the one-row requests' rows in every forward: its rows (cursors advanced),
    the token each row reads, how many rows were read, and what they gave so far (``parts``): logits (sampled rows)
    or each chunk's best candidates (beams)."""

    __slots__ = ("rows", "tokens", "done", "parts")

    def __init__(self, rows: list[Row], tokens: list[int]):
        self.rows = rows
        self.tokens = tokens
        self.done = 0
        self.parts: list = []


@dataclass
class Pending:
    """A job between submission and its first decode step."""

    job: Job
    rows: Future | list[Row]
    # chunked prefill: the prompt's cache so far and how many prompt tokens it holds
    cache: DynamicCache | None = None
    done_tokens: int = 0
    reused: int = 0

    def ready(self) -> bool:
        return not isinstance(self.rows, Future) or self.rows.done()

    def take_rows(self) -> list[Row]:
        return self.rows.result() if isinstance(self.rows, Future) else self.rows
