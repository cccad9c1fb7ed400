"""The admin token: required on every admin route and on nothing else, compared in constant time, never logged.

The admin routes are enumerated from the live app's ``/openapi.json`` (every path under ``/admin``), so a new
admin route is covered without editing this file. Each gets every kind of wrong credential and must answer
401 (JSON error, ``WWW-Authenticate: Bearer``) without touching the store; every other route must not care
about the ``Authorization`` header at all. After admin calls with the real token, the Ray session's log files
(the driver, the Serve controller, the proxy and every replica) must not contain it.
"""

from __future__ import annotations

import base64
import hmac
import logging
import os
from pathlib import Path
from unittest import mock

import pytest
import requests

from config import ServerSettings
from deployments import auth
from deployments.auth import check_bearer, mask_token, resolve_admin_token

pytestmark = pytest.mark.serve

TIMEOUT = 60
NAME = "sec-auth"
LABELS = {"type": "labels", "labels": ["yes", "no"]}


def _token(serve_app) -> str:
    return serve_app.admin["Authorization"].split(" ", 1)[1]


def _wrong_headers(token: str) -> dict[str, dict[str, str]]:
    last = token[-1]
    flipped = token[:-1] + ("A" if last != "A" else "B")
    basic = base64.b64encode(f"admin:{token}".encode()).decode()
    return {
        "none": {},
        "wrong": {"Authorization": "Bearer wrong-token"},
        "last char differs": {"Authorization": f"Bearer {flipped}"},
        "prefix": {"Authorization": f"Bearer {token[:-1]}"},
        "half": {"Authorization": f"Bearer {token[: len(token) // 2]}"},
        "longer": {"Authorization": f"Bearer {token}x"},
        "empty bearer": {"Authorization": "Bearer "},
        "bare scheme": {"Authorization": "Bearer"},
        "basic with user": {"Authorization": f"Basic {basic}"},
        "basic with token": {"Authorization": f"Basic {token}"},
        "other scheme": {"Authorization": f"Token {token}"},
        "no scheme": {"Authorization": token},
        "two tokens": {"Authorization": f"Bearer {token} {token}"},
        "token in another header": {"X-Admin-Token": token, "X-Api-Key": token},
        "token in the query": {},  # see _url
        "non-ascii": {"Authorization": "Bearer \u00e9\u00e9"},
    }


def _admin_operations(serve_app) -> list[tuple[str, str]]:
    spec = requests.get(f"{serve_app.url}/openapi.json", timeout=TIMEOUT).json()
    return sorted(
        (method.upper(), path)
        for path, item in spec["paths"].items()
        if path.startswith("/admin")
        for method in item
        if method in ("get", "put", "post", "delete", "patch")
    )


def _public_operations(serve_app) -> list[tuple[str, str]]:
    spec = requests.get(f"{serve_app.url}/openapi.json", timeout=TIMEOUT).json()
    return sorted(
        (method.upper(), path)
        for path, item in spec["paths"].items()
        if not path.startswith("/admin")
        for method in item
        if method in ("get", "put", "post", "delete", "patch")
    )


def _body(method: str, path: str) -> dict | None:
    if method == "PUT":
        return LABELS
    if path.endswith("/rollback"):
        return {"version": 1}
    return None


