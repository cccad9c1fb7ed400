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

import threading
from dataclasses import dataclass

from typing import Sequence, cast

import numpy as np
import torch

__all__ = [
    "ALLOW",
    "BAN",
    "BITMASK",
    "FREE",
    "MaskBatch",
    "MaskBuffer",
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


def apply_steps(scores: torch.Tensor, steps: list[Step], buffer: "MaskBuffer | None" = None) -> torch.Tensor:
    """Apply one :class:`Step` per row of ``scores`` in place and return ``scores``.

    ``buffer``: host memory reused from step to step (see :class:`MaskBuffer`); ``None``: one kept per thread.
    Work per call on a device: the batch's mask data written into that buffer, one copy to the device, then
    one gather and one scatter of the allowed logits around one fill of the constrained rows (``fill_``
    when every row is constrained), one masked fill for bitmask rows, one indexed fill for bans. On the CPU
    (unless the buffer asks for the device path) the same operations run on arrays made per call, which
    torch uses in place: there is nothing to copy. No loop over the vocabulary.
    """
    check_scores(scores, len(steps))
    if scores.device.type == "cpu" and (buffer is None or not buffer.device_path):
        return apply_steps_cpu(scores, steps)
    batch = MaskBatch(scores.shape[0], scores.shape[1])
    batch.add_steps(steps)
    return batch.apply(scores, buffer)


class MaskBuffer:
    """Host memory for one batch's mask data, reused across decode steps, and its device copy.

    Every step's instructions become int64 words in one host array (allowed flat indices, the rows
    to fill, banned flat indices, bitmask rows and their words), which goes to the device in one
    ``non_blocking`` copy. On a CUDA device the host array is pinned and the device array is kept
    too; both grow (doubling) when a wider batch needs more and never shrink, so a step allocates
    nothing once the largest batch has been seen. Before the host array is written again the
    previous copy is waited for (a CUDA event), so a step never overwrites data still in flight.
    On the CPU the "device copy" is the host array itself.

    One buffer per decode loop (it is not thread-safe).
    """

    def __init__(self, device: torch.device | str | None = None, *, pin: bool | None = None,
                 device_path: bool | None = None):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.pin = (self.device.type == "cuda") if pin is None else bool(pin)
        #: unpack bitmasks and revive dead rows with device ops (no host sync); default: off the CPU only.
        #: Tests turn it on for a CPU buffer to check that path against the host one.
        self.device_path = (self.device.type != "cpu") if device_path is None else bool(device_path)
        self._host: torch.Tensor | None = None
        self._host_np: np.ndarray = np.zeros(0, dtype=np.int64)
        self._dev: torch.Tensor | None = None
        self._event: "torch.cuda.Event | None" = None
        #: how many times the host array was (re)allocated; tests watch it
        self.allocations = 0

    @property
    def capacity(self) -> int:
        return int(self._host_np.size)

    def host(self, n: int) -> np.ndarray:
        """The host array (at least ``n`` words), safe to write: any copy from it has finished."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        if n > self._host_np.size:
            size = max(n, 2 * self._host_np.size, 1024)
            self._host = torch.empty(size, dtype=torch.int64, pin_memory=self.pin)
            self._host_np = self._host.numpy()
            self._dev = None
            self.allocations += 1
        return self._host_np

    def to_device(self, n: int) -> torch.Tensor:
        """The first ``n`` words on the device (one non-blocking copy); on the CPU the whole host array,
        of which the caller reads the first ``n`` words."""
        if self._host is None:
            self.host(n)
        assert self._host is not None
        if self.device.type == "cpu":
            return self._host
        if self._dev is None or self._dev.numel() < self._host.numel():
            self._dev = torch.empty(self._host.numel(), dtype=torch.int64, device=self.device)
        out = self._dev[:n]
        out.copy_(self._host[:n], non_blocking=True)
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self._event = event
        return out


class MaskBatch:
    """One decode step's mask instructions for a batch, gathered from any number of sources, applied at once.

    Sources: :meth:`add_steps` (one :class:`Step` per row, for rows masked one by one) and
    :meth:`add_allowed` (rows whose allowed ids were computed for all of them with array operations).
    Each row is given by at most one source.
    """

    __slots__ = ("n_rows", "width", "_fill", "_keep", "_allow_rows", "_allow_ids", "_allow_lens",
                 "_bm_rows", "_bm_words", "_bm_fallbacks", "_ban_rows", "_ban_ids")

    def __init__(self, n_rows: int, width: int):
        self.n_rows, self.width = int(n_rows), int(width)
        self._fill: list[np.ndarray] = []  # rows filled with -inf before their allowed logits come back
        self._keep: list[np.ndarray] = []  # flat indices (row * width + id) whose logits are kept
        self._allow_rows: list[int] = []
        self._allow_ids: list[np.ndarray] = []
        self._allow_lens: list[int] = []
        self._bm_rows: list[int] = []
        self._bm_words: list[np.ndarray] = []
        self._bm_fallbacks: list[int] = []
        self._ban_rows: list[int] = []
        self._ban_ids: list[np.ndarray] = []

    def add_steps(self, steps: Sequence[Step], rows: Sequence[int] | None = None) -> "MaskBatch":
        """Rows given one :class:`Step` each (``rows``: their row indices; default ``0..len(steps)-1``)."""
        allow_rows, allow_ids, allow_lens = self._allow_rows, self._allow_ids, self._allow_lens
        for k, step in enumerate(steps):
            row = k if rows is None else int(rows[k])
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
                self._bm_rows.append(row)
                self._bm_words.append(cast(np.ndarray, step.payload))
                self._bm_fallbacks.append(step.fallback)
            elif kind == BAN:
                if step.payload is not None and len(step.payload):
                    self._ban_rows.append(row)
                    self._ban_ids.append(step.payload)
            elif kind != FREE:
                raise ValueError(f"unknown step kind {kind!r} for row {row}")
        return self

    def add_allowed(self, rows: np.ndarray, keep: np.ndarray) -> "MaskBatch":
        """Rows masked as a group: every row in ``rows`` (int64, distinct) keeps exactly the flat
        indices ``keep`` (int64, ``row * width + id``, ids already in ``[0, width)``) that lie in it."""
        if rows.size:
            self._fill.append(rows)
            self._keep.append(keep)
        return self

    # -- applying ----------------------------------------------------------------------------------
    def _bitmask_words(self) -> np.ndarray:
        """(G, W) int32 words with the bits at or past the width cleared and an empty row given its fallback."""
        width = self.width
        n_words = (width + 31) // 32
        words = np.zeros((len(self._bm_words), n_words), dtype=np.int32)
        for i, w in enumerate(self._bm_words):
            w = np.asarray(w).astype(np.int32, copy=False)[:n_words]
            words[i, : w.size] = w
        if width % 32:
            words[:, -1] &= np.int32((1 << (width % 32)) - 1)
        for i in np.flatnonzero(~words.any(axis=1)).tolist():
            fb = self._bm_fallbacks[i]
            if 0 <= fb < width:
                words[i, fb >> 5] |= np.int32(np.uint32(1 << (fb & 31)).view(np.int32))
        return words

    def apply(self, scores: torch.Tensor, buffer: MaskBuffer | None = None) -> torch.Tensor:
        """Mask ``scores`` in place (see :func:`apply_steps`) and return it."""
        n_rows, width = self.n_rows, self.width
        if scores.shape[0] != n_rows or scores.shape[1] != width:
            raise ValueError(f"scores has shape {tuple(scores.shape)}, the batch was built for {(n_rows, width)}")
        allow_rows = self._allow_rows
        if not (allow_rows or self._fill or self._bm_rows or self._ban_rows):
            return scores
        if not scores.is_contiguous():  # rare: a strided view; mask a contiguous copy and write it back
            tmp = scores.contiguous()
            self.apply(tmp, buffer)
            scores.copy_(tmp)
            return scores
        device = scores.device
        if buffer is None:
            buffer = _default_buffer(device)
        elif buffer.device != device:
            raise ValueError(f"the mask buffer is for {buffer.device}, scores are on {device}")
        on_device = buffer.device_path

        # Everything goes into one host array, in this order: kept flat indices (rows masked as a group,
        # then step rows), rows to fill, banned flat indices, bitmask rows, bitmask words (device path).
        # Hot path: few numpy calls, since at small batches their fixed cost, not the data, is the time.
        ids = None
        if allow_rows:
            ids = np.concatenate(self._allow_ids, dtype=np.int64, casting="unsafe")
            # the range check is one reduction (negative ids read as huge unsigned values)
            if ids.size and ids.view(np.uint64).max() >= width:
                ok = (ids >= 0) & (ids < width)
                lens: np.ndarray | list[int] = np.add.reduceat(ok.astype(np.int64), np.cumsum([0] + self._allow_lens[:-1]))
                ids = ids[ok]
            else:
                lens = self._allow_lens
        fill_parts = self._fill
        nk_groups = sum(k.size for k in self._keep) if self._keep else 0
        nk = nk_groups + (ids.size if ids is not None else 0)
        nf = (sum(f.size for f in fill_parts) if fill_parts else 0) + len(allow_rows)
        fill_all = nf == n_rows  # then one fill_ of the whole tensor and no row list
        ban = None
        if self._ban_rows:
            blens = np.fromiter((len(a) for a in self._ban_ids), dtype=np.int64, count=len(self._ban_ids))
            ban_rows = np.repeat(np.asarray(self._ban_rows, dtype=np.int64), blens)
            ban_ids = np.concatenate(self._ban_ids).astype(np.int64, copy=False)
            ok = (ban_ids >= 0) & (ban_ids < width)
            ban = ban_rows[ok] * width + ban_ids[ok]
        nb = 0 if ban is None else ban.size
        ng = len(self._bm_rows)
        words = self._bitmask_words() if ng else None
        nw = words.size if (words is not None and on_device) else 0
        nfw = 0 if fill_all else nf
        total = nk + nfw + nb + ng + nw
        host = buffer.host(total)

        at = 0
        for part in self._keep:
            host[at : at + part.size] = part
            at += part.size
        if ids is not None:
            out = host[at:nk]
            if len(allow_rows) == 1:
                np.add(ids, allow_rows[0] * width, out=out)
            else:
                np.add(ids, np.repeat(np.asarray(allow_rows, dtype=np.int64) * width, lens), out=out)
        at = nk
        if nfw:
            for part in fill_parts:
                host[at : at + part.size] = part
                at += part.size
            host[at : nk + nfw] = allow_rows
            at = nk + nfw
        if nb:
            host[at : at + nb] = ban
            at += nb
        if ng:
            host[at : at + ng] = self._bm_rows
            at += ng
        if nw:
            host[at : at + nw] = cast(np.ndarray, words).reshape(-1)  # widened to int64, unpacked on the device
        dev = buffer.to_device(total)

        view = scores.view(-1)
        if nf:
            keep_t = dev[:nk]
            vals = view.index_select(0, keep_t)
            if fill_all:
                scores.fill_(NEG_INF)
            else:
                scores.index_fill_(0, dev[nk : nk + nfw], NEG_INF)
            view.index_copy_(0, keep_t, vals)
            if nk:
                _revive(scores, view, keep_t, vals, host[:nk], on_device)
        if nb:
            view.index_fill_(0, dev[nk + nfw : nk + nfw + nb], NEG_INF)
        if ng:
            at = nk + nfw + nb
            rows_t = dev[at : at + ng]
            if on_device:
                w = dev[at + ng : at + ng + nw].view(ng, -1)
                shifts = torch.arange(32, device=device, dtype=torch.int64)
                allowed = ((w[:, :, None] >> shifts) & 1).bool().view(ng, -1)[:, :width]
            else:
                allowed = torch.from_numpy(_unpack_bool(cast(np.ndarray, words), width))
            sub = scores.index_select(0, rows_t)
            sub.masked_fill_(~allowed, NEG_INF)
            # the same revival rule as for id lists: a row whose every allowed logit is -inf keeps them at 0
            dead = torch.isneginf(sub).all(dim=1, keepdim=True)
            sub = torch.where(dead & allowed, torch.zeros((), dtype=sub.dtype, device=device), sub)
            scores.index_copy_(0, rows_t, sub)
        return scores


_defaults = threading.local()


def _default_buffer(device: torch.device) -> MaskBuffer:
    """A buffer per thread and device for callers that keep none (``apply_steps`` without ``buffer``)."""
    buffers = getattr(_defaults, "buffers", None)
    if buffers is None:
        buffers = _defaults.buffers = {}
    buf = buffers.get(device)
    if buf is None:
        buf = buffers[device] = MaskBuffer(device)
    return buf


def _revive(scores: torch.Tensor, view: torch.Tensor, keep_t: torch.Tensor, vals: torch.Tensor,
            keep: np.ndarray | None, on_device: bool) -> None:
    """Upstream processors (min_new_tokens, bad words) may have set every allowed logit of a row to -inf;
    sampling would then see an all -inf row. Keep those rows' allowed tokens live (at 0) instead."""
    width = scores.shape[1]
    if on_device:
        # no host sync: count each row's live allowed logits on the device and zero the dead rows' ones
        dead_vals = torch.isneginf(vals)
        rows = torch.div(keep_t, width, rounding_mode="floor")
        live = torch.zeros(scores.shape[0], dtype=vals.dtype, device=vals.device)
        live.index_add_(0, rows, (~dead_vals).to(vals.dtype))
        revive = dead_vals & (live[rows] == 0)
        view.index_copy_(0, keep_t, torch.where(revive, torch.zeros((), dtype=vals.dtype, device=vals.device), vals))
        return
    # CPU: one reduction decides the common case (the smallest allowed logit is finite; a NaN anywhere
    # makes it NaN, and then the exact per-element test runs)
    low = float(vals.min())
    if low == NEG_INF or low != low:
        dead = torch.isneginf(vals)
        if bool(dead.any()):
            assert keep is not None
            keep = keep.copy()  # the buffer is rewritten next step
            _revive_dead_rows(scores, keep // width, keep % width, dead.cpu().numpy())


def _revive_dead_rows(scores, rows, ids, dead) -> None:
    bad_rows = []
    for row in np.unique(rows[dead]):
        sel = rows == row
        if dead[sel].all():
            bad_rows.append(row)
    for row in bad_rows:
        idx = torch.from_numpy(ids[rows == row]).to(scores.device)
        scores[int(row), idx] = 0.0


# the CPU path; imported last: it uses the names above
from .masks_cpu import apply_steps_cpu  # noqa: E402
