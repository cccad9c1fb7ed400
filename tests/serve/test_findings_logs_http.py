"""Smaller findings over real HTTP against the shared app: a client that leaves a streamed Responses request is an
INFO matter (not an ERROR with a traceback), a client error raised in a model replica is not logged as a failed
call, and a grammar with an empty language is refused in one line (not llguidance's parser state in a 200)."""

from __future__ import annotations

import json
import socket
import time
import uuid

import pytest
import requests

from test_logs import _lines, wait_for_lines

pytestmark = pytest.mark.serve

TIMEOUT = 120


def _leave_a_stream(port: int, path: str, body: dict, request_id: str) -> None:
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nX-Request-Id: "
                     f"{request_id}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
        received = b""
        while b"delta" not in received:  # the stream has started: tokens are coming
            chunk = sock.recv(4096)
            assert chunk, received[:500]
            received += chunk


@pytest.mark.parametrize("path, body", [
    ("/v1/responses", {"input": "Tell me a very long story about a dragon.", "stream": True, "max_output_tokens": 400}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a very long story about a dragon."}],
                              "stream": True, "max_tokens": 400}),
])
def test_a_client_leaving_a_stream_is_not_an_error(serve_app, path, body):
    request_id = f"leave-{uuid.uuid4().hex}"
    _leave_a_stream(serve_app.port, path, body, request_id)
    wait_for_lines("Ingress", request_id, f"POST {path}")
    time.sleep(3)  # anything the cancellation logs comes after the access line
    mine = [line for line, _ in _lines("Ingress") if request_id in line]
    assert not [line for line in mine if line.startswith("ERROR") or "Traceback" in line], mine
    assert not [line for line, _ in _lines("Ingress") if "Traceback" in line and path in line], path
    assert requests.get(f"{serve_app.url}/healthz", timeout=TIMEOUT).status_code == 200


def test_a_client_error_raised_in_the_replica_is_not_logged_as_a_failed_call(serve_app):
    request_id = f"unknown-{uuid.uuid4().hex}"
    r = requests.post(f"{serve_app.url}/v1/generate", json={"scenario": f"nope-{uuid.uuid4().hex[:6]}", "prompt": "x"},
                      headers={"X-Request-Id": request_id}, timeout=TIMEOUT)
    assert r.status_code == 404, r.text
    (line, _), = wait_for_lines("ModelReplica", request_id, "CALL generate")
    assert "CALL generate 404" in line and " ERROR " not in line and not line.startswith("ERROR"), line


@pytest.mark.parametrize("grammar", ['start: x\nx: x "a"', 'start: a\na: b "x"\nb: a "y"'])
def test_a_grammar_with_an_empty_language_is_refused_in_one_line(serve_app, grammar):
    r = requests.post(f"{serve_app.url}/v1/chat/completions", timeout=TIMEOUT, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "structured_outputs": {"grammar": grammar}})
    assert 400 <= r.status_code < 500, r.text[:500]
    message = r.json()["error"]["message"]
    assert "language is empty" in message and "\n" not in message and "<state>" not in message, message
    name = f"empty-{uuid.uuid4().hex[:6]}"
    r = requests.put(f"{serve_app.url}/admin/scenarios/{name}", json={"type": "grammar", "grammar": grammar},
                     headers=serve_app.admin, timeout=TIMEOUT)
    assert r.status_code in (400, 422) and "language is empty" in r.json()["error"]["message"], r.text[:500]
    assert requests.get(f"{serve_app.url}/admin/scenarios/{name}", headers=serve_app.admin,
                        timeout=TIMEOUT).status_code == 404
