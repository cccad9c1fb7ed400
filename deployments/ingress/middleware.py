"""ASGI middlewares of the ingress's own: the body size limit (413) and the ``X-Request-Id`` check (422).

(The strict JSON body check is ``deployments/json_body.py``; the per-client bound and proxy headers are
``deployments/guards.py``.)
"""

from __future__ import annotations

import re
from typing import Any, Callable

from deployments.ingress.errors import _error_response
from deployments.protocol import ServiceError, body_too_large


class BodySizeLimit:
    """ASGI middleware: a body over ``max_bytes`` is a 413.

    With a ``Content-Length`` header the check is up front. Without one (chunked upload) the body is read
    here, up to the limit, and replayed to the app: FastAPI turns errors raised while it reads a body into
    a 400, so the limit cannot be enforced from inside ``receive``. A request that ``streamed`` gives a limit for
    (a catalog upload: its route streams the body on and counts it, ``ingress/uploads.py``) is checked against that
    limit up front, and otherwise passed on unread.
    """

    def __init__(self, app: Any, max_bytes: int, streamed: Callable[[dict], int | None] | None = None):
        self.app = app
        self.max_bytes = int(max_bytes)
        self.streamed = streamed

    async def _reject(self, scope, receive, send, upload_limit: int | None = None) -> None:
        error = (body_too_large("max_body_bytes", self.max_bytes) if upload_limit is None
                 else body_too_large("max_upload_bytes", upload_limit))
        await _error_response(error)(scope, receive, send)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = next((value for key, value in scope.get("headers") or [] if key == b"content-length"), None)
        upload_limit = self.streamed(scope) if self.streamed is not None else None
        if length is not None or upload_limit is not None:
            try:
                too_large = length is not None and int(length) > (upload_limit or self.max_bytes)
            except ValueError:
                too_large = False
            if too_large:
                return await self._reject(scope, receive, send, upload_limit)
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
