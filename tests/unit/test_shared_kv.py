"""The shared-prompt attention of wide requests (``deployments/engines/transformers/shared_kv.py``) against plain
attention over each row's full cache (the prompt copied into the row), on the same inputs, float32.

Tolerance: 1e-5 absolute on outputs of magnitude ~1 (both sides compute in float32; they differ only in the order
of the additions of the softmax).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deployments.engines.transformers.shared_kv import SharedGroup, shared_attention

TOL = 1e-5


def _plain(query, segments, own_k, own_v, scaling):
    """Reference: every row reads its own copy of prompt + generated keys/values through SDPA."""
    w, heads, _, dim = query.shape
    kv_heads = own_k.shape[1]
    k = torch.cat([torch.cat([s[0] for s in segments], dim=2).expand(w, -1, -1, -1), own_k], dim=2)
    v = torch.cat([torch.cat([s[1] for s in segments], dim=2).expand(w, -1, -1, -1), own_v], dim=2)
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    out = F.scaled_dot_product_attention(query, k, v, scale=scaling)  # (w, heads, 1, dim)
    return out.transpose(1, 2)


@pytest.mark.parametrize("w,heads,kv_heads,prompt,own,segments", [
    (1, 9, 3, 17, 0, 1), (8, 9, 3, 64, 1, 1), (64, 9, 3, 33, 4, 2), (5, 4, 4, 10, 3, 3), (3, 8, 2, 1, 7, 1),
])
def test_shared_prompt_attention_equals_plain_attention(w, heads, kv_heads, prompt, own, segments):
    g = torch.Generator().manual_seed(w * 100 + prompt)
    dim = 16
    query = torch.randn(w, heads, 1, dim, generator=g)
    cuts = sorted(torch.randperm(max(prompt - 1, 1), generator=g)[: segments - 1].add(1).tolist())
    bounds = [0] + cuts + [prompt]
    pk = torch.randn(1, kv_heads, prompt, dim, generator=g)
    pv = torch.randn(1, kv_heads, prompt, dim, generator=g)
    segs = [(pk[:, :, a:b], pv[:, :, a:b]) for a, b in zip(bounds, bounds[1:]) if b > a]
    own_k = torch.randn(w, kv_heads, own + 1, dim, generator=g)  # the step's token is always in the own part
    own_v = torch.randn(w, kv_heads, own + 1, dim, generator=g)
    got = shared_attention(query, segs, own_k, own_v, dim ** -0.5)
    want = _plain(query, segs, own_k, own_v, dim ** -0.5)
    assert got.shape == (w, 1, heads, dim)
    assert torch.allclose(got, want, atol=TOL), (got - want).abs().max()


def test_a_group_reorder_gathers_only_the_generated_part():
    kv_heads, dim, prompt = 2, 8, 50
    shared = [[(torch.randn(1, kv_heads, prompt, dim), torch.randn(1, kv_heads, prompt, dim))] for _ in range(3)]
    group = SharedGroup(job=None, shared=shared, rows=4)
    steps = [torch.randn(4, kv_heads, 1, dim) for _ in range(2)]
    for step in steps:
        for layer in group.own:
            layer.append(step, step * 2)
    prompt_ptrs = [seg[0].data_ptr() for layer in shared for seg in layer]
    group.select([3, 3, 0], torch.device("cpu"))  # beams 3 (twice) and 0 go on
    assert group.rows == 3 and group.generated == 2
    keys = group.own[0].kbuf[:, :, :2]
    for row, src in enumerate([3, 3, 0]):
        assert torch.equal(keys[row, :, 0], steps[0][src, :, 0]) and torch.equal(keys[row, :, 1], steps[1][src, :, 0])
    # the prompt is untouched: the same tensors, not copied per row
    assert [seg[0].data_ptr() for layer in group.shared for seg in layer] == prompt_ptrs
    assert group.prompt_len == prompt