def _call(serve_app, method: str, path: str, headers: dict, query: str = "") -> requests.Response:
    url = f"{serve_app.url}{path.replace('{name}', NAME)}{query}"
    return requests.request(method, url, json=_body(method, path), headers=headers, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def stored(serve_app):
    serve_app.put(NAME, LABELS)
    yield NAME
    requests.delete(f"{serve_app.url}/admin/scenarios/{NAME}", headers=serve_app.admin, timeout=TIMEOUT)


def _history(serve_app):
    return requests.get(f"{serve_app.url}/admin/scenarios/{NAME}/versions", headers=serve_app.admin, timeout=TIMEOUT).json()


def test_admin_routes_enumerated(serve_app):
    ops = _admin_operations(serve_app)
    assert ("PUT", "/admin/scenarios/{name}") in ops and ("POST", "/admin/scenarios/{name}/rollback") in ops
    assert len(ops) >= 5, ops


def test_every_admin_route_refuses_wrong_credentials(serve_app, stored):
    token = _token(serve_app)
    before = _history(serve_app)
    for method, path in _admin_operations(serve_app):
        for kind, headers in _wrong_headers(token).items():
            query = f"?token={token}&access_token={token}" if kind == "token in the query" else ""
            r = _call(serve_app, method, path, headers, query)
            assert r.status_code == 401, (method, path, kind, r.status_code, r.text[:200])
            error = r.json()["error"]
            assert error["status"] == 401 and "token" in error["message"], (kind, error)
            assert r.headers.get("www-authenticate", "").lower().startswith("bearer"), (kind, dict(r.headers))
            assert token not in r.text
    # paths no admin route matches (a name with a '/', an unknown path, a method no route has) need it too,
    # so the admin surface cannot be probed without the token
    for method, path in (("GET", "/admin/scenarios/a%2Fb"), ("PUT", "/admin/scenarios/a/b"), ("DELETE", "/admin/nope"),
                         ("PATCH", f"/admin/scenarios/{NAME}"), ("GET", "/admin")):
        for headers in ({}, {"Authorization": f"Bearer {token[:-1]}"}):
            r = requests.request(method, f"{serve_app.url}{path}", json=LABELS, headers=headers, timeout=TIMEOUT)
            assert r.status_code == 401, (method, path, r.status_code, r.text)
    assert _history(serve_app) == before, "a refused admin request changed the store"


def test_every_admin_route_accepts_the_token(serve_app, stored):
    token = _token(serve_app)
    ops = dict.fromkeys(_admin_operations(serve_app))
    order = [op for op in (
        ("PUT", "/admin/scenarios/{name}"),
        ("GET", "/admin/scenarios/{name}"),
        ("GET", "/admin/scenarios/{name}/versions"),
        ("POST", "/admin/scenarios/{name}/rollback"),
        ("DELETE", "/admin/scenarios/{name}"),
    ) if op in ops] + [op for op in ops if op not in (
        ("PUT", "/admin/scenarios/{name}"), ("GET", "/admin/scenarios/{name}"), ("GET", "/admin/scenarios/{name}/versions"),
        ("POST", "/admin/scenarios/{name}/rollback"), ("DELETE", "/admin/scenarios/{name}"),
    )]
    for method, path in order:
        for header in (f"Bearer {token}", f"bearer {token}", f"Bearer  {token}"):  # the scheme is case-insensitive
            r = _call(serve_app, method, path, {"Authorization": header})
            assert r.status_code != 401, (method, path, header, r.text)
            assert r.status_code < 500, (method, path, r.text)
            if method in ("PUT", "DELETE", "POST"):
                break  # a write once is enough (a second delete is a 404)
    serve_app.put(NAME, LABELS)  # as the fixture left it


def test_no_public_route_requires_a_token(serve_app, stored):
    bodies = {
        "/v1/generate": {"scenario": NAME, "prompt": "Yes?", "max_new_tokens": 4},
        "/v1/completions": {"scenario": NAME, "prompt": "Yes?", "max_tokens": 4},
        "/v1/chat/completions": {"scenario": NAME, "messages": [{"role": "user", "content": "Yes?"}], "max_tokens": 4},
        "/v1/responses": {"scenario": NAME, "input": "Yes?", "max_output_tokens": 4},
    }
    ops = _public_operations(serve_app)
    assert ("POST", "/v1/generate") in ops and ("GET", "/healthz") in ops
    for method, path in ops:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic Zm9vOmJhcg=="}):
            r = requests.request(method, f"{serve_app.url}{path}", json=bodies.get(path), headers=headers, timeout=TIMEOUT)
            assert r.status_code == 200, (method, path, headers, r.status_code, r.text[:300])
    for path in ("/openapi.json", "/docs"):
        assert requests.get(f"{serve_app.url}{path}", timeout=TIMEOUT).status_code == 200


# --------------------------------------------------------------------------------------------- logs


def _ray_log_dirs() -> list[Path]:
    """This test session's Ray logs (the cluster the serve_app fixture started), not another process's."""
    import ray

    node = getattr(ray._private.worker, "_global_node", None)
    session = Path(node.get_session_dir_path()) if node is not None else None
    assert session is not None and session.is_dir(), "no Ray session directory for this process"
    return [session / "logs"]


def _files_containing(dirs: list[Path], needle: bytes) -> list[str]:
    found = []
    for root in dirs:
        for path in root.rglob("*"):
            if path.is_file() and not path.is_symlink():
                try:
                    if needle in path.read_bytes():
                        found.append(str(path))
                except OSError:
                    continue
    return found


def test_token_never_in_the_logs(serve_app, stored):
    import time

    token = _token(serve_app)
    for method, path in _admin_operations(serve_app):  # successful and refused admin calls, then look
        _call(serve_app, method, path, {"Authorization": f"Bearer {token[:-1]}X"})
        _call(serve_app, method, path, {"Authorization": f"Basic {token}"})
    assert _call(serve_app, "GET", "/admin/scenarios/{name}", serve_app.admin).status_code == 200
    assert _call(serve_app, "PUT", "/admin/scenarios/{name}", serve_app.admin).status_code == 200
    requests.get(f"{serve_app.url}/healthz", timeout=TIMEOUT)
    time.sleep(1.5)  # log handlers flush
    dirs = _ray_log_dirs()
    assert any(p.name.startswith("replica_") for d in dirs for p in d.rglob("*.log")), "no replica logs found"
    assert _files_containing(dirs, token.encode()) == []
    assert _files_containing([Path(serve_app.data_dir)], token.encode()) == []  # nor next to the data


# --------------------------------------------------------------------------------------------- check_bearer


def test_check_bearer_behaviour():
    token = "s3cret-Token_0123456789"
    assert check_bearer(f"Bearer {token}", token)
    assert check_bearer(f"bearer {token}", token) and check_bearer(f"BEARER {token}", token)
    for header in (None, "", "Bearer", "Bearer ", f"Bearer {token[:-1]}", f"Bearer {token}x", f"Basic {token}",
                   token, f"Bearer {token[:-1]}0", f"Bearer {token} {token}", "Bearer \u00e9", f"Bearer\t{token}"):
        assert not check_bearer(header, token), header
    assert not check_bearer("Bearer ", "") and not check_bearer("Bearer x", "")  # no token configured: nothing passes


def test_check_bearer_compares_in_constant_time():
    token = "s3cret-Token_0123456789"
    with mock.patch.object(auth.hmac, "compare_digest", wraps=hmac.compare_digest) as compare:
        assert check_bearer(f"Bearer {token}", token)
        assert not check_bearer(f"Bearer {token[:-1]}x", token)
        assert not check_bearer("Bearer short", token)  # a different length goes through the same compare
    assert compare.call_count == 3
    for call in compare.call_args_list:
        a, b = call.args
        assert isinstance(a, bytes) and isinstance(b, bytes)


def test_generated_token_is_never_logged(tmp_path, caplog):
    settings = ServerSettings(data_dir=str(tmp_path))
    with caplog.at_level(logging.DEBUG):
        token = resolve_admin_token(settings)
        again = resolve_admin_token(settings)
    assert token == again and len(token) >= 32
    path = tmp_path / "admin_token"
    assert (os.stat(path).st_mode & 0o777) == 0o600
    assert str(path) in caplog.text  # the location is logged
    assert token not in caplog.text
    assert mask_token(token) == token[:4] + "…" and token not in mask_token(token)


def test_settings_repr_hides_the_token():
    settings = ServerSettings(admin_token="very-secret-admin-token")
    assert "very-secret-admin-token" not in repr(settings) and "very-secret-admin-token" not in str(settings)
