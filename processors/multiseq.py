"""Multi-sequence guard: a finished row may only emit EOS.

Rows of a batch (``n > 1``, beams, mixed requests) finish at different steps; the others keep
decoding. A finished row is pinned to EOS so nothing appears after its end. Each row is an
unconstrained :class:`processors.chain.RowCursor` (free until one of its EOS tokens, then only the lowest).
"""

from __future__ import annotations

from typing import Iterable

from .base import CursorLogitsProcessor
from .chain import RowCursor

__all__ = ["MultiSeqLogitsProcessor"]


class MultiSeqLogitsProcessor(CursorLogitsProcessor):
    """Pin finished rows to EOS (the lowest of ``eos_token_ids``).

    Args:
        eos_token_ids: the tokens that end a row.
        prompt_len: prompt length; ``None`` means the length at the first call.

    Example::

        proc = MultiSeqLogitsProcessor([tokenizer.eos_token_id])
        model.generate(ids, num_return_sequences=4, logits_processor=LogitsProcessorList([proc]))
    """

    def __init__(self, eos_token_ids: Iterable[int], prompt_len: int | None = None):
        eos = sorted({int(t) for t in eos_token_ids})  # a finished row emits the lowest
        RowCursor(None, eos_token_ids=eos)  # validate now, not at the first step
        super().__init__(lambda: RowCursor(None, eos_token_ids=eos), prompt_len=prompt_len)
