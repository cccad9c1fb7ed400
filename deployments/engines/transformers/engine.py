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
``B`` live ones continue (their generated key/value rows are gathered accordingly, the prompt is held once, and
cursors follow their beam), ended candidates are kept as hypotheses with a length-normalized score. So a beam request
shares forward passes with everyone else and stops at the next step when it is cancelled.

One-row requests keep a share of every forward: the rows of requests of several rows (beams, ``n``) are read at most
``wide_step_rows`` per forward, so a wide request's step spans several forwards (:class:`.jobs.Feed`), each with all
the one-row rows; a beam request's candidates are ranked chunk by chunk as its rows are read and its beams chosen when
the last chunk is in (the best ``2B`` of the chunks' best ``2B``: the same beams). Their memory is bounded too: wide
requests together hold at most ``1 - narrow_reserve`` of ``kv_memory_mb`` (:mod:`.admission`).

Failures stay with their row: a row whose sampling or cursor fails finishes with ``error``; a failed
prefill fails only its own jobs; only a failed forward of the whole batch fails the jobs in it.

The engine's parts: :class:`DecodeEngine` (this module) owns the loop, the request queue, preparation (a job's rows
on the prepare pool), the shared counters (``_stats``) and one decode step (masks, sampling, beam ranking, advancing
rows); it holds four composed parts, each the one owner of its state, built in this order and each given the part it
reads:

- ``grammar``, :class:`.grammar_rows.GrammarRows`: the step's grammar mask budget and mask buffer (each row's
  allowed set, masks settled within ``mask_step_budget_ms``, rows that sit out a step);
- ``beams``, :class:`.beams.BeamSearch` (given ``grammar``): the beam requests' ended hypotheses, their candidates,
  selection and final events, a wide beam request ranked chunk by chunk (:mod:`.wide`);
- ``batch``, :class:`.batch.Batch` (given ``beams``): the running batch's rows, padded key/value cache, attention
  mask, logits and wide requests' groups (prompt held once, :mod:`.shared_kv`), the chunked prefill in progress:
  prefill, joining, the step's forward (wide rows in chunks), regrouping and trimming;
- ``admission``, :class:`.admission.Admission` (given ``batch``): the waiting requests and the memory budget
  (``job_bytes``, ``wide_budget``, ``admission_error``, fair order, admit).

:mod:`.rows` holds the stateless row helpers (sampling row by row, redraw, advance, finish); :mod:`.jobs` a request's
bookkeeping. The engine's public surface (``job_bytes``, ``admission_error``, ``kv_budget``, ``wide_budget``,
``active_rows``, ``stats``) reads these parts.

Nothing here imports Ray: the replica knows it only as an :class:`~deployments.engines.protocol.Engine`,
and tests drive it directly. See ``docs/design.md`` (engine contract).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch
from processors import RowCursor, apply_steps
from processors.lanes import mask_rows
from processors.mask_budget import MaskBudget
from processors.masks import mask_padded_vocab

from ..protocol import (
    Engine, EngineEvent, EngineRequest, ErrorEvent,
)
from .admission import Admission
from .batch import Batch
from .beams import BeamSearch
from .grammar_rows import GrammarRows
from .jobs import UNMASKED, Job, Pending, Row
from .prefix_cache import PrefixCache
from .rows import advance_lane, advance_sampled, fail_row, finish, redraw, sample_each
from ..sampling import sample_rows
from .shared_kv import SharedGroup, install
from processors.lane_beams import plan_tree_beams, row_logsumexp, tree_beam_candidates

logger = logging.getLogger(__name__)

__all__ = ["DecodeEngine", "Job"]


