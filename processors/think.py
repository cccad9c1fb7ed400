"""Think mode: a budgeted thinking block, then a forced end marker.

The answer starts inside the think block (the begin marker ends the prompt). While thinking, text
is free except that the row may not end (its stop tokens are banned), so an answer always follows.
Thinking cannot nest: while thinking, the first token of the begin marker is banned too (as in
RTP-LLM's think processor; not when it is also the end marker's first token, which must stay open).
Thinking ends when the budget of ``max_thinking_tokens`` is spent, or as soon as the model emits
the first token of the end marker; from then on the rest of the marker is forced one token per
step. After the marker the row is in its answer: the first token of the begin and the end marker
are banned there, so thinking cannot restart (a constraint, when the chain has one, takes over
instead).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from .base import Cursor, CursorLogitsProcessor, as_ids
from .masks import ALLOW, BAN, Step
from .tables import content_hash

__all__ = ["ThinkCursor", "ThinkModeLogitsProcessor", "ThinkSpec", "compile_think"]

THINKING, FORCING, ANSWER, FAILED = 0, 1, 2, 3  # FAILED: an invalid token was seen; only the end token now


@dataclass(frozen=True)
class ThinkSpec:
    """Compiled think settings.

    Args:
        max_thinking_tokens: the most tokens the row may think before the end marker.
        begin_ids, end_ids: the markers as token ids (continuations, round-trip checked).
        begin, end: the marker texts.
    """

    max_thinking_tokens: int
    begin_ids: tuple[int, ...]
    end_ids: tuple[int, ...]
    begin: str = "<think>\n"
    end: str = "</think>\n\n"
    version: str = field(init=False)

    def __post_init__(self) -> None:
        if self.max_thinking_tokens < 0:
            raise ValueError(f"max_thinking_tokens must be >= 0, got {self.max_thinking_tokens}")
        if not self.begin_ids or not self.end_ids:
            raise ValueError("think markers must tokenize to at least one token")
        object.__setattr__(
            self, "version", content_hash("think", self.max_thinking_tokens, self.begin_ids, self.end_ids)
        )


def compile_think(max_thinking_tokens: int, begin: str, end: str, tokenizer) -> ThinkSpec:
    """Tokenize the markers (refusing markers that do not survive a round trip); ``tokenizer``: a tokenizer or
    its :class:`~processors.tokenizer_info.TokenizerInfo`."""
    from .labels import tokenize_continuation

    return ThinkSpec(
        max_thinking_tokens=int(max_thinking_tokens),
        begin_ids=tuple(tokenize_continuation(tokenizer, begin, what="think begin marker")),
        end_ids=tuple(tokenize_continuation(tokenizer, end, what="think end marker")),
        begin=begin,
        end=end,
    )


class ThinkCursor(Cursor):
    """Per-row think state: thinking (counting), forcing the end marker, or answering."""

    def __init__(self, spec: ThinkSpec, stop_token_ids: Iterable[int]):
        self.spec = spec
        self.phase = THINKING
        self.pos = 0
        self.thought = 0
        self.error = None
        self.stop_ids = as_ids(sorted(set(stop_token_ids)))
        # thinking: the stop tokens and the begin marker's first token (no nested think block)
        nested = {spec.begin_ids[0]} - {spec.end_ids[0]}
        self._think_ban = as_ids(sorted(set(self.stop_ids.tolist()) | nested))
        #: most thinking tokens; a caller may lower it (a token budget that must leave room for the answer)
        self.limit = spec.max_thinking_tokens
        self._answer_ban = as_ids(sorted({spec.begin_ids[0], spec.end_ids[0]}))

    @property
    def end_token_id(self) -> int:
        return int(self.stop_ids[0]) if self.stop_ids.size else self.spec.end_ids[-1]

    @property
    def finished(self) -> bool:
        return False

    @property
    def in_answer(self) -> bool:
        return self.phase == ANSWER

    def step(self) -> Step:
        fb = self.end_token_id
        if self.phase == FAILED:
            return Step(ALLOW, as_ids([fb]), fb)
        if self.phase == THINKING:
            if self.thought >= self.limit:
                return Step(ALLOW, as_ids([self.spec.end_ids[0]]), self.spec.end_ids[0])
            return Step(BAN, self._think_ban, fb)
        if self.phase == FORCING:
            tok = self.spec.end_ids[self.pos]
            return Step(ALLOW, as_ids([tok]), tok)
        return Step(BAN, self._answer_ban, fb)

    def advance(self, token: int) -> None:
        spec = self.spec
        if self.phase == THINKING:
            if token in self.stop_ids:
                self._fail(f"stop token {token} emitted while thinking (stop tokens are banned until the end marker)")
            elif token == spec.end_ids[0]:
                self.pos = 1
                self.phase = ANSWER if len(spec.end_ids) == 1 else FORCING
            elif token in self._think_ban:
                self._fail(f"token {token} would open a think block inside the think block")
            elif self.thought >= self.limit:
                self._fail(f"token {token} emitted where the end marker token {spec.end_ids[0]} was forced "
                           "(thinking budget spent)")
            else:
                self.thought += 1
        elif self.phase == FORCING:
            if token != spec.end_ids[self.pos]:
                self._fail(f"token {token} emitted where the end marker token {spec.end_ids[self.pos]} was forced")
                return
            self.pos += 1
            if self.pos == len(spec.end_ids):
                self.phase = ANSWER
        elif self.phase == ANSWER and token in self._answer_ban:
            self._fail(f"token {token} would reopen the think block after it ended")

    def _fail(self, message: str) -> None:
        """An invalid token: record it; from now on only the end token is allowed."""
        if self.error is None:
            self.error = message
        self.phase = FAILED

    def copy(self) -> "ThinkCursor":
        new = ThinkCursor.__new__(ThinkCursor)
        new.__dict__.update(self.__dict__)
        return new


class ThinkModeLogitsProcessor(CursorLogitsProcessor):
    """Budgeted thinking for every row (without a constraint after it; the chain adds one).

    Args:
        spec: from :func:`compile_think`.
        stop_token_ids: tokens that would end the row (the model's EOS); banned while thinking.
        prompt_len: prompt length; ``None`` means the length at the first call.

    Example::

        spec = compile_think(64, "<think>\\n", "</think>\\n\\n", tokenizer)
        proc = ThinkModeLogitsProcessor(spec, stop_token_ids=[tokenizer.eos_token_id])
        model.generate(ids_ending_with_begin_marker, logits_processor=LogitsProcessorList([proc]))
    """

    def __init__(self, spec: ThinkSpec, stop_token_ids: Iterable[int], prompt_len: int | None = None):
        stops = list(stop_token_ids)
        if not stops:
            raise ValueError("stop_token_ids must name at least one token")
        super().__init__(lambda: ThinkCursor(spec, stops), prompt_len=prompt_len)
