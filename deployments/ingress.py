"""The HTTP ingress: one FastAPI app in front of the model replicas and the config manager.

:class:`Ingress` is a plain class: ``Ingress(settings, model_handle, manager_handle)`` builds its FastAPI
app (``ingress.http_app``) with routes bound to that instance, so it can be served by Ray Serve or tested
in-process with ``fastapi.testclient.TestClient``. Ray Serve gets the app through the late-bound hook
``__serve_build_asgi_app__`` (see ``deployments/app.py``: ``serve.deployment(serve.ingress()(Ingress))``).

Routes:

========================================= ===========================================================
``POST /v1/generate``                     native API (:class:`GenerateBody` -> ``GenerateResponse``), SSE when ``stream``
``POST /v1/completions``                  OpenAI completions; extra fields ``scenario``, ``structured_outputs``, ``top_k``
``POST /v1/chat/completions``             OpenAI chat completions; also ``response_format``
``GET /v1/models``                        the served model
``GET /v1/scenarios``                     stored scenarios: name, type, current version
``GET /healthz``                          liveness, the manager's health, per-replica scenario versions
``PUT|GET|DELETE /admin/scenarios/{name}`` admin (bearer token): create/replace, read, delete
``GET /admin/scenarios/{name}/versions``  admin: history
``POST /admin/scenarios/{name}/rollback`` admin: roll back to ``{"version": int}``
``POST /admin/scenarios/{name}/inspect``  admin: allowed next tokens after a prefix (``deployments/console.py``)
``GET /console``                          the web console (a page over the routes above)
========================================= ===========================================================

Every error is JSON ``{"error": {"status": int, "message": str, ...detail}}``. The OpenAI request and response
bodies, and their mapping to and from the native API, are in ``deployments/openai_api.py``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import sys
import time
import uuid
from collections import OrderedDict
from contextlib import aclosing
from typing import Annotated, Any, AsyncIterator, Literal

from fastapi import APIRouter, Depends, FastAPI, Header, Query, Request
from fastapi import Path as PathParam
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.json_schema import SkipJsonSchema
from starlette.exceptions import HTTPException as StarletteHTTPException

from config import ScenarioAdapter, ServerSettings
from deployments.auth import check_bearer, resolve_admin_token
from deployments.metrics import _in_serve_replica, route_logs_to_serve
from deployments.console import mount_console
from deployments.docs import mount_docs, plain_openapi
from deployments.guards import CLIENT_SCOPE_KEY, RELEASE_SCOPE_KEY, InflightPerClient, ProxyHeaderCheck, RowBudget
from deployments.json_body import StrictJSONBody
from deployments.manager.catalog import CATALOG_CONTENT_TYPES
from deployments.store import NAME_PATTERN, validate_name
from deployments.openai_api import (
    ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse, ModelList,
    openai_response, openai_stream_chunks, openai_to_generate, served_model_name, validation_error,
)
from deployments.protocol import GenerateRequest, GenerateResponse, ServiceError, check_request_limits, unwrap_service_error

__all__ = [
    "GenerateBody",
    "Ingress",
    "build_http_app",
    "to_service_error",
]

# Serve configures this logger in every replica (its files and the `serve run` console); a module logger
# below WARNING would be dropped there.
logger = logging.getLogger("ray.serve")

ScenarioName = Annotated[str, PathParam(pattern=NAME_PATTERN, description="Scenario name (the store's naming rule).")]
IfMatch = Annotated[str | None, Header(
    alias="If-Match",
    description="Optional, on PATCH: the version the change is based on, as GET's ETag (\"3\"): a 409 unless it is current.")]
IdempotencyKey = Annotated[str | None, Header(
    alias="Idempotency-Key",
    description="Optional, on admin writes: a key of the client's choosing (e.g. a UUID) per intended write. A retry with "
                "the same key and request gets the first answer (header Idempotent-Replayed: true) instead of a second "
                "write; the same key with another request is a 422. Remembered 24 h.")]
HEALTH_TIMEOUT_S = 5.0
# A request whose model replica died (crash, lost node) is sent again this many times; generation has no side effects.
# A request that was already in flight at an earlier replica death is never sent again (see DeathMemory).
MODEL_RETRIES = 1
DEATH_MEMORY_SIZE = 4096  # request fingerprints remembered after a replica death
# How long the ingress waits for some model replica to answer a ping before it calls the service unavailable (503):
# after a replica died under a request (before its retry), while the last check found none, and in /healthz.
# Serve's router holds a call while no replica is alive until one is started (17 s and more), instead of failing.
REPLICA_PROBE_TIMEOUT_S = 5.0
# After a check that found no live replica, requests are answered 503 at once for this long, then checked again.
NO_REPLICA_HOLD_S = 1.0
# A generation call without an answer (its first event, for a stream) after this long has the ingress check that
# some replica is alive (one ping shared by all such calls, a success reused for ALIVE_REUSE_S): when none is, the
# call, held by Serve's router, is cancelled and answered 503.
REPLICA_CHECK_AFTER_S = 2.0
ALIVE_REUSE_S = 1.0
RETRY_AFTER_NO_REPLICA_S = 5
NO_REPLICA_MESSAGE = "no live model replica: the service is unavailable until one is running again; retry later"
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_SSE_DONE = "data: [DONE]\n\n"


# --------------------------------------------------------------------------------------------- errors


def to_service_error(exc: BaseException) -> ServiceError:
    """The client-facing error for an exception from a handle call (or from our own code).

    A :class:`ServiceError` (also when Ray wrapped it) keeps its status; an overloaded or dead backend is a
    503, a timeout a 504; anything else is logged with its traceback and becomes a generic 500 that carries
    only an error id to find that log line.
    """
    found = unwrap_service_error(exc)
    if found is not None:
        return found
    unavailable, timeouts = _ray_error_types()
    if isinstance(exc, unavailable):
        logger.warning("backend unavailable: %s: %s", type(exc).__name__, exc)
        return ServiceError(503, "the service is overloaded or a backend replica is unavailable; retry later")
    if isinstance(exc, timeouts):
        return ServiceError(504, "a backend call timed out")
    error_id = uuid.uuid4().hex[:12]
    logger.error("unexpected error (error_id=%s)", error_id, exc_info=exc)
    return ServiceError(500, "internal server error", {"error_id": error_id})


def _ray_error_types() -> tuple[tuple[type, ...], tuple[type, ...]]:
    unavailable: list[type] = []
    timeouts: list[type] = [TimeoutError, asyncio.TimeoutError]
    if "ray" not in sys.modules:  # the in-process unit tests run without Ray; under Serve it is loaded
        return tuple(unavailable), tuple(timeouts)
    from ray import exceptions as ray_exc
    from ray.serve import exceptions as serve_exc

    for module, name in (
        (serve_exc, "BackPressureError"),
        (serve_exc, "DeploymentUnavailableError"),
        (serve_exc, "ReplicaUnavailableError"),
        (ray_exc, "RayActorError"),
        (ray_exc, "ActorUnavailableError"),
    ):
        cls = getattr(module, name, None)
        if isinstance(cls, type):
            unavailable.append(cls)
    if isinstance(getattr(ray_exc, "GetTimeoutError", None), type):
        timeouts.append(ray_exc.GetTimeoutError)
    return tuple(unavailable), tuple(timeouts)


def _replica_died(exc: BaseException) -> bool:
    """Whether ``exc`` says the replica process serving a call is gone (worth one more try elsewhere)."""
    if "ray" not in sys.modules or unwrap_service_error(exc) is not None:
        return False
    from ray import exceptions as ray_exc

    died = tuple(c for c in (getattr(ray_exc, "RayActorError", None), getattr(ray_exc, "ActorUnavailableError", None))
                 if isinstance(c, type))
    return isinstance(exc, died)


def request_fingerprint(payload: dict[str, Any]) -> str:
    """What identifies a generate request across retries and resends: its body (without ``stream``), hashed."""
    body = {k: v for k, v in payload.items() if k != "stream"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode("utf-8", "surrogatepass")).hexdigest()


class DeathMemory:
    """Fingerprints of requests that were in flight on a model replica when it died (the newest ``size``).

    A request is retried after a replica death only when its fingerprint was in no earlier death: the same
    request dying with a second replica (its retry, or the client sending it again) is answered 503, so a
    request that kills replicas cannot take them down one after another. Per ingress process.
    """

    def __init__(self, size: int = DEATH_MEMORY_SIZE):
        self.size = size
        self._seen: OrderedDict[str, None] = OrderedDict()

    def record(self, fingerprint: str) -> bool:
        """Note a death with this request in flight; whether the request was in an earlier death too."""
        seen = fingerprint in self._seen
        self._seen[fingerprint] = None
        self._seen.move_to_end(fingerprint)
        while len(self._seen) > self.size:
            self._seen.popitem(last=False)
        return seen


def _not_retried(exc: BaseException) -> ServiceError:
    logger.warning("model replica died (%s) with a request in flight that was in flight at an earlier replica "
                   "death too; not retried", type(exc).__name__)
    return ServiceError(503, "this request was in flight when a replica died; not retried", {"retried": False})


def _error_response(error: ServiceError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error.to_json(), status_code=error.status, headers=headers)


# --------------------------------------------------------------------------------------------- models


class GenerateBody(GenerateRequest):
    """Body of ``POST /v1/generate``: a :class:`GenerateRequest` without ``inline_scenario``.

    Give exactly one of ``prompt`` or ``messages``; ``scenario`` names a stored scenario (none = unconstrained).
    """

    model_config = ConfigDict(extra="forbid", title="GenerateBody")

    inline_scenario: SkipJsonSchema[None] = Field(
        default=None, exclude=True, description="Not accepted here (one-off constraints go through the OpenAI routes)."
    )

    @field_validator("messages")
    @classmethod
    def _some_messages(cls, value: Any) -> Any:
        if value is not None and not value:
            raise ValueError("give at least one message")
        return value

    @field_validator("inline_scenario", mode="before")
    @classmethod
    def _no_inline(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError(
                "not accepted by /v1/generate: store the scenario (PUT /admin/scenarios/{name}) and name it in "
                "'scenario', or use response_format / structured_outputs on /v1/chat/completions"
            )
        return value


class ScenarioSummary(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    type: str
    version: int


class ScenarioList(BaseModel):
    scenarios: list[ScenarioSummary] = Field(description="The scenarios being served, by name.")


class HealthResponse(BaseModel):
    """The health report; when ``status`` is ``unavailable`` (HTTP 503) it also has ``model``: why no model replica
    can generate."""

    model_config = ConfigDict(extra="allow")

    status: Literal["ok", "degraded", "unavailable"] = Field(
        description="degraded: the manager or its Redis reports a problem (generation works); unavailable (HTTP 503): "
                    "no model replica is alive or registered, generation requests are answered 503.")
    ingress: Literal["ok"] = "ok"
    manager: dict[str, Any] = Field(description="The config manager's own health report (or why it is unreachable).")
    replicas: dict[str, Any] = Field(description="Per model replica: the scenario versions it serves.")
    replicas_error: str | None = Field(default=None, description="Why the replica versions could not be read.")


class ScenarioVersionOut(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    version: int


class ScenarioPatchOut(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    version: int = Field(description="The new version (the current one when changed is false).")
    base_version: int | None = Field(default=None, description="The version the delta was applied to.")
    changed: bool | None = Field(default=None, description="False: every add was there and no remove was: no new version.")
    added: int | None = None
    removed: int | None = None
    already_present: list[Any] | None = Field(default=None, description="Adds that were there already (no-ops).")
    not_present: list[Any] | None = Field(default=None, description="Removes that were not there (no-ops).")


class ScenarioOut(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    version: int
    scenario: dict[str, Any] | None = Field(description="The stored scenario body (null for a delete entry).")
    created_at: float | str | None = Field(default=None, description="When this version was stored.")
    action: str | None = Field(default=None, description="What produced this version (put, rollback, ...).")


class ScenarioVersionsOut(BaseModel):
    name: str
    versions: list[dict[str, Any]]


class DeletedOut(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    deleted: bool = True


class RollbackBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int = Field(ge=1, strict=True, description="The stored version to make current again.")


class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="allow")

    status: int
    message: str


class ErrorBody(BaseModel):
    error: ErrorDetail


_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody, "description": what}
    for code, what in (
        (404, "Unknown scenario (``known`` lists the stored names)"),
        (413, "Body too large"),
        (422, "Invalid request; the message names the field"),
        (500, "Internal error"),
        (503, "Overloaded or a backend replica is unavailable"),
    )
}
_SSE_RESPONSE = {200: {"content": {"text/event-stream": {}}, "description": "JSON body, or SSE when stream is true"}}


# --------------------------------------------------------------------------------------------- plumbing


def sse(data: dict[str, Any]) -> str:
    """One server-sent event carrying ``data`` as compact JSON."""
    return "data: " + json.dumps(data, separators=(",", ":"), ensure_ascii=False) + "\n\n"


class BodySizeLimit:
    """ASGI middleware: a body over ``max_bytes`` is a 413.

    With a ``Content-Length`` header the check is up front. Without one (chunked upload) the body is read
    here, up to the limit, and replayed to the app: FastAPI turns errors raised while it reads a body into
    a 400, so the limit cannot be enforced from inside ``receive``.
    """

    def __init__(self, app: Any, max_bytes: int):
        self.app = app
        self.max_bytes = int(max_bytes)

    async def _reject(self, scope, receive, send) -> None:
        error = ServiceError(
            413, f"request body: more than {self.max_bytes} bytes exceeds the limit max_body_bytes={self.max_bytes}",
            {"field": "body", "limit_name": "max_body_bytes", "limit": self.max_bytes},
        )
        await _error_response(error)(scope, receive, send)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = next((value for key, value in scope.get("headers") or [] if key == b"content-length"), None)
        if length is not None:
            try:
                too_large = int(length) > self.max_bytes
            except ValueError:
                too_large = False
            if too_large:
                return await self._reject(scope, receive, send)
            return await self.app(scope, receive, send)

        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # client went away
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await self._reject(scope, receive, send)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=@~-]{1,128}")


class RequestIdCheck:
    """ASGI middleware: a client's ``X-Request-Id`` must be 1-128 characters of ``A-Z a-z 0-9 . _ : / + = @ ~ -``.

    Serve's proxy takes the client's id as the request id (it tags every log line of the request and comes
    back in the ``x-request-id`` response header) or makes a UUID when there is none. It cannot be replaced
    by a fresh one from here, so an id that would garble the logs (spaces, quotes, kilobytes) is refused.
    """

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            for key, value in scope.get("headers") or []:
                if key == b"x-request-id" and not _REQUEST_ID.fullmatch(value.decode("latin-1")):
                    error = ServiceError(422, "X-Request-Id: give 1 to 128 characters of A-Z a-z 0-9 . _ : / + = @ ~ - "
                                              "(or none: the service makes one)", {"field": "X-Request-Id"})
                    return await _error_response(error)(scope, receive, send)
        return await self.app(scope, receive, send)


def _log_generated(response: Any) -> Any:
    """One INFO line per finished generation with its scenario and version (Serve adds the request id)."""
    if isinstance(response, dict):
        usage = response.get("usage") or {}
        logger.info("generate scenario=%s version=%s outputs=%d completion_tokens=%s", response.get("scenario"),
                    response.get("version"), len(response.get("outputs") or ()), usage.get("completion_tokens"),
                    extra={"scenario": response.get("scenario"), "scenario_version": response.get("version")})
    return response


def _cancel(call: Any) -> None:
    cancel = getattr(call, "cancel", None)
    if callable(cancel):
        try:
            cancel()
        except Exception:  # best effort: the call may have finished already
            logger.debug("cancelling a backend call failed", exc_info=True)


# --------------------------------------------------------------------------------------------- ingress


class Ingress:
    """HTTP front of the service; a plain class (``deployments/app.py`` turns it into a Serve deployment).

    Args:
        settings: ``ServerSettings`` or its ``model_dump()`` (limits, data_dir / admin_token, model name).
        model_handle: handle to the model replicas (``generate``, ``generate_stream``).
        manager_handle: handle to the config manager (scenario CRUD, ``list``, ``health``, ``replica_versions``).
    """

    def __init__(self, settings: dict[str, Any] | ServerSettings, model_handle: Any, manager_handle: Any):
        self.settings = settings if isinstance(settings, ServerSettings) else ServerSettings.model_validate(settings)
        self.limits = self.settings.limits
        self.model = model_handle
        self.manager = manager_handle
        self.model_name = self.settings.served_model_name or served_model_name(self.settings.model)
        self.created = int(time.time())
        self.deaths = DeathMemory()  # requests in flight at a model replica's death: retried once, never again
        self.rows = RowBudget(self.settings.max_inflight_rows_per_client)  # work per client, in rows
        self._no_replica_at: float | None = None  # when a check last found no live model replica (None: none did)
        self._probe: asyncio.Future | None = None  # the check in progress, shared by the requests that wait on it
        self._alive_at: float | None = None  # when a check last found a live replica
        self._calls = 0  # generation requests of this ingress on the model replicas (held rows), streams included
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
        return check_bearer(authorization, self._admin_token)

    async def call(self, method: Any, *args: Any) -> Any:
        """``await method.remote(*args)`` with any failure turned into a :class:`ServiceError`."""
        try:
            return await method.remote(*args)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise to_service_error(exc) from None

    async def _ping_some_replica(self) -> bool:
        """Whether some model replica answers a ping within ``REPLICA_PROBE_TIMEOUT_S`` (a ping that reached a dead
        one is sent again: Serve's router leaves that replica out from then on)."""
        deadline = time.monotonic() + REPLICA_PROBE_TIMEOUT_S
        while (left := deadline - time.monotonic()) > 0:
            call = self.model.ping.remote()

            async def answer(call=call):
                return await call

            try:
                await asyncio.wait_for(answer(), left)
                return True
            except asyncio.TimeoutError:
                _cancel(call)
                if self._calls >= self._replica_slots() - 1:
                    # every replica may be full (max_ongoing_requests), so Serve's router queues the ping: a busy
                    # service, not a dead one; the calls keep waiting as before
                    logger.warning("no model replica answered a ping within %g s, with %d requests in flight (the "
                                   "replicas may be full); not treated as down", REPLICA_PROBE_TIMEOUT_S, self._calls)
                    return True
                return False
            except asyncio.CancelledError:
                _cancel(call)
                raise
            except Exception as exc:
                if not _replica_died(exc):
                    logger.warning("model replica ping failed: %s: %s", type(exc).__name__, exc)
                    return False
        return False

    def _replica_slots(self) -> int:
        """Requests the model replicas take at once (their ``max_ongoing_requests``, all replicas)."""
        from deployments.app import REPLICA_REQUESTS_PER_BATCH_SLOT

        return self.settings.num_replicas * REPLICA_REQUESTS_PER_BATCH_SLOT * self.settings.max_batch_size

    async def replica_alive(self, *, fresh: bool = False) -> bool:
        """Whether a model replica is alive. Not checked (True) while nothing suggested otherwise, unless ``fresh``;
        after a check found none, False for ``NO_REPLICA_HOLD_S``, then checked again. Concurrent callers share
        one check."""
        if not fresh and self._no_replica_at is None:
            return True
        if not fresh and time.monotonic() - self._no_replica_at < NO_REPLICA_HOLD_S:
            return False
        if fresh and self._no_replica_at is None and self._alive_at is not None and \
                time.monotonic() - self._alive_at < ALIVE_REUSE_S:
            return True
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(self._ping_some_replica())
        alive = await asyncio.shield(self._probe)
        if alive:
            if self._no_replica_at is not None:
                logger.warning("a model replica answers again")
            self._no_replica_at, self._alive_at = None, time.monotonic()
        else:
            if self._no_replica_at is None:
                logger.warning("no model replica answered within %g s: generation requests are answered 503",
                               REPLICA_PROBE_TIMEOUT_S)
            self._no_replica_at = time.monotonic()
        return alive

    async def require_replica(self, *, fresh: bool = False) -> None:
        """503 (detail ``retry_after``) at once when no model replica is alive (:meth:`replica_alive`), instead of a
        request held by Serve's router until a new replica has started."""
        if not await self.replica_alive(fresh=fresh):
            raise ServiceError(503, NO_REPLICA_MESSAGE, {"retry_after": RETRY_AFTER_NO_REPLICA_S})

    async def checked(self, awaitable: Any, call: Any) -> Any:
        """``await awaitable`` (a generation call, or a stream's first event), except that when it has no answer
        after ``REPLICA_CHECK_AFTER_S`` and no model replica is alive (:meth:`replica_alive`), ``call`` is cancelled
        and the answer is a 503: Serve's router would hold it until a new replica has started."""

        async def wait() -> Any:
            return await awaitable

        task = asyncio.ensure_future(wait())
        try:
            done, _ = await asyncio.wait({task}, timeout=REPLICA_CHECK_AFTER_S)
            if not done:
                check = asyncio.ensure_future(self.replica_alive(fresh=True))
                done, _ = await asyncio.wait({task, check}, return_when=asyncio.FIRST_COMPLETED)
                if task not in done:
                    if not check.result():
                        task.cancel()
                        _cancel(call)
                        raise ServiceError(503, NO_REPLICA_MESSAGE, {"retry_after": RETRY_AFTER_NO_REPLICA_S})
                else:
                    check.cancel()
            return await task
        except asyncio.CancelledError:
            task.cancel()
            raise

    async def generate(self, payload: dict[str, Any]) -> Any:
        """``model.generate(payload)``, sent again to another replica when the one that had it died.

        Generation has no side effects, so a request whose replica process dies (a crash, a lost node)
        is retried up to ``MODEL_RETRIES`` times; a seeded request gives the same answer on any replica.
        A request that was in flight at an earlier death is not retried (503, see :class:`DeathMemory`), nor
        one after whose replica's death no replica answers a ping (503, :meth:`require_replica`).
        """
        await self.require_replica()
        for attempt in range(MODEL_RETRIES + 1):
            try:
                call = self.model.generate.remote(payload)
                return _log_generated(await self.checked(call, call))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if _replica_died(exc) and self.deaths.record(request_fingerprint(payload)):
                    raise _not_retried(exc) from None
                if attempt < MODEL_RETRIES and _replica_died(exc):
                    await self.require_replica(fresh=True)
                    logger.warning("model replica died during a request (%s); retrying on another replica "
                                   "(attempt %d of %d)", type(exc).__name__, attempt + 1, MODEL_RETRIES)
                    continue
                raise to_service_error(exc) from None

    def check_limits(self, request: GenerateRequest, rename: dict[str, str] | None = None) -> None:
        """422 naming the field when a request asks for more than ``settings.limits`` allows."""
        check_request_limits(
            self.limits, max_new_tokens=request.max_new_tokens, n=request.n, num_beams=request.num_beams,
            seed=request.seed, exclude=request.exclude, rename=rename,
        )

    async def open_stream(self, request: GenerateRequest) -> tuple[dict[str, Any] | None, Any]:
        """Start a streamed generation and wait for its first event, so an early error is a plain HTTP error."""
        await self.require_replica()
        for attempt in range(MODEL_RETRIES + 1):
            stream = None
            try:
                stream = self.model.options(stream=True).generate_stream.remote(request.model_dump())
                return await self.checked(stream.__anext__(), stream), stream
            except StopAsyncIteration:
                return None, stream
            except asyncio.CancelledError:
                _cancel(stream)
                raise
            except Exception as exc:
                _cancel(stream)
                if _replica_died(exc) and self.deaths.record(request_fingerprint(request.model_dump())):
                    raise _not_retried(exc) from None
                if attempt < MODEL_RETRIES and _replica_died(exc):  # nothing was sent to the client yet
                    await self.require_replica(fresh=True)
                    logger.warning("model replica died before the first event (%s); retrying", type(exc).__name__)
                    continue
                raise to_service_error(exc) from None
        raise AssertionError("unreachable")

    async def events(self, first: dict[str, Any] | None, stream: Any, release: Any = None) -> AsyncIterator[dict[str, Any]]:
        """``first`` and the rest of the stream; a failure mid-stream becomes a last ``error`` event. ``release``
        (from :meth:`hold_rows`) is called when the stream ends, however it ends."""
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
            yield {"type": "error", "index": 0, "error": self.settings.redact_paths(error.message), "status": error.status}
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
        self, first: dict[str, Any] | None, stream: Any, *, chat: bool, n: int, include_usage: bool, release: Any = None
    ) -> AsyncIterator[str]:
        """The OpenAI-style chunks of :func:`openai_stream_chunks` as server-sent events, then ``[DONE]``."""
        chunks = openai_stream_chunks(self.events(first, stream, release), model=self.model_name, chat=chat, n=n,
                                      include_usage=include_usage)
        async with aclosing(chunks):
            async for chunk in chunks:
                yield sse(chunk)
        yield _SSE_DONE

    async def openai_generate(self, body: CompletionRequest | ChatCompletionRequest, *, chat: bool,
                              http: Request | None = None):
        request, rename = openai_to_generate(body, self.limits, served=self.model_name)
        self.check_limits(request, rename)
        release = await self.hold_rows(http, request)
        try:
            if request.stream:
                first, stream = await self.open_stream(request)
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                response = StreamingResponse(
                    self.openai_sse(first, stream, chat=chat, n=request.n, include_usage=include_usage, release=release),
                    media_type="text/event-stream",
                    headers=_SSE_HEADERS,
                )
                release = None  # the stream gives the rows back when it ends
                return response
            result = await self.generate(request.model_dump())
            return openai_response(result, chat=chat, model=self.model_name)
        finally:
            if release is not None:
                release()

    async def hold_rows(self, http: Request | None, request: GenerateRequest) -> Any:
        """Wait until the request's client may put ``max(n, num_beams)`` more rows on the model replicas
        (:class:`RowBudget`, ``max_inflight_rows_per_client``); returns the function that gives them back (once)."""
        client = str(http.scope.get(CLIENT_SCOPE_KEY) or "unknown") if http is not None else "unknown"
        rows = max(request.n, request.num_beams)
        await self.rows.acquire(client, rows)
        self._calls += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._calls -= 1
                self.rows.release(client, rows)

        if http is not None and isinstance(http.scope.get(RELEASE_SCOPE_KEY), list):
            http.scope[RELEASE_SCOPE_KEY].append(release)  # the middleware calls it when the request ends, at the latest
        return release

    async def health(self) -> dict[str, Any]:
        async def ask(method: Any) -> tuple[dict[str, Any] | None, str | None]:
            try:
                return await asyncio.wait_for(self.call(method), HEALTH_TIMEOUT_S), None
            except ServiceError as error:
                return None, error.message
            except asyncio.TimeoutError:
                return None, f"no answer within {HEALTH_TIMEOUT_S:g} s"

        (manager, manager_error), (replicas, replicas_error), alive = await asyncio.gather(
            ask(self.manager.health), ask(self.manager.replica_versions), self.replica_alive(fresh=True)
        )
        if manager is None:
            manager = {"status": "unreachable", "error": manager_error}
        # No model replica: none answers a ping, or the manager (read fine) knows of none (a replica registers
        # before it takes traffic). Generation cannot work: 503, whatever the rest says.
        no_replica = not alive or (replicas_error is None and isinstance(replicas, dict) and not replicas)
        report = {
            "status": "ok" if _manager_ok(manager) and replicas_error is None else "degraded",
            "ingress": "ok",
            "manager": manager if isinstance(manager, dict) else {"report": manager},
            "replicas": replicas if isinstance(replicas, dict) else {},
        }
        if no_replica:
            report["status"] = "unavailable"
            report["model"] = (NO_REPLICA_MESSAGE if not alive else
                               "no model replica is registered with the config manager (none running, or one starting)")
        if replicas_error is not None:
            report["replicas_error"] = replicas_error
        return redact_json(report, self.settings.redact_paths)  # public: no internal paths (Redis socket, data dir)


