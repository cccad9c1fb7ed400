"""A wide beam request's step ranked chunk by chunk: the rows of a request of several rows are read at most
``wide_step_rows`` per forward (:meth:`.batch.Batch.forward`), and a beam request's candidates are ranked as each chunk
comes in; its beams are chosen once its last chunk is in (:meth:`.beams.BeamSearch.rank_group`).

:func:`rank_chunk` holds no state: it is the ranking of :meth:`.beams.BeamSearch.chunk`, kept in its own module (the
tests turn the tree plan off here, ``wide.plan_tree_beams``, to compare with the masked path)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from processors.lanes import mask_rows
from processors.masks import mask_padded_vocab
from processors import apply_steps

from .jobs import Row
from processors.lane_beams import plan_tree_beams, row_logsumexp, tree_beam_candidates

if TYPE_CHECKING:
    from .beams import BeamSearch

__all__ = ["rank_chunk"]


def rank_chunk(search: "BeamSearch", rows: list[Row], logits: torch.Tensor, first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The best ``2B`` candidates of some rows of one beam request (rows ``first ..`` of its group), as (scores,
    flat ids over the group's rows), ranked as the engine's step ranks a beam request in the batch: from the tree's
    tables, or over the masked vocabulary (log-probabilities of the model's distribution, masked)."""
    idxs = list(range(len(rows)))
    k = 2 * rows[0].job.num_beams
    plan = plan_tree_beams([row.cursor for row in rows])
    if plan is not None:
        lse = row_logsumexp(logits, idxs)
        scores = torch.tensor([row.score for row in rows], dtype=torch.float32)
        top_scores, top_ids = tree_beam_candidates(plan, logits, idxs, lse, scores, k)
        search.stats["tree_ranked_steps"] += 1
    else:
        grammar = search.grammar
        logprobs = torch.log_softmax(logits, dim=-1)
        if search.vector_lane:
            late, _ = grammar.settle_masks(rows)
            failed = mask_rows(logits, [row.cursor for row in rows], grammar.mask_buffer)
            failed.update(late)
        else:
            steps, failed, _ = grammar.row_steps(rows)
            apply_steps(logits, steps, grammar.mask_buffer)
        mask_padded_vocab(logits, search.vocab_size)
        logprobs = logprobs.masked_fill(torch.isneginf(logits), float("-inf"))
        top_scores, top_ids = search.candidates(rows, idxs, logprobs, failed)
    return top_scores, top_ids + first * logits.shape[1]
