"""Server-sent events: a stream's events (a failure mid-stream becomes a last ``error`` event), framed natively
or as OpenAI chunks, then ``data: [DONE]``; or as the Responses API's named events (``event: <type>``, no
``[DONE]``).

:class:`Streams` is held by :class:`deployments.ingress.service.Ingress` (``ingress.streams``).
"""

from __future__ import annotations

import json
from contextlib import aclosing
from typing import Any, AsyncIterator, Callable

from deployments.ingress.errors import to_service_error
from deployments.ingress.replicas import _cancel, _log_generated
from deployments.openai.api import openai_stream_chunks
from deployments.openai.responses import ResponsesRequest
from deployments.openai.responses_stream import responses_events

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_SSE_DONE = "data: [DONE]\n\n"


def sse(data: dict[str, Any]) -> str:
    """One server-sent event carrying ``data`` as compact JSON."""
    return "data: " + json.dumps(data, separators=(",", ":"), ensure_ascii=False) + "\n\n"


class Streams:
    """The ingress's server-sent event streams.

    Args:
        redact: what an error message becomes before a client sees it (``ServerSettings.redact_paths``).
        model_name: the served model's name, in the OpenAI chunks and Responses events.
    """

    def __init__(self, redact: Callable[[str], str], model_name: str):
        self.redact = redact
        self.model_name = model_name

    async def events(self, first: dict[str, Any] | None, stream: Any, release: Any = None) -> AsyncIterator[dict[str, Any]]:
        """``first`` and the rest of the stream; a failure mid-stream becomes a last ``error`` event. ``release``
        (from :meth:`.replicas.ReplicaCalls.hold_rows`) is called when the stream ends, however it ends."""
        done = False
        try:
            if first is not None:
                yield first
                async for event in stream:
                    if event.get("type") == "done":
                        _log_generated(event.get("response"))
                    yield event
            done = True
        except Exception as exc:
            done = True
            error = to_service_error(exc)
            yield {"type": "error", "index": 0, "error": self.redact(error.message), "status": error.status}
        finally:
            if not done:  # client went away: stop generating for it
                _cancel(stream)
            if release is not None:
                release()

    async def native_sse(self, first: dict[str, Any] | None, stream: Any, release: Any = None) -> AsyncIterator[str]:
        async with aclosing(self.events(first, stream, release)) as events:
            async for event in events:
                yield sse(event)
        yield _SSE_DONE

    async def openai_sse(
        self, first: dict[str, Any] | None, stream: Any, *, chat: bool, n: int, include_usage: bool, release: Any = None,
        tools: Any = None,
    ) -> AsyncIterator[str]:
        """The OpenAI-style chunks of :func:`openai_stream_chunks` as server-sent events, then ``[DONE]``."""
        chunks = openai_stream_chunks(self.events(first, stream, release), model=self.model_name, chat=chat, n=n,
                                      include_usage=include_usage, tools=tools)
        async with aclosing(chunks):
            async for chunk in chunks:
                yield sse(chunk)
        yield _SSE_DONE

    async def responses_sse(
        self, first: dict[str, Any] | None, stream: Any, body: ResponsesRequest, release: Any = None, tools: Any = None
    ) -> AsyncIterator[str]:
        """The Responses API events of :func:`responses_events` as named server-sent events (``event: <type>``);
        ``tools``: the chat body's tool plan (the output read as tool calls), if any."""
        chunks = openai_stream_chunks(self.events(first, stream, release), model=self.model_name, chat=True, n=1,
                                      include_usage=True, **({"tools": tools} if tools is not None else {}))
        events = responses_events(chunks, body, model=self.model_name)
        async with aclosing(events):
            async for event in events:
                yield f"event: {event['type']}\n" + sse(event)
