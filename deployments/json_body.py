"""Strict JSON for request bodies: what Python's ``json`` module accepts but a body must not hold.

:func:`parse_json` parses like ``json.loads`` and refuses, naming the field by its dotted path
(``messages.0.content``, ``tree.prefix_dict``):

* non-finite numbers: the ``NaN``, ``Infinity`` and ``-Infinity`` literals (not JSON, but ``json.loads`` takes
  them) and numbers that overflow to infinity (``1e999``);
* integers of more than ``sys.get_int_max_str_digits()`` digits (4300), which ``json.loads`` refuses with a
  bare ``ValueError``;
* strings (values or keys) holding a lone UTF-16 surrogate (``"\\ud800"``, or its bytes in the body): not
  Unicode text, they break the tokenizer and the Redis encoding;
* an object that gives a key twice (``json.loads`` keeps the last silently; the tree-file loader reports it).

Invalid JSON and bodies nested deeper than the parser can go are left to the caller (``json.JSONDecodeError`` and
``RecursionError`` as from ``json.loads``), so their existing errors stay as they were.

:class:`StrictJSONBody` is the ASGI middleware that applies it to every request body the ingress receives; it
keeps what it parsed in the request's scope (``JSON_BODY_SCOPE_KEY``), where the routes of a
:class:`ParsedJSONRoute` take it instead of parsing the body again: a body is parsed once.

Example::

    >>> parse_json(b'{"temperature": 0.5}')
    {'temperature': 0.5}
    >>> try:
    ...     parse_json(b'{"messages": [{"content": "ok"}, {"temperature": NaN}]}')
    ... except BodyRejected as error:
    ...     print(error)
    messages.1.temperature: NaN is not a finite number (give a finite number)
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from collections import Counter
from typing import Any, Callable

from fastapi.routing import APIRoute
from starlette.requests import Request

from deployments.protocol import ServiceError

__all__ = ["JSON_BODY_SCOPE_KEY", "BodyRejected", "ParsedJSONRoute", "StrictJSONBody", "parse_json"]

#: the scope entry where :class:`StrictJSONBody` keeps the body it parsed (absent: not parsed there)
JSON_BODY_SCOPE_KEY = "constrained_serve.json_body"

#: a ``\uXXXX`` escape of a surrogate code point (D800-DFFF) in JSON text; a pair is fine, the walk tells
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_SURROGATE_ESCAPE_STR = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_SURROGATE = re.compile("[\ud800-\udfff]")
_METHODS_WITH_BODY = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_THREAD_BYTES = 1 << 20


class BodyRejected(ValueError):
    """A body breaks a rule of :func:`parse_json`; ``field`` is the dotted path, the message starts with it."""

    def __init__(self, field: str, reason: str):
        self.field, self.reason = field, reason
        super().__init__(f"{field}: {reason}")

    def __reduce__(self):
        return (type(self), (self.field, self.reason))

    def to_service_error(self) -> ServiceError:
        return ServiceError(422, str(self), {"field": self.field})


class _Bad:
    """Stands where a refused number was, until the walk finds its path."""

    __slots__ = ("reason",)

    def __init__(self, reason: str):
        self.reason = reason


class _Duplicates(dict):
    """An object that gave some key more than once (``counts``: key -> times)."""

    __slots__ = ("counts",)


class _Parse:
    """The hooks of one parse; ``suspect`` says whether the result needs the walk."""

    def __init__(self) -> None:
        self.suspect = False

    def constant(self, name: str) -> _Bad:
        self.suspect = True
        return _Bad(f"{name} is not a finite number (give a finite number)")

    def float_(self, text: str) -> float | _Bad:
        value = float(text)
        if value - value != 0.0:  # inf (nan cannot come from a JSON number)
            self.suspect = True
            shown = text if len(text) <= 24 else text[:12] + "..." + text[-6:]
            return _Bad(f"{shown} overflows to infinity, not a finite number (give a finite number)")
        return value

    def int_(self, text: str) -> int | _Bad:
        digits = len(text.lstrip("-"))
        limit = sys.get_int_max_str_digits()
        if limit and digits > limit:
            self.suspect = True
            return _Bad(f"an integer of {digits} digits is too long (at most {limit} digits)")
        return int(text)

    def object_(self, pairs: list[tuple[str, Any]]) -> dict:
        value = dict(pairs)
        if len(value) != len(pairs):
            self.suspect = True
            counts = Counter(key for key, _ in pairs)
            value = _Duplicates(value)
            value.counts = {key: n for key, n in counts.items() if n > 1}
        return value


def _loads(text: bytes | str, hooks: _Parse, parse_int: Callable[[str], Any] | None) -> Any:
    return json.loads(text, parse_constant=hooks.constant, parse_float=hooks.float_, parse_int=parse_int,
                      object_pairs_hook=hooks.object_)


def _join(path: str, part: Any) -> str:
    return f"{path}.{part}" if path else str(part)


def _surrogate_reason(text: str, what: str) -> str:
    match = _SURROGATE.search(text)
    return (f"{what} holds a lone surrogate (\\u{ord(match.group()):04x}) at character {match.start()}: "
            "not valid Unicode text")


def _first_problem(value: Any, field: str) -> BodyRejected | None:
    """The first refused item in document order, named by its path (iterative: no recursion limit)."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        where = path or field
        if isinstance(item, _Bad):
            return BodyRejected(where, item.reason)
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return BodyRejected(where, _surrogate_reason(item, "the text"))
        elif isinstance(item, dict):
            if isinstance(item, _Duplicates):
                key, times = next(iter(item.counts.items()))
                return BodyRejected(where, f"duplicate key {json.dumps(key)} (appears {times} times; give each key once)")
            for key in item:
                if _SURROGATE.search(key):
                    return BodyRejected(where, _surrogate_reason(key, f"a key ({key[:40]!r})"))
            stack.extend((child, _join(path, key)) for key, child in reversed(item.items()))
        elif isinstance(item, list):
            stack.extend((child, _join(path, i)) for i, child in reversed(list(enumerate(item))))
    return None


