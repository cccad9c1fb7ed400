"""The HTTP side of ``cs-admin`` (``cli/admin.py``): the exit codes, the error type, and :class:`AdminClient`, which
sends one admin request with the token and timeouts, retries a 503 with the same ``Idempotency-Key``, shows upload
progress, and turns every failure into a :class:`CliError` carrying an exit code from :data:`EXIT_CODES`. Only
``httpx`` (and ``tqdm`` for progress) is imported, so the tool starts fast and runs anywhere.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from typing import Any, Iterator
from urllib.parse import quote, urlsplit, urlunsplit

import httpx

__all__ = ["AdminClient", "CliError", "EXIT_CODES", "read_body", "scenario_path"]

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_TIMEOUT_S = 120.0  # a PUT waits for compilation (server limit 60 s) and every replica's ack
DEFAULT_CONNECT_TIMEOUT_S = 5.0
PROGRESS_MIN_BYTES = 1 << 20
UPLOAD_CHUNK_BYTES = 1 << 16
MAX_KNOWN_SHOWN = 20
DEFAULT_RETRIES = 3  # retries of a write answered 503, with the same Idempotency-Key
RETRY_DELAYS_S = (1.0, 2.0, 4.0, 8.0)  # before retry 1, 2, 3, 4 and later (or the service's Retry-After, up to 30 s)

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_AUTH = 3
EXIT_NOT_FOUND = 4
EXIT_INVALID = 5
EXIT_TOO_LARGE = 6
EXIT_UNAVAILABLE = 7
EXIT_CONNECT = 8
EXIT_TIMEOUT = 9

EXIT_CODES = {
    EXIT_OK: "success",
    EXIT_ERROR: "any other error from the service (HTTP 500, an output that failed, ...)",
    EXIT_USAGE: "bad command line, unreadable FILE, invalid --url",
    EXIT_AUTH: "admin token missing or refused (HTTP 401/403)",
    EXIT_NOT_FOUND: "unknown scenario or version (HTTP 404), or a version whose body was pruned (HTTP 410)",
    EXIT_INVALID: "request refused as invalid (HTTP 400/409/422; the message names the field)",
    EXIT_TOO_LARGE: "body too large (HTTP 413)",
    EXIT_UNAVAILABLE: "service unavailable: Redis, the config manager or replicas (HTTP 503)",
    EXIT_CONNECT: "no service at --url (connection refused, unknown host, no connection in time)",
    EXIT_TIMEOUT: "no answer within --timeout (or HTTP 504 from the service)",
}
STATUS_EXIT = {401: EXIT_AUTH, 403: EXIT_AUTH, 404: EXIT_NOT_FOUND, 410: EXIT_NOT_FOUND, 400: EXIT_INVALID, 409: EXIT_INVALID,
                422: EXIT_INVALID, 413: EXIT_TOO_LARGE, 503: EXIT_UNAVAILABLE, 504: EXIT_TIMEOUT}


class CliError(Exception):
    """A failure to report as one line, with the exit code; ``body`` is the service's JSON error, if any."""

    def __init__(self, message: str, code: int = EXIT_ERROR, body: Any = None):
        super().__init__(message)
        self.message = message
        self.code = code
        self.body = body


# --------------------------------------------------------------------------------------------- HTTP


