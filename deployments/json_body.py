"""Strict JSON request bodies at the ingress: :class:`StrictJSONBody`, the ASGI middleware that parses every request
body the ingress receives with :func:`config.strict_json.parse_json` (what ``json.loads`` accepts but a body must
not hold, refused naming the field) and keeps what it parsed in the request's scope (``JSON_BODY_SCOPE_KEY``), where
the routes of a :class:`ParsedJSONRoute` take it instead of parsing the body again: a body is parsed once; and
:func:`parse_json_body`, an admin write's body parsed once within the limits.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from fastapi.routing import APIRoute
from starlette.requests import Request

from config.strict_json import BodyRejected, parse_json
from deployments.protocol import ServiceError

__all__ = ["JSON_BODY_SCOPE_KEY", "BodyRejected", "ParsedJSONRoute", "StrictJSONBody", "body_rejected", "parse_json",
           "parse_json_body"]

#: the scope entry where :class:`StrictJSONBody` keeps the body it parsed (absent: not parsed there)
JSON_BODY_SCOPE_KEY = "constrained_serve.json_body"
_METHODS_WITH_BODY = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_THREAD_BYTES = 1 << 20


def body_rejected(error: BodyRejected) -> ServiceError:
    """The answer to a body that breaks a strict-JSON rule: a 422 naming the field."""
    return ServiceError(422, str(error), {"field": error.field})


class StrictJSONBody:
    """ASGI middleware: a request body that :func:`parse_json` refuses is a 422 naming the field.

    Every body of a ``POST``/``PUT``/``PATCH``/``DELETE`` is read here and, unless refused, replayed unchanged
    to the app, with the parsed value in ``scope[JSON_BODY_SCOPE_KEY]`` (a :class:`ParsedJSONRoute` takes it from
    there instead of parsing the body again). What is not JSON at all goes on to the app, whose error for it is
    unchanged. ``admits(scope)`` may keep a body from being read here (the ingress: admin routes without
    the admin token get their 401 without the body being parsed).
    """

    def __init__(self, app: Any, admits: Callable[[dict], bool] | None = None):
        self.app = app
        self.admits = admits

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") not in _METHODS_WITH_BODY or (
                self.admits is not None and not self.admits(scope)):
            return await self.app(scope, receive, send)
        chunks: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] != "http.request":  # client went away
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        raw = b"".join(chunks)
        if raw.strip():
            try:
                if len(raw) > _THREAD_BYTES:  # a large tree takes a second or more: not on the event loop
                    scope[JSON_BODY_SCOPE_KEY] = await asyncio.to_thread(parse_json, raw)
                else:
                    scope[JSON_BODY_SCOPE_KEY] = parse_json(raw)
            except BodyRejected as error:
                from starlette.responses import JSONResponse

                refusal = body_rejected(error)
                response = JSONResponse(refusal.to_json(), status_code=refusal.status)
                return await response(scope, receive, send)
            except (ValueError, RecursionError):  # not JSON, or too deep: the app answers as it always did
                pass
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await receive_or_disconnect(receive)

        await self.app(scope, replay, send)


async def receive_or_disconnect(receive) -> dict:
    """``await receive()``, where Serve's cancellation of the request (the client went away: Serve's proxy cancels
    the call, and the replica's ``receive`` raises Ray's ``TaskCancelledError``) is the ASGI ``http.disconnect``
    message a server sends when a client leaves. A streamed response waits on ``receive`` for exactly that; the
    exception reached the error handler instead and logged a client leaving as an unexpected error."""
    try:
        return await receive()
    except Exception as exc:
        if type(exc).__name__ == "TaskCancelledError":  # ray.exceptions (not imported: this module runs without Ray)
            return {"type": "http.disconnect"}
        raise


class _ParsedJSONRequest(Request):
    """A request whose ``json()`` is the body :class:`StrictJSONBody` parsed, when it parsed it."""

    async def json(self) -> Any:
        if JSON_BODY_SCOPE_KEY in self.scope:
            return self.scope[JSON_BODY_SCOPE_KEY]
        return await super().json()


class ParsedJSONRoute(APIRoute):
    """A FastAPI route that validates the body :class:`StrictJSONBody` parsed (``scope[JSON_BODY_SCOPE_KEY]``)
    instead of parsing the body a second time; a body not parsed there (not JSON, not read there) is parsed by
    FastAPI as usual, with its usual errors."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def parsed_body_handler(request: Request) -> Any:
            return await handler(_ParsedJSONRequest(request.scope, request.receive))

        return parsed_body_handler


def parse_json_body(raw: bytes, limits: Any, *, scenario: bool) -> Any:
    """An admin write's HTTP body (bytes, as the ingress received them) parsed once, strictly
    (:func:`deployments.json_body.parse_json`: no NaN, no lone surrogates, no repeated keys), within the
    nesting limit; a scenario body also gets the cheap limit checks (label count, inline tree keys, ...)."""
    from config.settings import LimitExceeded
    from processors.scenarios import check_limits

    try:
        body = parse_json(raw) if raw.strip() else None
    except BodyRejected as error:
        raise body_rejected(error) from None
    except (ValueError, UnicodeDecodeError) as error:
        raise ServiceError(422, f"body: not valid JSON: {error}", {"field": "body"}) from None
    except RecursionError:
        raise ServiceError(422, f"body: nesting depth over {limits.max_json_depth} exceeds the limit "
                                f"max_json_depth={limits.max_json_depth}",
                           {"field": "body", "limit_name": "max_json_depth", "limit": limits.max_json_depth}) from None
    if not isinstance(body, dict):
        what = "a scenario JSON object" if scenario else 'a JSON object {"add": [...], "remove": [...]}'
        raise ServiceError(422, f"body: expected {what}, got {type(body).__name__ if raw.strip() else 'nothing'}",
                           {"field": "body"})
    try:
        if scenario:  # the kind's own limits first (they name the field, e.g. max_schema_depth), as before
            check_limits(body, limits)
        limits.check_json_depth(body)
    except LimitExceeded as error:
        raise ServiceError(error.status, f"invalid scenario: {error}" if scenario else str(error),
                           error.detail()) from None
    return body
