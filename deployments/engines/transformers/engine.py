"""The decode loop of a model replica: continuous batching over a HuggingFace causal LM.

One engine thread owns the model. Requests (:class:`EngineRequest`, held as a ``Job``) arrive on a queue at any time and go through
three stages before they decode:

1. **prepare**: their row cursors are built. A grammar cursor's first mask can take a second or more
   (a long counted repetition), so grammar jobs are prepared on a small thread pool and their first
   masks computed there (llguidance releases the GIL); other rows keep decoding meanwhile.
2. **prefill**: waiting prompts are read in one batched, left-padded forward, keeping the logits of
   the last position only. A prompt longer than ``prefill_chunk_tokens`` is read one chunk at a
   time, each chunk followed by decode steps of the running batch that last at least as long as the
   chunk did, so a long prompt never holds the other rows for more than one chunk and slows their
   steps at most twofold.
3. **decode**: the prompt's key/value cache joins the running batch and from then on every active
   row shares the same forward pass. Each step the processor chain masks every row's logits with that
   row's own pinned scenario (:class:`processors.RowCursor`); sampled rows draw with their own
   parameters, beam-search rows of one request are ranked together (below); finished rows leave.

Beam search runs inside the same batch: a request with ``num_beams = B`` holds ``B`` rows; each step
its candidates are ranked over all its rows (log-probabilities of the masked logits, summed), the best
``B`` live ones continue (the key/value cache rows are gathered accordingly and cursors follow their
beam), ended candidates are kept as hypotheses with a length-normalized score. So a beam request
shares forward passes with everyone else and stops at the next step when it is cancelled.

Failures stay with their row: a row whose sampling or cursor fails finishes with ``error``; a failed
prefill fails only its own jobs; only a failed forward of the whole batch fails the jobs in it.

Nothing here imports Ray: the replica knows it only as an :class:`~deployments.engines.protocol.Engine`,
and tests drive it directly. See ``docs/design.md`` (engine contract).
"""

from __future__ import annotations

import logging
import queue
from bisect import bisect_right
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from processors import GrammarSpec, RowCursor, apply_steps
from processors.lanes import advance_rows, lane_of, mask_rows
from processors.masks import FREE, MaskBuffer, Step, mask_padded_vocab

from ..protocol import (
    DoneEvent, Engine, EngineEvent, EngineRequest, ErrorEvent, FinishedEvent, RequestTicket, TokenEvent,
)
from .kv_cache import cache_of, release_memory
from .prefix_cache import PrefixCache
from .sampling import sample_row, sample_rows
from .shared_kv import SharedGroup, StepContext, install
from .tree_beams import plan_tree_beams, row_logsumexp, tree_beam_candidates

logger = logging.getLogger(__name__)

__all__ = ["DecodeEngine", "Job"]

_FREE_STEP = Step(FREE, None, 0)


class _Unmasked:
    """Stands for a row the chain must leave alone this step (a tree beam ranked from its tables)."""

    @staticmethod
    def step() -> Step:
        return _FREE_STEP


_UNMASKED = _Unmasked()


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


class _Row:
    __slots__ = ("job", "index", "cursor", "generator", "tokens", "score")

    def __init__(self, job: Job, index: int, cursor: RowCursor, generator: torch.Generator | None,
                 tokens: list[int] | None = None, score: float = 0.0):
        self.job = job
        self.index = index
        self.cursor = cursor
        self.generator = generator
        self.tokens: list[int] = tokens if tokens is not None else []
        self.score = score  # beam rows: sum of the log-probabilities of ``tokens``


class _Beams:
    """Ended hypotheses of one beam request: ``(normalized score, tokens, finish_reason)``."""

    __slots__ = ("hyps",)

    def __init__(self):
        self.hyps: list[tuple[float, list[int], str]] = []

    def add(self, score: float, tokens: list[int], reason: str, keep: int) -> None:
        self.hyps.append((score / max(len(tokens), 1), tokens, reason))
        self.hyps.sort(key=lambda h: -h[0])
        del self.hyps[keep:]

    def worst(self) -> float:
        return self.hyps[-1][0]


@dataclass
class _Pending:
    """A job between submission and its first decode step."""

    job: Job
    rows: Future | list[_Row]
    # chunked prefill: the prompt's cache so far and how many prompt tokens it holds
    cache: DynamicCache | None = None
    done_tokens: int = 0
    reused: int = 0

    def ready(self) -> bool:
        return not isinstance(self.rows, Future) or self.rows.done()

    def take_rows(self) -> list[_Row]:
        return self.rows.result() if isinstance(self.rows, Future) else self.rows


