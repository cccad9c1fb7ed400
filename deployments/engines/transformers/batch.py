"""The batch's key/value rows: prefilling prompts (batched, or one chunk at a time), joining them to the running
batch in its two layouts (a one-row request in the padded cache, a request of several rows as a
:class:`.shared_kv.SharedGroup`), the forward of each step (the padded rows and the wide requests' rows, these in
chunks of at most ``wide_step_rows``), following the rows each step (finished rows leave, beams reorder) and trimming
padding.

:class:`Batch` is the engine's part for this and the one owner of the batch's state:

- ``rows``: the rows the next step samples or ranks, the padded rows first, then each group's rows in the batch;
- ``cache``, ``mask``: the padded rows' key/value cache and its attention mask (``None`` when there are none);
- ``logits``: the last forward's logits of ``rows`` (``None`` once a step consumed them);
- ``groups``: the wide requests (prompt held once): in the batch (their rows in ``rows``), or with their next step
  being read in chunks (``group.feed``, in the order their chunks are read);
- ``chunking``: the request whose prompt is being read one chunk at a time (at most one);
- ``trim_due``: memory to give back to the OS once the engine is idle.

It ranks a wide beam request through the :class:`.beams.BeamSearch` part given to it, and adds to the engine's shared
``stats``."""

from __future__ import annotations

import logging
import time
from bisect import bisect_right
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from ..protocol import ErrorEvent
from .beams import BeamSearch
from .jobs import HELD, Feed, Job, Pending, Row
from .kv_cache import cache_of, release_memory
from .prefix_cache import PrefixCache
from .rows import cancelled, finish
from .shared_kv import SharedGroup, StepContext

logger = logging.getLogger(__name__)

__all__ = ["Batch"]


