"""Key/value cache helpers of the transformers engine: a layer that grows in place, and giving memory back.

HF's ``DynamicLayer`` concatenates at every step, copying its whole cache; for a batch that holds a long prompt
that is gigabytes per step. :class:`GrowingLayer` appends into spare room instead.
"""

from __future__ import annotations

import ctypes

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

__all__ = ["GrowingLayer", "cache_of", "release_memory"]


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` that appends into spare room instead of concatenating.

    HF's layer copies its whole cache at every step (``torch.cat``), which for a batch holding a long
    prompt is gigabytes per step. This one keeps ``keys``/``values`` as views of buffers with room to
    grow (an eighth more, at least 64 positions) and reallocates only when they are full or when
    ``keys``/``values`` were replaced from outside (row selection, trimming).
    """

    _kbuf: torch.Tensor | None = None
    _vbuf: torch.Tensor | None = None

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys, values = self.keys, self.values
        used = keys.shape[-2] if keys.numel() else 0
        need = used + key_states.shape[-2]
        buf = self._kbuf
        if (
            buf is None or used == 0 or buf.shape[-2] < need or keys.data_ptr() != buf.data_ptr()
            or values.data_ptr() != self._vbuf.data_ptr() or keys.shape[0] != buf.shape[0]
        ):
            room = need + max(64, need // 8)
            shape = (key_states.shape[0], key_states.shape[1], room, key_states.shape[3])
            self._kbuf, self._vbuf = key_states.new_empty(shape), value_states.new_empty(shape)
            if used:
                self._kbuf[:, :, :used] = keys
                self._vbuf[:, :, :used] = values
        self._kbuf[:, :, used:need] = key_states
        self._vbuf[:, :, used:need] = value_states
        self.keys, self.values = self._kbuf[:, :, :need], self._vbuf[:, :, :need]
        return self.keys, self.values


def cache_of(kv, buffers=None) -> DynamicCache:
    """A cache holding these per-layer ``(keys, values)`` tensors as they are (no copy), growing in place.

    ``buffers``: per layer, the tensors that ``kv`` are leading views of (with room after them).
    """
    cache = DynamicCache(ddp_cache_data=[(k[:, :, :0], v[:, :, :0]) for k, v in kv])
    for i, (layer, (k, v)) in enumerate(zip(cache.layers, kv)):
        layer.__class__ = GrowingLayer
        layer.keys, layer.values = k, v
        if buffers is not None:
            layer._kbuf, layer._vbuf = buffers[i]
    return cache


def release_memory() -> None:
    """Give freed heap pages back to the OS (glibc keeps them after a large prefill otherwise)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