class DecodeEngine(Engine):
    name = "transformers"

    """Continuous-batching decode loop over ``model`` (see the module docstring).

    Args:
        model: a HF causal LM in eval mode.
        tokenizer: its tokenizer (for grammar matchers and the pad/EOS ids).
        max_batch_size: most rows in one forward pass; jobs wait beyond it.
        prefix_cache_tokens: prompt-prefix key/value cache budget in tokens (0 disables it), see
            :mod:`deployments.prefix_cache`.
        eos_token_ids: the model's EOS ids (default: the tokenizer's).
        prefill_chunk_tokens: prompts longer than this (after a cached prefix) are read in chunks of
            this many tokens, one chunk per engine iteration.
        prepare_threads: threads that build grammar cursors and their first masks.
        vector_lane: mask and advance tree and single-label rows without item controls together with array
            operations (:mod:`processors.lanes`) instead of one cursor call per row; the same masks and states.
            Off by default: on the CPU it measured slower than the per-row path below batch ~64 (README).
        kv_memory_mb: the budget of key/value cache and per-row logits memory, MiB. A request is admitted when its
            estimate (:meth:`job_bytes`) fits beside the running ones, and refused (:meth:`admission_error`) when it
            can never fit.
        shared_prompt: hold the prompt of a several-row request once (default); ``False`` copies it into every row
            of the padded batch, the layout before :mod:`.shared_kv` (kept for comparisons: ``bench/wide_beams.py``).

    Memory layout: a request of one row keeps its prompt in the padded batch cache (one copy per request); a request
    of ``w > 1`` rows (beams, ``n``) holds its prompt once and each row only its generated tokens
    (:mod:`.shared_kv`); ``max_batch_size`` bounds the one-row requests, the memory budget bounds everything.
    """

    def __init__(
        self, model, tokenizer, *, max_batch_size: int = 16, eos_token_ids: tuple[int, ...] | None = None,
        prefix_cache_tokens: int = 8192, prefill_chunk_tokens: int = 256, prepare_threads: int = 2,
        vector_lane: bool = False, kv_memory_mb: int = 4096, shared_prompt: bool = True,
    ):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens must be >= 1, got {prefill_chunk_tokens}")
        if kv_memory_mb < 1:
            raise ValueError(f"kv_memory_mb must be >= 1, got {kv_memory_mb}")
        install(model)
        self.model = model
        self.kv_budget = kv_memory_mb * 2**20
        self.shared_prompt = shared_prompt
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        elem = next(model.parameters()).element_size()
        self._token_bytes = 2 * cfg.num_hidden_layers * kv_heads * head_dim * elem  # keys + values, all layers
        self._score_bytes = cfg.num_attention_heads * 4 * 2  # one layer's scores and probabilities, per row and prompt token
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.vector_lane = vector_lane
        self.eos_token_ids = tuple(eos_token_ids or (tokenizer.eos_token_id,))
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_token_ids[0]
        self.device = next(model.parameters()).device
        self.vocab_size = len(tokenizer)
        self._queue: queue.Queue[Job] = queue.Queue()
        self._waiting: list[_Pending] = []
        self._chunking: _Pending | None = None
        self._rows: list[_Row] = []  # the padded rows first (their cache: _cache, _mask), then each group's rows
        self._groups: list[SharedGroup] = []  # requests of several rows, prompt held once
        self._beams: dict[int, _Beams] = {}
        self._cache: DynamicCache | None = None
        self._mask: torch.Tensor | None = None
        self._logits: torch.Tensor | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._prepare = ThreadPoolExecutor(max_workers=max(1, prepare_threads), thread_name_prefix="cursor-prepare")
        self._trim_due = False
        # the per-step mask data: host memory reused from step to step (pinned on a GPU), one copy to the device
        self._mask_buffer = MaskBuffer(self.device)
        self._chunk_debt = 0.0  # seconds of decoding owed to the running rows after the last prefill chunk
        self.prefix_cache = PrefixCache(max_tokens=prefix_cache_tokens)
        self._stats = {
            "steps": 0, "step_seconds": 0.0, "chain_seconds": 0.0, "rows_decoded": 0, "prefills": 0,
            "fallback_rows": 0, "prefill_tokens": 0, "prefix_tokens_reused": 0, "prefill_chunks": 0,
            "failed_rows": 0, "cancelled_jobs": 0, "forward_seconds": 0.0,
            "tree_ranked_steps": 0,  # beam steps of one request ranked from its tree's tables (tree_beams)
            "torch_threads": 0,  # intra-op threads torch uses on the engine thread (set when it starts)
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
        self._prepare.shutdown(wait=False, cancel_futures=True)

    def submit(self, request: EngineRequest, on_event: Callable[[EngineEvent], None]) -> Job:
        """Queue a request; its events arrive through ``on_event`` from the engine thread."""
        if not isinstance(request, EngineRequest):
            raise TypeError(f"expected an EngineRequest, got {type(request).__name__}")
        job = Job(request, on_event)
        self._queue.put(job)
        return job

    def stats(self) -> dict:
        return dict(self._stats)

    @property
    def active_rows(self) -> int:
        return len(self._rows)

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

    # -- loop -----------------------------------------------------------------------------------
    def _run(self) -> None:
        torch.set_grad_enabled(False)
        self._stats["torch_threads"] = torch.get_num_threads()
        while not self._stop.is_set():
            try:
                idle = not self._rows and self._chunking is None
                ready = any(p.ready() for p in self._waiting)
                try:
                    if idle and not ready:
                        job = self._queue.get(timeout=0.01 if self._waiting else 0.1)
                    else:
                        job = self._queue.get_nowait()
                    self._accept(job)
                    while True:
                        self._accept(self._queue.get_nowait())
                except queue.Empty:
                    pass
                self._admit()
                # A long prompt is read in chunks, each followed by decode steps of the running rows lasting at
                # least as long as the chunk did: prefill takes at most half of the engine's time while others
                # decode, so their steps slow down at most 2x and the prompt still moves at half speed.
                if self._chunking is not None and (self._chunk_debt <= 0 or not self._rows):
                    t0 = time.perf_counter()
                    self._prefill_chunk()
                    self._chunk_debt = time.perf_counter() - t0
                if self._rows:
                    t0 = time.perf_counter()
                    self._step()
                    self._chunk_debt -= time.perf_counter() - t0
                elif self._trim_due and self._chunking is None:
                    self._trim_due = False
                    release_memory()
            except Exception as exc:  # a failed forward must not kill the replica
                logger.exception("decode step failed; failing the jobs in the batch")
                self._fail_all(f"decode failed: {type(exc).__name__}: {exc}")

    def _fail_all(self, message: str) -> None:
        jobs = {id(r.job): r.job for r in self._rows}
        for job in jobs.values():
            job.on_event(ErrorEvent(message))
        self._rows, self._cache, self._mask, self._logits = [], None, None, None
        self._groups = []
        self._beams.clear()

    # -- preparation ----------------------------------------------------------------------------
    def _accept(self, job: Job) -> None:
        """Build the job's rows now, or on the prepare pool when its first masks may be slow."""
        slow = job.compiled is not None and isinstance(job.compiled.constraint, GrammarSpec)
        rows: Future | list[_Row]
        if slow:
            rows = self._prepare.submit(self._new_rows, job, True)
        else:
            try:
                rows = self._new_rows(job, False)
            except Exception as exc:
                logger.exception("building the rows of a job failed")
                job.on_event(ErrorEvent(f"cannot start: {type(exc).__name__}: {exc}"))
                return
        self._waiting.append(_Pending(job, rows))

    def _new_rows(self, job: Job, prime: bool) -> list[_Row]:
        """The job's rows: one fresh cursor, copied for the others (same state, independent)."""
        # the same ItemRequest for every row of the job: exclude, and distinct across its rows
        first = RowCursor(job.compiled, self.tokenizer, eos_token_ids=self.eos_token_ids,
                          max_new_tokens=job.max_new_tokens, items=job.request.items)
        cursors = [first] + [first.copy() for _ in range(job.width - 1)]
        if prime:
            for cursor in cursors:
                cursor.prime()
        rows = []
        for i, cursor in enumerate(cursors):
            gen = None
            if job.num_beams == 1 and job.sampling.seed is not None:
                gen = torch.Generator(device="cpu").manual_seed(job.sampling.seed + i)
            # beam rows 1.. start at -inf: all beams hold the same prompt, only one may expand at first
            score = 0.0 if job.num_beams == 1 or i == 0 else float("-inf")
            rows.append(_Row(job, i, cursor, gen, score=score))
        return rows

    # -- admission ------------------------------------------------------------------------------
    def _admit(self) -> None:
        room = self.max_batch_size - self._narrow_rows - (self._padded_width(self._chunking.job) if self._chunking else 0)
        memory = self._bytes_in_use() if self._waiting else 0
        admitted: list[tuple[_Pending, list[_Row]]] = []
        keep: list[_Pending] = []
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

    def _cancelled(self, job: Job) -> None:
        self._stats["cancelled_jobs"] += 1
        job.on_event(ErrorEvent("cancelled"))

    @staticmethod
    def _expand_prefix(prefix_kv, b: int) -> DynamicCache:
        return cache_of([(k.expand(b, -1, -1, -1).contiguous(), v.expand(b, -1, -1, -1).contiguous()) for k, v in prefix_kv])

    def _prefill(self, admitted: list[tuple[_Pending, list[_Row]]]) -> None:
        """Prefill new prompts (grouped by their cached prefix), then merge into the running batch."""
        groups: dict[int, tuple[list, list]] = {}
        for p, rows in admitted:
            length, kv = self.prefix_cache.lookup(p.job.prompt_ids)
            # jobs that hit the same cached prefix object share one forward pass
            key = id(kv[0][0].untyped_storage()) * 100003 + length if kv is not None else 0
            groups.setdefault(key, (kv, []))[1].append((p.job, rows))
        for kv, group in groups.values():
            try:
                self._prefill_group(group, kv)
            except Exception as exc:  # only these jobs fail; rows already decoding keep going
                logger.exception("prefill failed")
                for job, _ in group:
                    job.on_event(ErrorEvent(f"prefill failed: {type(exc).__name__}: {exc}"))

    def _prefill_group(self, group: list[tuple[Job, list[_Row]]], prefix_kv) -> None:
        """One forward over the prompts after a shared cached prefix (or whole prompts, left-padded).

        Row layout of the resulting cache: ``[prefix | padding | rest of the prompt]``; the attention
        mask zeroes the padding, position ids count only real tokens.
        """
        jobs = [job for job, _ in group]
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
        past = self._expand_prefix(prefix_kv, b) if prefix_kv is not None else DynamicCache()
        out = self.model(
            input_ids=ids.to(self.device), attention_mask=mask.to(self.device), position_ids=positions.to(self.device),
            past_key_values=past, use_cache=True, logits_to_keep=1,
        )
        layers = out.past_key_values.layers
        for i, job in enumerate(jobs):  # remember this prompt's block prefixes (contiguous, in prompt order)
            pad = width - len(rests[i])
            cols = torch.cat([torch.arange(plen), torch.arange(plen + pad, plen + width)]).to(self.device)
            self.prefix_cache.store(job.prompt_ids, [
                (layer.keys[i : i + 1].index_select(2, cols), layer.values[i : i + 1].index_select(2, cols)) for layer in layers
            ])
        narrow = [i for i, job in enumerate(jobs) if not self._is_group(job)]
        if narrow:
            self._join([group[i] for i in narrow], [(layer.keys, layer.values) for layer in layers],
                       mask.to(self.device), out.logits[:, -1, :], narrow)
        for i, (job, rows) in enumerate(group):
            if self._is_group(job):
                # the prompt once: the cached prefix by reference, the rest copied out of the batched prefill
                pad = width - len(rests[i])
                shared = [([prefix_kv[li]] if prefix_kv is not None else [])
                          + [(layer.keys[i : i + 1, :, plen + pad :].clone(), layer.values[i : i + 1, :, plen + pad :].clone())]
                          for li, layer in enumerate(layers)]
                self._join_group(job, rows, shared, out.logits[i : i + 1, -1, :])
        self._stats["prefills"] += 1
        self._stats["prefill_tokens"] += sum(len(r) for r in rests)
        self._stats["prefix_tokens_reused"] += plen * b

    def _prefill_chunk(self) -> None:
        """Read the next chunk of the prompt being prefilled in chunks; join the batch after the last."""
        p = self._chunking
        job = p.job
        if job.cancelled.is_set():
            self._chunking = None
            self._trim_due = True
            self._cancelled(job)
            return
        try:
            start = p.done_tokens
            end = min(start + self.prefill_chunk_tokens, len(job.prompt_ids))
            ids = torch.tensor([job.prompt_ids[start:end]], device=self.device)
            out = self.model(
                input_ids=ids, attention_mask=torch.ones((1, end), dtype=torch.long, device=self.device),
                position_ids=torch.arange(start, end, device=self.device)[None], past_key_values=p.cache,
                use_cache=True, logits_to_keep=1,
            )
            p.cache, p.done_tokens = out.past_key_values, end
            self._stats["prefill_chunks"] += 1
            if end < len(job.prompt_ids):
                return
            self._chunking = None
            self._trim_due = True
            layers = p.cache.layers
            self.prefix_cache.store(job.prompt_ids, [(layer.keys, layer.values) for layer in layers])
            if self._is_group(job):
                self._join_group(job, p.rows, [[(layer.keys, layer.values)] for layer in layers], out.logits[:, -1, :])
            else:
                mask = torch.ones((1, end), dtype=torch.long, device=self.device)
                self._join([(job, p.rows)], [(layer.keys, layer.values) for layer in layers], mask, out.logits[:, -1, :], [0])
            self._stats["prefills"] += 1
            self._stats["prefill_tokens"] += end - p.reused
            self._stats["prefix_tokens_reused"] += p.reused
        except Exception as exc:
            logger.exception("chunked prefill failed")
            self._chunking = None
            job.on_event(ErrorEvent(f"prefill failed: {type(exc).__name__}: {exc}"))

    def _join(self, group: list[tuple[Job, list[_Row]]], kv, mask, logits, sel: list[int]) -> None:
        """Merge one-row jobs' prompt caches into the padded batch, after its rows and before the groups' rows.

        ``kv``, ``mask`` and ``logits`` hold one row per prefilled prompt; ``sel[i]`` is the row of ``group[i]``,
        copied into each of that job's rows (one, unless ``shared_prompt`` is off).
        The merged cache is written once into a zeroed buffer (old rows, then the new prompts): copying
        multi-gigabyte caches through pad/cat temporaries cost seconds per long prompt.
        """
        rows = []
        for job, job_rows in group:
            job.remaining = job.n
            if job.num_beams > 1:
                self._beams[id(job)] = _Beams()
            rows.extend(job_rows)
        sel = [i for (job, _), i in zip(group, sel) for _ in range(job.width)]
        index = torch.tensor(sel, device=self.device)
        logits = logits.float().index_select(0, index.to(logits.device))
        mask = mask.index_select(0, index.to(mask.device))
        old_rows = self._narrow_rows
        new_rows = len(sel)
        old_len = self._mask.shape[1] if old_rows else 0
        new_len = mask.shape[1]
        total = max(old_len, new_len)
        merged = []
        for li, (k, v) in enumerate(kv):
            pair = []
            for new, old in ((k, self._cache.layers[li].keys if old_rows else None),
                             (v, self._cache.layers[li].values if old_rows else None)):
                # room to grow (see GrowingLayer), so the next steps append without copying
                out = new.new_zeros((old_rows + new_rows, new.shape[1], total + max(64, total // 8), new.shape[3]))
                if old is not None:
                    out[:old_rows, :, total - old_len : total] = old
                for j, i in enumerate(sel):
                    out[old_rows + j, :, total - new_len : total] = new[i]
                pair.append(out)
            merged.append(tuple(pair))
        if old_rows:
            self._mask = torch.cat([F.pad(self._mask, (total - old_len, 0)), F.pad(mask, (total - new_len, 0))])
        else:
            self._mask = mask
        if self._logits is None:
            self._logits = logits
        else:
            self._logits = torch.cat([self._logits[:old_rows], logits, self._logits[old_rows:]])
        self._rows = self._rows[:old_rows] + rows + self._rows[old_rows:]
        for g in self._groups:
            g.start += len(rows)
        self._cache = cache_of([(k[:, :, :total], v[:, :, :total]) for k, v in merged], buffers=merged)

    def _join_group(self, job: Job, rows: list[_Row], shared, logits: torch.Tensor) -> None:
        """A job of several rows joins after the batch's rows: its prompt held once (``shared``, per layer a list of
        ``(keys, values)`` segments), its rows' generated keys/values apart (:class:`.shared_kv.SharedGroup`)."""
        job.remaining = job.n
        if job.num_beams > 1:
            self._beams[id(job)] = _Beams()
        group = SharedGroup(job, shared, len(rows))
        group.start = len(self._rows)
        self._groups.append(group)
        logits = logits.float().expand(len(rows), -1)
        self._logits = logits.contiguous() if self._logits is None else torch.cat([self._logits, logits])
        self._rows = self._rows + rows

    # -- one decode step ------------------------------------------------------------------------
    def _row_steps(self, rows: list[_Row], skip: set[int] = frozenset()) -> tuple[list[Step], dict[int, str]]:  # type: ignore[assignment]
        """Each row's allowed set (rows in ``skip``: none, they are ranked from their tables); a cursor that raises
        fails its row only."""
        steps: list[Step] = []
        failed: dict[int, str] = {}
        for i, row in enumerate(rows):
            if i in skip:
                steps.append(_FREE_STEP)
                continue
            try:
                steps.append(row.cursor.step())
            except Exception as exc:
                logger.exception("a row's constraint failed")
                failed[i] = f"constraint failed: {type(exc).__name__}: {exc}"
                steps.append(Step(FREE, None, row.cursor.end_token_id))
        return steps, failed

    def _step(self) -> None:
        t0 = time.perf_counter()
        rows = self._rows
        logits = self._logits
        beam_groups: dict[int, list[int]] = {}
        for i, row in enumerate(rows):
            if row.job.num_beams > 1:
                beam_groups.setdefault(id(row.job), []).append(i)
        # beam requests on a plain tree are ranked straight from their tables (tree_beams): no mask over their rows
        tree_ranked: dict[int, tuple] = {}
        for key, idxs in beam_groups.items():
            plan = plan_tree_beams([rows[i].cursor for i in idxs])
            if plan is not None:
                tree_ranked[key] = (plan, row_logsumexp(logits, idxs))
        skip = {i for key in tree_ranked for i in beam_groups[key]}
        beam_at = [i for idxs in beam_groups.values() for i in idxs if i not in skip]
        # beam scores: log-probabilities of the model's distribution, masked (as HF beam search does)
        logprobs = torch.log_softmax(logits[beam_at], dim=-1) if beam_at else None
        if self.vector_lane:
            failed = mask_rows(logits, [_UNMASKED if i in skip else r.cursor for i, r in enumerate(rows)],
                               self._mask_buffer)
        else:
            steps, failed = self._row_steps(rows, skip)
            apply_steps(logits, steps, self._mask_buffer)
        mask_padded_vocab(logits, self.vocab_size)
        if beam_at:
            logprobs = logprobs.masked_fill(torch.isneginf(logits[beam_at]), float("-inf"))
        t_chain = time.perf_counter() - t0
        # the next batch: (source row index, row object, token)
        nxt: list[tuple[int, _Row, int]] = []
        sampled: list[int] = []
        for i, row in enumerate(rows):
            job = row.job
            if job.num_beams > 1:
                continue
            elif job.cancelled.is_set():
                self._finish(row, "error", "cancelled")
            elif i in failed:
                self._fail_row(row, failed[i])
            else:
                sampled.append(i)
        # everything chosen on the device comes back in one transfer: sampled tokens, then each beam
        # group's top candidates (scores and flat ids)
        parts: list[torch.Tensor] = []
        if sampled:
            try:
                parts.append(sample_rows(logits[sampled], [rows[i].job.sampling for i in sampled],
                                         [rows[i].generator for i in sampled]).double())
            except Exception:
                logger.exception("batched sampling failed; sampling row by row")
                parts.append(self._sample_each(rows, sampled, logits))
        groups = []
        if beam_groups:
            position = {i: k for k, i in enumerate(beam_at)}
            for key, idxs in beam_groups.items():
                job = rows[idxs[0]].job
                if job.cancelled.is_set():
                    self._beams.pop(id(job), None)
                    self._cancelled(job)
                    continue
                if key in tree_ranked:
                    plan, lse = tree_ranked[key]
                    scores = torch.tensor([rows[i].score for i in idxs], dtype=torch.float32)
                    top = tree_beam_candidates(plan, logits, idxs, lse, scores, 2 * job.num_beams)
                    self._stats["tree_ranked_steps"] += 1
                    groups.append((idxs, top[0].numel(), logits.shape[1]))
                else:
                    top = self._beam_candidates(rows, idxs, logprobs[[position[i] for i in idxs]], failed)
                    groups.append((idxs, top[0].numel(), logprobs.shape[1]))
                parts.extend(top)
        host = torch.cat(parts).tolist() if parts else []
        at = 0
        lane_done: dict[int, str | None] = {}  # rows whose cursor the lane advanced already: row -> error or None
        if sampled and self.vector_lane:
            t1 = time.perf_counter()
            lane_done = self._advance_lane(rows, sampled, host)
            t_chain += time.perf_counter() - t1
        if sampled:
            for i, token in zip(sampled, host[: len(sampled)]):
                row = rows[i]
                if token != token:  # NaN: this row failed (and finished) in the row-by-row fallback
                    continue
                t1 = time.perf_counter()
                token = int(token)
                items = row.job.request.items
                if items is not None and items.distinct and not row.cursor.allows(token):
                    token = self._redraw(i, row, logits)
                if i in lane_done:
                    nxt.extend(self._advance_sampled(i, row, token, advanced=True, error=lane_done[i]))
                else:
                    nxt.extend(self._advance_sampled(i, row, token))
                t_chain += time.perf_counter() - t1
            at = len(sampled)
        for idxs, k, vocab in groups:
            scores, flat_ids = host[at : at + k], host[at + k : at + 2 * k]
            at += 2 * k
            nxt.extend(self._beam_select(rows, idxs, scores, [int(f) for f in flat_ids], vocab))
        self._stats["steps"] += 1
        self._stats["rows_decoded"] += len(rows)
        if not nxt:
            self._rows, self._cache, self._mask, self._logits, self._groups = [], None, None, None, []
            self._trim_due = True
        else:
            nxt = self._regroup(nxt)
            self._rows = [row for _, row, _ in nxt]
            positions = []
            if self._mask is not None:
                positions.append(self._mask.sum(dim=1))
                ones = torch.ones((self._mask.shape[0], 1), dtype=self._mask.dtype, device=self.device)
                self._mask = torch.cat([self._mask, ones], dim=1)
            for g in self._groups:
                positions.append(torch.full((g.rows,), g.prompt_len + g.generated, dtype=torch.long, device=self.device))
            step = StepContext(self._cache.layers if self._mask is not None else None, self._mask, self._groups)
            t_fwd = time.perf_counter()
            out = self.model(
                input_ids=torch.tensor([t for _, _, t in nxt], device=self.device)[:, None],
                position_ids=torch.cat(positions)[:, None], use_cache=False, cs_step=step,
            )
            self._logits = out.logits[:, -1, :].float()
            self._stats["forward_seconds"] += time.perf_counter() - t_fwd
        step_seconds = time.perf_counter() - t0
        self._stats["step_seconds"] += step_seconds
        self._stats["chain_seconds"] += t_chain
        if self.on_step is not None:
            self.on_step(step_seconds, t_chain)

    def _regroup(self, nxt: list[tuple[int, _Row, int]]) -> list[tuple[int, _Row, int]]:
        """Lay the next batch out (padded rows, then each group's rows) and select the caches' rows to match: the
        padded cache's rows, and within each group only the generated part (a beam reorder). Returns ``nxt`` in
        the new row order."""
        n0 = self._narrow_rows
        narrow = [e for e in nxt if e[0] < n0]
        starts = [g.start for g in self._groups]
        buckets: list[list[tuple[int, _Row, int]]] = [[] for _ in self._groups]
        for e in nxt:
            if e[0] >= n0:
                buckets[bisect_right(starts, e[0]) - 1].append(e)
        order = [src for src, _, _ in narrow]
        if order != list(range(n0)):
            if order:
                idx = torch.tensor(order, device=self.device)
                self._cache.batch_select_indices(idx)
                self._mask = self._mask.index_select(0, idx)
                self._trim()
            else:
                self._cache, self._mask = None, None
        kept = []
        for g, bucket in zip(self._groups, buckets):
            if bucket:
                g.select([src - g.start for src, _, _ in bucket], self.device)
                kept.append(g)
        at = len(narrow)
        for g in kept:
            g.start, at = at, at + g.rows
        self._groups = kept
        return narrow + [e for bucket in buckets for e in bucket]

    def _redraw(self, i: int, row: _Row, logits: torch.Tensor) -> int:
        """A ``distinct`` row whose sampled token lost its item to another row of its request earlier in this step:
        draw again under its new mask (its allowed set only shrank; the rows of a request advance in order)."""
        sub = logits[i : i + 1].clone()
        apply_steps(sub, [row.cursor.step()])
        return int(sample_row(sub[0], row.job.sampling, row.generator))

    def _sample_each(self, rows: list[_Row], sampled: list[int], logits: torch.Tensor) -> torch.Tensor:
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

    def _advance_lane(self, rows: list[_Row], sampled: list[int], host: list) -> dict[int, str | None]:
        """Advance the sampled rows of the vector lane together (no item controls: their order does not matter);
        returns row -> None, or the message of a cursor that raised."""
        picked = [(i, int(t)) for i, t in zip(sampled, host[: len(sampled)]) if t == t and lane_of(rows[i].cursor)]
        if not picked:
            return {}
        failed = advance_rows([rows[i].cursor for i, _ in picked], [t for _, t in picked])
        return {i: failed.get(k) for k, (i, _) in enumerate(picked)}

    def _advance_sampled(self, i: int, row: _Row, token: int, *, advanced: bool = False,
                         error: str | None = None) -> list[tuple[int, _Row, int]]:
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

    def _beam_candidates(self, rows: list[_Row], idxs: list[int], logprobs: torch.Tensor, failed: dict[int, str]):
        """One beam request's best ``2 * num_beams`` candidates as (scores, flat ids), on the device."""
        for k, i in enumerate(idxs):
            if i in failed:  # a beam whose cursor failed is dropped; its request goes on with the others
                logprobs[k] = float("-inf")
        scores = logprobs + torch.tensor([rows[i].score for i in idxs], dtype=logprobs.dtype, device=logprobs.device)[:, None]
        flat = scores.view(-1)
        top_scores, top_ids = torch.topk(flat, min(2 * rows[idxs[0]].job.num_beams, flat.numel()))
        return top_scores.double(), top_ids.double()

    def _beam_select(self, rows: list[_Row], idxs: list[int], top_scores: list[float], top_ids: list[int], vocab: int):
        """Rank one beam request's candidates; returns the rows that go on as ``(source, row, token)``."""
        job = rows[idxs[0]].job
        beams = self._beams[id(job)]
        width = job.num_beams
        picked: list[tuple[int, int, float]] = []  # (row index, token, score)
        for rank, (score, flat_id) in enumerate(zip(top_scores, top_ids)):
            if score == float("-inf") or len(picked) >= width:
                break
            src = idxs[flat_id // vocab]
            token = flat_id % vocab
            cursor = rows[src].cursor
            if token in cursor.stop_ids or token == cursor.end_token_id:
                if rank < width:  # an ended candidate counts only among the best `width`
                    beams.add(score, rows[src].tokens + [token], "stop", width)
                continue
            picked.append((src, token, score))
        n_generated = len(rows[idxs[0]].tokens) + 1
        if n_generated >= job.max_new_tokens:
            for src, token, score in picked:
                beams.add(score, rows[src].tokens + [token], "length", width)
            picked = []
        elif picked and len(beams.hyps) >= width and picked[0][2] / n_generated <= beams.worst():
            picked = []  # no live beam can still beat the ended ones
        if not picked:
            self._beams.pop(id(job), None)
            self._emit_beams(job, beams)
            return []
        # cursors: the first beam taken from a row keeps its cursor, later ones get copies (made before
        # anything advances)
        seen: set[int] = set()
        cursors = []
        for src, _, _ in picked:
            cursors.append(rows[src].cursor.copy() if src in seen else rows[src].cursor)
            seen.add(src)
        # all survivors' cursors advance together (plain tree rows as array operations, processors.lanes); a beam
        # whose constraint fails is dropped, the request goes on with the others
        failed = advance_rows(cursors, [token for _, token, _ in picked])
        out = [(src, _Row(job, slot, cursor, None, rows[src].tokens + [token], score), token)
               for slot, ((src, token, score), cursor) in enumerate(zip(picked, cursors)) if slot not in failed]
        if not out:
            self._beams.pop(id(job), None)
            self._emit_beams(job, beams)
        return out

    def _emit_beams(self, job: Job, beams: _Beams) -> None:
        for index, (_, tokens, reason) in enumerate(beams.hyps[: job.n]):
            for t in tokens:
                job.on_event(TokenEvent(index, t))
            job.on_event(FinishedEvent(index, tokens, reason))
        job.on_event(DoneEvent())

    def _trim(self) -> None:
        """Drop leading columns that are padding in every remaining row."""
        live = self._mask.any(dim=0).nonzero()
        first = int(live[0]) if live.numel() else 0
        if first > 0:
            self._mask = self._mask[:, first:]
            for layer in self._cache.layers:
                layer.keys = layer.keys[:, :, first:, :]
                layer.values = layer.values[:, :, first:, :]

    def _fail_row(self, row: _Row, message: str) -> None:
        self._stats["failed_rows"] += 1
        self._finish(row, "error", message)

    def _finish(self, row: _Row, reason: str, error: str | None) -> None:
        if row.cursor.fell_back:
            self._stats["fallback_rows"] += 1
        job = row.job
        job.on_event(FinishedEvent(row.index, list(row.tokens), reason, error, row.cursor.fell_back))
        job.remaining -= 1
        if job.remaining == 0:
            if reason == "error" and error == "cancelled":
                self._stats["cancelled_jobs"] += 1
            job.on_event(DoneEvent())
