"""How a replica shapes an answer for its client: the label form, the thinking/answer split, stop strings.

Three small pieces :mod:`deployments.replica` applies around the engine, none of which changes what is decoded
under a constraint:

* :func:`answer_form` picks the tokenization of a label scenario that fits what precedes the answer: the bare
  form (``Sports``) after a chat template's assistant header, after a think end marker ending in whitespace or
  after raw text ending in whitespace; the spaced form (`` Sports``) after other raw text. Both forms are
  compiled with the scenario (:meth:`processors.labels.LabelTables.for_prompt`).
* :func:`split_thinking` splits a think scenario's output into the thinking text and the answer after the end
  marker (``reasoning_content`` / ``content`` on the OpenAI routes).
* :class:`TextWatch` follows one output's text as tokens arrive: what may be streamed now (holding back a tail
  that may still become a stop string or the end marker) and where the first stop string ends it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["TextWatch", "answer_form", "form_for_tokens", "split_thinking", "unsure_tail"]


def answer_form(compiled: Any, *, chat: bool, prompt: str | None) -> Any:
    """``compiled`` with the label form that fits the prompt (itself when the kind has one form only)."""
    constraint = getattr(compiled, "constraint", None)
    for_prompt = getattr(constraint, "for_prompt", None)
    if for_prompt is None:
        return compiled
    if compiled.think is not None:
        bare = compiled.think.end[-1:].isspace()
    else:
        bare = chat or (prompt or "")[-1:].isspace()
    chosen = for_prompt(bare)
    return compiled if chosen is constraint else dataclasses.replace(compiled, constraint=chosen)


def form_for_tokens(compiled: Any, token_ids: list[int]) -> Any:
    """``compiled`` with the label form that produced ``token_ids`` (an output replayed without its prompt, as the
    web console's playground does): a think scenario's form follows its end marker; otherwise the bare form when
    the first token starts a label only in that form."""
    constraint = getattr(compiled, "constraint", None)
    bare_form = getattr(constraint, "bare_form", None)
    if bare_form is None:
        return compiled
    if compiled.think is not None:
        bare = compiled.think.end[-1:].isspace()
    else:
        first = int(token_ids[0]) if token_ids else None
        bare = (first is not None and first in bare_form.tables.allowed(bare_form.tables.root)
                and first not in constraint.tables.allowed(constraint.tables.root))
    chosen = constraint.for_prompt(bare)
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


class TextWatch:
    """One output's decoded text against the request's stop strings.

    ``update(text)`` with the text decoded so far returns the text that may be sent (everything before a stop
    string; while none has appeared, all but a tail that may still become one). ``stopped`` is set once a stop
    string appeared; ``text`` is then the output's final text.
    """

    def __init__(self, stops: list[str] | None):
        self.stops = [s for s in stops or () if s]
        self.stopped = False
        self.text = ""

    def update(self, text: str) -> str:
        if self.stopped:
            return self.text
        if not self.stops:
            self.text = text
            return text
        cut = min((pos for pos in (text.find(s) for s in self.stops) if pos >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self.text = text[:cut]
            return self.text
        self.text = text
        return text[: len(text) - unsure_tail(text, self.stops)]
