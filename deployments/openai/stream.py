"""OpenAI-style stream chunks (``chat.completion.chunk``, ``text_completion``) for a replica's native stream.

Moved out of :mod:`deployments.openai.api` (which re-exports :func:`openai_stream_chunks`); tool calls are sent as
OpenAI's ``tool_calls`` deltas (:mod:`deployments.openai.tool_calls`).
"""

from __future__ import annotations

import time
import uuid
from contextlib import aclosing
from typing import Any, AsyncIterator

from deployments.protocol import GenerateResponse
from deployments.openai.tool_calls import ToolPlan, parse_tool_output, tool_call_deltas

__all__ = ["openai_stream_chunks"]


async def openai_stream_chunks(
    events: AsyncIterator[dict[str, Any]], *, model: str, chat: bool, n: int, include_usage: bool,
    tools: ToolPlan | None = None,
) -> AsyncIterator[dict[str, Any]]:
    """OpenAI-style stream chunks for the native stream ``events`` (each chunk one server-sent event's data).

    A role chunk per choice (chat), then text deltas and finish reasons, a usage chunk when ``include_usage``,
    and an ``error`` object for a native ``error`` event. ``events`` is closed when this generator is.

    With ``tools`` (a chat request's :class:`~deployments.openai.tool_calls.ToolPlan`) each output is sent once it is
    finished and read (:func:`~deployments.openai.tool_calls.parse_tool_output`): ``tool_calls`` deltas
    (:func:`~deployments.openai.tool_calls.tool_call_deltas`) and ``finish_reason: "tool_calls"``, or its text as one
    ``content`` delta. (A call's tokens are held back until the output passed its schema check in any case.)
    A stored tool set (a ``tools`` scenario) is read the same way with the plan its ``done`` response carries.
    """
    chunk_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict[str, Any]:
        body = {"id": chunk_id, "object": kind, "created": created, "model": model, "choices": choices}
        if include_usage:
            body["usage"] = usage
        return body

    def choice(index: int, text: str | None, finish_reason: str | None = None, role: bool = False,
               reasoning: str | None = None) -> dict[str, Any]:
        if not chat:
            return {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if text is not None:
            delta["content"] = text
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}

    if chat:
        yield chunk([choice(i, "", role=True) for i in range(n)])
    finished: set[int] = set()
    async with aclosing(events):
        async for event in events:
            kind_of = event.get("type")
            if kind_of == "token" and chat and (tools is not None or event.get("tool_call")):
                continue  # the outputs are read as tool calls once finished (the done event; a stored tool set's
                # tokens are marked tool_call by the replica)
            if kind_of == "token":
                index, reason, text = int(event.get("index") or 0), event.get("finish_reason"), event.get("text") or ""
                if reason:
                    finished.add(index)
                if chat and "reasoning" in event:  # a think scenario: thinking and answer apart
                    reasoning, answer = event.get("reasoning") or "", event.get("answer") or ""
                    if reasoning or answer or reason:
                        yield chunk([choice(index, answer or None, reason, reasoning=reasoning)])
                    continue
                yield chunk([choice(index, None if chat and reason and not text else text, reason)])
            elif kind_of == "done" and event.get("response"):
                response = GenerateResponse.model_validate(event["response"])
                plan = tools if tools is not None else ToolPlan.from_info(response.tool_plan)  # that version's tools
                for index, output in enumerate(response.outputs):
                    if chat and plan is not None:
                        text = output.text
                        if output.reasoning_content is not None:  # a think scenario: the thinking, then the calls
                            yield chunk([choice(index, None, reasoning=output.reasoning_content)])
                            text = output.answer or ""
                        content, calls, reason = parse_tool_output(text, output.finish_reason, plan)
                        for delta in tool_call_deltas(calls or []):
                            yield chunk([{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}])
                        yield chunk([choice(index, content or None, reason)])
                    elif index not in finished:
                        yield chunk([choice(index, None if chat else "", output.finish_reason)])
                if include_usage:
                    yield chunk([], response.usage.model_dump())
            elif kind_of == "error":
                yield {"error": {"status": event.get("status", 500), "message": event.get("error") or "generation failed"}}
