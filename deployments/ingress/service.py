"""The :class:`Ingress` class: settings, handles, the admin token check, request limits and the OpenAI routes'
flow. It holds its other parts: ``replicas`` (:class:`~deployments.ingress.replicas.ReplicaCalls`, with the
per-process state of the calls into the model replicas), ``streams`` (:class:`~deployments.ingress.sse.Streams`),
``health_check`` (:class:`~deployments.ingress.health.HealthCheck`); its app:
:func:`~deployments.ingress.app.build_http_app`, typed against what it uses of an ingress
(:class:`~deployments.ingress.seams.IngressApp`).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from config import ServerSettings
from deployments.auth import check_bearer, resolve_admin_token
from deployments.ingress.app import build_http_app
from deployments.ingress.health import HealthCheck
from deployments.ingress.replicas import ReplicaCalls, call
from deployments.ingress.sse import _SSE_HEADERS, Streams
from deployments.metrics import _in_serve_replica, route_logs_to_serve
from deployments.openai.api import (
    ChatCompletionRequest, CompletionRequest, openai_mapping, openai_response, served_model_name,
)
from deployments.options import replica_slots
from deployments.protocol import GenerateRequest, ServiceError, check_request_limits
from deployments.openai.responses import ResponsesRequest, chat_to_response, renamed_error, responses_to_chat
from deployments.openai.tool_calls import ToolPlan, check_tool_fields


class Ingress:
    """HTTP front of the service; a plain class (``deployments/app.py`` turns it into a Serve deployment).

    Args:
        settings: ``ServerSettings`` or its ``model_dump()`` (limits, data_dir / admin_token, model name).
        model_handle: handle to the model replicas (``generate``, ``generate_stream``).
        manager_handle: handle to the config manager (scenario CRUD, ``list``, ``health``, ``replica_versions``).
        beam_handle: handle to the transformers-engine replicas that run beam requests beside vLLM replicas
            (setting ``beam_replicas``), or ``None``: every request goes to ``model_handle``.
    """

    def __init__(self, settings: dict[str, Any] | ServerSettings, model_handle: Any, manager_handle: Any,
                 beam_handle: Any = None):
        self.settings = settings if isinstance(settings, ServerSettings) else ServerSettings.model_validate(settings)
        self.limits = self.settings.limits
        self.model = model_handle
        self.beams = beam_handle
        self.manager = manager_handle
        self.model_name = self.settings.served_model_name or served_model_name(self.settings.model)
        self.created = int(time.time())
        self.replicas = ReplicaCalls(model_handle, beam_handle, slots=replica_slots(self.settings),
                                     rows_per_client=self.settings.max_inflight_rows_per_client)
        self.streams = Streams(self.settings.redact_paths, self.model_name)
        self.health_check = HealthCheck(manager_handle, self.replicas, self.settings.redact_paths)
        route_logs_to_serve()
        self._admin_token = resolve_admin_token(self.settings)
        self.http_app = build_http_app(self)
        if _in_serve_replica():  # `serve run` prints no line of its own once the app serves (Ray 2.60)
            from deployments.ready import announce_when_ready

            announce_when_ready(self)

    def __serve_build_asgi_app__(self) -> FastAPI:
        """Ray Serve's late-bound ingress hook: the app whose routes are bound to this instance."""
        return self.http_app

    def check_admin(self, authorization: str | None) -> bool:
        """Whether ``authorization`` (an ``Authorization`` header) carries the admin token."""
        return check_bearer(authorization, self._admin_token)

    async def call(self, method: Any, *args: Any) -> Any:
        """``await method.remote(*args)`` (e.g. a method of ``self.manager``), any failure a :class:`ServiceError`."""
        return await call(method, *args)

    def check_limits(self, request: GenerateRequest, rename: dict[str, str] | None = None) -> None:
        """422 naming the field when a request asks for more than ``settings.limits`` allows (its tool parts
        too: :func:`~deployments.openai.tool_calls.check_tool_fields`). Linear in the request: the routes call it off the
        event loop, with the rest of a request's preparation."""
        check_request_limits(
            self.limits, max_new_tokens=request.max_new_tokens, n=request.n, num_beams=request.num_beams,
            seed=request.seed, exclude=request.exclude, rename=rename, item_filter=request.filter,
        )
        check_tool_fields(self.limits, request.tools, request.messages)

    def _openai_request(self, body: CompletionRequest | ChatCompletionRequest) -> tuple[GenerateRequest, ToolPlan | None]:
        """The replica request of an OpenAI body, checked, and the plan its outputs are read with as tool calls."""
        request, rename, plan = openai_mapping(body, self.limits, served=self.model_name)
        self.check_limits(request, rename)
        return request, plan

    async def openai_generate(self, body: CompletionRequest | ChatCompletionRequest, *, chat: bool,
                              http: Request | None = None):
        # off the event loop: the tools' and one-off schemas' checks are linear but may take seconds (a schema
        # of max_schema_bytes against the JSON-schema meta-schema); other requests are answered meanwhile
        request, tools = await asyncio.to_thread(self._openai_request, body)
        release = await self.replicas.hold_rows(http, request)
        try:
            if request.stream:
                first, stream = await self.replicas.open_stream(request)
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                response = StreamingResponse(
                    self.streams.openai_sse(first, stream, chat=chat, n=request.n, include_usage=include_usage, release=release,
                                    tools=tools),
                    media_type="text/event-stream",
                    headers=_SSE_HEADERS,
                )
                release = None  # the stream gives the rows back when it ends
                return response
            result = await self.replicas.generate(request)
            return openai_response(result, chat=chat, model=self.model_name, tools=tools)
        finally:
            if release is not None:
                release()

    async def responses_generate(self, body: ResponsesRequest, http: Request | None = None):
        """``POST /v1/responses``: the chat flow for the chat body the Responses body maps to, answered as a
        Responses object or event stream (errors name the Responses fields)."""
        def prepare() -> tuple[GenerateRequest, ToolPlan | None]:
            chat_body = responses_to_chat(body, self.limits)
            request, _, plan = openai_mapping(chat_body, self.limits, served=self.model_name)
            self.check_limits(request, {"max_new_tokens": "max_output_tokens"})
            return request, plan

        try:
            request, tools = await asyncio.to_thread(prepare)  # off the event loop, as openai_generate's
        except ServiceError as error:
            raise renamed_error(error) from None
        release = await self.replicas.hold_rows(http, request)
        try:
            if request.stream:
                first, stream = await self.replicas.open_stream(request)
                response = StreamingResponse(self.streams.responses_sse(first, stream, body, release, tools=tools),
                                             media_type="text/event-stream", headers=_SSE_HEADERS)
                release = None  # the stream gives the rows back when it ends
                return response
            result = await self.replicas.generate(request)
            chat = openai_response(result, chat=True, model=self.model_name, **({"tools": tools} if tools is not None else {}))
            return chat_to_response(chat, body, model=self.model_name)
        finally:
            if release is not None:
                release()