_BAD_STATES = {"down", "unreachable", "error", "disconnected", "degraded", "unavailable"}


def _manager_ok(report: Any) -> bool:
    """Whether the manager's report looks healthy (its ``status``, and its ``redis`` entry if it has one)."""
    if not isinstance(report, dict) or report.get("status", "ok") != "ok" or report.get("redis_ok") is False:
        return False
    redis = report.get("redis")
    if isinstance(redis, dict):
        redis = False if redis.get("ok") is False else redis.get("status")
    return redis is not False and not (isinstance(redis, str) and redis.lower() in _BAD_STATES)


def redact_json(value: Any, redact: Any) -> Any:
    """``value`` (JSON-like) with ``redact`` applied to every string in it, keys included."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {redact_json(k, redact): redact_json(v, redact) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_json(v, redact) for v in value]
    return value


def _install_error_handlers(app: FastAPI, not_found: Any = None, redact: Any = None) -> None:
    """JSON errors for everything; ``not_found(request, status)`` may answer a routing 404 or 405 instead (a
    response, or None for the plain error)."""

    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, exc: ServiceError):
        if redact is not None:  # a message about a tree file names it relative to <tree_dir>, not by its path
            exc = ServiceError(exc.status, redact(exc.message), redact_json(exc.detail, redact))
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return _error_response(validation_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        if exc.status_code in (404, 405) and not_found is not None and (answer := not_found(request, exc.status_code)) is not None:
            return answer
        return _error_response(ServiceError(exc.status_code, str(exc.detail)), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        return _error_response(to_service_error(exc))


def _scenario_openapi_extra() -> dict[str, Any]:
    schema = ScenarioAdapter.json_schema(ref_template="#/components/schemas/{model}")
    catalog = {"type": "string", "description": "A catalog: a header line {\"start_token_id\": ..., \"end_token_id\": "
               "...} then one JSON array of token ids (after the root, without the end token) per line."}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema},
                                                           CATALOG_CONTENT_TYPES[0]: {"schema": catalog}}}}


def _patch_openapi_extra() -> dict[str, Any]:
    item = {"oneOf": [{"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}, {"type": "string"}]}
    schema = {"type": "object", "additionalProperties": False, "properties": {
        "add": {"type": "array", "items": item, "description": "Tree items (token ids after the root) or labels."},
        "remove": {"type": "array", "items": item},
        "base_version": {"type": "integer", "minimum": 1, "description": "409 unless this version is current."}}}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _content_type(request: Request) -> str:
    return (request.headers.get("content-type") or "").split(";")[0].strip().lower()


def _if_match_version(value: str | None) -> int | None:
    """The version an ``If-Match`` header names (``"3"``, ``3``, ``W/"3"``; ``*`` names none); 422 for anything else."""
    if value is None or value.strip() == "*":  # '*': any current version
        return None
    text = value.strip()
    text = text[2:] if text.startswith("W/") else text
    text = text[1:-1] if len(text) >= 2 and text[0] == text[-1] == '"' else text
    # ASCII digits only (int() refuses some that isdigit() takes, e.g. '\xb2'), and few of them: int() refuses a
    # text of over 4300 digits, and no version has more than 18
    if not (text.isascii() and text.isdigit() and len(text) <= 18) or int(text) < 1:
        raise ServiceError(422, f"If-Match: expected a version as an entity tag (e.g. \"3\", from GET's ETag), got "
                                f"{value[:40]!r}", {"field": "If-Match"})
    return int(text)


def _with_scenario_components(app: FastAPI) -> None:
    """Move the scenario schema's ``$defs`` into ``components`` so ``/docs`` resolves them."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    body = (operation.get("requestBody") or {}).get("content", {}).get("application/json", {})
                    defs = (body.get("schema") or {}).pop("$defs", None)
                    if defs:
                        components.update(defs)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def _admin_refusal(ingress: Ingress, request: Request) -> ServiceError | None:
    """The 401 for a request without the admin token (logged without the header), or None."""
    header = request.headers.get("authorization")
    if ingress.check_admin(header):
        return None
    client = request.client.host if request.client else "?"
    logger.warning("rejected admin request %s %r from %s (%s token)", request.method, request.url.path, client, "wrong" if header else "no")
    return ServiceError(401, "invalid admin token" if header else "missing admin token: send 'Authorization: Bearer <token>'")


