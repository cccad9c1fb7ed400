"""The engine contract: what a model replica needs from whatever turns prompts into tokens.

A model replica knows engines only through :class:`Engine`. A request (:class:`EngineRequest`) carries the
prompt ids, the compiled scenario pinned at admission (or ``None``), the budget and the sampling parameters;
the engine answers with typed events, in this order per request:

* :class:`TokenEvent` for each sampled token of output ``index`` (sampled rows: as they are produced; beam
  search: for the returned sequences once the search ends),
* :class:`FinishedEvent` once per output (its tokens, ``finish_reason`` ``stop`` / ``length`` / ``error``; beam
  search: the ``score`` it was ranked by),
* :class:`DoneEvent` last; or a single :class:`ErrorEvent` instead when the request failed as a whole.

After a cancel, a request still waiting, prefilling or searching beams ends with ``ErrorEvent("cancelled")``;
sampled rows already decoding end with ``FinishedEvent(finish_reason="error", error="cancelled")`` each, then
``DoneEvent``.

Engines must keep one request's failure to that request (see ``docs/design.md``, "Engine contract").
Two ways to run a request: :meth:`Engine.submit` from any thread with a callback (called on the engine's
thread), or ``async for event in engine.generate(request)`` on an event loop; leaving the loop early cancels.
Nothing here imports torch, Ray or a model library.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Union

__all__ = [
    "DoneEvent",
    "Engine",
    "EngineEvent",
    "EngineRequest",
    "ErrorEvent",
    "EventCollector",
    "FinishedEvent",
    "RequestTicket",
    "SamplingParams",
    "TokenEvent",
]


@dataclass(frozen=True)
class SamplingParams:
    """Per-row sampling. ``temperature == 0`` is greedy; ``top_k == 0`` and ``top_p == 1`` are off."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k!r}")


@dataclass(frozen=True)
class EngineRequest:
    """One request: ``n`` outputs of one prompt under one pinned scenario (``compiled``; ``None``: free text).

    ``num_beams > 1`` asks for beam search; the best ``n`` (at most ``num_beams``) sequences are returned.
    Tree and label rows never start an item that cannot end within ``max_new_tokens`` (``processors.items``).
    """

    prompt_ids: list[int]
    compiled: Any
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    n: int = 1
    num_beams: int = 1
    #: tree and label rows: the request's item controls (a :class:`processors.items.ItemRequest`, shared by its
    #: rows: exclude, distinct), or ``None``
    items: Any = None
    #: an engine that reports log-probabilities itself (``Engine.reports_logprobs``): the alternatives per token
    #: each :class:`FinishedEvent` carries in ``logprobs`` (0: the chosen token's only); ``None``: not asked
    logprobs: int | None = None
    #: who sent it (the ingress's client identity, :mod:`deployments.guards`), for an engine that shares its
    #: admission fairly between clients; ``None``: unknown
    client: str | None = None

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        if self.n < 1 or self.num_beams < 1 or self.max_new_tokens < 1:
            raise ValueError("n, num_beams and max_new_tokens must be >= 1")
        if self.num_beams > 1 and self.n > self.num_beams:
            raise ValueError("n must not exceed num_beams with beam search")


@dataclass(frozen=True)
class TokenEvent:
    index: int
    token_id: int


@dataclass(frozen=True)
class FinishedEvent:
    index: int
    token_ids: list[int]
    finish_reason: str
    error: str | None = None
    fell_back: bool = False
    #: where the request asked for them from an engine that reports them: per output token
    #: ``(token_id, logprob, [(token_id, logprob), ...])``, the distribution the token was sampled from (after the
    #: constraint's mask); the alternatives best first, masked tokens left out
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None
    #: beam search: the score the output was ranked by, the sum of its tokens' log-probabilities (of the model's
    #: distribution, masked by the constraint; the end token included) divided by its length in tokens (HF
    #: ``generate``'s ``sequences_scores`` at ``length_penalty`` 1); ``None`` for sampled outputs
    score: float | None = None


@dataclass(frozen=True)
class DoneEvent:
    pass


@dataclass(frozen=True)
class ErrorEvent:
    message: str


