"""The contract every constraint implements, and the batch driver that runs them under HF ``generate``.

A constraint has three layers (spec -> compiled table -> per-row cursor). This module defines the
cursor contract (:class:`Cursor`) and :class:`CursorLogitsProcessor`, the HuggingFace
``LogitsProcessor`` that keeps one cursor per row and turns their answers into one masked
``scores`` tensor per step.

Row tracking. ``generate`` calls a processor with the whole ``input_ids`` every step. The driver
keeps the previous step's ids; when the new ids are the old ones plus one column, each cursor
advances by that column. When rows were reordered (beam search keeps the best beams and drops
others), each new row is matched to the previous row whose ids it extends and gets a copy of that
row's cursor, so state always follows a row's actual tokens. Anything else (a new generation, a
different batch) restarts the cursors and replays the generated tokens.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Sequence

import numpy as np
import torch

from .masks import Step, apply_steps

__all__ = ["LANE_BUDGET", "LANE_FILTER", "LANE_OFF", "LANE_PLAIN", "Cursor", "CursorLogitsProcessor", "expand_per_row"]

# the vector lane a row takes (:mod:`processors.lanes`, :meth:`Cursor.vector_lane`): its own step and advance, the
# lane, the lane with a token budget, the lane under a request's filter (and maybe a budget)
LANE_OFF, LANE_PLAIN, LANE_BUDGET, LANE_FILTER = 0, 1, 2, 3


class Cursor(ABC):
    """Per-row state of one constraint. Cheap to create and to copy; never raises on model output.

    A token the constraint did not allow (another processor interfered, or beam search kept a
    ``-inf`` continuation) puts the cursor into a fallback that allows only its end token, and
    records a readable :attr:`error`.
    """

    @property
    def end_token_id(self) -> int:
        """The token that ends this row; always allowed when nothing else is."""
        raise NotImplementedError

    @property
    def fell_back(self) -> bool:
        """True when a table had no entry for the row's state and it fell back to its end token (not an error)."""
        return False

    #: description of the first invalid token seen, or ``None``
    error: str | None = None

    @abstractmethod
    def step(self) -> Step:
        """What this row may emit now."""

    @abstractmethod
    def advance(self, token: int) -> None:
        """Consume the token the row actually emitted."""

    @property
    @abstractmethod
    def finished(self) -> bool:
        """True once the row emitted its end token (its state no longer changes)."""

    @abstractmethod
    def copy(self) -> "Cursor":
        """An independent cursor in the same state (used when beams are duplicated)."""

    # -- capabilities the engines ask for (safe defaults: none) ----------------------------------------------
    def vector_lane(self) -> int:
        """The vector lane (:mod:`processors.lanes`) this bound cursor's row takes, asked once when its row is built:
        :data:`LANE_OFF` (its own :meth:`step` and :meth:`advance`), :data:`LANE_PLAIN`, :data:`LANE_BUDGET`
        (with a token budget) or :data:`LANE_FILTER` (a request's filter, ``request.base``, and maybe a budget). A
        cursor in a lane walks a :class:`~processors.tables.MaskTables` and exposes what the lane reads and writes:
        ``tables``, ``state``, ``remaining``, ``path``, ``last_edge`` (and ``request`` in the filter lane)."""
        return LANE_OFF

    def item_position(self) -> object | None:
        """Where the row stands among its items, for the rows of a ``distinct`` request that draw their tokens in
        turn: rows at equal positions choose among the same items; ``None``: it may meet any of them (every row of
        the request draws in turn)."""
        return None

    def release_item(self) -> None:
        """Give back the item this row of a ``distinct`` request occupies (the row is dropped before it ends); its
        finished items stay taken. Nothing for a cursor without items."""
        return None


def expand_per_row(items: Sequence, n_rows: int, what: str = "entries") -> list:
    """Expand one entry per input row to ``n_rows`` rows.

    ``generate`` with ``num_return_sequences=k`` or ``num_beams=k`` repeats each input row ``k``
    times consecutively (``repeat_interleave``), so ``[a, b]`` becomes ``[a]*k + [b]*k``.
    """
    n = len(items)
    if n == n_rows:
        return list(items)
    if n == 0 or n_rows % n:
        raise ValueError(
            f"got {n} {what} for a batch of {n_rows} rows; give one per input row "
            f"(rows expanded by num_return_sequences/num_beams are handled) or one for all"
        )
    k = n_rows // n
    return [item for item in items for _ in range(k)]


