"""The vLLM engine's reading of vLLM's per-token ``logprobs`` (no vLLM needed: plain stand-ins for ``Logprob``)."""

from __future__ import annotations

import math
from types import SimpleNamespace

from deployments.engines.vllm.engine import _token_logprobs


def lp(logprob: float, rank: int):
    return SimpleNamespace(logprob=logprob, rank=rank)


def test_alternatives_best_first_masked_tokens_left_out():
    entries = [
        {7: lp(-0.1, 1), 3: lp(-2.5, 2), 9: lp(float("-inf"), 3)},  # only two tokens allowed: the third is masked
        {5: lp(-4.0, 6), 1: lp(-0.5, 1), 2: lp(-1.5, 2), 4: lp(-2.0, 3)},  # the sampled token ranks below the top 3
    ]
    out = _token_logprobs([7, 5], entries, 3)
    assert out[0] == (7, -0.1, [(7, -0.1), (3, -2.5)])
    assert out[1] == (5, -4.0, [(1, -0.5), (2, -1.5), (4, -2.0)])


def test_zero_alternatives_and_a_missing_entry():
    out = _token_logprobs([7, 8], [{7: lp(-0.3, 4)}], 0)
    assert out[0] == (7, -0.3, [])
    assert out[1][0] == 8 and math.isnan(out[1][1]) and out[1][2] == []