EngineEvent = Union[TokenEvent, FinishedEvent, DoneEvent, ErrorEvent]


class EventCollector:
    """An ``on_event`` callback for :meth:`Engine.submit` that gathers one request's events.

    ``tokens`` (per output index), ``times`` (arrival time and index of every token), ``finished`` (the
    :class:`FinishedEvent` per index), ``error`` (an :class:`ErrorEvent`'s message) and ``done`` (set by the
    last event). Read them after ``done`` is set, or use :meth:`wait`.
    """

    def __init__(self) -> None:
        self.tokens: dict[int, list[int]] = {}
        self.times: list[tuple[float, int]] = []
        self.finished: dict[int, FinishedEvent] = {}
        self.error: str | None = None
        self.done = threading.Event()

    def __call__(self, event: EngineEvent) -> None:
        if isinstance(event, TokenEvent):
            self.tokens.setdefault(event.index, []).append(event.token_id)
            self.times.append((time.perf_counter(), event.index))
        elif isinstance(event, FinishedEvent):
            self.finished[event.index] = event
        elif isinstance(event, DoneEvent):
            self.done.set()
        elif isinstance(event, ErrorEvent):
            self.error = event.message
            self.done.set()

    def wait(self, timeout: float | None = None) -> dict[int, FinishedEvent]:
        """The finished outputs by index once the request ended; raises ``TimeoutError`` if it has not ended
        in ``timeout`` seconds and ``RuntimeError`` if it failed as a whole."""
        if not self.done.wait(timeout):
            raise TimeoutError(f"the request did not end within {timeout} s")
        if self.error is not None:
            raise RuntimeError(self.error)
        return self.finished


class RequestTicket(ABC):
    """A submitted request: cancel it from any thread."""

    @abstractmethod
    def cancel(self) -> None:
        """Stop the request at the engine's next step; it ends with ``ErrorEvent("cancelled")`` or finished
        events whose reason is ``error`` / ``cancelled``."""


class Engine(ABC):
    """A token generator shared by the requests of one model replica."""

    #: the backend's name in settings and health reports
    name: str = "engine"
    #: the engine fills :attr:`FinishedEvent.logprobs` when :attr:`EngineRequest.logprobs` asks (else the replica
    #: computes them with its own model)
    reports_logprobs: bool = False
    #: an engine whose rows honour a request's item ``filter`` (its :class:`~processors.items.ItemRequest`'s ``base``)
    item_filters: bool = False
    #: called after every decode step with (step seconds, constraint-chain seconds), from the engine's thread
    on_step: Callable[[float, float], None] | None = None

    @abstractmethod
    def start(self) -> "Engine":
        """Start serving (idempotent); returns ``self``."""

    @abstractmethod
    def stop(self) -> None:
        """Stop serving; requests in flight may get no further events."""

    @abstractmethod
    def submit(self, request: EngineRequest, on_event: Callable[[EngineEvent], None]) -> RequestTicket:
        """Queue ``request``; ``on_event`` is called with its events from the engine's own thread.

        Raises ``ValueError`` for a request the engine cannot run (before anything is queued).
        """

    @abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters since start (steps, rows, seconds, ...), JSON-serializable."""

    @property
    @abstractmethod
    def active_rows(self) -> int:
        """Rows decoding now."""

    def admission_error(self, request: EngineRequest) -> str | None:
        """Why ``request`` can never run on this engine (e.g. more key/value memory than its budget), or ``None``.

        The replica answers such a request with a 422 before submitting it."""
        return None

    def health(self) -> dict[str, Any]:
        return {"engine": self.name, "active_rows": self.active_rows, "stats": self.stats()}

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineEvent]:
        """The request's events on the running event loop; closing the iterator early cancels the request."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        def deliver(event: EngineEvent) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, event)
            except RuntimeError:  # that event loop has closed (a cancelled caller's asyncio.run): nobody listens
                pass

        ticket = self.submit(request, deliver)
        ended = False
        try:
            while True:
                event = await queue.get()
                yield event
                if isinstance(event, (DoneEvent, ErrorEvent)):
                    ended = True
                    return
        finally:
            if not ended:
                ticket.cancel()
