"""The decode loop of a model replica: continuous batching over a HuggingFace causal LM.

One engine thread owns the model. Requests (``Job``) arrive on a queue at any time; between two
decode steps the engine admits waiting jobs (one batched, left-padded prefill for all of them),
merges their key/value cache into the running batch, and from then on every active row shares
the same forward pass. Each step: the processor chain masks the logits of every row with that
row's own pinned scenario (:class:`processors.RowCursor`), each row samples with its own
parameters and generator, finished rows leave the batch. Beam search runs as its own batch
through ``model.generate`` with the same chain.

Nothing here imports Ray: the replica wraps the engine, and tests drive it directly.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from transformers import DynamicCache, LogitsProcessorList

from processors import CompiledScenario, ConstrainedLogitsProcessor, RowCursor, apply_steps
from processors.masks import mask_padded_vocab

from .prefix_cache import PrefixCache

logger = logging.getLogger(__name__)

__all__ = ["DecodeEngine", "Job", "SamplingParams"]


@dataclass(frozen=True)
class SamplingParams:
    """Per-row sampling. ``temperature == 0`` is greedy; ``top_k == 0`` and ``top_p == 1`` are off."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None


@dataclass
class Job:
    """One request: ``n`` outputs of one prompt under one pinned scenario.

    ``on_event`` is called from the engine thread with dicts:
    ``{"type": "token", "index", "token_id"}``, ``{"type": "finished", "index", "token_ids",
    "finish_reason", "error"}``, and last ``{"type": "done"}`` (or ``{"type": "error", "message"}``
    when the job failed as a whole).
    """

    prompt_ids: list[int]
    compiled: CompiledScenario | None
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    n: int = 1
    num_beams: int = 1
    on_event: Callable[[dict], None] = lambda event: None
    cancelled: threading.Event = field(default_factory=threading.Event)
    remaining: int = 0


class _Row:
    __slots__ = ("job", "index", "cursor", "generator", "tokens")

    def __init__(self, job: Job, index: int, cursor: RowCursor, generator: torch.Generator | None):
        self.job = job
        self.index = index
        self.cursor = cursor
        self.generator = generator
        self.tokens: list[int] = []


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Sample one token from one row of (already masked) logits."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) > params.top_p  # keep the token that crosses top_p
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


