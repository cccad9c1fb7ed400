"""Which waiting requests join the batch: rows of the padded batch (``max_batch_size``) and estimated memory
(``kv_memory_mb``, of which requests of several rows together take at most ``1 - narrow_reserve``, so one-row requests
always find the rest); a request that can never fit is refused. Part of :class:`.engine.DecodeEngine`."""

from __future__ import annotations

import logging
from concurrent.futures import Future

from transformers import DynamicCache

from ..protocol import EngineRequest, ErrorEvent
from .jobs import Job, Pending, Row

logger = logging.getLogger(__name__)

__all__ = ["AdmissionMixin"]


class AdmissionMixin:
    """Admission of the decode engine (see :class:`.engine.DecodeEngine` for the state it reads)."""

    @property
    def _narrow_rows(self) -> int:
        return 0 if self._mask is None else self._mask.shape[0]

    def _is_group(self, job: Job) -> bool:
        """Whether ``job`` decodes as a :class:`SharedGroup` (its prompt once) rather than in the padded batch."""
        return self.shared_prompt and job.width > 1

    def _padded_width(self, job: Job) -> int:
        """Rows ``job`` takes in the padded batch (bounded by ``max_batch_size``)."""
        return 0 if self._is_group(job) else job.width

    def job_bytes(self, request: EngineRequest) -> int:
        """Estimated memory of a request while it decodes: key/value cache (its prompt once, each row's generated
        tokens), per-row logits and their working copies, and the attention scores of its rows over the prompt."""
        width = request.num_beams if request.num_beams > 1 else request.n
        prompt = len(request.prompt_ids)
        copies = 1 if self.shared_prompt else width
        kv = (copies * prompt + width * request.max_new_tokens) * self._token_bytes
        logits = width * self.vocab_size * 4 * 4  # logits, log-probabilities, masked copy, ranking
        scores = width * prompt * self._score_bytes if width > 1 and self.shared_prompt else 0
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

    def _jobs_in_use(self) -> list[Job]:
        jobs = {id(r.job): r.job for r in self._rows}
        jobs.update((id(g.job), g.job) for g in self._groups)
        if self._chunking is not None:
            jobs[id(self._chunking.job)] = self._chunking.job
        return list(jobs.values())

    def _bytes_in_use(self) -> int:
        return sum(self.job_bytes(j.request) for j in self._jobs_in_use())

    def _fair_order(self) -> list[Pending]:
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
        for job in self._jobs_in_use():
            running[job.request.client] = running.get(job.request.client, 0) + job.width
        turns = sorted(queues.values(), key=lambda q: running.get(q[0].job.request.client, 0))  # stable
        return [q[i] for i in range(max(map(len, turns))) for q in turns if i < len(q)]

    def _admit(self) -> None:
        room = self.max_batch_size - self._narrow_rows - (self._padded_width(self._chunking.job) if self._chunking else 0)
        memory = wide = 0
        if self._waiting:
            for j in self._jobs_in_use():
                need = self.job_bytes(j.request)
                memory += need
                wide += need if j.width > 1 else 0
        admitted: list[tuple[Pending, list[Row]]] = []
        keep: list[Pending] = []
        empty = not self._rows and not self._groups and self._chunking is None
        for p in self._fair_order():
            job = p.job
            if job.cancelled.is_set():
                if isinstance(p.rows, Future):
                    p.rows.cancel()
                self._cancelled(job)
                continue
            if not p.ready():
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
            fits = (self._padded_width(job) <= room or alone) and (memory + need <= self.kv_budget or alone)
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
                if self._chunking is not None:
                    keep.append(p)  # one chunked prefill at a time
                    continue
                p.rows, p.done_tokens, p.reused = rows, length, length
                p.cache = self._expand_prefix(kv, 1) if kv is not None else DynamicCache()
                self._chunking = p
                room -= self._padded_width(job)
                memory += need
                wide += need if job.width > 1 else 0
                continue
            admitted.append((p, rows))
            room -= self._padded_width(job)
            memory += need
            wide += need if job.width > 1 else 0
        self._waiting = keep
        if admitted:
            self._prefill(admitted)
