"""Issue 23 over real HTTP against the shared Serve app: requests that used to slip past a guard or answer 500.

* a guard header sent twice (``x-request-timeout-seconds: 300`` then ``0``): the ingress read the first copy and
  Serve's proxy the last, so the timeout was lifted; now a 400 naming the header.
"""

from __future__ import annotations

import json
import socket

import pytest

pytestmark = pytest.mark.serve

TIMEOUT = 60


def _raw(app, method: str, path: str, headers: list[tuple[str, str]], body: bytes = b"") -> tuple[int, bytes]:
    """One HTTP/1.1 request written byte by byte (a header may repeat); ``(status, body)``."""
    head = f"{method} {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Length: {len(body)}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers)
    with socket.create_connection(("127.0.0.1", app.port), timeout=TIMEOUT) as sock:
        sock.sendall(head.encode("latin-1") + b"\r\n" + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, data.split(b"\r\n\r\n", 1)[1]


@pytest.mark.parametrize("header, values", [
    ("x-request-timeout-seconds", ["300", "0"]),
    ("x-request-timeout-seconds", ["5", "5"]),
    ("x-request-disconnect-disabled", ["?0", "?1"]),
])
def test_a_repeated_guard_header_is_a_400_naming_it(serve_app, header, values):
    body = json.dumps({"prompt": "x", "max_new_tokens": 1}).encode()
    for path in ("/v1/generate", "/admin/scenarios"):
        status, answer = _raw(serve_app, "POST" if path == "/v1/generate" else "GET", path,
                              [("Content-Type", "application/json"), ("Authorization", serve_app.admin["Authorization"])]
                              + [(header, v) for v in values], body if path == "/v1/generate" else b"")
        assert status == 400, (status, answer[:300])
        error = json.loads(answer)["error"]
        assert error["message"].startswith(f"{header}:") and error.get("field") == header, error
    # sent once, the same header is judged as before: a value in (0, request_timeout_s] passes
    if header == "x-request-timeout-seconds":
        status, answer = _raw(serve_app, "POST", "/v1/generate", [("Content-Type", "application/json"),
                                                                  (header, "30")], body)
        assert status == 200, answer[:300]
