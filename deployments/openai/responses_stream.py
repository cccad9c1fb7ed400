"""The Responses API event stream (``POST /v1/responses`` with ``stream: true``) for a chat stream.

:func:`responses_events` turns the chunks of :func:`deployments.openai.api.openai_stream_chunks` (one choice, with
a usage chunk) into numbered Responses events; the request mapping and the response object are in
:mod:`deployments.openai.responses`. This module knows nothing of HTTP.
"""

from __future__ import annotations

from contextlib import aclosing
from typing import Any, AsyncIterator

from deployments.openai.responses import (
    ResponsesRequest, function_call_item, message_item, reasoning_item, finished, response_skeleton,
)

__all__ = ["responses_events"]

class _Events:
    """Numbered Responses events and the output items they build."""

    def __init__(self) -> None:
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being streamed (reasoning or message)
        self.text = ""

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, **fields, "sequence_number": self.sequence}
        self.sequence += 1
        return event

    def start(self, kind: str) -> list[dict[str, Any]]:
        """Events that close the open item when it is of another kind and open one of ``kind``."""
        if self.open is not None and self.open["type"] == kind:
            return []
        events = self.close("completed")
        item = message_item("", "in_progress") if kind == "message" else reasoning_item("", "in_progress")
        part = item["content"].pop()
        self.open, self.text = item, ""
        index = len(self.output)
        events.append(self.event("response.output_item.added", output_index=index, item=item))
        events.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                 content_index=0, part=part))
        return events

    def delta(self, text: str) -> dict[str, Any]:
        assert self.open is not None
        self.text += text
        kind = "response.output_text.delta" if self.open["type"] == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if self.open["type"] == "message" else {}
        return self.event(kind, item_id=self.open["id"], output_index=len(self.output), content_index=0, delta=text,
                          **extra)

    def close(self, status: str) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        item, index = self.open, len(self.output)
        message = item["type"] == "message"
        done = (message_item if message else reasoning_item)(self.text, status, item["id"])
        part = done["content"][0]
        events = [
            self.event("response.output_text.done" if message else "response.reasoning_text.done", item_id=item["id"],
                       output_index=index, content_index=0, text=self.text, **({"logprobs": []} if message else {})),
            self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part),
            self.event("response.output_item.done", output_index=index, item=done),
        ]
        self.output.append(done)
        self.open = None
        return events

    def function_call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        item, index = function_call_item(call), len(self.output)
        events = [
            self.event("response.output_item.added", output_index=index, item={**item, "arguments": "", "status": "in_progress"}),
            self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                       delta=item["arguments"]),
            self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                       name=item["name"], arguments=item["arguments"]),
            self.event("response.output_item.done", output_index=index, item=item),
        ]
        self.output.append(item)
        return events


def _add_tool_call_deltas(calls: dict[int, dict[str, Any]], deltas: list[dict[str, Any]]) -> None:
    """Chat stream ``delta.tool_calls`` pieces gathered per index into whole calls."""
    for piece in deltas:
        call = calls.setdefault(int(piece.get("index") or 0), {"id": None, "function": {"name": None, "arguments": ""}})
        call["id"] = piece.get("id") or call["id"]
        function = piece.get("function") or {}
        call["function"]["name"] = function.get("name") or call["function"]["name"]
        call["function"]["arguments"] += function.get("arguments") or ""


async def responses_events(chunks: AsyncIterator[dict[str, Any]], body: ResponsesRequest, *,
                           model: str) -> AsyncIterator[dict[str, Any]]:
    """The Responses event stream for the chat stream ``chunks`` (``openai_stream_chunks``, one choice, with usage).

    ``response.created``, ``response.in_progress``, then per output item ``response.output_item.added``,
    ``response.content_part.added``, ``response.output_text.delta`` (``response.reasoning_text.delta`` for a think
    scenario's thinking) ..., ``response.output_text.done``, ``response.content_part.done``,
    ``response.output_item.done``; last ``response.completed`` (``response.incomplete`` when cut by
    ``max_output_tokens``; an ``error`` event and ``response.failed`` when generation failed).
    ``chunks`` is closed when this generator is.
    """
    out = _Events()
    response = response_skeleton(body, model=model)
    yield out.event("response.created", response=response)
    yield out.event("response.in_progress", response=response)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    error: str | None = None
    calls: dict[int, dict[str, Any]] = {}
    async with aclosing(chunks):
        async for chunk in chunks:
            if "error" in chunk and "choices" not in chunk:
                error = (chunk["error"] or {}).get("message") or "generation failed"
                yield out.event("error", code="server_error", message=error, param=None)
                break
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                for kind, text in (("reasoning", delta.get("reasoning_content")), ("message", delta.get("content"))):
                    if text:
                        for event in out.start(kind):
                            yield event
                        yield out.delta(text)
                _add_tool_call_deltas(calls, delta.get("tool_calls") or [])
                finish_reason = choice.get("finish_reason") or finish_reason
    status = "incomplete" if finish_reason == "length" or error is not None else "completed"
    if out.open is None and not calls and not any(item["type"] == "message" for item in out.output) and error is None:
        for event in out.start("message"):  # an empty answer is still a message
            yield event
    for event in out.close(status):
        yield event
    for index in sorted(calls):
        for event in out.function_call(calls[index]):
            yield event
    final = finished(response, output=out.output, finish_reason=finish_reason, usage=usage, error=error)
    kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(final["status"], "response.failed")
    yield out.event(kind, response=final)
