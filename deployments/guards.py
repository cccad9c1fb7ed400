"""ASGI middlewares of the ingress that bound what one client can hold: in-flight generations per client, and the
proxy headers that would lift the request timeout.

* :class:`InflightPerClient`: at most ``max_inflight_per_client`` generation requests (every path of
  :data:`GENERATE_PATHS`: ``POST /v1/generate``, ``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses``)
  of one client at a time in this ingress replica; past that a 429 with ``Retry-After``. A client is its peer
  address, or the last address of ``client_ip_header`` when the service runs behind a proxy that sets that header
  (the peer is then the proxy; the header's lines are read as one list, so the address the proxy appended is the
  last one whether it added a line or extended the client's). A request counts from the
  moment its headers reach the ingress until its response (a stream included) ends or the client goes away.
  With several ingress replicas, the bound holds per replica. The middleware notes the client in the request's
  scope (``scope["cs.client"]``) for :class:`RowBudget`.
* :class:`RowBudget`: work per client counted in rows (``max(n, num_beams)`` of a request: what it holds in a
  replica's batch), not in requests. A client's generations hold at most ``max_inflight_rows_per_client`` rows
  on the model replicas at a time (per ingress replica); a request past that waits at the ingress, in the
  client's own first-come queue, until the client's earlier requests give rows back. Another client is not
  behind that queue: its request goes to the replicas at once, behind at most that many rows of each other
  client, instead of behind everything one client sent. A request larger than the budget
  (the budget is at least ``max_n`` and ``max_num_beams``) is sent when the client has nothing else in flight.
* :class:`ProxyHeaderCheck`: Serve's HTTP proxy lets a client choose its own request timeout
  (``x-request-timeout-seconds``, where 0 or less means none) and switch off the disconnect check
  (``x-request-disconnect-disabled: ?1``). Either would let a slow client be held longer than the service's
  ``request_timeout_s``, so a value that is not a number of seconds in ``(0, request_timeout_s]``, and the
  disconnect header, are a 422. Either header sent more than once is a 400 naming it: this check and Serve's
  proxy could read different copies (the proxy takes the last), so a harmless first copy would hide the second.
"""

from __future__ import annotations

import math
import asyncio
from collections import deque
from typing import Any

from deployments.protocol import ServiceError

__all__ = ["CLIENT_SCOPE_KEY", "RELEASE_SCOPE_KEY", "GENERATE_PATHS", "InflightPerClient", "ProxyHeaderCheck", "RowBudget",
           "route_path"]

#: every route that generates: each is counted per client here and in :class:`RowBudget` (a test walks the app's
#: routes so that a new generating route cannot be left out)
GENERATE_PATHS = frozenset({"/v1/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses"})
RETRY_AFTER_S = 1
TIMEOUT_HEADER = b"x-request-timeout-seconds"
DISCONNECT_HEADER = b"x-request-disconnect-disabled"
CLIENT_SCOPE_KEY = "cs.client"  # where InflightPerClient leaves the client's identity for the routes
RELEASE_SCOPE_KEY = "cs.release"  # functions InflightPerClient calls when the request ends (RowBudget's rows)


async def _answer(error: ServiceError, scope, receive, send, headers: dict[str, str] | None = None) -> None:
    from starlette.responses import JSONResponse

    await JSONResponse(error.to_json(), status_code=error.status, headers=headers)(scope, receive, send)


def route_path(scope) -> str:
    """The request's path inside this app: Serve mounts an app under its ``route_prefix`` and puts the prefix in
    ``root_path`` *and* at the head of ``path``, so ``/beams/v1/generate`` under ``/beams`` is ``/v1/generate``."""
    path = scope.get("path") or ""
    root = (scope.get("root_path") or "").rstrip("/")
    if root and (path == root or path.startswith(root + "/")):
        return path[len(root):] or "/"
    return path


def _header(scope, name: bytes) -> bytes | None:
    """The first value of header ``name`` (``None`` when absent)."""
    return next((value for key, value in scope.get("headers") or [] if key == name), None)


def _header_lines(scope, name: bytes) -> bytes | None:
    """Every line of header ``name`` joined as one comma-separated list, in order (RFC 9110, 5.3: repeated lines
    of a list header are one list); ``None`` when absent."""
    lines = [value for key, value in scope.get("headers") or [] if key == name]
    return b",".join(lines) if lines else None