_SCENARIOS_PREFIX = "/admin/scenarios/"


def _admin_not_found(ingress: Ingress, request: Request, status: int = 404) -> JSONResponse | None:
    """Answer a routing 404 or 405 under ``/admin``: 401 without the token (as on every admin route, so the
    admin routes cannot be probed without it); then, for a 404 under ``/admin/scenarios/``, a name no route
    could hold (one with a '/': ``../x``, ``a%2Fb``) is a 422 naming the naming rule, like any other bad name."""
    path = request.url.path
    if not (path == "/admin" or path.startswith("/admin/")):
        return None
    refused = _admin_refusal(ingress, request)
    if refused is not None:
        return _error_response(refused, headers={"WWW-Authenticate": "Bearer"})
    if status != 404 or not path.startswith(_SCENARIOS_PREFIX):
        return None
    name = path[len(_SCENARIOS_PREFIX):]
    head, _, tail = name.partition("/")
    try:
        validate_name(head if tail in ("versions", "rollback") else name)
    except ServiceError as error:
        return _error_response(error)
    return None


def _parse_body_here(ingress: Ingress, scope: dict) -> bool:
    """Whether the strict JSON check reads this request's body: not for an admin route without the admin token
    (it gets its 401 without its body being read, as before)."""
    path = scope.get("path") or ""
    if path.startswith(_SCENARIOS_PREFIX) and "/" not in path[len(_SCENARIOS_PREFIX):] and \
            scope.get("method") in ("PUT", "PATCH"):
        return False  # a scenario write goes to the manager as bytes and is parsed there, once (as strictly)
    if path == "/admin" or path.startswith("/admin/"):
        header = next((v.decode("latin-1") for k, v in scope.get("headers") or [] if k == b"authorization"), None)
        return ingress.check_admin(header)
    return True