class DecodeEngine(Engine):
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
        narrow_reserve: the share of ``kv_memory_mb`` that requests of several rows (beams, ``n``) never take: they
            are admitted while their estimates together fit ``(1 - narrow_reserve) x kv_memory_mb`` (one that can
            never fit there is refused), so one-row requests always find that much memory.
        wide_step_rows: the most rows of requests of several rows read in one forward pass (0 = all). A wider step
            is read in chunks over several forwards, the one-row requests' rows in every one of them (their tokens
            come at the pace of a forward of at most this many more rows); a beam request is ranked once all its
            rows were read, its candidates gathered chunk by chunk.
        wide_step_rows_shared: the most such rows in one forward while one-row requests decode (at most
            ``wide_step_rows``): on a CPU a forward of 32 more rows costs about six one-row forwards, of 8 about
            two. While one-row requests decode, a request of several rows is also prefilled only once the decode
            steps since the last such prefill took at least as long as it did, so those prefills take at most half
            of the engine's time.
        mask_step_budget_ms: the CPU time one row's grammar mask may take in one step (0: no budget, masks computed
            on the decode thread). The step's masks are computed in parallel off the decode thread
            (:class:`processors.mask_budget.MaskBudget`); a row whose mask is late ends with ``finish_reason:
            "error"`` naming ``mask_step_budget_ms`` and the step goes on for the others.
        shared_prompt: hold the prompt of a several-row request once (default); ``False`` copies it into every row
            of the padded batch, the layout before :mod:`.shared_kv` (kept for comparisons: ``bench/wide_beams.py``).

    Memory layout: a request of one row keeps its prompt in the padded batch cache (one copy per request); a request
    of ``w > 1`` rows (beams, ``n``) holds its prompt once and each row only its generated tokens
    (:mod:`.shared_kv`); ``max_batch_size`` bounds the one-row requests, the memory budget bounds everything.
    """

    name = "transformers"
    item_filters = True  # rows read a filter's book like an exclude list (processors/tree.py)

    def __init__(
        self, model, tokenizer, *, max_batch_size: int = 16, eos_token_ids: tuple[int, ...] | None = None,
        prefix_cache_tokens: int = 8192, prefill_chunk_tokens: int = 256, prepare_threads: int = 2,
        vector_lane: bool = False, kv_memory_mb: int = 4096, shared_prompt: bool = True,
        mask_step_budget_ms: float = 200.0,
        narrow_reserve: float = 0.25, wide_step_rows: int = 32, wide_step_rows_shared: int = 8,
    ):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens must be >= 1, got {prefill_chunk_tokens}")
        if kv_memory_mb < 1:
            raise ValueError(f"kv_memory_mb must be >= 1, got {kv_memory_mb}")
        if not 0 <= narrow_reserve < 1:
            raise ValueError(f"narrow_reserve must be in [0, 1), got {narrow_reserve}")
        if wide_step_rows < 0:
            raise ValueError(f"wide_step_rows must be >= 0, got {wide_step_rows}")
        if wide_step_rows_shared < 1:
            raise ValueError(f"wide_step_rows_shared must be >= 1, got {wide_step_rows_shared}")
        install(model)
        self.model = model
        self.wide_step_rows = wide_step_rows
        self.shared_prompt = shared_prompt
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        elem = next(model.parameters()).element_size()
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.vector_lane = vector_lane
        self.eos_token_ids = tuple(eos_token_ids or (tokenizer.eos_token_id,))
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_token_ids[0]
        self.device = next(model.parameters()).device
        self.vocab_size = len(tokenizer)
        self._queue: queue.Queue[Job] = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._prepare = ThreadPoolExecutor(max_workers=max(1, prepare_threads), thread_name_prefix="cursor-prepare")
        self._chunk_debt = 0.0  # seconds of decoding owed to the running rows after the last prefill chunk
        self._wide_prefill_debt = 0.0  # the same after the last prefill of requests of several rows
        self.prefix_cache = PrefixCache(max_tokens=prefix_cache_tokens)
        self._stats = {
            "steps": 0, "held_row_steps": 0, "step_seconds": 0.0, "chain_seconds": 0.0, "rows_decoded": 0, "prefills": 0,
            "fallback_rows": 0, "prefill_tokens": 0, "prefix_tokens_reused": 0, "prefill_chunks": 0,
            "failed_rows": 0, "cancelled_jobs": 0, "forward_seconds": 0.0,
            "tree_ranked_steps": 0,  # beam steps of one request ranked from its tree's tables (tree_beams)
            "torch_threads": 0,  # intra-op threads torch uses on the engine thread (set when it starts)
        }
        # the parts, each the one owner of its state (module docstring); the counters above are shared
        self.grammar = GrammarRows(mask_step_budget_ms, self.device, self._stats)
        self.beams = BeamSearch(self.grammar, stats=self._stats, vector_lane=vector_lane, vocab_size=self.vocab_size,
                                device=self.device)
        self.batch = Batch(model, self.beams, self.prefix_cache, self._stats, device=self.device, pad_id=self.pad_id,
                           shared_prompt=shared_prompt, prefill_chunk_tokens=prefill_chunk_tokens,
                           wide_step_rows=wide_step_rows, wide_step_rows_shared=wide_step_rows_shared)
        self.admission = Admission(
            self.batch, self.prefix_cache, self._stats, kv_budget=kv_memory_mb * 2**20, narrow_reserve=narrow_reserve,
            token_bytes=2 * cfg.num_hidden_layers * kv_heads * head_dim * elem,  # keys + values, all layers
            score_bytes=cfg.num_attention_heads * 4 * 2,  # one layer's scores and probabilities, per row and prompt token
            vocab_size=self.vocab_size, max_batch_size=max_batch_size, prefill_chunk_tokens=prefill_chunk_tokens)

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
        self.grammar.close()

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
        return self.batch.active_rows

    # -- admission (the Admission part) ---------------------------------------------------------
    @property
    def kv_budget(self) -> int:
        """Bytes of key/value and logits memory (``kv_memory_mb``)."""
        return self.admission.kv_budget

    @property
    def narrow_reserve(self) -> float:
        return self.admission.narrow_reserve

    @property
    def wide_budget(self) -> int:
        """Bytes requests of several rows may hold together (:attr:`.admission.Admission.wide_budget`)."""
        return self.admission.wide_budget

    def job_bytes(self, request: EngineRequest) -> int:
        """Estimated memory of a request while it decodes (:meth:`.admission.Admission.job_bytes`)."""
        return self.admission.job_bytes(request)

    def admission_error(self, request: EngineRequest) -> str | None:
        """Why ``request`` can never be admitted, or ``None`` (:meth:`.admission.Admission.admission_error`)."""
        return self.admission.admission_error(request)

    # read access to the parts' state, for tests and diagnostics
    @property
    def _groups(self) -> list[SharedGroup]:
        return self.batch.groups

    @property
    def _rows(self) -> list[Row]:
        return self.batch.rows

    @property
    def _waiting(self) -> list[Pending]:
        return self.admission.waiting

    @property
    def _mask_budget(self) -> MaskBudget:
        return self.grammar.mask_budget

    # -- loop -----------------------------------------------------------------------------------
    def _run(self) -> None:
        torch.set_grad_enabled(False)
        self._stats["torch_threads"] = torch.get_num_threads()
        while not self._stop.is_set():
            try:
                batch, admission = self.batch, self.admission
                idle = batch.idle
                ready = admission.ready()
                try:
                    if idle and not ready:
                        job = self._queue.get(timeout=0.01 if admission.waiting else 0.1)
                    else:
                        job = self._queue.get_nowait()
                    self._accept(job)
                    while True:
                        self._accept(self._queue.get_nowait())
                except queue.Empty:
                    pass
                # requests of several rows are prefilled while one-row requests decode only once the decode steps
                # since the last such prefill took as long as it did: at most half of the engine's time
                hold_wide = self._wide_prefill_debt > 0 and batch.narrow_rows > 0
                t0 = time.perf_counter()
                if admission.admit(hold_wide=hold_wide):
                    self._wide_prefill_debt = time.perf_counter() - t0
                # A long prompt is read in chunks, each followed by decode steps of the running rows lasting at
                # least as long as the chunk did: prefill takes at most half of the engine's time while others
                # decode, so their steps slow down at most 2x and the prompt still moves at half speed.
                if batch.chunking is not None and (self._chunk_debt <= 0 or not batch.decoding):
                    t0 = time.perf_counter()
                    batch.prefill_chunk()
                    self._chunk_debt = time.perf_counter() - t0
                if batch.decoding:
                    t0 = time.perf_counter()
                    self._step()
                    spent = time.perf_counter() - t0
                    self._chunk_debt -= spent
                    self._wide_prefill_debt -= spent
                else:
                    batch.release_if_due()
            except Exception as exc:  # a failed forward must not kill the replica
                logger.exception("decode step failed; failing the jobs in the batch")
                self._fail_all(f"decode failed: {type(exc).__name__}: {exc}")

    def _fail_all(self, message: str) -> None:
        self.batch.fail_all(message)

    # -- preparation ----------------------------------------------------------------------------
    def _accept(self, job: Job) -> None:
        """Build the job's rows now, or on the prepare pool when its first masks may be slow."""
        slow = job.compiled is not None and job.compiled.capabilities.grammar
        rows: Future | list[Row]
        if slow:
            rows = self._prepare.submit(self._new_rows, job, True)
        else:
            try:
                rows = self._new_rows(job, False)
            except Exception as exc:
                logger.exception("building the rows of a job failed")
                job.on_event(ErrorEvent(f"cannot start: {type(exc).__name__}: {exc}"))
                return
        self.admission.enqueue(Pending(job, rows))

    def _new_rows(self, job: Job, prime: bool) -> list[Row]:
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
            rows.append(Row(job, i, cursor, gen, score=score))
        return rows

    # -- one decode step ------------------------------------------------------------------------
    def _step(self) -> None:
        t0 = time.perf_counter()
        batch, grammar, beams, stats = self.batch, self.grammar, self.beams, self._stats
        if not batch.rows:  # only wide requests' chunks to read
            self._forward_step([], t0, 0.0)
            return
        rows = batch.rows
        logits = batch.logits
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
        defer = grammar.deferrable(rows, batch.narrow_rows)
        alone = not batch.groups  # no wide request to serve while masks compute
        if self.vector_lane:
            late, waiting = grammar.settle_masks(rows, skip, defer, alone=alone)
            failed = mask_rows(logits, [UNMASKED if i in skip or i in waiting else r.cursor
                                        for i, r in enumerate(rows)], grammar.mask_buffer)
            failed.update(late)
        else:
            steps, failed, waiting = grammar.row_steps(rows, skip, defer, alone=alone)
            apply_steps(logits, steps, grammar.mask_buffer)
        mask_padded_vocab(logits, self.vocab_size)
        if beam_at:
            logprobs = logprobs.masked_fill(torch.isneginf(logits[beam_at]), float("-inf"))
        t_chain = time.perf_counter() - t0
        # the next batch: (source row index, row object, token)
        nxt: list[tuple[int, Row, int]] = []
        sampled: list[int] = []
        for i, row in enumerate(rows):
            job = row.job
            if job.num_beams > 1:
                continue
            elif job.cancelled.is_set():
                finish(row, "error", "cancelled", stats)
            elif i in failed:
                fail_row(row, failed[i], stats)
            elif i in waiting:  # its grammar mask is still computing: it sits out this step
                nxt.append(grammar.hold(i, row, logits))
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
                parts.append(sample_each(rows, sampled, logits, stats))
        groups = []
        if beam_groups:
            position = {i: k for k, i in enumerate(beam_at)}
            for key, idxs in beam_groups.items():
                job = rows[idxs[0]].job
                if job.cancelled.is_set():
                    beams.cancel(job)
                    continue
                if key in tree_ranked:
                    plan, lse = tree_ranked[key]
                    scores = torch.tensor([rows[i].score for i in idxs], dtype=torch.float32)
                    top = tree_beam_candidates(plan, logits, idxs, lse, scores, 2 * job.num_beams)
                    stats["tree_ranked_steps"] += 1
                    groups.append((idxs, top[0].numel(), logits.shape[1]))
                else:
                    top = beams.candidates(rows, idxs, logprobs[[position[i] for i in idxs]], failed)
                    groups.append((idxs, top[0].numel(), logprobs.shape[1]))
                parts.extend(top)
        host = torch.cat(parts).tolist() if parts else []
        at = 0
        lane_done: dict[int, str | None] = {}  # rows whose cursor the lane advanced already: row -> error or None
        if sampled and self.vector_lane:
            t1 = time.perf_counter()
            lane_done = advance_lane(rows, sampled, host)
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
                    token = redraw(i, row, logits)
                if i in lane_done:
                    nxt.extend(advance_sampled(i, row, token, stats, advanced=True, error=lane_done[i]))
                else:
                    nxt.extend(advance_sampled(i, row, token, stats))
                t_chain += time.perf_counter() - t1
            at = len(sampled)
        for idxs, k, vocab in groups:
            scores, flat_ids = host[at : at + k], host[at + k : at + 2 * k]
            at += 2 * k
            nxt.extend(beams.select(rows, idxs, scores, [int(f) for f in flat_ids], vocab))
        self._forward_step(nxt, t0, t_chain)

    def _forward_step(self, nxt: list[tuple[int, Row, int]], t0: float, t_chain: float) -> None:
        """The forward of one engine step (:meth:`.batch.Batch.forward`: the rows chosen this step, ``nxt`` as
        ``(source row, row, token)``, and the wide requests' rows in chunks), then the step's timings."""
        self.batch.forward(nxt, self.grammar.mask_budget.start)
        step_seconds = time.perf_counter() - t0
        self._stats["step_seconds"] += step_seconds
        self._stats["chain_seconds"] += t_chain
        if self.on_step is not None:
            self.on_step(step_seconds, t_chain)
