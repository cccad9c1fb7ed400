"""Choosing the next token of every sampled row of a step (any engine: the transformers decode loop, and the vLLM
processor where it draws a row itself).

:func:`sample_rows` draws for a whole batch at once on the logits' device (one host-to-device copy of the rows'
uniform draws, no per-row round trip); :func:`sample_row` is the row-by-row form, used when the batched call
fails so that a failure stays with its row.
"""

from __future__ import annotations

import torch

from .protocol import SamplingParams

__all__ = ["MIN_TEMPERATURE", "sample_row", "sample_rows"]

# Below this temperature sampling is greedy: dividing logits by less overflows float32.
MIN_TEMPERATURE = 1e-5


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Sample one token from one row of (already masked) logits."""
    if params.temperature < MIN_TEMPERATURE:
        return int(torch.argmax(logits))
    logits = logits.float()
    # shift by the max first: (x - max) / t is <= 0, so a small t gives -inf, never +inf or NaN
    logits = (logits - logits.max()) / params.temperature
    if params.top_k and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(dim=-1) - probs > params.top_p  # keep the token that crosses top_p
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], generators: list) -> torch.Tensor:
    """Sample one token per row of (already masked) ``logits`` with each row's own parameters, on the device.

    Each row draws one uniform number from its own generator (seeded rows reproduce) on the host; the rest is
    a few batched operations (temperature, top-k, top-p, inverse CDF), so choosing the tokens of a whole batch
    costs no per-row device round trip. Greedy rows (temperature below ``MIN_TEMPERATURE``) take the argmax.
    """
    b, vocab = logits.shape
    device = logits.device
    greedy_tok = logits.argmax(dim=-1)
    greedy_rows = [p.temperature < MIN_TEMPERATURE for p in params]
    if all(greedy_rows):
        return greedy_tok
    temps = torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy_rows)], device=device)
    x = logits.float()
    # shift by the max first: (x - max) / t is <= 0, so a small t gives -inf, never +inf or NaN
    x = (x - x.max(dim=-1, keepdim=True).values) / temps[:, None]
    u = torch.tensor([float(torch.rand(1, generator=g)) for g in generators], device=device)
    order = None
    if any(0 < p.top_k < vocab for p in params) or any(p.top_p < 1.0 for p in params):
        x, order = torch.sort(x, dim=-1, descending=True)
        ks = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
        x = x.masked_fill(torch.arange(vocab, device=device)[None] >= ks[:, None], float("-inf"))
        probs = torch.softmax(x, dim=-1)
        top_p = torch.tensor([p.top_p for p in params], device=device)
        x = x.masked_fill(probs.cumsum(dim=-1) - probs > top_p[:, None], float("-inf"))  # keep the crossing token
    probs = torch.softmax(x, dim=-1)
    cum = probs.cumsum(dim=-1)
    idx = torch.searchsorted(cum, (u * cum[:, -1])[:, None], right=True).clamp_(max=vocab - 1)
    # float rounding at the top of the CDF must never pick a token of probability zero
    idx = torch.where(probs.gather(1, idx) > 0, idx, probs.argmax(dim=-1, keepdim=True)).squeeze(1)
    if order is not None:
        idx = order.gather(1, idx[:, None]).squeeze(1)
    return torch.where(torch.tensor(greedy_rows, device=device), greedy_tok, idx)