def _may_hold_surrogates(text: bytes | str) -> bool:
    if isinstance(text, str):
        return bool(_SURROGATE.search(text) or _SURROGATE_ESCAPE_STR.search(text))
    if _SURROGATE_ESCAPE.search(text):
        return True
    try:
        text.decode("utf-8")
    except UnicodeDecodeError:  # json.loads decodes with 'surrogatepass' (or the body is UTF-16/32)
        return True
    return False


def parse_json(text: bytes | str, field: str = "body") -> Any:
    """``json.loads(text)``, refusing what the module docstring lists with :class:`BodyRejected`.

    ``field`` names the text itself; paths inside it are appended (``field`` is dropped for a whole body,
    kept as a prefix otherwise: ``structured_outputs.json.minimum``).

    Raises:
        BodyRejected: naming the first offending field.
        json.JSONDecodeError, UnicodeDecodeError: not JSON (as ``json.loads``).
        RecursionError: nested deeper than the parser can go (as ``json.loads``).
    """
    hooks = _Parse()
    try:
        value = _loads(text, hooks, None)
    except json.JSONDecodeError:
        raise
    except ValueError as error:  # int(): "Exceeds the limit (4300 digits) for integer string conversion"
        if "integer string conversion" not in str(error):
            raise
        hooks = _Parse()
        value = _loads(text, hooks, hooks.int_)
    if hooks.suspect or _may_hold_surrogates(text):
        problem = _first_problem(value, field)
        if problem is not None:
            if field != "body" and problem.field != field:
                problem = BodyRejected(f"{field}.{problem.field}", problem.reason)
            raise problem
    return value


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

                refusal = error.to_service_error()
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