class Batch:
    """Prefill and key/value layout of the running batch.

    Args:
        model: the HF causal LM (with :func:`.shared_kv.install` applied).
        beams: the beam-search part (a wide beam request's first step and its chunks are ranked there).
        prefix_cache: the prompt-prefix cache prefills read and fill.
        stats: the engine's counters.
        device, pad_id: the model's device and the padding token of a left-padded prefill.
        shared_prompt: hold the prompt of a several-row request once (a :class:`.shared_kv.SharedGroup`).
        prefill_chunk_tokens: a chunked prefill reads this many prompt tokens per chunk.
        wide_step_rows: the most rows of wide requests read in one forward (0: all).
        wide_step_rows_shared: the most of them while the padded batch has rows (one-row requests decode).
    """

    def __init__(self, model, beams: BeamSearch, prefix_cache: PrefixCache, stats: dict, *, device, pad_id: int,
                 shared_prompt: bool, prefill_chunk_tokens: int, wide_step_rows: int,
                 wide_step_rows_shared: int = 8):
        self.model = model
        self.beams = beams
        self.prefix_cache = prefix_cache
        self._stats = stats
        self.device = device
        self.pad_id = pad_id
        self.shared_prompt = shared_prompt
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.wide_step_rows = wide_step_rows
        self.wide_step_rows_shared = wide_step_rows_shared
        self.rows: list[Row] = []
        self.groups: list[SharedGroup] = []
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None
        self.logits: torch.Tensor | None = None
        self.chunking: Pending | None = None
        self.trim_due = False

    # -- what the batch holds ---------------------------------------------------------------------
    @property
    def narrow_rows(self) -> int:
        """Rows of the padded batch (one-row requests)."""
        return 0 if self.mask is None else self.mask.shape[0]

    @property
    def active_rows(self) -> int:
        return len(self.rows) + sum(g.rows for g in self.groups if g.feed is not None)

    @property
    def decoding(self) -> bool:
        """Whether a decode step has rows to read (in the batch, or a wide request's chunks)."""
        return bool(self.rows or self.groups)

    @property
    def idle(self) -> bool:
        """Nothing decoding and no prompt being read in chunks."""
        return not self.rows and not self.groups and self.chunking is None

    def is_group(self, job: Job) -> bool:
        """Whether ``job`` decodes as a :class:`SharedGroup` (its prompt once) rather than in the padded batch."""
        return self.shared_prompt and job.width > 1

    def padded_width(self, job: Job) -> int:
        """Rows ``job`` takes in the padded batch (bounded by ``max_batch_size``)."""
        return 0 if self.is_group(job) else job.width

    def jobs_in_use(self) -> list[Job]:
        """The requests holding memory: decoding, or having their prompt read in chunks."""
        jobs = {id(r.job): r.job for r in self.rows}
        jobs.update((id(g.job), g.job) for g in self.groups)
        if self.chunking is not None:
            jobs[id(self.chunking.job)] = self.chunking.job
        return list(jobs.values())

    def fail_all(self, message: str) -> None:
        """A forward of the whole batch failed: every decoding request is told and the batch empties."""
        jobs = {id(r.job): r.job for r in self.rows}
        jobs.update((id(g.job), g.job) for g in self.groups)
        for job in jobs.values():
            job.on_event(ErrorEvent(message))
        self.rows, self.cache, self.mask, self.logits = [], None, None, None
        self.groups = []
        self.beams.clear()

    def release_if_due(self) -> None:
        """Give freed memory back to the OS once, after the batch emptied (not while a prompt is read in chunks)."""
        if self.trim_due and self.chunking is None:
            self.trim_due = False
            release_memory()

    def start_chunking(self, p: Pending, rows: list[Row], length: int, kv) -> None:
        """``p``'s prompt is read one chunk at a time from its cached prefix (``length`` tokens, ``kv``) on."""
        p.rows, p.done_tokens, p.reused = rows, length, length
        p.cache = self.expand_prefix(kv, 1) if kv is not None else DynamicCache()
        self.chunking = p

    # -- prefill and joining ----------------------------------------------------------------------
    @staticmethod
    def expand_prefix(prefix_kv, b: int) -> DynamicCache:
        return cache_of([(k.expand(b, -1, -1, -1).contiguous(), v.expand(b, -1, -1, -1).contiguous()) for k, v in prefix_kv])

    def prefill(self, admitted: list[tuple[Pending, list[Row]]]) -> None:
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

    def _prefill_group(self, group: list[tuple[Job, list[Row]]], prefix_kv) -> None:
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
        past = self.expand_prefix(prefix_kv, b) if prefix_kv is not None else DynamicCache()
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
        narrow = [i for i, job in enumerate(jobs) if not self.is_group(job)]
        if narrow:
            self._join([group[i] for i in narrow], [(layer.keys, layer.values) for layer in layers],
                       mask.to(self.device), out.logits[:, -1, :], narrow)
        for i, (job, rows) in enumerate(group):
            if self.is_group(job):
                # the prompt once: the cached prefix by reference, the rest copied out of the batched prefill
                pad = width - len(rests[i])
                shared = [([prefix_kv[li]] if prefix_kv is not None else [])
                          + [(layer.keys[i : i + 1, :, plen + pad :].clone(), layer.values[i : i + 1, :, plen + pad :].clone())]
                          for li, layer in enumerate(layers)]
                self._join_group(job, rows, shared, out.logits[i : i + 1, -1, :])
        self._stats["prefills"] += 1
        self._stats["prefill_tokens"] += sum(len(r) for r in rests)
        self._stats["prefix_tokens_reused"] += plen * b

    def prefill_chunk(self) -> None:
        """Read the next chunk of the prompt being prefilled in chunks; join the batch after the last."""
        p = self.chunking
        job = p.job
        if job.cancelled.is_set():
            self.chunking = None
            self.trim_due = True
            cancelled(job, self._stats)
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
            self.chunking = None
            self.trim_due = True
            layers = p.cache.layers
            self.prefix_cache.store(job.prompt_ids, [(layer.keys, layer.values) for layer in layers])
            if self.is_group(job):
                self._join_group(job, p.rows, [[(layer.keys, layer.values)] for layer in layers], out.logits[:, -1, :])
            else:
                mask = torch.ones((1, end), dtype=torch.long, device=self.device)
                self._join([(job, p.rows)], [(layer.keys, layer.values) for layer in layers], mask, out.logits[:, -1, :], [0])
            self._stats["prefills"] += 1
            self._stats["prefill_tokens"] += end - p.reused
            self._stats["prefix_tokens_reused"] += p.reused
        except Exception as exc:
            logger.exception("chunked prefill failed")
            self.chunking = None
            job.on_event(ErrorEvent(f"prefill failed: {type(exc).__name__}: {exc}"))

    def _join(self, group: list[tuple[Job, list[Row]]], kv, mask, logits, sel: list[int]) -> None:
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
                self.beams.start(job)
            rows.extend(job_rows)
        sel = [i for (job, _), i in zip(group, sel) for _ in range(job.width)]
        index = torch.tensor(sel, device=self.device)
        logits = logits.float().index_select(0, index.to(logits.device))
        mask = mask.index_select(0, index.to(mask.device))
        old_rows = self.narrow_rows
        new_rows = len(sel)
        old_len = self.mask.shape[1] if old_rows else 0
        new_len = mask.shape[1]
        total = max(old_len, new_len)
        merged = []
        for li, (k, v) in enumerate(kv):
            pair = []
            for new, old in ((k, self.cache.layers[li].keys if old_rows else None),
                             (v, self.cache.layers[li].values if old_rows else None)):
                # room to grow (see GrowingLayer), so the next steps append without copying
                out = new.new_zeros((old_rows + new_rows, new.shape[1], total + max(64, total // 8), new.shape[3]))
                if old is not None:
                    out[:old_rows, :, total - old_len : total] = old
                for j, i in enumerate(sel):
                    out[old_rows + j, :, total - new_len : total] = new[i]
                pair.append(out)
            merged.append(tuple(pair))
        if old_rows:
            self.mask = torch.cat([F.pad(self.mask, (total - old_len, 0)), F.pad(mask, (total - new_len, 0))])
        else:
            self.mask = mask
        if self.logits is None:
            self.logits = logits
        else:
            self.logits = torch.cat([self.logits[:old_rows], logits, self.logits[old_rows:]])
        self.rows = self.rows[:old_rows] + rows + self.rows[old_rows:]
        for g in self.groups:
            g.start += len(rows)
        self.cache = cache_of([(k[:, :, :total], v[:, :, :total]) for k, v in merged], buffers=merged)

    def _join_group(self, job: Job, rows: list[Row], shared, logits: torch.Tensor) -> None:
        """A job of several rows joins after the batch's rows: its prompt held once (``shared``, per layer a list of
        ``(keys, values)`` segments), its rows' generated keys/values apart (:class:`.shared_kv.SharedGroup`)."""
        job.remaining = job.n
        group = SharedGroup(job, shared, len(rows))
        if job.num_beams > 1:
            # its first step: every beam holds the same prompt and only the first may expand (the others score
            # -inf), so that row's candidates are the request's; from then on its steps are read in chunks
            self.beams.start(job)
            feed = Feed(rows, [])
            feed.parts.append(self.beams.chunk(rows[:1], logits[:1].float().clone(), 0))
            self.groups.append(group)
            self._rank_group(group, feed, logits.shape[1])
            return
        group.start = len(self.rows)
        self.groups.append(group)
        logits = logits.float().expand(len(rows), -1)
        self.logits = logits.contiguous() if self.logits is None else torch.cat([self.logits, logits])
        self.rows = self.rows + rows

    def regroup(self, nxt: list[tuple[int, Row, int]]) -> list[tuple[int, Row, int]]:
        """Lay the next batch out (padded rows, then each group's rows) and select the caches' rows to match: the
        padded cache's rows, and within each group in the batch (not one whose step is being read in chunks) only
        the generated part (a beam reorder). Returns ``nxt`` in the new row order."""
        n0 = self.narrow_rows
        narrow = [e for e in nxt if e[0] < n0]
        ready = sorted((g for g in self.groups if g.feed is None), key=lambda g: g.start)  # groups in the batch
        starts = [g.start for g in ready]
        buckets: list[list[tuple[int, Row, int]]] = [[] for _ in ready]
        for e in nxt:
            if e[0] >= n0:
                buckets[bisect_right(starts, e[0]) - 1].append(e)
        order = [src for src, _, _ in narrow]
        if order != list(range(n0)):
            if order:
                idx = torch.tensor(order, device=self.device)
                self.cache.batch_select_indices(idx)
                self.mask = self.mask.index_select(0, idx)
                self._trim()
            else:
                self.cache, self.mask = None, None
        kept = []
        for g, bucket in zip(ready, buckets):
            if bucket:
                g.select([src - g.start for src, _, _ in bucket], self.device)
                kept.append(g)
        at = len(narrow)
        for g in kept:
            g.start, at = at, at + g.rows
        self.groups = [g for g in self.groups if g.feed is not None] + kept
        return narrow + [e for bucket in buckets for e in bucket]

    def _trim(self) -> None:
        """Drop leading columns that are padding in every remaining row."""
        live = self.mask.any(dim=0).nonzero()
        first = int(live[0]) if live.numel() else 0
        if first > 0:
            self.mask = self.mask[:, first:]
            for layer in self.cache.layers:
                layer.keys = layer.keys[:, :, first:, :]
                layer.values = layer.values[:, :, first:, :]

    # -- one step's forward -----------------------------------------------------------------------
    def forward(self, nxt: list[tuple[int, Row, int]], start_masks: Callable[[Iterable], None]) -> None:
        """The forward of one engine step: the rows chosen this step (``nxt``, as ``(source row, row, token)``) that
        are one-row requests' rows all, the wide requests' rows (those chosen now and those whose step is being read
        already) in chunks of at most ``wide_step_rows`` rows (:meth:`wide_chunks`). ``start_masks`` gets the
        padded rows' cursors right before the model runs (their next grammar masks compute meanwhile)."""
        if nxt:
            nxt = self.regroup(nxt)
        else:
            self.cache, self.mask = None, None
            self.groups = [g for g in self.groups if g.feed is not None]
        n = self.narrow_rows
        for g in [g for g in self.groups if g.feed is None]:  # chosen now: their next step starts
            picked = nxt[g.start : g.start + g.rows]
            g.feed = Feed([row for _, row, _ in picked], [token for _, _, token in picked])
            self.groups.remove(g)
            self.groups.append(g)
        self.rows = [row for _, row, _ in nxt[:n]]
        chunks = self.wide_chunks()
        self._stats["steps"] += 1
        self._stats["rows_decoded"] += n + sum(end - first for _, first, end in chunks)
        self.logits = None
        if not n and not chunks:
            self.rows, self.cache, self.mask = [], None, None
            if not self.groups:
                self.trim_due = True
            return
        positions, tokens = [], [token for _, _, token in nxt[:n]]
        held = [k for k, token in enumerate(tokens) if token == HELD]
        if self.mask is not None:
            positions.append(self.mask.sum(dim=1))
            ones = torch.ones((self.mask.shape[0], 1), dtype=self.mask.dtype, device=self.device)
            if held:  # rows sitting out the step: a column no query ever reads, any token in it
                ones[held] = 0
                tokens = [0 if token == HELD else token for token in tokens]
            self.mask = torch.cat([self.mask, ones], dim=1)
        for g, first, end in chunks:
            positions.append(torch.full((end - first,), g.prompt_len + g.generated, dtype=torch.long, device=self.device))
            tokens.extend(g.feed.tokens[first:end])
        # the one-row rows' next grammar masks compute while the model runs (processors.mask_budget)
        start_masks(row.cursor for row in self.rows)
        step = StepContext(self.cache.layers if self.mask is not None else None, self.mask, chunks)
        t_fwd = time.perf_counter()
        out = self.model(
            input_ids=torch.tensor(tokens, device=self.device)[:, None],
            position_ids=torch.cat(positions)[:, None], use_cache=False, cs_step=step,
        )
        logits = out.logits[:, -1, :].float()
        self._stats["forward_seconds"] += time.perf_counter() - t_fwd
        if n:
            self.logits = logits[:n]
            for k in held:  # the logits it sat out with
                row = self.rows[k]
                self.logits[k] = row.held
                row.held = None
        at = n
        for g, first, end in chunks:
            self.read_chunk(g, first, end, logits[at : at + end - first])
            at += end - first

    # -- wide requests' steps in chunks -----------------------------------------------------------
    def wide_chunks(self) -> list[tuple[SharedGroup, int, int]]:
        """The wide requests' rows this forward reads, as ``(group, first row, end)``: at most ``wide_step_rows``
        rows (0: all), or ``wide_step_rows_shared`` while one-row requests decode in it; the groups in their queue's
        order. A cancelled request whose step is being read leaves now."""
        budget = self.wide_step_rows or float("inf")
        if self.narrow_rows:
            budget = min(budget, self.wide_step_rows_shared)
        chunks = []
        for g in list(self.groups):
            feed = g.feed
            if g.job.cancelled.is_set():
                self.groups.remove(g)
                if g.job.num_beams > 1:
                    self.beams.cancel(g.job)
                else:
                    for row in feed.rows:
                        finish(row, "error", "cancelled", self._stats)
                continue
            if budget <= 0:
                continue
            take = int(min(g.rows - feed.done, budget))
            chunks.append((g, feed.done, feed.done + take))
            budget -= take
        return chunks

    def read_chunk(self, g: SharedGroup, first: int, end: int, logits: torch.Tensor) -> None:
        """Keep what rows ``first .. end - 1`` of a wide request gave (a beam request: their best candidates right
        away); once all its rows were read, a beam request is ranked and goes on (:meth:`_rank_group`), a sampled
        one joins the batch to be sampled at the next step."""
        feed = g.feed
        feed.done = end
        if g.job.num_beams > 1:
            feed.parts.append(self.beams.chunk(feed.rows[first:end], logits, first))
        else:
            feed.parts.append(logits)
        if end < g.rows:
            return
        g.commit()
        g.feed = None
        if g.job.num_beams > 1:
            self._rank_group(g, feed, logits.shape[1])
            return
        g.start = len(self.rows)
        self.rows = self.rows + feed.rows
        logits = feed.parts[0] if len(feed.parts) == 1 else torch.cat(feed.parts)
        self.logits = logits if self.logits is None else torch.cat([self.logits, logits])

    def _rank_group(self, group: SharedGroup, feed: Feed, vocab: int) -> None:
        """A wide beam request's step is read: it leaves the queue of wide requests, and, ranked
        (:meth:`.beams.BeamSearch.rank_group`), takes its next step at the end of the queue unless it ended."""
        if group in self.groups:
            self.groups.remove(group)
        if self.beams.rank_group(group, feed, vocab):
            self.groups.append(group)