class DecodeEngine:
    """Continuous-batching decode loop over ``model`` (see the module docstring).

    Args:
        model: a HF causal LM in eval mode.
        tokenizer: its tokenizer (for grammar matchers and the pad/EOS ids).
        max_batch_size: most rows in one forward pass; jobs wait beyond it.
        prefix_cache_tokens: prompt-prefix key/value cache budget in tokens (0 disables it), see
            :mod:`deployments.prefix_cache`.
        eos_token_ids: the model's EOS ids (default: the tokenizer's).
    """

    def __init__(
        self, model, tokenizer, *, max_batch_size: int = 16, eos_token_ids: tuple[int, ...] | None = None,
        prefix_cache_tokens: int = 8192,
    ):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.eos_token_ids = tuple(eos_token_ids or (tokenizer.eos_token_id,))
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_token_ids[0]
        self.device = next(model.parameters()).device
        self.vocab_size = len(tokenizer)
        self._queue: queue.Queue[Job] = queue.Queue()
        self._waiting: list[Job] = []
        self._rows: list[_Row] = []
        self._cache: DynamicCache | None = None
        self._mask: torch.Tensor | None = None
        self._logits: torch.Tensor | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.prefix_cache = PrefixCache(max_tokens=prefix_cache_tokens)
        # Called from the engine thread after every decode step with (step seconds, chain seconds).
        self.on_step: Callable[[float, float], None] | None = None
        self.stats = {
            "steps": 0, "step_seconds": 0.0, "chain_seconds": 0.0, "rows_decoded": 0, "prefills": 0,
            "fallback_rows": 0, "prefill_tokens": 0, "prefix_tokens_reused": 0,
        }

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> "DecodeEngine":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="decode-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def submit(self, job: Job) -> Job:
        """Queue a job; events arrive through ``job.on_event`` from the engine thread."""
        if not job.prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        if job.n < 1 or job.num_beams < 1 or job.max_new_tokens < 1:
            raise ValueError("n, num_beams and max_new_tokens must be >= 1")
        self._queue.put(job)
        return job

    @property
    def active_rows(self) -> int:
        return len(self._rows)

    # -- loop -----------------------------------------------------------------------------------
    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while not self._stop.is_set():
            try:
                block = not self._rows and not self._waiting
                try:
                    job = self._queue.get(timeout=0.1) if block else self._queue.get_nowait()
                    self._waiting.append(job)
                    while True:
                        self._waiting.append(self._queue.get_nowait())
                except queue.Empty:
                    pass
                self._admit()
                if self._rows:
                    self._step()
            except Exception as exc:  # a failed forward must not kill the replica
                logger.exception("decode step failed; failing the active jobs")
                self._fail_all(f"decode failed: {type(exc).__name__}: {exc}")

    def _fail_all(self, message: str) -> None:
        jobs = {id(r.job): r.job for r in self._rows}
        for job in jobs.values():
            job.on_event({"type": "error", "message": message})
        self._rows, self._cache, self._mask, self._logits = [], None, None, None

    # -- admission ------------------------------------------------------------------------------
    def _admit(self) -> None:
        waiting = [j for j in self._waiting if not j.cancelled.is_set()]
        for j in self._waiting:
            if j.cancelled.is_set():
                j.on_event({"type": "error", "message": "cancelled"})
        self._waiting = []
        admitted: list[Job] = []
        room = self.max_batch_size - len(self._rows)
        for job in waiting:
            if job.num_beams > 1:
                if not self._rows and not admitted:
                    self._run_beams(job)  # its own batch; nothing else runs meanwhile
                else:
                    self._waiting.append(job)
                continue
            if job.n <= room or (not self._rows and not admitted):
                admitted.append(job)
                room -= job.n
            else:
                self._waiting.append(job)
        if admitted:
            self._prefill(admitted)

    def _new_rows(self, job: Job) -> list[_Row]:
        rows = []
        for i in range(job.n):
            gen = None
            if job.sampling.seed is not None:
                gen = torch.Generator(device="cpu").manual_seed(job.sampling.seed + i)
            cursor = RowCursor(job.compiled, self.tokenizer, eos_token_ids=self.eos_token_ids)
            rows.append(_Row(job, i, cursor, gen))
        job.remaining = job.n
        return rows

    def _prefill(self, jobs: list[Job]) -> None:
        """Prefill new prompts (grouped by their cached prefix), then merge into the running batch."""
        groups: dict[int, tuple[list, list[Job]]] = {}
        for job in jobs:
            length, kv = self.prefix_cache.lookup(job.prompt_ids)
            # jobs that hit the same cached prefix object share one forward pass
            key = id(kv[0][0].untyped_storage()) * 100003 + length if kv is not None else 0
            groups.setdefault(key, (kv, []))[1].append(job)
        for kv, group in groups.values():
            try:
                self._prefill_group(group, kv)
            except Exception as exc:  # only these jobs fail; rows already decoding keep going
                logger.exception("prefill failed")
                for job in group:
                    job.on_event({"type": "error", "message": f"prefill failed: {type(exc).__name__}: {exc}"})

    def _prefill_group(self, jobs: list[Job], prefix_kv) -> None:
        """One forward over the prompts after a shared cached prefix (or whole prompts, left-padded).

        Row layout of the resulting cache: ``[prefix | padding | rest of the prompt]``; the attention
        mask zeroes the padding, position ids count only real tokens.
        """
        plen = prefix_kv[0][0].shape[2] if prefix_kv is not None else 0
        rests = [j.prompt_ids[plen:] for j in jobs]
        width = max(len(r) for r in rests)
        b = len(jobs)
        ids = torch.full((b, width), self.pad_id, dtype=torch.long)
        rest_mask = torch.zeros((b, width), dtype=torch.long)
        for i, r in enumerate(rests):
            ids[i, width - len(r):] = torch.tensor(r)
            rest_mask[i, width - len(r):] = 1
        positions = (plen + rest_mask.cumsum(dim=1) - 1).clamp(min=0)
        mask = torch.cat([torch.ones((b, plen), dtype=torch.long), rest_mask], dim=1)
        if prefix_kv is not None:
            past = DynamicCache(ddp_cache_data=[(k.expand(b, -1, -1, -1).contiguous(), v.expand(b, -1, -1, -1).contiguous()) for k, v in prefix_kv])
        else:
            past = DynamicCache()
        out = self.model(
            input_ids=ids.to(self.device), attention_mask=mask.to(self.device), position_ids=positions.to(self.device),
            past_key_values=past, use_cache=True,
        )
        layers = out.past_key_values.layers
        for i, job in enumerate(jobs):  # remember this prompt's block prefixes (contiguous, in prompt order)
            pad = width - len(rests[i])
            cols = torch.cat([torch.arange(plen), torch.arange(plen + pad, plen + width)]).to(self.device)
            self.prefix_cache.store(job.prompt_ids, [
                (layer.keys[i : i + 1].index_select(2, cols), layer.values[i : i + 1].index_select(2, cols)) for layer in layers
            ])
        repeats = torch.tensor([j.n for j in jobs])
        kv = [
            (layer.keys.repeat_interleave(repeats.to(layer.keys.device), dim=0),
             layer.values.repeat_interleave(repeats.to(layer.values.device), dim=0))
            for layer in layers
        ]
        logits = out.logits[:, -1, :].float().repeat_interleave(repeats.to(out.logits.device), dim=0)
        mask = mask.repeat_interleave(repeats, dim=0).to(self.device)
        rows = [row for j in jobs for row in self._new_rows(j)]
        self._merge(kv, mask, logits, rows)
        self.stats["prefills"] += 1
        self.stats["prefill_tokens"] += sum(len(r) for r in rests)
        self.stats["prefix_tokens_reused"] += plen * b

    def _merge(self, kv, mask, logits, rows) -> None:
        if self._cache is None:
            self._cache = DynamicCache(ddp_cache_data=kv)
            self._mask, self._logits, self._rows = mask, logits, rows
            return
        old_len, new_len = self._mask.shape[1], mask.shape[1]
        total = max(old_len, new_len)
        merged = []
        for layer, (k, v) in zip(self._cache.layers, kv):
            ok = F.pad(layer.keys, (0, 0, total - old_len, 0))
            ov = F.pad(layer.values, (0, 0, total - old_len, 0))
            merged.append((torch.cat([ok, F.pad(k, (0, 0, total - new_len, 0))]), torch.cat([ov, F.pad(v, (0, 0, total - new_len, 0))])))
        self._cache = DynamicCache(ddp_cache_data=merged)
        self._mask = torch.cat([F.pad(self._mask, (total - old_len, 0)), F.pad(mask, (total - new_len, 0))])
        self._logits = torch.cat([self._logits, logits])
        self._rows = self._rows + rows

    # -- one decode step ------------------------------------------------------------------------
    def _step(self) -> None:
        t0 = time.perf_counter()
        rows = self._rows
        logits = self._logits
        apply_steps(logits, [r.cursor.step() for r in rows])
        mask_padded_vocab(logits, self.vocab_size)
        t_chain = time.perf_counter() - t0
        keep: list[int] = []
        next_tokens: list[int] = []
        for i, row in enumerate(rows):
            job = row.job
            if job.cancelled.is_set():
                self._finish(row, "error", "cancelled")
                continue
            token = sample_row(logits[i], job.sampling, row.generator)
            t1 = time.perf_counter()
            row.cursor.advance(token)
            t_chain += time.perf_counter() - t1
            row.tokens.append(token)
            job.on_event({"type": "token", "index": row.index, "token_id": token})
            if row.cursor.finished:
                self._finish(row, "error" if row.cursor.error else "stop", row.cursor.error)
            elif len(row.tokens) >= job.max_new_tokens:
                self._finish(row, "length", row.cursor.error)
            else:
                keep.append(i)
                next_tokens.append(token)
        self.stats["steps"] += 1
        self.stats["rows_decoded"] += len(rows)
        if not keep:
            self._rows, self._cache, self._mask, self._logits = [], None, None, None
        else:
            if len(keep) < len(rows):
                idx = torch.tensor(keep, device=self.device)
                self._cache.batch_select_indices(idx)
                self._mask = self._mask.index_select(0, idx)
                self._rows = [rows[i] for i in keep]
                self._trim()
            positions = self._mask.sum(dim=1, keepdim=True)
            self._mask = torch.cat([self._mask, torch.ones((len(keep), 1), dtype=self._mask.dtype, device=self.device)], dim=1)
            out = self.model(
                input_ids=torch.tensor(next_tokens, device=self.device)[:, None], attention_mask=self._mask,
                position_ids=positions, past_key_values=self._cache, use_cache=True,
            )
            self._cache = out.past_key_values
            self._logits = out.logits[:, -1, :].float()
        step_seconds = time.perf_counter() - t0
        self.stats["step_seconds"] += step_seconds
        self.stats["chain_seconds"] += t_chain
        if self.on_step is not None:
            self.on_step(step_seconds, t_chain)

    def _trim(self) -> None:
        """Drop leading columns that are padding in every remaining row."""
        live = self._mask.any(dim=0).nonzero()
        first = int(live[0]) if live.numel() else 0
        if first > 0:
            self._mask = self._mask[:, first:]
            for layer in self._cache.layers:
                layer.keys = layer.keys[:, :, first:, :]
                layer.values = layer.values[:, :, first:, :]

    def _finish(self, row: _Row, reason: str, error: str | None) -> None:
        if row.cursor.fell_back:
            self.stats["fallback_rows"] += 1
        job = row.job
        job.on_event({"type": "finished", "index": row.index, "token_ids": list(row.tokens), "finish_reason": reason,
                      "error": error, "fell_back": row.cursor.fell_back})
        job.remaining -= 1
        if job.remaining == 0:
            job.on_event({"type": "done"})

    # -- beam search ----------------------------------------------------------------------------
    def _run_beams(self, job: Job) -> None:
        """Beam search as its own batch, through ``generate`` with the same chain."""
        try:
            proc = ConstrainedLogitsProcessor(
                job.compiled, tokenizer=self.tokenizer, eos_token_ids=self.eos_token_ids
            ) if job.compiled is not None else ConstrainedLogitsProcessor([None], tokenizer=self.tokenizer, eos_token_ids=self.eos_token_ids)
            stop = list(proc.stop_token_ids)
            ids = torch.tensor([job.prompt_ids], device=self.device)
            out = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), logits_processor=LogitsProcessorList([proc]),
                num_beams=job.num_beams, num_return_sequences=job.n, do_sample=False,
                max_new_tokens=job.max_new_tokens, eos_token_id=stop, pad_token_id=self.pad_id,
            )
        except Exception as exc:
            logger.exception("beam search failed")
            job.on_event({"type": "error", "message": f"beam search failed: {type(exc).__name__}: {exc}"})
            return
        job.remaining = job.n
        for index, seq in enumerate(out[:, len(job.prompt_ids):].tolist()):
            tokens = []
            reason = "length"
            for t in seq:
                tokens.append(t)
                if t in stop:
                    reason = "stop"
                    break
            for t in tokens:
                job.on_event({"type": "token", "index": index, "token_id": t})
            job.on_event({"type": "finished", "index": index, "token_ids": tokens, "finish_reason": reason, "error": None})
            job.remaining -= 1
        job.on_event({"type": "done"})
