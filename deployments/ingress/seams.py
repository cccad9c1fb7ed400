"""What the ingress's routes use of an :class:`~deployments.ingress.service.Ingress`, as Protocols.

The app (``app.py``) and the admin routes (``admin.py``) are built by the ``Ingress`` they serve, so they are typed
against these, not against the class that imports them: :class:`AdminIngress` for the admin routes (the token check,
the limits, calls to the config manager), :class:`IngressApp` for the app's public routes besides.
"""

from __future__ import annotations

from typing import Any, Protocol

from fastapi import Request

from config import Limits, ServerSettings
from deployments.ingress.health import HealthCheck
from deployments.ingress.replicas import ReplicaCalls
from deployments.ingress.sse import Streams
from deployments.openai.api import ChatCompletionRequest, CompletionRequest
from deployments.openai.responses import ResponsesRequest
from deployments.protocol import GenerateRequest

__all__ = ["AdminIngress", "IngressApp"]


class AdminIngress(Protocol):
    """What the admin routes, the console's inspect route and a catalog upload use of the ingress."""

    #: the request limits (``settings.limits``)
    limits: Limits
    #: handle to the config manager
    manager: Any

    def check_admin(self, authorization: str | None) -> bool:
        """Whether ``authorization`` (an ``Authorization`` header, or None) carries the admin token."""
        ...

    async def call(self, method: Any, *args: Any) -> Any:
        """``await method.remote(*args)`` (a method of a handle), any failure a ``ServiceError``."""
        ...


class IngressApp(AdminIngress, Protocol):
    """What :func:`~deployments.ingress.app.build_http_app` uses of the ingress besides the admin part."""

    settings: ServerSettings
    #: the served model's name (``GET /v1/models``, the OpenAI answers)
    model_name: str
    #: when the ingress started, in seconds since the epoch (``GET /v1/models``)
    created: int
    #: the calls into the model replicas: rows held per client, streams opened, generation
    replicas: ReplicaCalls
    #: the server-sent event streams
    streams: Streams
    #: ``GET /healthz``'s report
    health_check: HealthCheck

    def check_limits(self, request: GenerateRequest, rename: dict[str, str] | None = None) -> None:
        """A 422 naming the field when ``request`` asks for more than the limits allow (linear in the request)."""
        ...

    async def openai_generate(self, body: CompletionRequest | ChatCompletionRequest, *, chat: bool,
                              http: Request | None = None) -> Any:
        """The answer (or event stream) of an OpenAI completions (``chat`` False) or chat completions body."""
        ...

    async def responses_generate(self, body: ResponsesRequest, http: Request | None = None) -> Any:
        """The answer (or event stream) of a Responses API body."""
        ...
