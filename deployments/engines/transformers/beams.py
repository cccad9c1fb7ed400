"""Beam search inside the batch: a request's candidates ranked over all its rows (summed log-probabilities of the
masked distribution; tree requests straight from their tables, :mod:`processors.lane_beams`), ended candidates
kept with a length-normalized score, the surviving beams' cursors copied and advanced together.

:class:`BeamSearch` is the engine's part for this: it owns the ended hypotheses of every beam request in the engine
(``Beams`` by job); it ranks a beam request of the padded batch (:meth:`BeamSearch.candidates`,
:meth:`BeamSearch.select`) and a wide beam request chunk by chunk (:meth:`BeamSearch.chunk`, the ranking in
:mod:`.wide`; :meth:`BeamSearch.rank_group` once the last chunk is in). It reads the rows' masks through the
:class:`.grammar_rows.GrammarRows` part and touches no key/value state but a wide request's own rows
(:meth:`.shared_kv.SharedGroup.select`); the batch part keeps the groups' order."""

from __future__ import annotations

import logging

import torch

from processors.lanes import advance_rows

from ..protocol import DoneEvent, FinishedEvent, TokenEvent
from .grammar_rows import GrammarRows
from .jobs import Beams, Feed, Job, Row
from .rows import cancelled
from .shared_kv import SharedGroup
from .wide import rank_chunk, top_candidates

logger = logging.getLogger(__name__)

__all__ = ["BeamSearch"]


class BeamSearch:
    """Beam ranking and selection.

    Args:
        grammar: the rows' masks (a wide request's chunk is masked there).
        stats: the engine's counters (``tree_ranked_steps``, ``cancelled_jobs``).
        vector_lane: mask a chunk's lane rows with array operations (:mod:`processors.lanes`).
        vocab_size: the tokenizer's vocabulary (the model's logits may be padded past it).
        device: where a wide request's generated keys/values are gathered.
    """

    def __init__(self, grammar: GrammarRows, *, stats: dict, vector_lane: bool, vocab_size: int, device):
        self.grammar = grammar
        self.stats = stats
        self.vector_lane = vector_lane
        self.vocab_size = vocab_size
        self.device = device
        self._beams: dict[int, Beams] = {}

    def start(self, job: Job) -> None:
        """A beam request joins the batch: no ended hypotheses yet."""
        self._beams[id(job)] = Beams()

    def cancel(self, job: Job) -> None:
        """A beam request was cancelled: its hypotheses are dropped and it is told."""
        self._beams.pop(id(job), None)
        cancelled(job, self.stats)

    def clear(self) -> None:
        self._beams.clear()

    #: one beam request's best ``2 * num_beams`` candidates as (scores, flat ids), on the device
    candidates = staticmethod(top_candidates)

    def chunk(self, rows: list[Row], logits: torch.Tensor, first: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The best ``2B`` candidates of rows ``first ..`` of a wide beam request (:func:`.wide.rank_chunk`)."""
        return rank_chunk(rows, logits, first, grammar=self.grammar, stats=self.stats, vector_lane=self.vector_lane,
                          vocab_size=self.vocab_size)

    def select(self, rows: list[Row], idxs: list[int], top_scores: list[float], top_ids: list[int], vocab: int):
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
            self.emit(job, beams)
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
        out = [(src, Row(job, slot, cursor, None, rows[src].tokens + [token], score), token)
               for slot, ((src, token, score), cursor) in enumerate(zip(picked, cursors)) if slot not in failed]
        if not out:
            self._beams.pop(id(job), None)
            self.emit(job, beams)
        return out

    def rank_group(self, group: SharedGroup, feed: Feed, vocab: int) -> bool:
        """Rank a wide beam request once every row of its step was read (``feed.parts``: each chunk's best
        candidates, flat ids over the group's rows): the best ``2B`` of all chunks are the request's best ``2B``.
        The surviving beams' generated keys/values are gathered and their next step set (``group.feed``). Returns
        whether the request goes on (the caller queues it at the end of the wide requests); ``False`` when it
        ended or was cancelled."""
        job = group.job
        if job.cancelled.is_set():
            self.cancel(job)
            return False
        scores = torch.cat([s for s, _ in feed.parts])
        flat = torch.cat([f for _, f in feed.parts])
        if len(feed.parts) > 1:
            scores, pos = torch.topk(scores, min(2 * job.num_beams, scores.numel()))
            flat = flat[pos]
        host = torch.cat([scores, flat]).tolist()
        k = scores.numel()
        nxt = self.select(feed.rows, list(range(len(feed.rows))), host[:k], [int(f) for f in host[k:]], vocab)
        if not nxt:
            return False
        group.select([src for src, _, _ in nxt], self.device)
        group.feed = Feed([row for _, row, _ in nxt], [token for _, _, token in nxt])
        return True

    @staticmethod
    def emit(job: Job, beams: Beams) -> None:
        """The best ``n`` ended hypotheses, best first, each with the normalized score it was ranked by."""
        for index, (score, tokens, reason) in enumerate(beams.hyps[: job.n]):
            for t in tokens:
                job.on_event(TokenEvent(index, t))
            job.on_event(FinishedEvent(index, tokens, reason, score=score))
        job.on_event(DoneEvent())
