"""Attention over a prompt held once per request: the key/value layout of wide requests (beams, ``n`` rows).

A request of ``w`` rows (``num_beams`` beams, or ``n`` sampled outputs) reads the same prompt in every row. Copying the
prompt's keys and values into each row costs ``w x prompt`` of memory and of copying at every beam reorder (256 beams
after 1,024 prompt tokens: 12 GB for the default model). Here such a request is a :class:`SharedGroup`:

- ``shared``: the prompt's keys/values, once, as one or more segments per layer (a segment may be a view of a
  prefix-cache entry: rows of requests that share a cached prefix read it by reference);
- ``own``: per row, only the keys/values of the tokens that row generated, ``(w, kv_heads, t, dim)``, with room
  to grow. All rows of a group have generated the same number of tokens (beams advance together, sampled rows
  start together), so no padding is needed inside a group.

Attention of a row combines both parts in one softmax: the scores against the shared segments (one matrix product
for all ``w`` rows and their query heads, as in a prefill) and against its own part, normalized together. A beam
reorder gathers only ``own``.

Requests of one row keep the engine's padded batch layout (one copy of the prompt per row is one copy per request
there); :class:`StepContext` carries both layouts to :func:`attention`, which the engine installs as the model's
attention implementation (plain SDPA whenever no context is passed, e.g. during prefill).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .kv_cache import GrowingLayer

__all__ = ["ATTENTION_NAME", "SharedGroup", "StepContext", "attention", "install", "shared_attention"]

ATTENTION_NAME = "cs_shared_prefix"


class _OwnLayer:
    """One layer's per-row keys/values of a group: ``(rows, kv_heads, used, dim)`` views of a buffer with room."""

    __slots__ = ("kbuf", "vbuf", "used")

    def __init__(self):
        self.kbuf: torch.Tensor | None = None
        self.vbuf: torch.Tensor | None = None
        self.used = 0

    def write(self, k: torch.Tensor, v: torch.Tensor, first: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the keys/values of rows ``first ..`` (``k``: ``(c, kv_heads, t, dim)``) at the group's next positions
        without advancing ``used`` (the other rows of the step may follow in later forwards: see
        :meth:`SharedGroup.commit`); returns those rows' keys/values so far, the new ones included. ``rows``: the
        group's rows (the buffer holds all of them)."""
        need = self.used + k.shape[2]
        if self.kbuf is None or self.kbuf.shape[2] < need or self.kbuf.shape[0] != rows:
            room = need + max(16, need // 4)
            shape = (rows, k.shape[1], room, k.shape[3])
            kbuf, vbuf = k.new_empty(shape), v.new_empty(shape)
            if self.used:
                kbuf[:, :, : self.used] = self.kbuf[:, :, : self.used]
                vbuf[:, :, : self.used] = self.vbuf[:, :, : self.used]
            self.kbuf, self.vbuf = kbuf, vbuf
        end = first + k.shape[0]
        self.kbuf[first:end, :, self.used : need] = k
        self.vbuf[first:end, :, self.used : need] = v
        return self.kbuf[first:end, :, :need], self.vbuf[first:end, :, :need]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """All rows' keys/values of the next positions, written and counted."""
        out = self.write(k, v, 0, k.shape[0])
        self.used += k.shape[2]
        return out

    def select(self, index: torch.Tensor) -> None:
        if self.used:
            self.kbuf = self.kbuf[:, :, : self.used].index_select(0, index)
            self.vbuf = self.vbuf[:, :, : self.used].index_select(0, index)

    def nbytes(self) -> int:
        return 0 if self.kbuf is None else 2 * self.kbuf.numel() * self.kbuf.element_size()


class SharedGroup:
    """The key/value state of one wide request: its prompt once (``shared``), each row's generated part (``own``).

    Args:
        job: the engine's job this group decodes.
        shared: per layer, a list of ``(keys, values)`` segments of shape ``(1, kv_heads, L_i, dim)`` in prompt order.
        rows: rows the group starts with.
    """

    def __init__(self, job, shared: list[list[tuple[torch.Tensor, torch.Tensor]]], rows: int):
        self.job = job
        self.shared = shared
        self.prompt_len = sum(k.shape[2] for k, _ in shared[0])
        self.rows = rows
        self.own = [_OwnLayer() for _ in shared]
        self.start = 0  # first row of the group in the batch (set by the engine each step)
        self.feed = None  # the engine's Feed while the group's next step is read in row chunks (engine.py)

    @property
    def generated(self) -> int:
        """Tokens each row has in ``own`` (equal for all rows)."""
        return self.own[0].used

    def select(self, local: list[int], device) -> None:
        """Keep rows ``local`` (indices into the group's rows, repeats allowed), in that order: a beam reorder."""
        if local != list(range(self.rows)):
            index = torch.tensor(local, device=device)
            for layer in self.own:
                layer.select(index)
        self.rows = len(local)

    def commit(self, tokens: int = 1) -> None:
        """Count the positions every row has written (:meth:`_OwnLayer.write`): the step of all rows is read."""
        for layer in self.own:
            layer.used += tokens

    def nbytes(self) -> int:
        shared = sum(2 * k.numel() * k.element_size() for k, _ in (seg for layer in self.shared for seg in layer))
        return shared + sum(layer.nbytes() for layer in self.own)


class StepContext:
    """What :func:`attention` needs for one decode forward: the padded rows first, then the wide requests' rows.

    Args:
        narrow: per layer, the padded rows' cache layer (``GrowingLayer``), or ``None`` when there are none.
        narrow_mask: ``(rows, columns)`` 0/1 mask of the padded rows, the new column included.
        groups: the wide requests' rows, in batch order after the padded rows: a :class:`SharedGroup` (all its rows;
            their keys/values are appended and counted), or ``(group, first, end)``: rows ``first .. end - 1`` of the
            group, written at its next position without counting it (the engine calls :meth:`SharedGroup.commit` once
            every row of the step was read: a wide request's step may span several forwards, ``wide_step_rows``).
    """

    __slots__ = ("narrow", "narrow_rows", "narrow_mask4d", "groups")

    def __init__(self, narrow: list[GrowingLayer] | None, narrow_mask: torch.Tensor | None,
                 groups: list[SharedGroup | tuple[SharedGroup, int, int]]):
        self.narrow = narrow
        self.narrow_rows = 0 if narrow_mask is None else narrow_mask.shape[0]
        self.narrow_mask4d = None if narrow_mask is None else narrow_mask.bool()[:, None, None, :]
        self.groups = groups


def shared_attention(query: torch.Tensor, segments: list[tuple[torch.Tensor, torch.Tensor]], own_k: torch.Tensor,
                     own_v: torch.Tensor, scaling: float) -> torch.Tensor:
    """Attention of ``w`` one-token queries over shared prompt segments plus each row's own keys/values.

    Args:
        query: ``(w, heads, 1, dim)``.
        segments: ``(keys, values)`` of shape ``(1, kv_heads, L_i, dim)``, read by every row.
        own_k, own_v: ``(w, kv_heads, t, dim)``, row ``i`` reads only row ``i``.
        scaling: the score scale (``dim ** -0.5`` for most models).

    Returns ``(w, 1, heads, dim)`` (the layout HF attention functions return). Scores are computed in float32.
    """
    w, heads, _, dim = query.shape
    kv_heads = own_k.shape[1]
    g = heads // kv_heads
    q = query.reshape(w, kv_heads, g, dim).float() * scaling  # (w, kvh, g, d)
    # shared: all rows' query heads against one copy of the prompt, as one product per segment
    qs = q.permute(1, 0, 2, 3).reshape(1, kv_heads, w * g, dim)
    parts = [torch.matmul(qs, k.float().transpose(-1, -2)).reshape(kv_heads, w, g, -1).permute(1, 0, 2, 3)
             for k, _ in segments]
    parts.append(torch.matmul(q, own_k.float().transpose(-1, -2)))  # (w, kvh, g, t)
    probs = torch.softmax(torch.cat(parts, dim=-1), dim=-1)
    out = torch.matmul(probs[..., -own_k.shape[2]:], own_v.float())  # (w, kvh, g, d)
    at = 0
    for k, v in segments:
        n = k.shape[2]
        p = probs[..., at : at + n].permute(1, 0, 2, 3).reshape(1, kv_heads, w * g, n)
        out = out + torch.matmul(p, v.float()).reshape(kv_heads, w, g, dim).permute(1, 0, 2, 3)
        at += n
    return out.reshape(w, heads, dim).to(query.dtype)[:, None]


def attention(module, query, key, value, attention_mask, *, scaling=None, dropout=0.0, cs_step=None, **kwargs):
    """The model's attention: SDPA as usual, or, for a decode step with a :class:`StepContext`, the padded rows
    through SDPA over their cache and each wide group through :func:`shared_attention`. Appends the step's
    keys/values to the caches it reads (the model runs with ``use_cache=False``)."""
    if cs_step is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    ctx: StepContext = cs_step
    layer = module.layer_idx
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    outs = []
    n = ctx.narrow_rows
    if n:
        k, v = ctx.narrow[layer].update(key[:n], value[:n])
        out, _ = sdpa_attention_forward(module, query[:n], k, v, ctx.narrow_mask4d, scaling=scale, dropout=0.0, **kwargs)
        outs.append(out)
    s = n
    for entry in ctx.groups:
        if isinstance(entry, SharedGroup):
            group, e = entry, s + entry.rows
            k, v = group.own[layer].append(key[s:e], value[s:e])
        else:
            group, first, end = entry
            e = s + end - first
            k, v = group.own[layer].write(key[s:e], value[s:e], first, group.rows)
        outs.append(shared_attention(query[s:e], group.shared[layer], k, v, scale))
        s = e
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)), None


def install(model) -> None:
    """Make :func:`attention` the model's attention implementation (it is SDPA unless a step context is passed)."""
    AttentionInterface.register(ATTENTION_NAME, attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    if model.config._attn_implementation not in ("sdpa", ATTENTION_NAME):
        raise ValueError(f"the engine needs an SDPA-capable model, got attention {model.config._attn_implementation!r}")
    model.config._attn_implementation = ATTENTION_NAME
