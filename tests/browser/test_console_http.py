"""The console over plain HTTP against the shared Serve app: its files, and the admin inspect route it uses."""

from __future__ import annotations

import pytest
import requests

from deployments.examples import chat_root_token_id

pytestmark = pytest.mark.serve

TIMEOUT = 60


def test_page_and_files_are_served_with_a_strict_policy(serve_app):
    page = requests.get(f"{serve_app.url}/console", timeout=TIMEOUT)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/console/console.js" in page.text and "http://" not in page.text and "https://" not in page.text
    policy = page.headers["content-security-policy"]
    assert "default-src 'self'" in policy and "frame-ancestors 'none'" in policy
    assert page.headers["x-content-type-options"] == "nosniff"
    for name, kind in (("console.js", "text/javascript"), ("console.css", "text/css")):
        r = requests.get(f"{serve_app.url}/console/{name}", timeout=TIMEOUT)
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind) and r.text
    slash = requests.get(f"{serve_app.url}/console/", timeout=TIMEOUT, allow_redirects=False)
    assert slash.status_code == 308 and slash.headers["location"] == "/console"
    for path in ("/console/nope.js", "/console/..%2Fconsole.py", "/console/%2e%2e/ingress.py"):
        r = requests.get(f"{serve_app.url}{path}", timeout=TIMEOUT)
        assert r.status_code == 404 and r.json()["error"]["status"] == 404, path
    # the page is not an API operation; the inspect route is, and it is an admin one
    paths = requests.get(f"{serve_app.url}/openapi.json", timeout=TIMEOUT).json()["paths"]
    assert not any(p.startswith("/console") for p in paths)
    assert paths["/admin/scenarios/{name}/inspect"]["post"]["security"]


def _inspect(serve_app, name, body, headers=None):
    return requests.post(f"{serve_app.url}/admin/scenarios/{name}/inspect", json=body,
                         headers=serve_app.admin if headers is None else headers, timeout=TIMEOUT)


def test_inspect_needs_the_admin_token(serve_app):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = _inspect(serve_app, "topics", {}, headers)
        assert r.status_code == 401 and "admin token" in r.json()["error"]["message"]
        assert r.headers["www-authenticate"] == "Bearer"


def test_inspect_walks_the_seeded_tree(serve_app, tokenizer):
    stored = requests.get(f"{serve_app.url}/admin/scenarios/topics", headers=serve_app.admin, timeout=TIMEOUT).json()
    tree = stored["scenario"]["tree"]
    root = chat_root_token_id(tokenizer)
    assert tree["start_token_id"] == root
    first = sorted(tree["prefix_dict"][str(root)])
    r = _inspect(serve_app, "topics", {"steps": "last"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["version"] == stored["version"] and body["type"] == "tree"
    assert [t["id"] for t in body["steps"][0]["allowed"]] == first
    child = first[0]
    deeper = _inspect(serve_app, "topics", {"token_ids": [child], "steps": "last"}).json()
    assert [s["index"] for s in deeper["steps"]] == [1]
    assert [t["id"] for t in deeper["steps"][0]["allowed"]] == sorted(tree["prefix_dict"][f"{root}_{child}"])
    assert all(t["text"] == tokenizer.decode([t["id"]]) for t in deeper["steps"][0]["allowed"])


@pytest.mark.parametrize(
    "body, status, text",
    [
        ({"token_ids": [49152]}, 422, "token_ids.0: id 49152 is outside the vocabulary"),
        ({"token_ids": [-1]}, 422, "token_ids.0"),
        ({"token_ids": ["x"]}, 422, "token_ids.0"),
        ({"token_ids": [1] * 1025}, 422, "max_new_tokens=1024"),
        ({"limit": 0}, 422, "limit"),
        ({"limit": 1001}, 422, "limit"),
        ({"steps": "some"}, 422, "steps"),
        ({"version": 0}, 422, "version"),
        ({"version": 999}, 404, "has no version 999"),
        ({"colour": 1}, 422, "colour"),
    ],
)
def test_inspect_refuses_bad_input_with_a_clear_4xx(serve_app, body, status, text):
    r = _inspect(serve_app, "sentiment", body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["status"] == status and text in error["message"], error["message"]


def test_inspect_of_an_unknown_or_badly_named_scenario(serve_app):
    r = _inspect(serve_app, "no-such-scenario", {})
    assert r.status_code == 404 and "sentiment" in r.json()["error"]["known"]
    r = _inspect(serve_app, "bad%20name", {})
    assert r.status_code == 422 and "name" in r.json()["error"]["message"]
