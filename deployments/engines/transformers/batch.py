"""The batch's key/value rows: prefilling prompts (batched, or one chunk at a time), joining them to the running
batch in its two layouts (a one-row request in the padded cache, a request of several rows as a
:class:`.shared_kv.SharedGroup`), following the rows each step (finished rows leave, beams reorder) and trimming
padding. Part of :class:`.engine.DecodeEngine`."""

from __future__ import annotations

import logging
from bisect import bisect_right

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from ..protocol import ErrorEvent
from .jobs import Beams, Feed, Job, Pending, Row
from .kv_cache import cache_of
from .shared_kv import SharedGroup

logger = logging.getLogger(__name__)

__all__ = ["BatchMixin"]


class BatchMixin:
    """Prefill and key/value layout of the decode engine (see :class:`.engine.DecodeEngine` for its state)."""

    @staticmethod
    def _expand_prefix(prefix_kv, b: int) -> DynamicCache:
        return cache_of([(k.expand(b, -1, -1, -1).contiguous(), v.expand(b, -1, -1, -1).contiguous()) for k, v in prefix_kv])

    def _prefill(self, admitted: list[tuple[Pending, list[Row]]]) -> None:
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
                self._beams[id(job)] = Beams()
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

    def _join_group(self, job: Job, rows: list[Row], shared, logits: torch.Tensor) -> None:
        """A job of several rows joins after the batch's rows: its prompt held once (``shared``, per layer a list of
        ``(keys, values)`` segments), its rows' generated keys/values apart (:class:`.shared_kv.SharedGroup`)."""
        job.remaining = job.n
        group = SharedGroup(job, shared, len(rows))
        if job.num_beams > 1:
            # its first step: every beam holds the same prompt and only the first may expand (the others score
            # -inf), so that row's candidates are the request's; from then on its steps are read in chunks
            self._beams[id(job)] = Beams()
            feed = Feed(rows, [])
            feed.parts.append(self._beam_chunk(rows[:1], logits[:1].float().clone(), 0))
            self._groups.append(group)
            self._select_group(group, feed, logits.shape[1])
            return
        group.start = len(self._rows)
        self._groups.append(group)
        logits = logits.float().expand(len(rows), -1)
        self._logits = logits.contiguous() if self._logits is None else torch.cat([self._logits, logits])
        self._rows = self._rows + rows

    def _regroup(self, nxt: list[tuple[int, Row, int]]) -> list[tuple[int, Row, int]]:
        """Lay the next batch out (padded rows, then each group's rows) and select the caches' rows to match: the
        padded cache's rows, and within each group in the batch (not one whose step is being read in chunks) only
        the generated part (a beam reorder). Returns ``nxt`` in the new row order."""
        n0 = self._narrow_rows
        narrow = [e for e in nxt if e[0] < n0]
        ready = sorted((g for g in self._groups if g.feed is None), key=lambda g: g.start)  # groups in the batch
        starts = [g.start for g in ready]
        buckets: list[list[tuple[int, Row, int]]] = [[] for _ in ready]
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
        for g, bucket in zip(ready, buckets):
            if bucket:
                g.select([src - g.start for src, _, _ in bucket], self.device)
                kept.append(g)
        at = len(narrow)
        for g in kept:
            g.start, at = at, at + g.rows
        self._groups = [g for g in self._groups if g.feed is not None] + kept
        return narrow + [e for bucket in buckets for e in bucket]

    def _trim(self) -> None:
        """Drop leading columns that are padding in every remaining row."""
        live = self._mask.any(dim=0).nonzero()
        first = int(live[0]) if live.numel() else 0
        if first > 0:
            self._mask = self._mask[:, first:]
            for layer in self._cache.layers:
                layer.keys = layer.keys[:, :, first:, :]
                layer.values = layer.values[:, :, first:, :]
