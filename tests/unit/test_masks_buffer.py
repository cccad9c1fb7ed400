"""The reused mask buffer (processors.masks.MaskBuffer): growth, mixed rows, no stale data between steps, and the
device form of the bitmask/revival path. The buffers here take the path a GPU runs (``device_path=True``: mask data
through the buffer, bitmask unpacked and dead rows revived by tensor ops), on the CPU; the reference is
``apply_steps`` without a buffer, which on the CPU keeps the direct path (arrays made per call)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from processors import ALLOW, BAN, BITMASK, FREE, Step, apply_steps
from processors.masks import MaskBuffer
from processors.testing import allowed_ids

W = 70
NEG = float("-inf")


def pack(ids, vocab=W) -> np.ndarray:
    words = [0] * ((vocab + 31) // 32)
    for i in ids:
        words[i // 32] |= 1 << (i % 32)
    return np.array([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=np.int32)


def ids(*values) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def scores(rows, seed=0):
    return torch.randn(rows, W, generator=torch.Generator().manual_seed(seed))


def test_buffer_grows_for_a_wider_batch_and_is_reused():
    buf = MaskBuffer(device_path=True)
    apply_steps(scores(2), [Step(ALLOW, ids(1, 2), 0), Step(ALLOW, ids(3), 0)], buf)
    assert buf.allocations == 1
    first = buf.capacity
    wide = [Step(ALLOW, np.arange(W, dtype=np.int64), 0) for _ in range(40)]  # 2,800 words > 1,024
    out = apply_steps(scores(40), wide, buf)
    assert buf.allocations == 2 and buf.capacity > first and buf.capacity >= 40 * W
    assert all(allowed_ids(out[r]) == set(range(W)) for r in range(40))
    apply_steps(scores(3), [Step(ALLOW, ids(5), 0)] * 3, buf)
    apply_steps(scores(40), wide, buf)
    assert buf.allocations == 2  # smaller and equal batches reuse it


def test_mixed_kinds_through_one_buffer_match_the_direct_path():
    buf = MaskBuffer(device_path=True)
    rng = np.random.default_rng(1)
    for step in range(30):
        n = int(rng.integers(1, 9))
        steps = []
        for _ in range(n):
            kind = int(rng.integers(0, 4))
            chosen = rng.choice(W, int(rng.integers(0, 6)), replace=False)
            if kind == ALLOW:
                steps.append(Step(ALLOW, chosen.astype(np.int64), int(rng.integers(0, W))))
            elif kind == BITMASK:
                steps.append(Step(BITMASK, pack(chosen.tolist()), int(rng.integers(0, W))))
            elif kind == BAN:
                steps.append(Step(BAN, chosen.astype(np.int64), 0))
            else:
                steps.append(Step(FREE, None, 0))
        raw = scores(n, seed=step)
        expected = apply_steps(raw.clone(), steps)
        got = apply_steps(raw.clone(), steps, buf)
        assert torch.equal(got, expected), f"step {step}"
        for r, s in enumerate(steps):  # and each row got its own instruction
            if s.kind == ALLOW:
                want = set(s.payload.tolist()) or {s.fallback}
                assert allowed_ids(got[r]) == want
            elif s.kind == BAN:
                assert allowed_ids(got[r]) == set(range(W)) - set(s.payload.tolist())
            elif s.kind == FREE:
                assert torch.equal(got[r], raw[r])


def test_a_step_after_a_wider_batch_keeps_no_stale_bits():
    buf = MaskBuffer(device_path=True)
    big = [Step(ALLOW, np.arange(0, W, 2, dtype=np.int64), 0) for _ in range(8)]
    apply_steps(scores(8), big, buf)
    # the buffer still holds the wide batch's indices past what this step writes
    out = apply_steps(scores(2, seed=3), [Step(ALLOW, ids(7), 0), Step(BAN, ids(1), 0)], buf)
    assert allowed_ids(out[0]) == {7}
    assert allowed_ids(out[1]) == set(range(W)) - {1}
    bm = apply_steps(scores(1, seed=4), [Step(BITMASK, pack([3, 69]), 0)], buf)
    assert allowed_ids(bm[0]) == {3, 69}


def test_device_path_equals_host_path_on_cpu():
    """The ops a GPU runs (bitmask unpacked from the transferred words, revival without a host sync), here on the
    CPU, against the host path, including rows whose allowed logits are all -inf."""
    rng = np.random.default_rng(2)
    dev_buf, host_buf = MaskBuffer(device_path=True), None
    for step in range(25):
        n = int(rng.integers(1, 7))
        raw = scores(n, seed=100 + step)
        steps = []
        for r in range(n):
            chosen = rng.choice(W, int(rng.integers(1, 5)), replace=False)
            if rng.random() < 0.4:
                raw[r, chosen] = NEG  # an upstream processor banned every allowed token: revived at 0
            kind = int(rng.integers(0, 4))
            if kind == BITMASK:
                steps.append(Step(BITMASK, pack(chosen.tolist()), 0))
            elif kind == BAN:
                steps.append(Step(BAN, chosen.astype(np.int64), 0))
            elif kind == FREE:
                steps.append(Step(FREE, None, 0))
            else:
                steps.append(Step(ALLOW, chosen.astype(np.int64), 0))
        a = apply_steps(raw.clone(), steps, host_buf)
        b = apply_steps(raw.clone(), steps, dev_buf)
        assert torch.equal(a, b), f"step {step}"
        for r, s in enumerate(steps):
            if s.kind in (ALLOW, BITMASK):
                assert torch.isfinite(a[r]).any(), "a constrained row kept something"


@pytest.mark.parametrize("buffer", [None, "device path"])
def test_ids_beyond_width_dropped_per_row_in_a_batch(buffer):
    """Out-of-range ids in several rows at once: each row keeps exactly its own in-range ids."""
    steps = [Step(ALLOW, ids(1, W + 5, 2), 0), Step(ALLOW, ids(-3, 4), 0), Step(ALLOW, ids(6, 7, 10**6), 0)]
    out = apply_steps(scores(3), steps, MaskBuffer(device_path=True) if buffer else None)
    assert [allowed_ids(out[r]) for r in range(3)] == [{1, 2}, {4}, {6, 7}]


def test_cpu_buffer_without_device_path_is_not_written():
    """On the CPU apply_steps keeps the direct path: an engine's buffer stays unallocated."""
    buf = MaskBuffer()
    out = apply_steps(scores(2), [Step(ALLOW, ids(1), 0), Step(BAN, ids(2), 0)], buf)
    assert buf.allocations == 0 and allowed_ids(out[0]) == {1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_device_path_dtypes_and_strided_scores(dtype):
    """Low-precision logits and a strided view through the buffer path give the direct path's result."""
    steps = [Step(ALLOW, ids(3, 5, 69), 0), Step(BITMASK, pack([0, 33, 64]), 0), Step(BAN, ids(2), 0), Step(FREE, None, 0)]
    raw = scores(4).to(dtype)
    expected = apply_steps(raw.clone(), steps)
    got = apply_steps(raw.clone(), steps, MaskBuffer(device_path=True))
    assert got.dtype == dtype and torch.equal(got, expected)
    wide = scores(4, seed=9).to(dtype).repeat(1, 2)  # (4, 140): its first 70 columns are a strided view
    view_a, view_b = wide.clone()[:, :W], wide.clone()[:, :W]
    assert not view_a.is_contiguous()
    assert torch.equal(apply_steps(view_a, steps, MaskBuffer(device_path=True)), apply_steps(view_b, steps))
