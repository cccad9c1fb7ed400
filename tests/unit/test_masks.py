"""Mask primitives: ``apply_steps`` over mixed batches, the bitmask convention, fallbacks, revival, dtypes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from processors import ALLOW, BAN, BITMASK, FREE, Step, apply_steps, bitmask_to_ids, bitmask_words
from processors.masks import check_scores
from processors.testing import allowed_ids

W = 70  # three bitmask words, the last one partial
NEG = float("-inf")


def pack(ids, vocab=W) -> np.ndarray:
    """Reference packing written independently of the code under test: bit i % 32 of word i // 32."""
    words = [0] * ((vocab + 31) // 32)
    for i in ids:
        words[i // 32] |= 1 << (i % 32)
    return np.array([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=np.int32)


def ids(*values) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def random_scores(rows, width=W, dtype=torch.float32, seed=0):
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_bitmask_convention():
    assert bitmask_words(1) == 1 and bitmask_words(32) == 1 and bitmask_words(33) == 2 and bitmask_words(70) == 3
    with pytest.raises(ValueError, match="vocab_size"):
        bitmask_words(0)
    chosen = [0, 1, 31, 32, 33, 63, 64, 69]
    words = pack(chosen)
    assert words[0] == np.int32(-(1 << 31) + 3)  # bits 0, 1 and 31 (the sign bit)
    assert words[1] == np.int32(-(1 << 31) + 3)  # ids 32, 33, 63
    assert words[2] == np.int32(1 | (1 << 5))  # ids 64, 69
    assert bitmask_to_ids(words).tolist() == chosen
    assert bitmask_to_ids(words, limit=64).tolist() == [0, 1, 31, 32, 33, 63]
    with pytest.raises(ValueError, match="int32"):
        bitmask_to_ids(words.astype(np.int64))


def test_mixed_batch_each_row_gets_its_instruction():
    raw = random_scores(5)
    bm_ids = [0, 31, 32, 63, 64, 69]
    steps = [
        Step(ALLOW, ids(3, 5, 40), 2),
        Step(BITMASK, pack(bm_ids), 2),
        Step(BAN, ids(2, 4), 2),
        Step(FREE, None, 2),
        Step(ALLOW, ids(69), 2),
    ]
    out = apply_steps(raw.clone(), steps)
    assert allowed_ids(out[0]) == {3, 5, 40}
    assert allowed_ids(out[1]) == set(bm_ids)
    assert allowed_ids(out[2]) == set(range(W)) - {2, 4}
    assert torch.equal(out[3], raw[3])
    assert allowed_ids(out[4]) == {69}
    # allowed logits keep their values exactly
    for row, keep in ((0, [3, 5, 40]), (1, bm_ids), (2, [i for i in range(W) if i not in (2, 4)]), (4, [69])):
        assert torch.equal(out[row, keep], raw[row, keep])


def test_apply_steps_is_in_place_and_returns_scores():
    scores = random_scores(2)
    out = apply_steps(scores, [Step(ALLOW, ids(1), 0), Step(FREE, None, 0)])
    assert out is scores
    assert allowed_ids(scores[0]) == {1}


def test_all_allow_rows_path():
    raw = random_scores(3)
    out = apply_steps(raw.clone(), [Step(ALLOW, ids(1, 2), 0), Step(ALLOW, ids(7), 0), Step(ALLOW, ids(0, 69), 0)])
    assert [allowed_ids(r) for r in out] == [{1, 2}, {7}, {0, 69}]
    assert torch.equal(out[2, [0, 69]], raw[2, [0, 69]])


def test_free_rows_untouched_bit_for_bit():
    raw = random_scores(4)
    raw[1, 5] = NEG
    raw[1, 6] = float("nan")
    raw[1, 7] = float("inf")
    steps = [Step(ALLOW, ids(3), 0), Step(FREE, None, 0), Step(BITMASK, pack([9]), 0), Step(BAN, ids(1), 0)]
    out = apply_steps(raw.clone(), steps)
    assert torch.equal(out[1].view(torch.int32), raw[1].view(torch.int32))
    # a BAN row changes only its banned ids
    assert torch.equal(out[3, 2:], raw[3, 2:]) and torch.equal(out[3, :1], raw[3, :1]) and out[3, 1] == NEG


def test_all_free_batch_is_untouched():
    raw = random_scores(3)
    out = apply_steps(raw.clone(), [Step(FREE, None, 0)] * 3)
    assert torch.equal(out, raw)


def test_empty_allow_and_zero_bitmask_fall_back_to_end_token():
    raw = random_scores(3)
    steps = [
        Step(ALLOW, np.zeros(0, dtype=np.int64), 7),
        Step(BITMASK, np.zeros(bitmask_words(W), dtype=np.int32), 11),
        Step(ALLOW, None, 13),
    ]
    out = apply_steps(raw.clone(), steps)
    assert [allowed_ids(r) for r in out] == [{7}, {11}, {13}]
    assert out[0, 7] == raw[0, 7] and out[1, 11] == raw[1, 11]


def test_upstream_neg_inf_on_every_allowed_token_is_revived():
    raw = random_scores(4)
    raw[0, [3, 5]] = NEG  # e.g. min_new_tokens banned the only allowed tokens (EOS)
    raw[1, [9, 40]] = NEG
    raw[2, 3] = NEG  # only part of the allowed set is dead: nothing to revive
    raw[3, :] = NEG  # fallback token dead too
    steps = [
        Step(ALLOW, ids(3, 5), 0),
        Step(BITMASK, pack([9, 40]), 0),
        Step(ALLOW, ids(3, 5), 0),
        Step(ALLOW, np.zeros(0, dtype=np.int64), 12),
    ]
    out = apply_steps(raw.clone(), steps)
    assert allowed_ids(out[0]) == {3, 5} and (out[0, [3, 5]] == 0).all()
    assert allowed_ids(out[1]) == {9, 40} and (out[1, [9, 40]] == 0).all()
    assert allowed_ids(out[2]) == {5} and out[2, 5] == raw[2, 5]
    assert allowed_ids(out[3]) == {12}
    for row in out:
        assert not torch.isneginf(row).all()


def test_ids_beyond_width_are_ignored_and_padded_ids_masked():
    width = 40
    raw = random_scores(3, width=width)
    raw[:, 35:] = 1000.0  # ids the tokenizer (vocab 35) does not know
    steps = [
        Step(ALLOW, ids(1, 34, 50), 0),  # 50 is beyond the scores: ignored
        Step(BITMASK, pack([2, 33], vocab=35), 0),  # 2 words cover 64 ids; only 35 are tokens
        Step(BAN, ids(3, 99), 0),
    ]
    out = apply_steps(raw.clone(), steps)
    assert allowed_ids(out[0]) == {1, 34}
    assert allowed_ids(out[1]) == {2, 33}
    assert torch.isneginf(out[:2, 35:]).all()
    assert allowed_ids(out[2]) == set(range(width)) - {3}
    # negative ids are ignored too (never produced by the tables, but the range check covers them)
    out = apply_steps(random_scores(1, width=width), [Step(ALLOW, ids(-1, 3, -40), 0)])
    assert allowed_ids(out[0]) == {3}
    # a bitmask narrower than the scores: the ids past 32 * words are masked
    out = apply_steps(random_scores(1, width=W), [Step(BITMASK, pack([5], vocab=32), 0)])
    assert allowed_ids(out[0]) == {5}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_low_precision_dtypes(dtype):
    raw = random_scores(5, dtype=dtype)
    raw[4, [6, 7]] = NEG
    steps = [
        Step(ALLOW, ids(3, 5), 0),
        Step(BITMASK, pack([0, 31, 69]), 0),
        Step(BAN, ids(2), 0),
        Step(FREE, None, 0),
        Step(ALLOW, ids(6, 7), 0),
    ]
    out = apply_steps(raw.clone(), steps)
    assert out.dtype == dtype
    assert [allowed_ids(r) for r in out[:2]] == [{3, 5}, {0, 31, 69}]
    assert torch.equal(out[0, [3, 5]], raw[0, [3, 5]])
    assert torch.equal(out[1, [0, 31, 69]], raw[1, [0, 31, 69]])
    assert out[2, 2] == NEG and torch.equal(out[2, 3:], raw[2, 3:])
    assert torch.equal(out[3], raw[3])
    assert allowed_ids(out[4]) == {6, 7} and (out[4, [6, 7]] == 0).all()


def test_non_contiguous_scores():
    base = random_scores(W, width=3)  # (W, 3) -> transpose is a (3, W) strided view
    scores = base.t()
    assert not scores.is_contiguous()
    raw = scores.clone()
    raw_dead = [4, 8]
    scores[1, raw_dead] = NEG
    steps = [Step(ALLOW, ids(4, 8), 0), Step(ALLOW, ids(*raw_dead), 0), Step(FREE, None, 0)]
    out = apply_steps(scores, steps)
    assert allowed_ids(out[0]) == {4, 8} and torch.equal(out[0, [4, 8]], raw[0, [4, 8]])
    assert allowed_ids(out[1]) == {4, 8} and (out[1, [4, 8]] == 0).all()
    assert torch.equal(out[2], raw[2])


def test_check_scores_names_expected_and_actual():
    with pytest.raises(ValueError, match=r"3 rows, expected 2"):
        apply_steps(torch.zeros(3, W), [Step(FREE, None, 0)] * 2)
    with pytest.raises(ValueError, match=r"2-D.*\(70,\)"):
        check_scores(torch.zeros(W), 1)
    with pytest.raises(ValueError, match="floating-point.*int64"):
        check_scores(torch.zeros(1, W, dtype=torch.int64), 1)
    with pytest.raises(TypeError, match="ndarray"):
        check_scores(np.zeros((1, W)), 1)
    with pytest.raises(ValueError, match="unknown step kind 9 for row 1"):
        apply_steps(torch.zeros(2, W), [Step(FREE, None, 0), Step(9, None, 0)])


def test_step_is_frozen():
    step = Step(ALLOW, ids(1), 0)
    with pytest.raises(AttributeError):  # dataclasses.FrozenInstanceError
        step.kind = BAN  # type: ignore[misc]
