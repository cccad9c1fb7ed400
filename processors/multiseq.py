"""Multi-sequence guard: a finished row may only emit EOS.

Rows of a batch (``n > 1``, beams, mixed requests) finish at different steps; the others keep
decoding. A finished row is pinned to EOS so nothing appears after its end.
"""

from __future__ import annotations

from typing import Iterable

from .base import Cursor, CursorLogitsProcessor, as_ids
from .masks import ALLOW, FREE, Step

__all__ = ["MultiSeqCursor", "MultiSeqLogitsProcessor"]


class MultiSeqCursor(Cursor):
    """Free until the row emits one of its EOS tokens, then only EOS."""

    def __init__(self, eos_token_ids: Iterable[int]):
        self.eos_ids = frozenset(int(t) for t in eos_token_ids)
        if not self.eos_ids:
            raise ValueError("eos_token_ids must name at least one token")
        self._end_token_id = min(self.eos_ids)
        self.error = None
        self.done = False
        self._free = Step(FREE, None, self.end_token_id)
        self._end = Step(ALLOW, as_ids([self.end_token_id]), self.end_token_id)

    @property
    def end_token_id(self) -> int:
        return self._end_token_id

    @property
    def finished(self) -> bool:
        return self.done

    def step(self) -> Step:
        return self._end if self.done else self._free

    def advance(self, token: int) -> None:
        if token in self.eos_ids:
            self.done = True

    def copy(self) -> "MultiSeqCursor":
        new = MultiSeqCursor.__new__(MultiSeqCursor)
        new.__dict__.update(self.__dict__)
        return new


class MultiSeqLogitsProcessor(CursorLogitsProcessor):
    """Pin finished rows to EOS.

    Args:
        eos_token_ids: the tokens that end a row.
        prompt_len: prompt length; ``None`` means the length at the first call.

    Example::

        proc = MultiSeqLogitsProcessor([tokenizer.eos_token_id])
        model.generate(ids, num_return_sequences=4, logits_processor=LogitsProcessorList([proc]))
    """

    def __init__(self, eos_token_ids: Iterable[int], prompt_len: int | None = None):
        eos = list(eos_token_ids)
        MultiSeqCursor(eos)  # validate now, not at the first step
        super().__init__(lambda: MultiSeqCursor(eos), prompt_len=prompt_len)
