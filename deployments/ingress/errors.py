"""Error mapping: any exception to the client-facing :class:`ServiceError`, and the app's JSON error handlers.

Every error is JSON ``{"error": {"status": int, "message": str, ...detail}}``.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.openai.api import validation_error
from deployments.protocol import ServiceError, unwrap_service_error

# Serve configures this logger in every replica (its files and the `serve run` console); a module logger
# below WARNING would be dropped there.
logger = logging.getLogger("ray.serve")


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



def _error_response(error: ServiceError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error.to_json(), status_code=error.status, headers=headers)



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
