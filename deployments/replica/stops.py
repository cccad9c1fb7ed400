"""Stop strings matched as tokens arrive (the replica's ``stop`` handling): each output's text is decoded
incrementally and watched for the first stop string, so a long output costs no more per token than a short one."""

from __future__ import annotations

from ..engines import FinishedEvent
from .answer import IncrementalDecoder, TextWatch


def free_text_stops(stops: list[str] | None, compiled) -> list[str] | None:
    """The stop strings that apply to a request: ``stops`` when its output is free text (no scenario, or one
    without a constraint), else none. A stop string never cuts a constrained output (a JSON document, a label, a
    tool call, the JSON string of a ``tool_choice: auto`` text answer): its constraint decides where it ends, and a
    cut one would come back as ``finish_reason: "stop"`` though it is not valid. OpenAI and vLLM clients send
    ``stop`` with such requests (smolagents' tool requests), so it is accepted there and has no effect."""
    if not stops or (compiled is not None and compiled.constraint is not None):
        return None
    return stops

class _Stops:
    """A request's stop strings across its outputs: an output whose text shows one gets a ``FinishedEvent``
    (reason ``stop``, the tokens so far) in ``outputs`` and its text before the string in ``final``.

    Each output's text is decoded one token at a time (:class:`IncrementalDecoder`) and only its tail is searched
    for the stop strings again (:class:`TextWatch`): a token costs the same however long the output already is."""

    def __init__(self, tokenizer, stops: list[str] | None):
        self.tokenizer = tokenizer
        self.active = bool(stops)
        self.stops = stops
        self.decoders: dict[int, IncrementalDecoder] = {}
        self.watches: dict[int, TextWatch] = {}
        self.ids: dict[int, list[int]] = {}
        self.final: dict[int, str] = {}

    def piece(self, index: int, token_id: int, ids: list[int], outputs: dict[int, FinishedEvent]) -> str | None:
        """Output ``index`` emitted ``token_id`` (``ids``: its tokens so far, that one included): the text that may
        be sent now beyond what earlier calls returned, or None while the text ends in an incomplete UTF-8
        sequence. A stop string appearing ends the output (``outputs``, ``final``)."""
        decoder = self.decoders.get(index)
        if decoder is None:
            decoder = self.decoders[index] = IncrementalDecoder(self.tokenizer, skip_special_tokens=True)
        new = decoder.add(token_id)
        if new is None or not self.active:
            return new
        watch = self.watches.setdefault(index, TextWatch(self.stops))
        shown = watch.feed(new)
        if watch.stopped and index not in outputs:
            outputs[index] = FinishedEvent(index=index, token_ids=list(ids), finish_reason="stop")
            self.final[index] = watch.text
        return shown

    def token(self, index: int, token_id: int, outputs: dict[int, FinishedEvent]) -> None:
        """Follow one more token of output ``index`` (non-streaming requests)."""
        if index in outputs:
            return
        ids = self.ids.setdefault(index, [])
        ids.append(token_id)
        self.piece(index, token_id, ids, outputs)
