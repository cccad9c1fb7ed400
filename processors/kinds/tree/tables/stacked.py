"""A read-only array that is two arrays one after the other, without a copy: each array of an overlay version of
tables (:mod:`processors.kinds.tree.tables.overlay`) is its base's followed by the appended part."""

from __future__ import annotations

import numpy as np
from numpy.lib.mixins import NDArrayOperatorsMixin

__all__ = ["Stacked"]


class Stacked(NDArrayOperatorsMixin):
    """A read-only 1-d array that is ``head`` followed by ``tail``, without a copy of either.

    Indexing by an integer, by a slice inside one part, or by an integer array (``a[idx]``, ``take``, also with
    ``mode="clip"``) reads the parts directly; anything else (a numpy function, an operator, a method such as
    ``astype``) works on the concatenation, made at the first such use and kept. Pickled as its two parts."""

    __slots__ = ("head", "tail", "_n", "_whole")
    ndim = 1
    _whole: np.ndarray | None

    def __init__(self, head: np.ndarray, tail: np.ndarray):
        if tail.dtype != head.dtype:
            tail = tail.astype(head.dtype)
        tail.setflags(write=False)
        self.head, self.tail, self._n, self._whole = head, tail, int(head.size), None

    def __reduce__(self):
        return Stacked, (self.head, self.tail)

    @property
    def size(self) -> int:
        return self._n + int(self.tail.size)

    @property
    def shape(self) -> tuple[int]:
        return (self.size,)

    @property
    def dtype(self):
        return self.head.dtype

    @property
    def nbytes(self) -> int:
        return int(self.head.nbytes + self.tail.nbytes)

    def __len__(self) -> int:
        return self.size

    def whole(self) -> np.ndarray:
        """The concatenation (made once, read-only)."""
        whole = self._whole
        if whole is None:
            whole = np.concatenate((self.head, self.tail))
            whole.setflags(write=False)
            self._whole = whole
        return whole

    def __array__(self, dtype=None, copy=None):
        whole = self.whole()
        return whole if dtype is None else whole.astype(dtype, copy=False)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        inputs = tuple(x.whole() if isinstance(x, Stacked) else x for x in inputs)
        return getattr(ufunc, method)(*inputs, **kwargs)

    def __getattr__(self, name: str):  # astype, tolist, sum, ...: the concatenation's
        if name.startswith("_") or name in ("head", "tail"):
            raise AttributeError(name)
        return getattr(self.whole(), name)

    def max(self, *args, **kwargs):
        parts = [p.max() for p in (self.head, self.tail) if p.size]
        return max(parts) if parts and not args and not kwargs else self.whole().max(*args, **kwargs)

    def min(self, *args, **kwargs):
        parts = [p.min() for p in (self.head, self.tail) if p.size]
        return min(parts) if parts and not args and not kwargs else self.whole().min(*args, **kwargs)

    def __getitem__(self, key):
        n = self._n
        if isinstance(key, (int, np.integer)):
            k = int(key)
            if k < 0:
                k += self.size
            if k < n:
                return self.head[k]
            return self.tail[k - n]
        if isinstance(key, slice):
            start, stop, step = key.indices(self.size)
            if step == 1:
                if stop <= n:
                    return self.head[start:stop]
                if start >= n:
                    return self.tail[start - n:stop - n]
            return self.whole()[key]
        idx = np.asarray(key)
        if idx.dtype == bool or idx.dtype.kind not in "iu":
            return self.whole()[key]
        return self.take(idx)

    def take(self, indices, mode: str = "raise") -> np.ndarray:
        idx = np.asarray(indices, dtype=np.int64)
        size, n = self.size, self._n
        if mode == "clip":
            idx = np.clip(idx, 0, size - 1)
        elif idx.size:
            if int(idx.min()) < -size or int(idx.max()) >= size:
                raise IndexError(f"index out of bounds for a stacked array of size {size}")
            idx = np.where(idx < 0, idx + size, idx)
        if not self.tail.size:
            return self.head.take(idx)
        if not n:
            return self.tail.take(idx)
        in_head = idx < n
        return np.where(in_head, self.head.take(np.minimum(idx, n - 1)), self.tail.take(np.maximum(idx - n, 0)))
