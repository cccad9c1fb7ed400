"""Mask primitives: the only code that touches the logits tensor.

Every constraint in this package reduces, for one row and one decode step, to one of four
instructions (see :class:`Step`): keep only a list of token ids, keep only the tokens whose bit is
set in a packed int32 bitmask (the xgrammar / llguidance convention: ``(ceil(V/32),)`` words, bit
``i % 32`` of word ``i // 32`` set = token ``i`` allowed), ban a few ids, or leave the row alone.
:func:`apply_steps` applies a whole batch of instructions with a handful of vectorized tensor
operations, whatever the mix of rows.

Ids at or beyond the width of ``scores`` are ignored; ids that the tokenizer does not know but
the model's (padded) logits do are masked like any other disallowed id, so a constrained row
never samples a token that does not exist.
"""

from __future__ import annotations

from dataclasses import dataclass

from typing import cast

import numpy as np
import torch

__all__ = [
    "ALLOW",
    "BAN",
    "BITMASK",
    "FREE",
    "Step",
    "apply_steps",
    "bitmask_to_ids",
    "bitmask_words",
    "check_scores",
    "mask_padded_vocab",
]

ALLOW = 0  # payload: 1-D int array of allowed token ids (non-empty)
BITMASK = 1  # payload: 1-D int32 array of packed words, bit set = allowed
BAN = 2  # payload: 1-D int array of banned token ids
FREE = 3  # payload: None

NEG_INF = float("-inf")


@dataclass(frozen=True)
class Step:
    """What one row may do at one decode step.

    Args:
        kind: one of ``ALLOW``, ``BITMASK``, ``BAN``, ``FREE``.
        payload: the ids (``ALLOW``/``BAN``) or packed words (``BITMASK``); ``None`` for ``FREE``.
        fallback: the token to allow when the row would otherwise have nothing left
            (the row's end token). Used for ``ALLOW`` with an empty list and ``BITMASK`` with no bit set.
    """

    kind: int
    payload: np.ndarray | None
    fallback: int


