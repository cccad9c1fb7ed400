"""The processor chain: think mode, the row's constraint, and the finished-row guard, per row.

Each row of a batch carries its own :class:`CompiledScenario` (or ``None``: unconstrained), so one
forward pass can serve requests of different scenarios. Per row and step the chain decides, in
this order:

1. finished (the row emitted its end token or an EOS): only the end token;
2. thinking: the think cursor decides (free text with the stop tokens banned, or the forced end
   marker); the constraint is gated off and its state does not advance;
3. a constraint: its allowed set (tree candidates, label trie, grammar bitmask);
4. no constraint: free, except that a finished think block cannot be reopened.

A row never ends up with nothing allowed: an empty set falls back to the row's end token.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from . import registry
from .base import Cursor, CursorLogitsProcessor, as_ids
from .compile import CompiledScenario
from .items import item_rules, min_item_tokens
from .masks import ALLOW, BAN, FREE, Step, apply_steps, check_scores, mask_padded_vocab
from .lanes import advance_rows, lane_code, mask_rows
from .think import ThinkCursor
from .tokenizer_info import TokenizerInfo

__all__ = ["ConstrainedLogitsProcessor", "RowCursor", "constraint_cursor"]


def constraint_cursor(constraint, tokenizer=None) -> Cursor:
    """A fresh cursor for a compiled constraint, made by its kind (:func:`processors.registry.kind_of`).

    ``tokenizer``: a tokenizer or its :class:`TokenizerInfo`; needed by kinds whose cursor is a grammar matcher.
    """
    info = TokenizerInfo.of(tokenizer) if tokenizer is not None else None
    return registry.kind_of(constraint).cursor(constraint, info)


def bind_item_controls(row: "RowCursor", bind, max_new_tokens: int | None, items) -> None:
    """Give a tree or label row its token budget, its request's item controls and the multi-item rules; with think
    mode, thinking is cut short so that the end marker and one item still fit in the budget."""
    compiled = row.compiled
    assert compiled is not None
    bind(budget=max_new_tokens, request=items, rules=item_rules(compiled))
    row._budgeted = max_new_tokens is not None
    if row.think is not None and compiled.think is not None and max_new_tokens is not None:
        room = max_new_tokens - len(compiled.think.end_ids) - min_item_tokens(compiled.constraint)
        row.think.limit = max(0, min(row.think.limit, room))


class RowCursor(Cursor):
    """One row of the chain: think cursor + constraint cursor + finished flag.

    Args:
        compiled: the row's scenario, or ``None`` for free text.
        tokenizer: a tokenizer or its :class:`TokenizerInfo` (grammar kinds need it for their matcher).
        eos_token_ids: the stop tokens of a free-text row.
    """

    def __init__(self, compiled: CompiledScenario | None, tokenizer=None, *, eos_token_ids: Sequence[int] = (),
                 max_new_tokens: int | None = None, items=None):
        self.compiled = compiled
        if compiled is not None:
            self.stop_ids = frozenset(compiled.stop_token_ids)
            self._end_token_id = compiled.end_token_id
            self.constraint = constraint_cursor(compiled.constraint, tokenizer) if compiled.constraint is not None else None
            self.think = ThinkCursor(compiled.think, compiled.stop_token_ids) if compiled.think is not None else None
        else:
            if not eos_token_ids:
                raise ValueError("an unconstrained row needs eos_token_ids")
            self.stop_ids = frozenset(int(t) for t in eos_token_ids)
            self._end_token_id = int(eos_token_ids[0])
            self.constraint = None
            self.think = None
        self.done = False
        self.generated = 0
        # item controls (processors.items): tree and label rows get the token budget, the request's
        # exclude/distinct book and the scenario's multi-item rules
        self._budgeted = False
        bind = getattr(self.constraint, "bind", None)
        if bind is not None and (max_new_tokens is not None or items is not None):
            bind_item_controls(self, bind, max_new_tokens, items)
        self._end = Step(ALLOW, as_ids([self.end_token_id]), self.end_token_id)
        self._free = Step(FREE, None, self.end_token_id)
        self._lane_code = lane_code(self)  # whether this row takes the vector lane (processors.lanes)

    @property
    def end_token_id(self) -> int:
        return self._end_token_id

    @property
    def finished(self) -> bool:
        return self.done

    @property
    def thinking(self) -> bool:
        return self.think is not None and not self.think.in_answer

    @property
    def error(self) -> str | None:  # type: ignore[override]
        for part in (self.think, self.constraint):
            if part is not None and part.error:
                return part.error
        return None

    @property
    def fell_back(self) -> bool:
        return bool(getattr(self.constraint, "fell_back", False))

    @property
    def mask_due(self) -> bool:
        """The next :meth:`step` computes the constraint's mask (a grammar's: :mod:`processors.mask_budget`)."""
        return (not self.done and (self.think is None or self.think.in_answer)
                and bool(getattr(self.constraint, "mask_due", False)))

    def expire(self, message: str) -> None:
        """End the row with ``message`` (its constraint's mask work was late): only its end token from now on."""
        expire = getattr(self.constraint, "expire", None)
        if expire is not None:
            expire(message)

    def prime(self) -> None:
        """Compute the constraint's first allowed set now (it is kept until the row advances).

        A grammar's first mask can take a second; the engine primes new rows off its decode thread.
        """
        prime = getattr(self.constraint, "prime", None)
        if prime is not None:
            prime()

    def step(self) -> Step:
        if self.done:
            return self._end
        think = self.think
        if think is not None and not think.in_answer:
            return think.step()
        if self.constraint is not None:
            return self.constraint.step()
        if think is not None:
            return think.step()  # answering without a constraint: only the re-entry ban
        return self._free

    def advance(self, token: int) -> None:
        if self.done:
            return
        self.generated += 1
        think = self.think
        if think is not None and not think.in_answer:
            think.advance(token)
            if self._budgeted:
                self.constraint.spend()  # type: ignore[union-attr]
            if token in self.stop_ids:  # banned while thinking; emitted anyway, it still ends the row
                self.done = True
            return
        if self.constraint is not None:
            self.constraint.advance(token)
            if self.constraint.finished:
                self.done = True
                return
        elif think is not None:
            think.advance(token)  # answering without a constraint: the re-entry ban
        if token in self.stop_ids:
            self.done = True

    def allows(self, token: int) -> bool:
        """Whether :meth:`step` allows ``token`` now (used to re-check a distinct row's sampled token)."""
        step = self.step()
        if step.kind == FREE:
            return True
        payload = step.payload
        if step.kind == ALLOW:
            return bool(np.any(payload == token)) if payload is not None and len(payload) else token == step.fallback
        if step.kind == BAN:
            return not bool(np.any(payload == token))
        return True

    def copy(self) -> "RowCursor":
        new = RowCursor.__new__(RowCursor)
        new.__dict__.update(self.__dict__)
        if self.constraint is not None:
            new.constraint = self.constraint.copy()
        if self.think is not None:
            new.think = self.think.copy()
        return new


class ConstrainedLogitsProcessor(CursorLogitsProcessor):
    """The whole chain (think mode, constraint, multi-sequence) as one HF ``LogitsProcessor``.

    Args:
        compiled_or_list_per_row: one :class:`CompiledScenario` for every row, or a list with one
            entry per input row (``None`` for an unconstrained row). Rows that ``generate``
            expands for ``num_return_sequences``/``num_beams`` inherit their input row's entry.
        tokenizer: a tokenizer or its :class:`TokenizerInfo`; needed for json/json_schema/regex scenarios
            (llguidance matchers), and it gives the vocabulary size and the EOS of free rows.
        prompt_len: length of the (left-padded) prompt; ``None``: the length at the first call.
        eos_token_ids: EOS ids for unconstrained rows (default: taken from the compiled scenarios,
            else ``tokenizer.eos_token_id``).

    Pass :attr:`stop_token_ids` as ``eos_token_id`` to ``generate`` so that a tree whose end token
    is not the model's EOS also stops its rows.

    Example::

        compiled = compile_scenario(load_scenario({"type": "labels", "labels": ["yes", "no"]}), tok)
        ids = build_prompt_ids(compiled, tok, messages=[{"role": "user", "content": "Is it?"}])
        proc = ConstrainedLogitsProcessor(compiled, tokenizer=tok)
        out = model.generate(torch.tensor([ids]), logits_processor=LogitsProcessorList([proc]),
                             eos_token_id=list(proc.stop_token_ids), do_sample=True)
    """

    def __init__(
        self,
        compiled_or_list_per_row: CompiledScenario | Sequence[CompiledScenario | None],
        *,
        tokenizer=None,
        prompt_len: int | None = None,
        eos_token_ids: Sequence[int] | None = None,
        vectorized: bool = False,
    ):
        #: tree and single-label rows masked and advanced together with array operations (processors.lanes);
        #: False (the default while the lane is slower than the per-row path, see bench/mask_overhead.py):
        #: every row through its own cursor
        self.vectorized = vectorized
        if isinstance(compiled_or_list_per_row, CompiledScenario):
            per_row: list[CompiledScenario | None] = [compiled_or_list_per_row]
        else:
            per_row = list(compiled_or_list_per_row)
            if not per_row:
                raise ValueError("compiled_or_list_per_row must not be empty")
        info = TokenizerInfo.of(tokenizer) if tokenizer is not None else None
        for i, c in enumerate(per_row):
            if c is not None and not isinstance(c, CompiledScenario):
                raise TypeError(f"row {i}: expected CompiledScenario or None, got {type(c).__name__}")
            if c is not None and info is not None and c.vocab_size != info.vocab_size:
                raise ValueError(
                    f"row {i}: scenario compiled for a vocabulary of {c.vocab_size}, tokenizer has {info.vocab_size}"
                )
        if eos_token_ids is None:
            first = next((c for c in per_row if c is not None), None)
            if first is not None:
                eos_token_ids = first.eos_token_ids
            elif info is not None and info.eos_token_ids:
                eos_token_ids = info.eos_token_ids[:1]
            else:
                raise ValueError("eos_token_ids is required when no row has a scenario and no tokenizer is given")
        eos = tuple(int(t) for t in eos_token_ids)
        self.scenarios = per_row
        self.eos_token_ids = eos
        sizes = {c.vocab_size for c in per_row if c is not None}
        #: ids at or above this exist only in padded logits (e.g. Qwen: 151,936 logits, ~151,665 tokens)
        self.vocab_size = info.vocab_size if info is not None else (max(sizes) if sizes else None)
        factories = [(lambda c=c: RowCursor(c, info, eos_token_ids=eos)) for c in per_row]
        super().__init__(factories, prompt_len=prompt_len)

    def sync(self, input_ids):
        """:meth:`CursorLogitsProcessor.sync`, advancing the rows of the vector lane together when the new ids
        are the previous ones plus one column (every other case: the base class)."""
        prev = self._prev
        if (
            self.vectorized and self.cursors is not None and prev is not None and input_ids.dim() == 2
            and prev.shape[0] == input_ids.shape[0] and prev.shape[1] + 1 == input_ids.shape[1]
            and torch.equal(input_ids[:, :-1], prev)
        ):
            advance_rows(self.cursors, input_ids[:, -1].tolist(), strict=True)
            self._prev = input_ids.detach().clone()
            return self.cursors
        return super().sync(input_ids)

    def __call__(self, input_ids, scores):
        cursors = self.sync(input_ids)
        if self.vectorized:
            check_scores(scores, len(cursors))
            mask_rows(scores, cursors, strict=True)
        else:
            apply_steps(scores, [c.step() for c in cursors])
        mask_padded_vocab(scores, self.vocab_size)
        return scores

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Every token that ends some row: the model's EOS and each scenario's end token."""
        ids = list(self.eos_token_ids)
        for c in self.scenarios:
            if c is not None:
                ids.extend(t for t in c.stop_token_ids if t not in ids)
        return tuple(ids)

    @property
    def fallback_rows(self) -> list[int]:
        """Rows that fell back to the end token because their tree had no entry for their state."""
        return [i for i, c in enumerate(self.cursors or []) if c.fell_back]
