"""Which waiting requests join the batch: rows of the padded batch (``max_batch_size``) and estimated memory
(``kv_memory_mb``); a request that can never fit is refused. Part of :class:`.engine.DecodeEngine`."""

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

    def admission_error(self, request: EngineRequest) -> str | None:
        need = self.job_bytes(request)
        if need <= self.kv_budget:
            return None
        return (f"this request needs about {need / 2**20:.0f} MiB of key/value and logits memory (prompt "
                f"{len(request.prompt_ids)} tokens, {max(request.n, request.num_beams)} rows x "
                f"{request.max_new_tokens} new tokens), more than the replica's budget kv_memory_mb="
                f"{self.kv_budget // 2**20}; lower num_beams, n or max_new_tokens")

    def _bytes_in_use(self) -> int:
        jobs = {id(r.job): r.job for r in self._rows}
        if self._chunking is not None:
            jobs[id(self._chunking.job)] = self._chunking.job
        return sum(self.job_bytes(j.request) for j in jobs.values())

    def _admit(self) -> None:
        room = self.max_batch_size - self._narrow_rows - (self._padded_width(self._chunking.job) if self._chunking else 0)
        memory = self._bytes_in_use() if self._waiting else 0
        admitted: list[tuple[Pending, list[Row]]] = []
        keep: list[Pending] = []
        empty = not self._rows and self._chunking is None
        for p in self._waiting:
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
            if need > self.kv_budget:
                if isinstance(p.rows, Future):
                    p.rows.cancel()
                job.on_event(ErrorEvent(self.admission_error(job.request) or "too large"))
                continue
            alone = empty and not admitted
            fits = (self._padded_width(job) <= room or alone) and (memory + need <= self.kv_budget or alone)
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
                continue
            admitted.append((p, rows))
            room -= self._padded_width(job)
            memory += need
        self._waiting = keep
        if admitted:
            self._prefill(admitted)