class CursorLogitsProcessor:
    """A HuggingFace ``LogitsProcessor`` driving one :class:`Cursor` per row.

    Args:
        factories: one callable per input row that returns a fresh cursor for it (or one callable
            for every row). Rows expanded by ``num_return_sequences``/``num_beams`` share their
            input row's factory.
        prompt_len: length of the (padded) prompt. ``None``: the sequence length at the first call.
    """

    def __init__(self, factories: Callable[[], Cursor] | Sequence[Callable[[], Cursor]], prompt_len: int | None = None):
        if callable(factories):
            factories = [factories]
        factories = list(factories)
        if not factories:
            raise ValueError("factories must not be empty")
        if prompt_len is not None and prompt_len < 0:
            raise ValueError(f"prompt_len must be >= 0, got {prompt_len}")
        self._factories = factories
        self.prompt_len = prompt_len
        self.cursors: list[Cursor] | None = None
        self._prev: torch.Tensor | None = None
        self._start = 0

    # -- row tracking -------------------------------------------------------------------------
    def _restart(self, input_ids: torch.Tensor) -> None:
        n_rows, length = input_ids.shape
        start = self.prompt_len if self.prompt_len is not None else length
        if start > length:
            raise ValueError(f"prompt_len {start} is longer than input_ids ({length} tokens)")
        rows = expand_per_row(self._factories, n_rows, what="row specs")
        self.cursors = [make() for make in rows]
        self._start = start
        if length > start:
            for cursor, tokens in zip(self.cursors, input_ids[:, start:].tolist()):
                for token in tokens:
                    cursor.advance(token)

    def _reorder(self, input_ids: torch.Tensor) -> bool:
        """Match each row to the previous row it extends; False when some row matches none."""
        prev = self._prev
        assert prev is not None and self.cursors is not None
        cur = input_ids[:, :-1]
        eq = (cur[:, None, :] == prev[None, :, :]).all(dim=-1)
        if not bool(eq.any(dim=1).all()):
            return False
        src = eq.to(torch.int8).argmax(dim=1).tolist()
        old = self.cursors
        used: set[int] = set()
        new = []
        for s in src:
            new.append(old[s].copy() if s in used else old[s])
            used.add(s)
        self.cursors = new
        return True

    def sync(self, input_ids: torch.Tensor) -> list[Cursor]:
        """Bring the cursors up to date with ``input_ids`` and return them (one per row)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be 2-D (batch, seq), got shape {tuple(input_ids.shape)}")
        prev = self._prev
        if (
            self.cursors is None
            or prev is None
            or prev.shape[0] != input_ids.shape[0]
            or prev.shape[1] + 1 != input_ids.shape[1]
        ):
            self._restart(input_ids)
        else:
            same = torch.equal(input_ids[:, :-1], prev)
            if same or self._reorder(input_ids):
                for cursor, token in zip(self.cursors, input_ids[:, -1].tolist()):
                    cursor.advance(token)
            else:
                self._restart(input_ids)
        self._prev = input_ids.detach().clone()
        assert self.cursors is not None
        return self.cursors

    def reset(self) -> None:
        """Forget all rows; the next call starts afresh."""
        self.cursors = None
        self._prev = None

    # -- HF entry point -------------------------------------------------------------------------
    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        cursors = self.sync(input_ids)
        return apply_steps(scores, [c.step() for c in cursors])

    @property
    def errors(self) -> list[str | None]:
        """Per row, the first invalid token seen (``None`` where all was well)."""
        return [c.error for c in self.cursors or []]


def as_ids(values) -> np.ndarray:
    """A read-only int64 id array (for constant step payloads)."""
    arr = np.asarray(list(values), dtype=np.int64)
    arr.setflags(write=False)
    return arr