def _display_url(url: str) -> str:
    """``url`` without any ``user:password@`` part, for messages."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def _error_message(response: httpx.Response) -> tuple[str, Any]:
    """The service's message for an error response (``{"error": {...}}``), with the details that help:
    the known names for a 404, the stored versions for a missing version, the limit for a 413."""
    try:
        body = response.json()
    except ValueError:  # not ours (a proxy, Serve's own 404 before the app is deployed): first line of text
        text = response.text.strip().splitlines()[0][:200] if response.text.strip() else response.reason_phrase
        return text or f"HTTP {response.status_code}", None
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return json.dumps(body)[:200], body
    message = str(error.get("message") or response.reason_phrase)
    versions = error.get("versions")
    if isinstance(versions, list) and versions:
        message += f" (stored versions: {', '.join(str(v) for v in versions)})"
    known = error.get("known")
    if isinstance(known, list) and not versions:  # a missing version: the stored versions are what helps
        shown = ", ".join(str(k) for k in known[:MAX_KNOWN_SHOWN])
        more = f" and {len(known) - MAX_KNOWN_SHOWN} more" if len(known) > MAX_KNOWN_SHOWN else ""
        message += f" (known scenarios: {shown}{more})" if known else " (no scenarios are stored)"
    if response.status_code == 401:
        message += " (check --token, --token-file or ADMIN_TOKEN)"
    if "error_id" in error:
        message += f" (error_id {error['error_id']} in the service log)"
    return message, body


def _http_error(response: httpx.Response) -> CliError:
    message, body = _error_message(response)
    return CliError(f"HTTP {response.status_code}: {message}", STATUS_EXIT.get(response.status_code, EXIT_ERROR), body)


class AdminClient:
    """A thin synchronous client for the service; every transport failure becomes a :class:`CliError`."""

    def __init__(self, url: str, token: str | None, timeout: float, connect_timeout: float,
                 retries: int = DEFAULT_RETRIES):
        self.url = url.rstrip("/")
        self.retries = max(0, int(retries))
        self.shown_url = _display_url(self.url)
        self.token = token
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        try:
            self.http = httpx.Client(base_url=self.url, timeout=httpx.Timeout(timeout, connect=connect_timeout))
        except (httpx.InvalidURL, httpx.UnsupportedProtocol, ValueError) as exc:
            raise CliError(f"invalid --url {self.shown_url!r}: {exc}", EXIT_USAGE) from None

    def close(self) -> None:
        self.http.close()

    def _headers(self, admin: bool) -> dict[str, str]:
        if not admin:
            return {}
        if not self.token:
            raise CliError("no admin token: pass --token or --token-file, or set ADMIN_TOKEN", EXIT_AUTH)
        return {"Authorization": f"Bearer {self.token}"}

    def _transport_error(self, exc: httpx.HTTPError) -> CliError:
        if isinstance(exc, httpx.ConnectTimeout):
            return CliError(f"no service at {self.shown_url}: no connection within {self.connect_timeout:g} s "
                            "(--connect-timeout)", EXIT_CONNECT)
        if isinstance(exc, httpx.ConnectError):
            reason = str(exc).split("] ", 1)[-1] or "cannot connect"
            return CliError(f"no service at {self.shown_url} ({reason})", EXIT_CONNECT)
        if isinstance(exc, httpx.TimeoutException):
            return CliError(f"no answer from {self.shown_url} within {self.timeout:g} s (--timeout or CS_TIMEOUT)",
                            EXIT_TIMEOUT)
        if isinstance(exc, (httpx.InvalidURL, httpx.UnsupportedProtocol)):
            return CliError(f"invalid --url {self.shown_url!r}: {exc}", EXIT_USAGE)
        if isinstance(exc, httpx.LocalProtocolError):  # e.g. a token with characters a header cannot hold
            return CliError("cannot send the request: the admin token or a header holds characters not allowed "
                            "in HTTP headers", EXIT_USAGE)
        return CliError(f"connection to {self.shown_url} failed: {type(exc).__name__}: {exc}", EXIT_ERROR)

    def request(self, method: str, path: str, *, admin: bool = True, idempotent: bool = False,
                content_factory: Any = None, **kwargs: Any) -> Any:
        """Send one request and return the JSON answer; errors raise :class:`CliError`.

        ``idempotent``: an admin write; it carries a new ``Idempotency-Key`` and is sent again with the
        same key (up to ``retries`` times) while the service answers 503, so a write that was stored
        although its answer was a 503 is answered with its first result, never made twice.
        ``content_factory()`` makes the body of each attempt (a streamed body can be sent once only)."""
        headers = {**self._headers(admin), **kwargs.pop("headers", {})}
        if idempotent:
            headers["Idempotency-Key"] = str(uuid.uuid4())
        attempt = 0
        while True:
            if content_factory is not None:
                kwargs["content"] = content_factory(attempt)
            try:
                response = self.http.request(method, path, headers=headers, **kwargs)
            except httpx.HTTPError as exc:
                raise self._transport_error(exc) from None
            if response.status_code == 503 and idempotent and attempt < self.retries:
                delay = _retry_delay(response, attempt)
                message, _ = _error_message(response)
                print(f"cs-admin: HTTP 503: {message.splitlines()[0] if message else 'unavailable'}; retrying in "
                      f"{delay:g} s with the same Idempotency-Key ({attempt + 1} of {self.retries})", file=sys.stderr)
                time.sleep(delay)
                attempt += 1
                continue
            break
        if response.status_code >= 400:
            raise _http_error(response)
        try:
            return response.json()
        except ValueError:
            raise CliError(f"the service answered HTTP {response.status_code} with a body that is not JSON") from None

    def events(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """POST ``body`` and yield the server-sent events (``data: {...}``) until ``[DONE]``."""
        try:
            with self.http.stream("POST", path, json=body) as response:
                if response.status_code >= 400:
                    response.read()
                    raise _http_error(response)
                data: list[str] = []
                for line in response.iter_lines():
                    if line.startswith("data:"):
                        data.append(line[5:].lstrip(" "))
                        continue
                    if line or not data:
                        continue
                    payload, data = "\n".join(data), []
                    if payload == "[DONE]":
                        return
                    try:
                        event = json.loads(payload)
                    except ValueError:
                        raise CliError(f"the service sent an event that is not JSON: {payload[:80]!r}") from None
                    yield event
        except httpx.HTTPError as exc:
            raise self._transport_error(exc) from None


def _retry_delay(response: httpx.Response, attempt: int) -> float:
    """Seconds before retry ``attempt + 1``: the service's ``Retry-After`` (seconds, up to 30), else
    :data:`RETRY_DELAYS_S`."""
    try:
        return min(30.0, max(0.0, float(response.headers["Retry-After"])))
    except (KeyError, ValueError):
        return RETRY_DELAYS_S[min(attempt, len(RETRY_DELAYS_S) - 1)]


def scenario_path(name: str, suffix: str = "") -> str:
    # Quote everything: a name with '/' reaches the server as one segment and gets its naming-rule 422.
    return f"/admin/scenarios/{quote(name, safe='')}{suffix}"


# --------------------------------------------------------------------------------------------- output


def read_body(source: str) -> tuple[Any, int, Any]:
    """``(content for httpx, size in bytes, file to close or None)`` for FILE or ``-`` (stdin)."""
    if source == "-":
        data = sys.stdin.buffer.read()
        return data, len(data), None
    try:
        handle = open(source, "rb")
        size = os.fstat(handle.fileno()).st_size
    except OSError as exc:
        raise CliError(f"cannot read {source}: {exc.strerror or exc}", EXIT_USAGE) from None
    return handle, size, handle
