"""A wide beam request's step ranked chunk by chunk: the rows of a request of several rows are read at most
``wide_step_rows`` per forward (:meth:`.batch.Batch.forward`), and a beam request's candidates are ranked as each chunk
comes in; its beams are chosen once its last chunk is in (:meth:`.beams.BeamSearch.rank_group`).

:func:`rank_chunk` holds no state: it is the ranking of :meth:`.beams.BeamSearch.chunk`, kept in its own module (the
tests turn the tree plan off here, ``wide.plan_tree_beams``, to compare with the masked path); it is given the rows'
masks and the engine's counters, and ranks with :func:`top_candidates`, the same ranking as a beam request's in the
padded batch (:meth:`.beams.BeamSearch.candidates`)."""

from __future__ import annotations

import torch

from processors.lanes import mask_rows
from processors.masks import mask_padded_vocab
from processors import apply_steps

from .grammar_rows import GrammarRows
from .jobs import Row
from processors.lane_beams import plan_tree_beams, row_logsumexp, tree_beam_candidates

__all__ = ["rank_chunk", "top_candidates"]


def top_candidates(rows: list[Row], idxs: list[int], logprobs: torch.Tensor, failed: dict[int, str]):
    """One beam request's best ``2 * num_beams`` candidates as (scores, flat ids), on the device."""
    for k, i in enumerate(idxs):
        if i in failed:  # a beam whose cursor failed is dropped; its request goes on with the others
            logprobs[k] = float("-inf")
    scores = logprobs + torch.tensor([rows[i].score for i in idxs], dtype=logprobs.dtype, device=logprobs.device)[:, None]
    flat = scores.view(-1)
    top_scores, top_ids = torch.topk(flat, min(2 * rows[idxs[0]].job.num_beams, flat.numel()))
    return top_scores.double(), top_ids.double()


def rank_chunk(rows: list[Row], logits: torch.Tensor, first: int, *, grammar: GrammarRows, stats: dict,
               vector_lane: bool, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The best ``2B`` candidates of some rows of one beam request (rows ``first ..`` of its group), as (scores,
    flat ids over the group's rows), ranked as the engine's step ranks a beam request in the batch: from the tree's
    tables, or over the masked vocabulary (log-probabilities of the model's distribution, masked).

    ``grammar``: the rows' masks; ``stats``: the engine's counters (``tree_ranked_steps``); ``vector_lane``: mask
    the lane rows with array operations; ``vocab_size``: the tokenizer's vocabulary (the logits may be padded)."""
    idxs = list(range(len(rows)))
    k = 2 * rows[0].job.num_beams
    plan = plan_tree_beams([row.cursor for row in rows])
    if plan is not None:
        lse = row_logsumexp(logits, idxs)
        scores = torch.tensor([row.score for row in rows], dtype=torch.float32)
        top_scores, top_ids = tree_beam_candidates(plan, logits, idxs, lse, scores, k)
        stats["tree_ranked_steps"] += 1
    else:
        logprobs = torch.log_softmax(logits, dim=-1)
        if vector_lane:
            late, _ = grammar.settle_masks(rows)
            failed = mask_rows(logits, [row.cursor for row in rows], grammar.mask_buffer)
            failed.update(late)
        else:
            steps, failed, _ = grammar.row_steps(rows)
            apply_steps(logits, steps, grammar.mask_buffer)
        mask_padded_vocab(logits, vocab_size)
        logprobs = logprobs.masked_fill(torch.isneginf(logits), float("-inf"))
        top_scores, top_ids = top_candidates(rows, idxs, logprobs, failed)
    return top_scores, top_ids + first * logits.shape[1]
