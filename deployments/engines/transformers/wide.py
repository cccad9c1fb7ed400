"""The wide requests' step in chunks: the rows of a request of several rows (beams, ``n``) are read at most
``wide_step_rows`` per forward, beside every one-row row, so one-row requests keep a share of each step; a beam
request's candidates are ranked chunk by chunk and its beams chosen once its last chunk is in. Part of
:class:`.engine.DecodeEngine` (its state: ``_groups``, ``_beams``, ``_rows``, ``_logits``)."""

from __future__ import annotations

import torch

from processors.lanes import mask_rows
from processors.masks import mask_padded_vocab
from processors import apply_steps

from .jobs import Row
from .shared_kv import SharedGroup
from processors.lane_beams import plan_tree_beams, row_logsumexp, tree_beam_candidates

__all__ = ["WideMixin"]


class WideMixin:
    """Reading wide requests' rows in chunks (see :class:`.engine.DecodeEngine` for its state)."""

    def _wide_chunks(self) -> list[tuple[SharedGroup, int, int]]:
        """The wide requests' rows this forward reads, as ``(group, first row, end)``: at most ``wide_step_rows``
        rows (0: all), the groups in their queue's order. A cancelled request whose step is being read leaves now."""
        budget = self.wide_step_rows or float("inf")
        chunks = []
        for g in list(self._groups):
            feed = g.feed
            if g.job.cancelled.is_set():
                self._groups.remove(g)
                if g.job.num_beams > 1:
                    self._beams.pop(id(g.job), None)
                    self._cancelled(g.job)
                else:
                    for row in feed.rows:
                        self._finish(row, "error", "cancelled")
                continue
            if budget <= 0:
                continue
            take = int(min(g.rows - feed.done, budget))
            chunks.append((g, feed.done, feed.done + take))
            budget -= take
        return chunks

    def _read_chunk(self, g: SharedGroup, first: int, end: int, logits: torch.Tensor) -> None:
        """Keep what rows ``first .. end - 1`` of a wide request gave (a beam request: their best candidates right
        away); once all its rows were read, a beam request is ranked and goes on (:meth:`_select_group`), a sampled
        one joins the batch to be sampled at the next step."""
        feed = g.feed
        feed.done = end
        if g.job.num_beams > 1:
            feed.parts.append(self._beam_chunk(feed.rows[first:end], logits, first))
        else:
            feed.parts.append(logits)
        if end < g.rows:
            return
        g.commit()
        g.feed = None
        if g.job.num_beams > 1:
            self._select_group(g, feed, logits.shape[1])
            return
        g.start = len(self._rows)
        self._rows = self._rows + feed.rows
        logits = feed.parts[0] if len(feed.parts) == 1 else torch.cat(feed.parts)
        self._logits = logits if self._logits is None else torch.cat([self._logits, logits])

    def _beam_chunk(self, rows: list[Row], logits: torch.Tensor, first: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The best ``2B`` candidates of some rows of one beam request (rows ``first ..`` of its group), as (scores,
        flat ids over the group's rows), ranked as :meth:`_step` ranks a beam request in the batch: from the tree's
        tables, or over the masked vocabulary (log-probabilities of the model's distribution, masked)."""
        idxs = list(range(len(rows)))
        k = 2 * rows[0].job.num_beams
        plan = plan_tree_beams([row.cursor for row in rows])
        if plan is not None:
            lse = row_logsumexp(logits, idxs)
            scores = torch.tensor([row.score for row in rows], dtype=torch.float32)
            top_scores, top_ids = tree_beam_candidates(plan, logits, idxs, lse, scores, k)
            self._stats["tree_ranked_steps"] += 1
        else:
            logprobs = torch.log_softmax(logits, dim=-1)
            if self.vector_lane:
                late, _ = self._settle_masks(rows)
                failed = mask_rows(logits, [row.cursor for row in rows], self._mask_buffer)
                failed.update(late)
            else:
                steps, failed, _ = self._row_steps(rows)
                apply_steps(logits, steps, self._mask_buffer)
            mask_padded_vocab(logits, self.vocab_size)
            logprobs = logprobs.masked_fill(torch.isneginf(logits), float("-inf"))
            top_scores, top_ids = self._beam_candidates(rows, idxs, logprobs, failed)
        return top_scores, top_ids + first * logits.shape[1]