def bitmask_words(vocab_size: int) -> int:
    """Number of int32 words in a packed bitmask for ``vocab_size`` tokens."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    return (vocab_size + 31) // 32


def bitmask_to_ids(words: np.ndarray, limit: int | None = None) -> np.ndarray:
    """Token ids whose bit is set in a packed int32 bitmask (optionally only ids < ``limit``)."""
    if words.dtype != np.int32:
        raise ValueError(f"bitmask must be int32, got {words.dtype}")
    bits = np.unpackbits(np.ascontiguousarray(words).view(np.uint8), bitorder="little")
    if limit is not None:
        bits = bits[:limit]
    return np.flatnonzero(bits)


def _unpack_bool(words: np.ndarray, width: int) -> np.ndarray:
    """(G, W) int32 words -> (G, width) bool, padding with False past 32*W."""
    bits = np.unpackbits(np.ascontiguousarray(words).view(np.uint8), axis=-1, bitorder="little")
    if bits.shape[1] >= width:
        return bits[:, :width].astype(bool, copy=False)
    out = np.zeros((bits.shape[0], width), dtype=bool)
    out[:, : bits.shape[1]] = bits
    return out


def mask_padded_vocab(scores: torch.Tensor, vocab_size: int | None) -> torch.Tensor:
    """Ban the columns of padded logits that no token of the tokenizer has (every row, also free ones)."""
    if vocab_size is not None and scores.shape[-1] > vocab_size:
        scores[..., vocab_size:] = NEG_INF
    return scores


def check_scores(scores: torch.Tensor, n_rows: int) -> None:
    """Refuse a scores tensor that cannot be a batch of next-token logits for ``n_rows`` rows."""
    if not isinstance(scores, torch.Tensor):
        raise TypeError(f"scores must be a torch.Tensor, got {type(scores).__name__}")
    if scores.dim() != 2:
        raise ValueError(f"scores must be 2-D (batch, vocab), got shape {tuple(scores.shape)}")
    if scores.shape[0] != n_rows:
        raise ValueError(f"scores has {scores.shape[0]} rows, expected {n_rows}")
    if not scores.is_floating_point():
        raise ValueError(f"scores must be a floating-point tensor, got {scores.dtype}")


def apply_steps(scores: torch.Tensor, steps: list[Step]) -> torch.Tensor:
    """Apply one :class:`Step` per row of ``scores`` in place and return ``scores``.

    Work per call: one gather and one scatter of the allowed logits, one fill of the constrained
    rows (``scores.fill_`` when every row is an ``ALLOW`` row), one masked fill for bitmask rows,
    one scatter for bans. No loop over the vocabulary.
    """
    check_scores(scores, len(steps))
    n_rows, width = scores.shape
    device = scores.device

    allow_rows: list[int] = []
    allow_ids: list[np.ndarray] = []
    allow_lens: list[int] = []
    bm_rows: list[int] = []
    bm_words: list[np.ndarray] = []
    ban_rows: list[int] = []
    ban_ids: list[np.ndarray] = []
    for row, step in enumerate(steps):
        kind = step.kind
        if kind == ALLOW:
            ids = step.payload
            n = 0 if ids is None else len(ids)
            if ids is None or n == 0:
                ids = np.array([step.fallback], dtype=np.int64)
                n = 1
            allow_rows.append(row)
            allow_ids.append(ids)
            allow_lens.append(n)
        elif kind == BITMASK:
            bm_rows.append(row)
            bm_words.append(cast(np.ndarray, step.payload))
        elif kind == BAN:
            if step.payload is not None and len(step.payload):
                ban_rows.append(row)
                ban_ids.append(step.payload)
        elif kind != FREE:
            raise ValueError(f"unknown step kind {kind!r} for row {row}")

    if allow_rows:
        _apply_allow(scores, allow_rows, allow_ids, allow_lens, n_rows, width, device)
    if bm_rows:
        _apply_bitmask(scores, bm_rows, bm_words, [steps[r].fallback for r in bm_rows], width, device)
    if ban_rows:
        lens = np.fromiter((len(a) for a in ban_ids), dtype=np.int64, count=len(ban_ids))
        rows = np.repeat(np.asarray(ban_rows, dtype=np.int64), lens)
        ids = np.concatenate(ban_ids).astype(np.int64, copy=False)
        keep = (ids >= 0) & (ids < width)
        scores[torch.from_numpy(rows[keep]).to(device), torch.from_numpy(ids[keep]).to(device)] = NEG_INF
    return scores


def _apply_allow(scores, allow_rows, allow_ids, allow_lens, n_rows, width, device) -> None:
    # Hot path (every constrained step): as few numpy/torch dispatches as possible, since at small
    # batches their fixed cost, not the data, is the time. One pass builds the int64 ids, one the
    # flat indices; the range check is one reduction (negative ids read as huge unsigned values).
    ids = np.concatenate(allow_ids, dtype=np.int64, casting="unsafe")
    if len(allow_rows) == 1:
        flat_np = np.full(ids.size, allow_rows[0] * width, dtype=np.int64)
    else:
        flat_np = np.repeat(np.asarray(allow_rows, dtype=np.int64) * width, allow_lens)
    if ids.size and ids.view(np.uint64).max() >= width:
        keep = (ids >= 0) & (ids < width)
        flat_np, ids = flat_np[keep], ids[keep]
    flat_np += ids
    flat = torch.from_numpy(flat_np)
    if device.type != "cpu":
        flat = flat.to(device, non_blocking=True)
    if scores.is_contiguous():
        view = scores.view(-1)
        vals = view.index_select(0, flat)
        if len(allow_rows) == n_rows:
            scores.fill_(NEG_INF)
        else:
            scores.index_fill_(0, torch.as_tensor(allow_rows, device=device), NEG_INF)
        view.index_copy_(0, flat, vals)
    else:  # rare: a strided view; same result through advanced indexing
        r_t = torch.from_numpy(flat_np // width).to(device)
        i_t = torch.from_numpy(ids).to(device)
        vals = scores[r_t, i_t]
        scores[torch.as_tensor(allow_rows, device=device)] = NEG_INF
        scores[r_t, i_t] = vals
    # Upstream processors (min_new_tokens, bad words) may have set every allowed logit to -inf;
    # sampling would then see an all -inf row. Keep the allowed tokens live instead.
    # One reduction decides the common case: the smallest allowed logit is finite (a NaN anywhere
    # makes it NaN, and then the exact per-element test runs).
    if vals.numel():
        low = float(vals.min())
        if low == NEG_INF or low != low:
            dead = torch.isneginf(vals)
            if bool(dead.any()):
                _revive_dead_rows(scores, flat_np // width, ids, dead.cpu().numpy())


def _revive_dead_rows(scores, rows, ids, dead) -> None:
    bad_rows = []
    for row in np.unique(rows[dead]):
        sel = rows == row
        if dead[sel].all():
            bad_rows.append(row)
    for row in bad_rows:
        idx = torch.from_numpy(ids[rows == row]).to(scores.device)
        scores[int(row), idx] = 0.0


def _apply_bitmask(scores, bm_rows, bm_words, fallbacks, width, device) -> None:
    words = np.stack(bm_words).astype(np.int32, copy=False)
    allowed = _unpack_bool(words, width)
    empty = ~allowed.any(axis=1)
    for i in np.flatnonzero(empty):
        fb = fallbacks[i]
        if 0 <= fb < width:
            allowed[i, fb] = True
    rows_t = torch.as_tensor(bm_rows, device=device)
    mask_t = torch.from_numpy(allowed).to(device, non_blocking=True)
    sub = scores.index_select(0, rows_t)
    sub.masked_fill_(~mask_t, NEG_INF)
    # the same revival rule as for id lists: a row whose every allowed logit is -inf keeps them at 0
    dead = torch.isneginf(sub).all(dim=1)
    if bool(dead.any()):
        sub[dead] = torch.where(mask_t[dead], torch.zeros((), dtype=sub.dtype, device=device), sub[dead])
    scores.index_copy_(0, rows_t, sub)
