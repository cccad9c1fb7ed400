"""Which waiting requests join the batch: rows of the padded batch (``max_batch_size``) and estimated memory
(``kv_memory_mb``, of which requests of several rows together take at most ``1 - narrow_reserve``, so one-row requests
always find the rest); a request that can never fit is refused.

:class:`Admission` is the engine's part for this: it owns the requests waiting to join (``waiting``, each a
:class:`.jobs.Pending` whose rows are built or being built) and the memory budget (``kv_budget``, ``narrow_reserve``,
and the per-token and per-row costs :meth:`Admission.job_bytes` estimates from). It reads what the batch holds through
the :class:`.batch.Batch` part given to it and hands the admitted requests to it (a prefill, or a prompt read in
chunks)."""

from __future__ import annotations

import logging
from concurrent.futures import Future

from ..protocol import EngineRequest, ErrorEvent
from .batch import Batch
from .jobs import Pending, Row
from .prefix_cache import PrefixCache
from .rows import cancelled

logger = logging.getLogger(__name__)

__all__ = ["Admission"]


class Admission:
    """Admission of waiting requests.

    Args:
        batch: the running batch (what it holds; admitted requests join it).
        prefix_cache: the prompt-prefix cache (a prompt's uncached rest decides whether it is read in chunks).
        stats: the engine's counters.
        kv_budget: bytes of key/value and logits memory all requests may hold together.
        narrow_reserve: the share of ``kv_budget`` requests of several rows never take.
        token_bytes: key/value bytes of one token (keys and values, all layers).
        score_bytes: attention scores and probabilities of one layer, per row and prompt token.
        vocab_size: the vocabulary (per-row logits).
        max_batch_size: most rows in the padded batch.
        prefill_chunk_tokens: prompts longer than this (after a cached prefix) are read in chunks.
    """

    def __init__(self, batch: Batch, prefix_cache: PrefixCache, stats: dict, *, kv_budget: int, narrow_reserve: float,
                 token_bytes: int, score_bytes: int, vocab_size: int, max_batch_size: int, prefill_chunk_tokens: int):
        self.batch = batch
        self.prefix_cache = prefix_cache
        self._stats = stats
        self.kv_budget = kv_budget
        self.narrow_reserve = narrow_reserve
        self.token_bytes = token_bytes
        self.score_bytes = score_bytes
        self.vocab_size = vocab_size
        self.max_batch_size = max_batch_size
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self._waiting: list[Pending] = []

    @property
    def waiting(self) -> list[Pending]:
        """The requests waiting to join, in arrival order (read only: :meth:`enqueue` adds, :meth:`admit` takes)."""
        return self._waiting

    def enqueue(self, p: Pending) -> None:
        self._waiting.append(p)

    def ready(self) -> bool:
        """Whether a waiting request has its rows built."""
        return any(p.ready() for p in self._waiting)

    def job_bytes(self, request: EngineRequest) -> int:
        """Estimated memory of a request while it decodes: key/value cache (its prompt once, each row's generated
        tokens), per-row logits and their working copies, and the attention scores of its rows over the prompt."""
        width = request.num_beams if request.num_beams > 1 else request.n
        prompt = len(request.prompt_ids)
        shared = self.batch.shared_prompt
        copies = 1 if shared else width
        kv = (copies * prompt + width * request.max_new_tokens) * self.token_bytes
        logits = width * self.vocab_size * 4 * 4  # logits, log-probabilities, masked copy, ranking
        scores = width * prompt * self.score_bytes if width > 1 and shared else 0
        return kv + logits + scores

    @property
    def wide_budget(self) -> int:
        """Bytes that requests of several rows (beams, ``n``) may hold together: ``kv_memory_mb`` less the share
        ``narrow_reserve`` kept for one-row requests."""
        return int(self.kv_budget * (1 - self.narrow_reserve))

    def admission_error(self, request: EngineRequest) -> str | None:
        need = self.job_bytes(request)
        rows = max(request.n, request.num_beams)
        budget = self.wide_budget if rows > 1 else self.kv_budget
        if need <= budget:
            return None
        where = (f"the replica's budget kv_memory_mb={self.kv_budget // 2**20}" if rows == 1 else
                 f"what requests of several rows may hold: kv_memory_mb={self.kv_budget // 2**20} less the "
                 f"narrow_reserve={self.narrow_reserve:g} kept for one-row requests, {budget / 2**20:.0f} MiB")
        return (f"this request needs about {need / 2**20:.0f} MiB of key/value and logits memory (prompt "
                f"{len(request.prompt_ids)} tokens, {rows} rows x {request.max_new_tokens} new tokens), more than "
                f"{where}; lower num_beams, n or max_new_tokens")

    def bytes_in_use(self) -> int:
        return sum(self.job_bytes(j.request) for j in self.batch.jobs_in_use())

    def fair_order(self) -> list[Pending]:
        """The waiting requests in the order they are offered room: one request of each client in turn (round robin),
        the clients with fewer rows running first, each client's own requests first come first served. One
        client's burst (up to its ``max_inflight_rows_per_client`` at the ingress) then fills the room only while
        nobody else waits: another client's request takes one of the next rows that free up instead of waiting
        behind the whole burst."""
        if len(self._waiting) < 2:
            return self._waiting
        queues: dict[str | None, list[Pending]] = {}
        for p in self._waiting:
            queues.setdefault(p.job.request.client, []).append(p)
        if len(queues) < 2:
            return self._waiting
        running: dict[str | None, int] = {}
        for job in self.batch.jobs_in_use():
            running[job.request.client] = running.get(job.request.client, 0) + job.width
        turns = sorted(queues.values(), key=lambda q: running.get(q[0].job.request.client, 0))  # stable
        return [q[i] for i in range(max(map(len, turns))) for q in turns if i < len(q)]

    def admit(self, hold_wide: bool = False) -> bool:
        """Offer the waiting requests room in :meth:`fair_order`: those that fit join the batch (one prefill), one
        whose uncached prompt is longer than ``prefill_chunk_tokens`` starts its chunked prefill, the rest wait.
        ``hold_wide``: requests of several rows wait too (the engine's prefill share, while one-row requests
        decode); the one-row requests behind them are still admitted. Returns whether a request of several rows
        was prefilled now."""
        batch = self.batch
        room = self.max_batch_size - batch.narrow_rows - (batch.padded_width(batch.chunking.job) if batch.chunking else 0)
        memory = wide = 0
        if self._waiting:
            for j in batch.jobs_in_use():
                need = self.job_bytes(j.request)
                memory += need
                wide += need if j.width > 1 else 0
        admitted: list[tuple[Pending, list[Row]]] = []
        keep: list[Pending] = []
        empty = batch.idle
        for p in self.fair_order():
            job = p.job
            if job.cancelled.is_set():
                if isinstance(p.rows, Future):
                    p.rows.cancel()
                cancelled(job, self._stats)
                continue
            if not p.ready() or (hold_wide and job.width > 1):
                keep.append(p)
                continue
            need = self.job_bytes(job.request)
            error = self.admission_error(job.request)
            if error is not None:
                if isinstance(p.rows, Future):
                    p.rows.cancel()
                job.on_event(ErrorEvent(error))
                continue
            alone = empty and not admitted
            fits = (batch.padded_width(job) <= room or alone) and (memory + need <= self.kv_budget or alone)
            # requests of several rows leave narrow_reserve of the memory to one-row requests
            fits = fits and (job.width == 1 or wide + need <= self.wide_budget)
            if not fits:
                keep.append(p)
                continue
            try:
                rows = p.take_rows()
            except Exception as exc:
                logger.exception("preparing the rows of a job failed")
                job.on_event(ErrorEvent(f"cannot start: {type(exc).__name__}: {exc}"))
                continue
            length, kv = self.prefix_cache.lookup(job.prompt_ids)
            if len(job.prompt_ids) - length > self.prefill_chunk_tokens:
                if batch.chunking is not None:
                    keep.append(p)  # one chunked prefill at a time
                    continue
                batch.start_chunking(p, rows, length, kv)
                room -= batch.padded_width(job)
                memory += need
                wide += need if job.width > 1 else 0
                continue
            admitted.append((p, rows))
            room -= batch.padded_width(job)
            memory += need
            wide += need if job.width > 1 else 0
        self._waiting = keep
        if admitted:
            batch.prefill(admitted)
        return any(p.job.width > 1 for p, _ in admitted)
