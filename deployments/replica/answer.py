"""How a replica shapes an answer for its client: the answer form, the thinking/answer split, stop strings.

Three small pieces :mod:`deployments.replica` applies around the engine, none of which changes what is decoded
under a constraint:

* :func:`answer_form` picks the tokenization of the answer that fits what precedes it, for a kind with two forms
  (:meth:`processors.kinds.base.ConstraintKind.answer_form`: a label set's): the bare form (``Sports``) after a
  chat template's assistant header, after a think end marker ending in whitespace or after raw text ending in
  whitespace; the spaced form (`` Sports``) after other raw text. Both forms are compiled with the scenario.
* :func:`split_thinking` splits a think scenario's output into the thinking text and the answer after the end
  marker (``reasoning_content`` / ``content`` on the OpenAI routes).
* :class:`TextWatch` follows one output's text as tokens arrive: what may be streamed now (holding back a tail
  that may still become a stop string or the end marker) and where the first stop string ends it; fed the pieces
  of :class:`IncrementalDecoder`, which decodes only each new token (with the previous piece's tokens as
  context), so a long output is never decoded again from its start.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["IncrementalDecoder", "TextWatch", "answer_form", "form_for_tokens", "split_thinking", "unsure_tail"]


def answer_form(compiled: Any, *, chat: bool, prompt: str | None) -> Any:
    """``compiled`` with the answer form that fits the prompt (itself when the kind has one form only)."""
    kind = compiled.constraint_kind if compiled is not None and compiled.constraint is not None else None
    if kind is None:
        return compiled
    if compiled.think is not None:
        bare = compiled.think.end[-1:].isspace()
    else:
        bare = chat or (prompt or "")[-1:].isspace()
    return _with_form(compiled, kind, bare)


def form_for_tokens(compiled: Any, token_ids: list[int]) -> Any:
    """``compiled`` with the answer form that produced ``token_ids`` (an output replayed without its prompt, as the
    web console's playground does): a think scenario's form follows its end marker; otherwise the kind tells by the
    first token (:meth:`~processors.kinds.base.ConstraintKind.bare_output`)."""
    kind = compiled.constraint_kind if compiled is not None and compiled.constraint is not None else None
    if kind is None:
        return compiled
    if compiled.think is not None:
        bare = compiled.think.end[-1:].isspace()
    else:
        bare = kind.bare_output(compiled.constraint, int(token_ids[0]) if token_ids else None)
    return _with_form(compiled, kind, bare)


def _with_form(compiled: Any, kind: Any, bare: bool) -> Any:
    constraint = compiled.constraint
    chosen = kind.answer_form(constraint, bare)
    return compiled if chosen is constraint else dataclasses.replace(compiled, constraint=chosen)


def unsure_tail(text: str, markers: list[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of one of ``markers`` (may still become it)."""
    longest = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:k]):
                longest = k
                break
    return longest


def split_thinking(text: str, end: str, *, final: bool = True) -> tuple[str, str]:
    """(thinking, answer) of a think output: the text before the end marker, and after it with its leading
    whitespace removed. Without the marker (the row ended while thinking) everything is thinking; with
    ``final=False`` (a stream in progress) a tail that may still become the marker is held back."""
    pos = text.find(end)
    if pos >= 0:
        return text[:pos], text[pos + len(end):].lstrip()
    if final:
        return text, ""
    held = unsure_tail(text, [end])
    return text[: len(text) - held], ""


class IncrementalDecoder:
    """The text of one output's growing token list, decoding only what each token adds.

    ``add(token_id)`` returns the text the token adds to ``decode(all ids)``, or None while that text ends in an
    incomplete UTF-8 sequence (the next tokens complete it; their call returns the whole character). Each call
    decodes a window: the tokens of the previous piece (context for tokenizers whose decode of a token depends on
    the one before, such as a SentencePiece leading space) plus the new ones, so a call costs the same at token
    10 and at token 10,000. The pieces add up to the text a full decode gives at the same points.
    """

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # the window's first token
        self._read = 0  # tokens whose text was returned

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""

    def add(self, token_id: int) -> str | None:
        self.ids.append(int(token_id))
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        if after.endswith("\ufffd"):
            return None
        self._prefix, self._read = self._read, len(self.ids)
        return after[len(before):]


class TextWatch:
    """One output's decoded text against the request's stop strings, fed piece by piece.

    ``feed(piece)`` with the text's next part returns what may be sent now beyond what earlier calls returned
    (everything before a stop string; while none has appeared, all but a tail that may still become one).
    ``stopped`` is set once a stop string appeared; ``text`` is then the output's final text (the text before
    the first stop string). Only a tail as long as the longest stop string less one character is searched again
    with each piece, so a long output costs a constant per piece, not its length.
    """

    def __init__(self, stops: list[str] | None):
        self.stops = [s for s in stops or () if s]
        self.stopped = False
        self.text = ""
        self._keep = max((len(s) for s in self.stops), default=1) - 1  # tail a stop string may start in
        self._chunks: list[str] = []  # the text so far, in pieces (joined once: at a stop, or on request)
        self._length = 0  # len(text so far)
        self._tail = ""  # its last `_keep` characters (fewer at the start)
        self._shown = 0  # characters returned so far

    def feed(self, piece: str) -> str:
        if self.stopped or not piece:
            return ""
        if not self.stops:
            self._chunks.append(piece)
            self._length += len(piece)
            self._shown = self._length
            return piece
        window = self._tail + piece
        start = self._length - len(self._tail)  # where `window` begins in the text
        cut = min((pos for pos in (window.find(s) for s in self.stops) if pos >= 0), default=-1)
        if cut >= 0:  # a stop string ends in this piece (an earlier one would have stopped an earlier piece)
            self.stopped = True
            self.text = ("".join(self._chunks) + piece)[: start + cut]
            shown, self._shown = self._shown, start + cut
            return window[shown - start: cut]
        self._chunks.append(piece)
        self._length += len(piece)
        self._tail = window[max(0, len(window) - self._keep):] if self._keep else ""
        shown, self._shown = self._shown, self._length - unsure_tail(window, self.stops)
        return window[shown - start: self._shown - start]

    def update(self, text: str) -> str:
        """The whole-text form of :meth:`feed`: ``text`` is the text so far (extending the previous call's); returns
        the whole part of it that may be sent."""
        if not self.stopped:
            self.feed(text[self._length:])
        if self.stopped:
            return self.text
        self.text = "".join(self._chunks)
        return self.text[: self._shown]
