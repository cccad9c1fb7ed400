"""Guards over real HTTP against the shared Serve app: requests that used to slip past a guard or answer 500.

* a guard header sent twice (``x-request-timeout-seconds: 300`` then ``0``): the ingress read the first copy and
  Serve's proxy the last, so the timeout was lifted; now a 400 naming the header;
* 500s: a catalog header with a lone surrogate (``"\\ud800"``) in ``description``, an ``If-Match`` of 5,000 digits
  (past Python's int limit) or of a non-ASCII digit; each is a 422 now, nothing stored;
* a catalog header that gives a key twice was taken (the last copy won): admin bodies are strict JSON, a 422;
* an ``exclude`` item of 2,000,000 ids went to a model replica to be walked; now each item is bounded by
  ``max_new_tokens`` (a longer item can never be produced), a 422 naming ``exclude[i]`` at the ingress.
"""

from __future__ import annotations

import json
import socket

import pytest
import requests

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


NDJSON = {"Content-Type": "application/x-ndjson"}


def _put_catalog(app, name: str, header: bytes) -> requests.Response:
    return requests.put(f"{app.url}/admin/scenarios/{name}", data=header + b"\n[5]\n[6, 7]\n",
                        headers={**NDJSON, **app.admin}, timeout=TIMEOUT)


def _not_stored(app, name: str) -> None:
    r = requests.get(f"{app.url}/admin/scenarios/{name}", headers=app.admin, timeout=TIMEOUT)
    assert r.status_code == 404, r.text


def test_lone_surrogate_in_a_catalog_header_is_a_422(serve_app):
    for header in (b'{"start_token_id": 1000, "end_token_id": 2, "description": "\\ud800"}',
                   b'{"start_token_id": 1000, "end_token_id": 2, "description": "a\xed\xa0\x80"}'):
        r = _put_catalog(serve_app, "i23-surrogate", header)
        assert r.status_code == 422, (r.status_code, r.text[:300])
        error = r.json()["error"]
        assert "surrogate" in error["message"] and error.get("field") == "header.description", error
    _not_stored(serve_app, "i23-surrogate")


def test_a_catalog_header_with_a_repeated_key_is_a_422(serve_app):
    r = _put_catalog(serve_app, "i23-dup", b'{"start_token_id": 1000, "end_token_id": 2, "start_token_id": 1001}')
    assert r.status_code == 422, (r.status_code, r.text[:300])
    assert "duplicate key" in r.json()["error"]["message"] and "start_token_id" in r.json()["error"]["message"]
    _not_stored(serve_app, "i23-dup")


def test_an_if_match_out_of_range_is_a_422(serve_app):
    name = "i23-ifmatch"
    serve_app.put(name, {"type": "labels", "labels": ["a", "b"]})
    url = f"{serve_app.url}/admin/scenarios/{name}"
    for tag in ("9" * 5000, '"' + "1" * 5000 + '"', "\xb2", "1" * 19):
        r = requests.patch(url, json={"add": ["c"]}, headers={**serve_app.admin, "If-Match": tag.encode("latin-1")},
                           timeout=TIMEOUT)
        assert r.status_code == 422, (r.status_code, r.text[:300])
        assert r.json()["error"].get("field") == "If-Match", r.text[:300]
    history = requests.get(f"{url}/versions", headers=serve_app.admin, timeout=TIMEOUT).json()["versions"]
    assert [v["version"] for v in history] == [1]
    r = requests.patch(url, json={"add": ["c"]}, headers={**serve_app.admin, "If-Match": '"1"'}, timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["version"] == 2, r.text


def test_an_exclude_item_longer_than_max_new_tokens_is_refused_at_the_ingress(serve_app):
    from config import Limits

    longest = Limits().max_new_tokens
    serve_app.put("i23-exclude", {"type": "tree", "tree": {"start_token_id": 1000, "end_token_id": 2,
                                                          "prefix_dict": {"1000": [5, 6], "1000_5": [2, 5]}}})
    base = {"scenario": "i23-exclude", "prompt": "x", "max_new_tokens": 4}
    for path, body in (("/v1/generate", base),
                       ("/v1/chat/completions", {"scenario": "i23-exclude", "max_tokens": 4,
                                                 "messages": [{"role": "user", "content": "x"}]})):
        huge = {**body, "exclude": [[5], [5] * 2_000_000]}
        r = requests.post(f"{serve_app.url}{path}", json=huge, timeout=TIMEOUT)
        assert r.status_code == 422, (r.status_code, r.text[:300])
        error = r.json()["error"]
        assert error["message"].startswith("exclude[1]:") and f"max_new_tokens={longest}" in error["message"], error
        assert error.get("field") == "exclude[1]" and error.get("limit_name") == "max_new_tokens", error
    # at the bound the item is judged as before: not an item of this tree (a 422 naming it, from the replica)
    r = requests.post(f"{serve_app.url}/v1/generate", json={**base, "exclude": [[5] * longest]}, timeout=TIMEOUT)
    assert r.status_code == 422 and r.json()["error"]["message"].startswith("exclude[0]:"), r.text[:300]
    assert "not an item" in r.json()["error"]["message"], r.text[:300]
    r = requests.post(f"{serve_app.url}/v1/generate", json={**base, "exclude": [[5, 5]]}, timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["outputs"][0]["token_ids"] in ([5], [6], [5, 2], [6, 2]), r.text[:300]