class InflightPerClient:
    """ASGI middleware: at most ``limit`` generation requests in flight per client (see the module docstring)."""

    def __init__(self, app: Any, limit: int, client_ip_header: str | None = None, paths=GENERATE_PATHS):
        self.app = app
        self.limit = int(limit)
        self.header = client_ip_header.lower().encode("latin-1") if client_ip_header else None
        self.paths = frozenset(paths)
        self.inflight: dict[str, int] = {}  # one event loop per ingress replica: no lock needed

    def client_of(self, scope) -> str:
        if self.header is not None:
            value = _header_lines(scope, self.header)
            if value:
                # a proxy appends the address it saw: the last one is the one this service can trust
                last = value.decode("latin-1").rsplit(",", 1)[-1].strip()
                if last:
                    return last
        client = scope.get("client")
        return str(client[0]) if client else "unknown"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or route_path(scope) not in self.paths:
            return await self.app(scope, receive, send)
        client = self.client_of(scope)
        scope[CLIENT_SCOPE_KEY] = client
        scope[RELEASE_SCOPE_KEY] = []
        count = self.inflight.get(client, 0)
        if count >= self.limit:
            error = ServiceError(
                429, f"client: {count} requests of this client ({client}) are in flight, the limit "
                     f"max_inflight_per_client={self.limit}; retry when one has finished",
                {"field": "client", "limit_name": "max_inflight_per_client", "limit": self.limit},
            )
            return await _answer(error, scope, receive, send, {"Retry-After": str(RETRY_AFTER_S)})
        self.inflight[client] = count + 1
        try:
            await self.app(scope, receive, send)
        finally:
            for release in scope.get(RELEASE_SCOPE_KEY) or ():  # a stream that never started gives its rows back too
                release()
            left = self.inflight.get(client, 1) - 1
            if left > 0:
                self.inflight[client] = left
            else:
                self.inflight.pop(client, None)


class RowBudget:
    """Rows (``max(n, num_beams)`` per request) each client has on the model replicas, at most ``limit`` (see the
    module docstring). ``await acquire(client, rows)`` waits its turn in the client's queue; ``release`` gives the
    rows back. One event loop per ingress replica: no lock needed."""

    def __init__(self, limit: int):
        self.limit = int(limit)
        self.held: dict[str, int] = {}
        self.waiting: dict[str, deque[tuple[int, asyncio.Future]]] = {}

    def _fits(self, client: str, rows: int) -> bool:
        held = self.held.get(client, 0)
        return held == 0 or held + rows <= self.limit

    async def acquire(self, client: str, rows: int) -> None:
        rows = max(1, int(rows))
        queue = self.waiting.get(client)
        if not queue and self._fits(client, rows):
            self.held[client] = self.held.get(client, 0) + rows
            return
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        entry = (rows, future)
        self.waiting.setdefault(client, deque()).append(entry)
        try:
            await future  # release() adds our rows to held before it wakes us
        except BaseException:
            if future.done() and not future.cancelled():
                self.release(client, rows)  # woken and cancelled at once: give the rows back
            else:
                queue = self.waiting.get(client)
                if queue is not None and entry in queue:
                    queue.remove(entry)
                    if not queue:
                        self.waiting.pop(client, None)
                self._wake(client)  # a smaller request behind us may fit now
            raise

    def release(self, client: str, rows: int) -> None:
        left = self.held.get(client, 0) - max(1, int(rows))
        if left > 0:
            self.held[client] = left
        else:
            self.held.pop(client, None)
        self._wake(client)

    def _wake(self, client: str) -> None:
        queue = self.waiting.get(client)
        while queue and self._fits(client, queue[0][0]):  # first come, first served within the client
            rows, future = queue.popleft()
            if future.done():
                continue
            self.held[client] = self.held.get(client, 0) + rows
            future.set_result(None)
        if not queue:
            self.waiting.pop(client, None)

    def rows_of(self, client: str) -> int:
        return self.held.get(client, 0)

    def waiting_of(self, client: str) -> int:
        return len(self.waiting.get(client) or ())


class ProxyHeaderCheck:
    """ASGI middleware: refuse the proxy headers that lift the request timeout (see the module docstring)."""

    def __init__(self, app: Any, request_timeout_s: float | None):
        self.app = app
        self.request_timeout_s = request_timeout_s

    def _refusal(self, scope) -> ServiceError | None:
        for name in (TIMEOUT_HEADER, DISCONNECT_HEADER):
            count = sum(1 for key, _ in scope.get("headers") or [] if key == name)
            if count > 1:
                text = name.decode("latin-1")
                return ServiceError(400, f"{text}: sent {count} times; send it at most once", {"field": text})
        raw = _header(scope, TIMEOUT_HEADER)
        if raw is not None:
            cap = self.request_timeout_s
            try:
                value = float(raw.decode("latin-1"))
            except ValueError:
                value = math.nan
            if not (math.isfinite(value) and value > 0 and (cap is None or value <= cap)):
                bound = f"at most {cap:g} (the service's request_timeout_s)" if cap is not None else "finite"
                return ServiceError(422, f"x-request-timeout-seconds: give a number of seconds above 0 and {bound}; "
                                         "the request timeout cannot be lifted", {"field": "x-request-timeout-seconds"})
        raw = _header(scope, DISCONNECT_HEADER)
        if raw is not None and raw.strip() != b"?0":
            return ServiceError(422, "x-request-disconnect-disabled: not accepted (a request ends when its client "
                                     "goes away)", {"field": "x-request-disconnect-disabled"})
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and (error := self._refusal(scope)) is not None:
            return await _answer(error, scope, receive, send)
        return await self.app(scope, receive, send)