def build_http_app(ingress: Ingress) -> FastAPI:
    """The FastAPI app for ``ingress``: public routes, the admin router, error handlers, the body limit."""
    app = FastAPI(
        title="constrained-serve",
        description="An LLM with hard output constraints (token trees, label sets, JSON schema, regex, think budget).",
        version="0.1.0",
        # No 307 from '/admin/scenarios/a/' to '/admin/scenarios/a' (a client that follows it would write a
        # scenario it did not name, and before any token check): a trailing slash is a 404, or a 422 for a name.
        redirect_slashes=False,
        # FastAPI's /docs and /redoc load their scripts from a CDN: /docs is served from deployments/docs-ui/
        # instead (deployments/docs.py), under a Content-Security-Policy; there is no /redoc.
        docs_url=None,
        redoc_url=None,
        swagger_ui_oauth2_redirect_url=None,
    )
    _install_error_handlers(app, not_found=lambda request, status: _admin_not_found(ingress, request, status),
                            redact=ingress.settings.redact_paths)
    # Outermost last: request id, proxy timeout headers, in-flight bound per client, body size, strict JSON.
    app.add_middleware(StrictJSONBody, admits=lambda scope: _parse_body_here(ingress, scope))
    app.add_middleware(BodySizeLimit, max_bytes=ingress.limits.max_body_bytes)
    settings = ingress.settings
    app.add_middleware(InflightPerClient, limit=settings.max_inflight_per_client, client_ip_header=settings.client_ip_header)
    app.add_middleware(ProxyHeaderCheck, request_timeout_s=settings.request_timeout_s)
    app.add_middleware(RequestIdCheck)

    @app.post("/v1/generate", response_model=GenerateResponse, responses={**_SSE_RESPONSE, **_ERROR_RESPONSES}, tags=["generate"])
    async def generate(body: GenerateBody, http: Request):
        """Generate under a stored scenario (or unconstrained). ``stream: true`` gives SSE ``data: {event}`` lines."""
        request = GenerateRequest.model_validate(body.model_dump())
        ingress.check_limits(request)
        release = await ingress.hold_rows(http, request)
        try:
            if request.stream:
                first, stream = await ingress.open_stream(request)
                response = StreamingResponse(ingress.native_sse(first, stream, release), media_type="text/event-stream",
                                             headers=_SSE_HEADERS)
                release = None  # the stream gives the rows back when it ends
                return response
            return await ingress.generate(request.model_dump())
        finally:
            if release is not None:
                release()

    @app.post("/v1/completions", response_model=CompletionResponse, responses={**_SSE_RESPONSE, **_ERROR_RESPONSES}, tags=["openai"])
    async def completions(body: CompletionRequest, http: Request):
        """OpenAI-compatible completions; ``scenario`` / ``response_format`` / ``structured_outputs`` constrain."""
        return await ingress.openai_generate(body, chat=False, http=http)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses={**_SSE_RESPONSE, **_ERROR_RESPONSES}, tags=["openai"])
    async def chat_completions(body: ChatCompletionRequest, http: Request):
        """OpenAI-compatible chat completions; ``scenario`` / ``response_format`` / ``structured_outputs`` constrain."""
        return await ingress.openai_generate(body, chat=True, http=http)

    @app.get("/v1/models", response_model=ModelList, tags=["openai"])
    async def models():
        return {"data": [{"id": ingress.model_name, "created": ingress.created}]}

    @app.get("/v1/scenarios", response_model=ScenarioList, tags=["scenarios"])
    async def scenarios():
        return {"scenarios": await ingress.call(ingress.manager.list)}

    @app.get("/healthz", response_model=HealthResponse, tags=["health"],
             responses={503: {"model": HealthResponse, "description": "No model replica is alive or registered"}})
    async def healthz():
        """200 while generation works (``status: degraded`` when the manager or Redis is not well); 503 with
        ``status: unavailable`` when no model replica answers or none is registered."""
        report = await ingress.health()
        if report.get("status") == "unavailable":
            return JSONResponse(jsonable_encoder(HealthResponse.model_validate(report)), status_code=503)
        return report

    bearer = HTTPBearer(auto_error=False, description="The admin token (ADMIN_TOKEN, or the generated token file).")

    async def require_admin(request: Request, _: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        refused = _admin_refusal(ingress, request)
        if refused is not None:
            raise StarletteHTTPException(401, refused.message, headers={"WWW-Authenticate": "Bearer"})

    admin = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(require_admin)], responses={401: {"model": ErrorBody}, **_ERROR_RESPONSES})

    def idempotent(args: tuple, key: str | None) -> tuple:
        return args if key is None else (*args, key)

    def write_answer(result: Any) -> Any:
        """A retried write's first answer (the body is the first answer's), marked ``Idempotent-Replayed: true``."""
        if isinstance(result, dict) and result.pop("replayed", False):
            return JSONResponse(result, headers={"Idempotent-Replayed": "true"})
        return result

    @admin.put("/scenarios/{name}", response_model=ScenarioVersionOut, openapi_extra=_scenario_openapi_extra())
    async def put_scenario(request: Request, name: ScenarioName, idempotency_key: IdempotencyKey = None):
        """Create or replace a scenario; returns once every live replica serves the new version. A JSON body is a
        scenario; a ``Content-Type: application/x-ndjson`` body is a catalog (a tree given as its items: a header
        line, then one JSON array of token ids per line; see the README). The body goes to the config manager as
        bytes, which parses and validates it once."""
        raw = await request.body()
        if _content_type(request) in CATALOG_CONTENT_TYPES:
            result = await ingress.call(ingress.manager.put_items, *idempotent((name, raw), idempotency_key))
        else:
            result = await ingress.call(ingress.manager.put, *idempotent((name, raw), idempotency_key))
        return write_answer(result)

    @admin.patch("/scenarios/{name}", response_model=ScenarioPatchOut, openapi_extra=_patch_openapi_extra())
    async def patch_scenario(request: Request, name: ScenarioName, idempotency_key: IdempotencyKey = None,
                             if_match: IfMatch = None):
        """Add and remove tree items (token ids after the root, without the end token) or labels: ``{"add": [...],
        "remove": [...]}``, as a new version (history, rollback, acks, Idempotency-Key as for a PUT). No-ops (adds
        already there, removes not there) are applied as nothing and listed in the answer; a PATCH that changes
        nothing makes no version. ``If-Match: "<version>"`` or ``base_version``: a 409 unless that version is
        current, nothing stored."""
        raw = await request.body()
        base = _if_match_version(if_match)
        result = await ingress.call(ingress.manager.patch, name, raw, idempotency_key, base)
        return write_answer(result)

    @admin.get("/scenarios/{name}", response_model=ScenarioOut)
    async def get_scenario(name: ScenarioName, version: int | None = Query(default=None, ge=1, description="A stored version (default: current).")):
        """A stored version (the current one by default); its ``ETag`` is ``"<version>"`` (for a PATCH's If-Match).
        410 for a version whose body the bounded history dropped (setting history_bodies)."""
        record = await ingress.call(ingress.manager.get, name, version)
        if isinstance(record, dict) and isinstance(record.get("version"), int):
            return JSONResponse(jsonable_encoder(record), headers={"ETag": f'"{record["version"]}"'})
        return record

    @admin.delete("/scenarios/{name}", response_model=DeletedOut)
    async def delete_scenario(name: ScenarioName, idempotency_key: IdempotencyKey = None):
        result = await ingress.call(ingress.manager.delete, *idempotent((name,), idempotency_key))
        return write_answer({"name": name, "deleted": True, **(result if isinstance(result, dict) else {})})

    @admin.get("/scenarios/{name}/versions", response_model=ScenarioVersionsOut)
    async def scenario_versions(name: ScenarioName):
        return {"name": name, "versions": await ingress.call(ingress.manager.versions, name)}

    @admin.post("/scenarios/{name}/rollback", response_model=ScenarioVersionOut)
    async def rollback_scenario(body: RollbackBody, name: ScenarioName, idempotency_key: IdempotencyKey = None):
        return write_answer(await ingress.call(ingress.manager.rollback, *idempotent((name, body.version), idempotency_key)))

    app.include_router(admin)
    mount_console(app, ingress, require_admin)  # /console and POST /admin/scenarios/{name}/inspect
    mount_docs(app)  # /docs: Swagger UI from this service
    _with_scenario_components(app)
    plain_openapi(app)  # Markdown, not Sphinx markup, in the descriptions /docs shows
    return app
