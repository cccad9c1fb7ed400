"""Every limit in ``config.Limits``: just over it is a clear 4xx whose message names the limit, just under passes.

The shared Serve app runs with the default limits (but a short ``upload_part_timeout_s``); where a default makes
the test cheap the request goes there over HTTP (stored scenarios, one-off constraints of the OpenAI routes,
generation parameters, the prompt).
Where the default would need a huge input or a slow run (100,000 labels, 2,000,000 tree keys, a compile timeout,
a 4096-token prefill) or a configuration of its own (a small body limit), the check runs in-process with real
components and small limits: the config manager with its embedded Redis and the real tokenizer, the ingress
under ``TestClient``, and a model replica with the real model (also for its own checks of one-off constraints,
which HTTP cannot reach because the ingress checks first).

``test_every_limit_is_tested`` fails when a field is added to ``Limits`` without a test here.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import requests
from fastapi.testclient import TestClient

from config import Limits, ServerSettings
from config.settings import LimitExceeded, json_depth, regex_repeat
from deployments.protocol import ServiceError
from helpers import user_messages
from serve_app import UPLOAD_PART_TIMEOUT_S, WIDE_BEAMS

pytestmark = pytest.mark.serve

#: the limits of the shared live app (tests/serve_app.py): the defaults but the two it sets
DEFAULTS = Limits(upload_part_timeout_s=UPLOAD_PART_TIMEOUT_S, max_num_beams=WIDE_BEAMS)
LABELS = {"type": "labels", "labels": ["yes", "no"]}
TIMEOUT = 120

# Limits field -> the tests that cover it (checked by test_every_limit_is_tested).
COVERED = {
    "max_body_bytes": ["test_body_size_live", "test_body_size_in_process"],
    "max_upload_bytes": ["test_upload_size_in_process"],  # more in tests/unit/test_upload_spool.py
    # more (four stalled uploads over Serve, the spool's places freed) in tests/serve/test_catalog_http.py
    "upload_part_timeout_s": ["test_upload_part_timeout_in_process"],
    "max_prompt_tokens": ["test_prompt_tokens", "test_replica_limits"],
    "max_new_tokens": ["test_max_new_tokens", "test_scenario_max_new_tokens"],
    "default_max_new_tokens": ["test_replica_limits"],
    "max_n": ["test_n_and_num_beams"],
    "max_num_beams": ["test_n_and_num_beams"],
    "max_exclude_items": ["test_exclude_items"],  # more in tests/integration/test_item_controls.py
    "max_filter_clauses": ["test_filter_limits"],  # more in tests/unit/test_item_filters.py
    "max_filter_depth": ["test_filter_limits"],  # more in tests/serve/test_item_filters_http.py
    "max_filter_values": ["test_filter_limits"],
    "max_tree_keys": ["test_tree_keys_inline_and_path"],
    "max_item_tokens": ["test_item_tokens_catalog_and_patch"],  # more in tests/unit/test_catalog_unit.py
    "max_labels": ["test_labels_live", "test_labels_in_process"],
    "max_inline_labels": ["test_inline_labels"],
    "max_inline_label_bytes": ["test_inline_labels"],
    "max_schema_bytes": ["test_schema_bytes"],
    "max_schema_depth": ["test_schema_depth"],
    "max_tools": ["test_max_tools"],  # more in tests/security/test_tool_bounds_http.py, tests/unit/test_tool_bounds.py
    "max_regex_length": ["test_regex_length"],
    "max_regex_repeat": ["test_regex_repeat", "test_regex_repeat_measure", "test_grammar_limits"],
    "max_grammar_bytes": ["test_grammar_limits"],  # more in tests/unit/test_grammar_kind.py
    "max_json_depth": ["test_json_depth"],
    "max_description_bytes": ["test_description_bytes"],  # more in tests/unit/test_scenarios.py
    "compile_timeout_s": ["test_compile_timeout"],
    "compile_memory_mb": ["test_compile_memory"],  # more in tests/security/test_compile_bounds.py
}


def test_every_limit_is_tested():
    assert set(COVERED) == set(Limits.model_fields), "a Limits field has no test here (add it to COVERED)"
    for tests in COVERED.values():
        for name in tests:
            assert callable(globals().get(name)), name


# --------------------------------------------------------------------------------------------- helpers


def _put(app, name: str, body) -> requests.Response:
    return requests.put(f"{app.url}/admin/scenarios/{name}", json=body, headers=app.admin, timeout=TIMEOUT)


def _post(app, path: str, body: dict) -> requests.Response:
    return requests.post(f"{app.url}{path}", json=body, timeout=TIMEOUT)


def _refused(response: requests.Response, status: int, limit_name: str, field: str | None = None) -> dict:
    """The response is ``status`` with a JSON error whose message names ``limit_name=<value>``."""
    assert response.status_code == status, (response.status_code, response.text[:500])
    error = response.json()["error"]
    value = getattr(DEFAULTS, limit_name)
    assert f"{limit_name}={value}" in error["message"], error["message"]
    if field is not None:
        assert error["message"].startswith(field) or f" {field}:" in error["message"], error["message"]
    return error


def _history(app, name: str):
    r = requests.get(f"{app.url}/admin/scenarios/{name}/versions", headers=app.admin, timeout=30)
    return r.status_code, r.json()


@pytest.fixture(scope="module")
def live(serve_app):
    """The shared app with a cheap labels scenario (generation stops after the label)."""
    serve_app.put("sec-lim-labels", LABELS)
    yield serve_app
    for name in ("sec-lim-labels", "sec-lim-s", "sec-lim-r", "sec-lim-g", "sec-lim-f"):
        requests.delete(f"{serve_app.url}/admin/scenarios/{name}", headers=serve_app.admin, timeout=60)


QUESTION = "Yes or no?"


# --------------------------------------------------------------------------------------------- request limits


def test_max_new_tokens(live):
    limit = DEFAULTS.max_new_tokens
    _refused(_post(live, "/v1/generate", {"scenario": "sec-lim-labels", "prompt": "x", "max_new_tokens": limit + 1}),
             422, "max_new_tokens", "max_new_tokens")
    _refused(_post(live, "/v1/completions", {"scenario": "sec-lim-labels", "prompt": "x", "max_tokens": limit + 1}),
             422, "max_new_tokens", "max_tokens")
    _refused(_post(live, "/v1/chat/completions", {"messages": user_messages(QUESTION), "max_completion_tokens": limit + 1}),
             422, "max_new_tokens", "max_completion_tokens")
    # at the limit: accepted (the label scenario ends after a few tokens)
    r = _post(live, "/v1/generate", {"scenario": "sec-lim-labels", "messages": user_messages(QUESTION), "max_new_tokens": limit})
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["finish_reason"] == "stop"


def test_scenario_max_new_tokens(live):
    """A scenario's own default max_new_tokens is held to the same limit when it is stored."""
    before = _history(live, "sec-lim-labels")
    _refused(_put(live, "sec-lim-labels", {**LABELS, "max_new_tokens": DEFAULTS.max_new_tokens + 1}),
             422, "max_new_tokens", "invalid scenario: max_new_tokens")
    assert _history(live, "sec-lim-labels") == before
    assert _put(live, "sec-lim-labels", {**LABELS, "max_new_tokens": DEFAULTS.max_new_tokens}).status_code == 200


def test_n_and_num_beams(live):
    base = {"scenario": "sec-lim-labels", "messages": user_messages(QUESTION), "max_new_tokens": 4}
    _refused(_post(live, "/v1/generate", {**base, "n": DEFAULTS.max_n + 1}), 422, "max_n", "n")
    _refused(_post(live, "/v1/chat/completions", {"messages": user_messages(QUESTION), "n": DEFAULTS.max_n + 1, "max_tokens": 2}), 422, "max_n", "n")
    _refused(_post(live, "/v1/generate", {**base, "num_beams": DEFAULTS.max_num_beams + 1}), 422, "max_num_beams", "num_beams")
    r = _post(live, "/v1/generate", {**base, "n": DEFAULTS.max_n, "temperature": 1.0})
    assert r.status_code == 200, r.text
    assert len(r.json()["outputs"]) == DEFAULTS.max_n
    r = _post(live, "/v1/generate", {**base, "num_beams": DEFAULTS.max_num_beams})
    assert r.status_code == 200, r.text


def test_exclude_items(live):
    limit = DEFAULTS.max_exclude_items
    base = {"scenario": "sec-lim-labels", "messages": user_messages(QUESTION), "max_new_tokens": 4}
    _refused(_post(live, "/v1/generate", {**base, "exclude": ["yes"] * (limit + 1)}), 422, "max_exclude_items",
             "exclude")
    # at the limit (the same label repeated) it passes, and the excluded label is never the answer
    r = _post(live, "/v1/generate", {**base, "exclude": ["yes"] * limit, "n": 3, "temperature": 2.0})
    assert r.status_code == 200, r.text
    assert [o["text"].strip() for o in r.json()["outputs"]] == ["no"] * 3


def test_filter_limits(live, tokenizer):
    """A catalog with item metadata: filters past each bound are a 422 naming it; at the bound they are served."""
    import json

    root, eos = 2000, tokenizer.eos_token_id
    lines = [json.dumps({"start_token_id": root, "end_token_id": eos, "max_new_tokens": 4})]
    lines += [json.dumps({"ids": [1000 + i], "metadata": {"region": f"r{i % 4}", "stock": i}}) for i in range(8)]
    r = requests.put(f"{live.url}/admin/scenarios/sec-lim-f", data=("\n".join(lines) + "\n").encode(),
                     headers={**live.admin, "Content-Type": "application/x-ndjson"}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    base = {"scenario": "sec-lim-f", "prompt": "Item:"}

    def nested(levels: int) -> dict:
        out: dict = {"region": "r1"}
        for _ in range(levels):
            out = {"$and": [out]}
        return out

    depth = DEFAULTS.max_filter_depth
    assert _post(live, "/v1/generate", {**base, "filter": nested(depth - 1)}).status_code == 200
    _refused(_post(live, "/v1/generate", {**base, "filter": nested(depth)}), 422, "max_filter_depth", "filter")
    _refused(_post(live, "/v1/generate", {**base, "filter": nested(depth + 2)}), 422, "max_filter_depth", "filter")
    clauses = DEFAULTS.max_filter_clauses
    ok = {"$or": [{"stock": i} for i in range(clauses)]}
    assert _post(live, "/v1/generate", {**base, "filter": ok}).status_code == 200
    _refused(_post(live, "/v1/generate", {**base, "filter": {"$or": [{"stock": i} for i in range(clauses + 1)]}}),
             422, "max_filter_clauses", "filter")
    values = DEFAULTS.max_filter_values
    assert _post(live, "/v1/generate", {**base, "filter": {"stock": {"$in": list(range(values))}}}).status_code == 200
    _refused(_post(live, "/v1/generate", {**base, "filter": {"stock": {"$in": list(range(values + 1))}}}), 422,
             "max_filter_values", "filter")


def test_prompt_tokens(live, tokenizer):
    limit = DEFAULTS.max_prompt_tokens

    def prompt(tokens: int) -> str:
        text = "a" + " a" * (tokens - 1)
        assert len(tokenizer.encode(text, add_special_tokens=False)) == tokens
        return text

    error = _refused(_post(live, "/v1/generate", {"prompt": prompt(limit + 1), "max_new_tokens": 1}), 413, "max_prompt_tokens", "prompt")
    assert str(limit + 1) in error["message"]
    _refused(_post(live, "/v1/completions", {"prompt": prompt(limit + 1), "max_tokens": 1}), 413, "max_prompt_tokens")
    _refused(_post(live, "/v1/chat/completions", {"messages": user_messages(prompt(limit)), "max_tokens": 1}), 413, "max_prompt_tokens")
    # (exactly at the limit passes: checked on a replica with a small limit, test_replica_limits; a 4096-token
    # prefill costs tens of seconds on a small CPU)


def test_body_size_live(live):
    limit = DEFAULTS.max_body_bytes
    body = b'{"prompt": "' + b"a" * (limit + 1 - 14) + b'"}'
    assert len(body) == limit + 1
    r = requests.post(f"{live.url}/v1/generate", data=body, headers={"content-type": "application/json"}, timeout=TIMEOUT)
    _refused(r, 413, "max_body_bytes", "request body")
    r = requests.put(f"{live.url}/admin/scenarios/sec-lim-big", data=body, headers={**live.admin, "content-type": "application/json"}, timeout=TIMEOUT)
    _refused(r, 413, "max_body_bytes")
    assert _history(live, "sec-lim-big")[0] == 404


def test_body_size_in_process(tmp_path):
    """A small max_body_bytes on the real ingress app: exactly the limit passes the size check, one more byte
    is a 413, with and without Content-Length (chunked)."""
    from deployments.ingress import Ingress

    limit = 2048
    settings = ServerSettings(data_dir=str(tmp_path), admin_token="t" * 24, limits=Limits(max_body_bytes=limit))
    client = TestClient(Ingress(settings, None, None).http_app)  # no request below reaches a backend

    def body(size: int) -> bytes:  # valid JSON, but 'prompt' and 'messages' together: a 422 once read
        data = b'{"messages": [], "prompt": "' + b"x" * (size - 30) + b'"}'
        assert len(data) == size
        return data

    headers = {"content-type": "application/json"}
    r = client.post("/v1/generate", content=body(limit + 1), headers=headers)
    assert r.status_code == 413 and f"max_body_bytes={limit}" in r.json()["error"]["message"], r.text
    r = client.post("/v1/generate", content=body(limit), headers=headers)
    assert r.status_code == 422, r.text  # past the size check, refused by validation

    def chunks(data: bytes):
        for i in range(0, len(data), 500):
            yield data[i:i + 500]

    r = client.post("/v1/generate", content=chunks(body(limit + 1)), headers=headers)
    assert r.status_code == 413 and f"max_body_bytes={limit}" in r.json()["error"]["message"], r.text
    r = client.post("/v1/generate", content=chunks(body(limit)), headers=headers)
    assert r.status_code == 422, r.text


def test_upload_size_in_process(tmp_path):
    """A catalog upload (an NDJSON or Parquet PUT, streamed to the manager) is bounded by max_upload_bytes in place
    of max_body_bytes: one byte over is a 413 naming it, with Content-Length (the middleware, before the body is
    read) and without (chunked: counted as it streams, before a part reaches the manager); a catalog between the
    two limits passes both checks; a JSON PUT keeps max_body_bytes; no token: a 401 before the body is read."""
    from deployments.ingress import Ingress

    token = "t" * 24
    settings = ServerSettings(data_dir=str(tmp_path), admin_token=token,
                              limits=Limits(max_body_bytes=2048, max_upload_bytes=8192))
    client = TestClient(Ingress(settings, None, None).http_app, raise_server_exceptions=False)  # no backend

    def chunks(data: bytes):
        for i in range(0, len(data), 500):
            yield data[i:i + 500]

    for kind in ("application/x-ndjson", "application/vnd.apache.parquet"):
        headers = {"Authorization": f"Bearer {token}", "content-type": kind}
        for body in (b"x" * 8193, chunks(b"x" * 8193)):
            r = client.put("/admin/scenarios/big", content=body, headers=headers)
            assert r.status_code == 413 and "max_upload_bytes=8192" in r.json()["error"]["message"], r.text
            assert r.json()["error"]["limit_name"] == "max_upload_bytes"
        r = client.put("/admin/scenarios/big", content=b"x" * 4000, headers=headers)
        assert r.status_code != 413, r.text  # (past the size checks: no manager here to take it)
        r = client.put("/admin/scenarios/big", content=chunks(b"x" * 8193), headers={"content-type": kind})
        assert r.status_code == 401, r.text
    r = client.put("/admin/scenarios/big", content=b" " * 4000,
                   headers={"Authorization": f"Bearer {token}", "content-type": "application/json"})
    assert r.status_code == 413 and "max_body_bytes=2048" in r.json()["error"]["message"], r.text


def test_upload_part_timeout_in_process(tmp_path):
    """A catalog upload whose body stops arriving is a 408 naming upload_part_timeout_s once the part it is sending
    is past the limit: the real ingress app under a real HTTP server (uvicorn; TestClient reads a body on the
    app's event loop, so a stalled one would stall the app), a short limit, a body of less than one part (sent
    whole, so the manager is never reached: there is none here), chunked and with Content-Length, NDJSON and
    Parquet. Four stalled uploads of more than one part over Serve, with the manager's spool:
    tests/serve/test_catalog_http.py."""
    import socket
    import threading

    import uvicorn
    from helpers import free_port, http_answer, wait_until

    from deployments.ingress import Ingress

    token = "t" * 24
    limit = 0.5
    settings = ServerSettings(data_dir=str(tmp_path), admin_token=token, limits=Limits(upload_part_timeout_s=limit))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(Ingress(settings, None, None).http_app, host="127.0.0.1", port=port,
                                           lifespan="off", log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, timeout=60, what="uvicorn started", interval=0.05)
        for kind in ("application/x-ndjson", "application/vnd.apache.parquet"):
            for framing in (b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n" % (1 << 20),
                            b"Content-Length: 1048576\r\n\r\n"):
                with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
                    sock.sendall(f"PUT /admin/scenarios/slow HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {token}"
                                 f"\r\nContent-Type: {kind}\r\n".encode() + framing + b"x" * 1000)
                    status, text = http_answer(sock)
                assert status.split(b"\r\n")[0].split(b" ")[1:2] == [b"408"], (kind, framing, status, text[:300])
                error = json.loads(text)["error"]
                assert (error["limit_name"], error["limit"], error["field"]) == ("upload_part_timeout_s", limit,
                                                                                 "body"), error
                assert f"upload_part_timeout_s={limit:g}" in error["message"] and "1000 bytes" in error["message"]
    finally:
        server.should_exit = True
        thread.join(30)


# --------------------------------------------------------------------------------------------- scenario limits (live)


def test_description_bytes(live, tokenizer):
    """A scenario's description is bounded by max_description_bytes (UTF-8) however it is given: a JSON body, an
    NDJSON catalog's header line, a Parquet catalog's header (its metadata under ``catalog``). One byte over is a
    422 naming description and the limit, nothing stored; at the limit it is stored and GET gives it back."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    from deployments.examples import chat_root_token_id

    limit = DEFAULTS.max_description_bytes
    ids = tokenizer.encode(" yes", add_special_tokens=False)
    head = {"start_token_id": chat_root_token_id(tokenizer), "end_token_id": tokenizer.eos_token_id}

    def parquet(header: dict) -> bytes:
        sink = io.BytesIO()
        pq.write_table(pa.table({"ids": pa.array([ids], pa.list_(pa.int32()))})
                       .replace_schema_metadata({"catalog": json.dumps(header)}), sink)
        return sink.getvalue()

    bodies = {
        "application/json": lambda d: json.dumps({**LABELS, "description": d}).encode(),
        "application/x-ndjson": lambda d: (json.dumps({**head, "description": d}) + "\n" + json.dumps(ids)
                                           + "\n").encode(),
        "application/vnd.apache.parquet": lambda d: parquet({**head, "description": d}),
    }
    for i, (kind, body) in enumerate(bodies.items()):
        name = f"sec-lim-d{i}"
        url = f"{live.url}/admin/scenarios/{name}"
        headers = {**live.admin, "Content-Type": kind}
        over = "\u00e9" * (limit // 2) + "x"  # limit + 1 bytes, fewer characters
        r = requests.put(url, data=body(over), headers=headers, timeout=TIMEOUT)
        error = _refused(r, 422, "max_description_bytes", "description")
        assert error["field"] == "description" and error["limit"] == limit, (kind, error)
        assert f"description: {limit + 1} bytes" in error["message"], (kind, error)
        assert _history(live, name)[0] == 404, kind
        r = requests.put(url, data=body("d" * limit), headers=headers, timeout=TIMEOUT)
        assert r.status_code == 200, (kind, r.text[:500])
        got = requests.get(url, headers=live.admin, timeout=TIMEOUT).json()["scenario"]
        assert got["description"] == "d" * limit, kind
        assert requests.delete(url, headers=live.admin, timeout=TIMEOUT).status_code == 200


def test_labels_live(live):
    """Over the default max_labels: refused before anything is compiled, stored or one-off."""
    many = [f"l{i}" for i in range(DEFAULTS.max_labels + 1)]
    _refused(_put(live, "sec-lim-many", {"type": "labels", "labels": many}), 422, "max_labels", "invalid scenario: labels")
    assert _history(live, "sec-lim-many")[0] == 404
    _refused(_post(live, "/v1/chat/completions", {"messages": user_messages(QUESTION), "structured_outputs": {"choice": many}, "max_tokens": 2}),
             422, "max_labels", "structured_outputs.choice")


def test_inline_labels(live):
    """A one-off choice is compiled on a model replica for its one request (100,000 labels cost
    17-20 s of a replica each), so it has smaller bounds than a stored scenario: max_inline_labels and
    max_inline_label_bytes, a 422 naming the field the client used, on every one-off route; a stored scenario of as
    many labels is fine (max_labels)."""
    from processors.scenarios import parse_scenario
    from config import ScenarioError

    limit = DEFAULTS.max_inline_labels
    assert limit < DEFAULTS.max_labels
    many = [f"l{i}" for i in range(limit + 1)]
    over = {"messages": user_messages(QUESTION), "max_tokens": 2}
    _refused(_post(live, "/v1/chat/completions", {**over, "structured_outputs": {"choice": many}}),
             422, "max_inline_labels", "structured_outputs.choice")
    _refused(_post(live, "/v1/completions", {"prompt": "x", "max_tokens": 2, "guided_choice": many}),
             422, "max_inline_labels", "guided_choice")
    wide = ["x" * (DEFAULTS.max_inline_label_bytes // 2 + 1), "y" * (DEFAULTS.max_inline_label_bytes // 2)]
    _refused(_post(live, "/v1/chat/completions", {**over, "structured_outputs": {"choice": wide}}),
             422, "max_inline_label_bytes", "structured_outputs.choice")
    # at the limits: accepted and answered with one of the labels
    at = [f"l{i}" for i in range(limit)]
    r = _post(live, "/v1/chat/completions", {"messages": user_messages("Pick one."), "max_tokens": 8, "structured_outputs": {"choice": at}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] in at, r.text
    # the replica's own check (a direct handle call skips the ingress): the same pipeline stage, one_off=True
    with pytest.raises(ScenarioError) as error:
        parse_scenario({"type": "labels", "labels": many}, DEFAULTS, one_off=True)
    assert error.value.kind == "limit" and f"max_inline_labels={limit}" in str(error.value), error.value
    # a stored scenario is bounded by max_labels only
    r = _put(live, "sec-lim-manyish", {"type": "labels", "labels": many})
    assert r.status_code == 200, r.text
    requests.delete(f"{live.url}/admin/scenarios/sec-lim-manyish", headers=live.admin, timeout=60)


def test_schema_bytes(live):
    limit = DEFAULTS.max_schema_bytes
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "description": ""}
    schema["description"] = "x" * (limit - len(json.dumps(schema, separators=(",", ":")).encode()))
    assert len(json.dumps(schema, separators=(",", ":")).encode()) == limit
    assert _put(live, "sec-lim-s", {"type": "json_schema", "schema": schema}).status_code == 200
    before = _history(live, "sec-lim-s")
    bigger = {**schema, "description": schema["description"] + "x"}
    error = _refused(_put(live, "sec-lim-s", {"type": "json_schema", "schema": bigger}), 422, "max_schema_bytes", "invalid scenario: schema")
    assert str(limit + 1) in error["message"]
    assert _history(live, "sec-lim-s") == before
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": bigger}}
    _refused(_post(live, "/v1/chat/completions", {"messages": user_messages(QUESTION), "response_format": fmt, "max_tokens": 2}),
             422, "max_schema_bytes", "response_format.json_schema.schema")


def _nested_schema(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    assert json_depth(schema) == depth
    return schema


def test_max_tools(live):
    limit = DEFAULTS.max_tools
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(limit + 1)]
    for path, body in (("/v1/chat/completions", {"messages": user_messages(QUESTION), "max_tokens": 2, "tools": tools}),
                       ("/v1/generate", {"messages": user_messages(QUESTION), "max_new_tokens": 2, "tools": tools})):
        _refused(_post(live, path, body), 422, "max_tools", "tools")
    r = _put(live, "sec-lim-t", {"type": "tools", "tools": tools})
    _refused(r, 422, "max_tools", "invalid scenario: tools")
    assert _history(live, "sec-lim-t")[0] == 404
    # at the limit: past the count (tool_choice none: nothing to compile; the answer is the model's)
    body = {"messages": user_messages(QUESTION), "max_tokens": 2, "tools": tools[:limit], "tool_choice": "none"}
    assert "max_tools" not in _post(live, "/v1/chat/completions", body).text


def test_schema_depth(live):
    limit = DEFAULTS.max_schema_depth
    assert _put(live, "sec-lim-s", {"type": "json_schema", "schema": _nested_schema(limit)}).status_code == 200
    before = _history(live, "sec-lim-s")
    _refused(_put(live, "sec-lim-s", {"type": "json_schema", "schema": _nested_schema(limit + 1)}), 422, "max_schema_depth", "invalid scenario: schema")
    # far deeper than the schema checker could recurse: still a clean 4xx, never a 500
    _refused(_put(live, "sec-lim-s", {"type": "json_schema", "schema": _nested_schema(400)}), 422, "max_schema_depth")
    assert _history(live, "sec-lim-s") == before
    for deep in (_nested_schema(limit + 1), _nested_schema(400)):
        r = _post(live, "/v1/completions", {"prompt": "x", "max_tokens": 2, "structured_outputs": {"json": deep}})
        _refused(r, 422, "max_schema_depth", "structured_outputs.json")
    text = "[" * 100_000 + "]" * 100_000  # JSON text (structured_outputs.json may be a string) too deep to parse
    _refused(_post(live, "/v1/completions", {"prompt": "x", "max_tokens": 2, "structured_outputs": {"json": text}}),
             422, "max_schema_depth", "structured_outputs.json")
    r = _post(live, "/v1/completions", {"prompt": "[", "max_tokens": 2, "structured_outputs": {"json": _nested_schema(limit)}})
    assert r.status_code == 200, r.text


def test_regex_length(live):
    limit = DEFAULTS.max_regex_length
    assert _put(live, "sec-lim-r", {"type": "regex", "pattern": "[ab]" * (limit // 4)}).status_code == 200
    before = _history(live, "sec-lim-r")
    _refused(_put(live, "sec-lim-r", {"type": "regex", "pattern": "a" * (limit + 1)}), 422, "max_regex_length", "invalid scenario: pattern")
    assert _history(live, "sec-lim-r") == before
    _refused(_post(live, "/v1/completions", {"prompt": "x", "max_tokens": 2, "structured_outputs": {"regex": "a" * (limit + 1)}}),
             422, "max_regex_length", "structured_outputs.regex")


def test_regex_repeat(live):
    limit = DEFAULTS.max_regex_repeat
    for ok in (f"a{{{limit}}}", "(a{100}){100}" if limit >= 10_000 else f"a{{1,{limit}}}", "[0-9]{3}-[0-9]{4}"):
        assert _put(live, "sec-lim-r", {"type": "regex", "pattern": ok}).status_code == 200, ok
    before = _history(live, "sec-lim-r")
    for bad in (f"a{{{limit + 1}}}", "a{1000000}", "((a{100}){100}){100}", f"(x{{1,{limit}}}){{2}}", "b{99999999999999999999999}"):
        error = _refused(_put(live, "sec-lim-r", {"type": "regex", "pattern": bad}), 422, "max_regex_repeat", "invalid scenario: pattern")
        assert "repetition" in error["message"]
        _refused(_post(live, "/v1/completions", {"prompt": "x", "max_tokens": 2, "structured_outputs": {"regex": bad}}),
                 422, "max_regex_repeat", "structured_outputs.regex")
    assert _history(live, "sec-lim-r") == before


def test_grammar_limits(live):
    """A grammar scenario: its size (max_grammar_bytes, here a long comment) and each /regex/ in it (the regex
    limits), on a stored scenario and on the OpenAI one-off form."""
    limit = DEFAULTS.max_grammar_bytes
    head = 'start: "yes" | "no"\n// '
    at_limit = head + "x" * (limit - len(head.encode()))
    assert _put(live, "sec-lim-g", {"type": "grammar", "grammar": at_limit}).status_code == 200
    before = _history(live, "sec-lim-g")
    error = _refused(_put(live, "sec-lim-g", {"type": "grammar", "grammar": at_limit + "x"}), 422, "max_grammar_bytes",
                     "invalid scenario: grammar")
    assert str(limit + 1) in error["message"]
    repeat = DEFAULTS.max_regex_repeat
    bad = f'start: "a" n\nn: /b{{{repeat + 1}}}/\n'
    _refused(_put(live, "sec-lim-g", {"type": "grammar", "grammar": bad}), 422, "max_regex_repeat",
             "invalid scenario: grammar: the regex on line 2")
    assert _history(live, "sec-lim-g") == before
    for one_off in (at_limit + "x", bad):
        name = "max_grammar_bytes" if one_off != bad else "max_regex_repeat"
        _refused(_post(live, "/v1/completions", {"prompt": "x", "max_tokens": 2, "structured_outputs": {"grammar": one_off}}),
                 422, name, "structured_outputs.grammar")


def test_regex_repeat_measure():
    """What it counts: the size with counted repetitions written out (sequential add up, nested multiply).
    More cases in tests/unit/test_regex_limits.py."""
    assert regex_repeat("[0-9]{3}-[0-9]{4}") == 8
    assert regex_repeat("(a{100}){100}") == 10_000
    assert regex_repeat("((a{100}){100}){100}") == 1_000_000
    assert regex_repeat("(a{10000})" * 400) == 4_000_000
    assert regex_repeat("(ab|c{7}){3}") == 27
    assert regex_repeat("a{2,}b{3,5}") == 7
    assert regex_repeat(r"\p{L}{3}\x{41}") == 4  # braces of an escape are not a repetition
    assert regex_repeat(r"a\{99\}[{]{2}") == 7  # escaped or in a class: literal braces
    assert regex_repeat("(a+)*b?") == 2
    assert regex_repeat("a{" + "9" * 40 + "}") >= 10**18  # no int() of a huge literal, still over any limit
    with pytest.raises(LimitExceeded) as error:
        Limits(max_regex_repeat=50).check_regex("(a{10}){6}")
    assert error.value.limit_name == "max_regex_repeat" and "max_regex_repeat=50" in str(error.value)


def test_json_depth(live):
    limit = DEFAULTS.max_json_depth

    def nested(depth: int):
        value: list = []
        for _ in range(depth - 2):  # the body object is level 1, "description" holds the rest
            value = [value]
        return {"type": "json", "description": value}

    assert json_depth(nested(limit)) == limit
    r = _put(live, "sec-lim-deep", nested(limit))  # under the limit: refused by validation, not by the limit
    assert r.status_code == 422 and "max_json_depth" not in r.text and "description" in r.json()["error"]["message"], r.text
    _refused(_put(live, "sec-lim-deep", nested(limit + 1)), 422, "max_json_depth", "invalid scenario: body")
    raw = ("[" * 100_000 + "]" * 100_000).encode()  # deeper than any JSON parser may recurse: a 422, not a 500
    r = requests.put(f"{live.url}/admin/scenarios/sec-lim-deep", data=raw, headers={**live.admin, "content-type": "application/json"}, timeout=TIMEOUT)
    _refused(r, 422, "max_json_depth", "body")
    r = requests.post(f"{live.url}/v1/generate", data=raw, headers={"content-type": "application/json"}, timeout=TIMEOUT)
    assert 400 <= r.status_code < 500 and "error" in r.json(), r.text
    assert _history(live, "sec-lim-deep")[0] == 404
    with pytest.raises(ValueError, match="max_json_depth"):  # it must leave room for the deepest allowed schema
        Limits(max_schema_depth=limit)


# --------------------------------------------------------------------------------------------- in-process (small limits)


SMALL = Limits(max_labels=3, max_tree_keys=3, max_item_tokens=3)


@pytest.fixture(scope="module")
def small_manager(start_manager):
    """The real config manager (embedded Redis, real tokenizer, no replicas) with small limits."""
    with start_manager("limits-data", limits=SMALL) as manager:
        yield manager


def _refused_by(manager, name: str, body: dict, limit_name: str, limit) -> ServiceError:
    with pytest.raises(ServiceError) as error:
        manager.run(manager.put(name, body))
    assert error.value.status == 422, error.value.message
    assert f"{limit_name}={limit}" in error.value.message, error.value.message
    assert error.value.detail["limit_name"] == limit_name and error.value.detail["limit"] == limit
    assert not manager.store.versions(name)  # nothing stored
    return error.value


def test_labels_in_process(small_manager):
    _refused_by(small_manager, "four", {"type": "labels", "labels": ["a", "b", "c", "d"]}, "max_labels", 3)
    assert small_manager.run(small_manager.put("three", {"type": "labels", "labels": ["a", "b", "c"]}))["version"] == 1


def _tree(keys: int, tokenizer) -> dict:
    ids = tokenizer.encode(" red green blue yellow", add_special_tokens=False)[: keys + 1]
    eos = tokenizer.eos_token_id
    prefix, key = {}, str(ids[0])
    for t in ids[1:keys]:
        prefix[key] = [t]
        key = f"{key}_{t}"
    prefix[key] = [eos]
    assert len(prefix) == keys
    return {"start_token_id": ids[0], "end_token_id": eos, "prefix_dict": prefix}


def test_tree_keys_inline_and_path(small_manager, tokenizer, tmp_path):
    _refused_by(small_manager, "tree4", {"type": "tree", "tree": _tree(4, tokenizer)}, "max_tree_keys", 3)
    assert small_manager.run(small_manager.put("tree3", {"type": "tree", "tree": _tree(3, tokenizer)}))["version"] == 1
    # a tree file is counted too (once loaded), and the message names the file and the limit
    trees = Path(small_manager.settings.tree_root)
    trees.mkdir(parents=True, exist_ok=True)
    big, small = trees / "big.json", trees / "small.json"
    big.write_text(json.dumps(_tree(4, tokenizer)))
    small.write_text(json.dumps(_tree(3, tokenizer)))
    error = _refused_by(small_manager, "treefile4", {"type": "tree", "path": str(big)}, "max_tree_keys", 3)
    assert str(big) in error.message
    assert small_manager.run(small_manager.put("treefile3", {"type": "tree", "path": "small.json"}))["version"] == 1


def test_item_tokens_catalog_and_patch(small_manager):
    """A catalog line or a PATCH add longer than max_item_tokens is a 422 naming the line / ``add[i]`` and the
    limit, nothing stored; an item at the limit is accepted (3 tokens: 3 states, within max_tree_keys=3 too)."""
    header = b'{"start_token_id": 1000, "end_token_id": 2}\n'
    for body, where in ((header + b"[5]\n\n[5,6,7,8]\n", "items: line 4:"),  # the fast parse
                        (header + b'[5]\n[5, 6, 7, 8]\n"x"\n', "items: line 3:")):  # the per-line parse
        with pytest.raises(ServiceError) as error:
            small_manager.run(small_manager.put_items("items4", body))
        assert error.value.status == 422, error.value.message
        assert error.value.message.startswith(where) and "max_item_tokens=3" in error.value.message, error.value.message
        assert error.value.detail["limit_name"] == "max_item_tokens" and error.value.detail["limit"] == 3
        assert not small_manager.store.versions("items4")
    assert small_manager.run(small_manager.put_items("items3", header + b"[5,6,7]\n"))["version"] == 1
    with pytest.raises(ServiceError) as error:
        small_manager.run(small_manager.patch("items3", {"add": [[5, 6, 8], [5, 6, 7, 8]]}))
    assert error.value.status == 422, error.value.message
    assert error.value.message.startswith("add: add[1]:") and "max_item_tokens=3" in error.value.message
    assert error.value.detail["limit_name"] == "max_item_tokens"
    assert len(small_manager.store.versions("items3")) == 1  # nothing stored
    answer = small_manager.run(small_manager.patch("items3", {"add": [[5, 6, 8]]}))
    assert answer["version"] == 2 and answer["added"] == 1


@pytest.mark.parametrize("path", ["/etc/passwd", "../../../../etc/passwd", "sub/../../escape.json", "link.json"])
def test_tree_path_outside_the_tree_directory_is_refused_without_reading_it(small_manager, path, tmp_path):
    trees = Path(small_manager.settings.tree_root)
    trees.mkdir(parents=True, exist_ok=True)
    secret = tmp_path / "secret.json"
    secret.write_text('{"secret": "do not echo me"}')
    if path == "link.json":  # a link inside the directory that points out of it
        (trees / "link.json").unlink(missing_ok=True)
        (trees / "link.json").symlink_to(secret)
    with pytest.raises(ServiceError) as error:
        small_manager.run(small_manager.put("escape", {"type": "tree", "path": path}))
    assert error.value.status == 422 and "tree directory" in error.value.message, error.value.message
    assert "do not echo me" not in error.value.message and "root:" not in error.value.message


def test_compile_timeout(small_manager, tokenizer):
    from deployments.manager import ConfigManager

    hasty = ConfigManager(ServerSettings(data_dir=small_manager.settings.data_dir, seed_examples=False,
                                         limits=Limits(compile_timeout_s=0.001)),
                          tokenizer=tokenizer, redis_client=small_manager.store.client, prefix="cs-hasty:")
    try:
        with pytest.raises(ServiceError) as error:
            small_manager.run(hasty.put("slow", {"type": "labels", "labels": [f"label number {i}" for i in range(2000)]}))
        assert error.value.status == 400 and "compile_timeout_s" in error.value.message, error.value.message
        assert not hasty.store.versions("slow")
    finally:
        small_manager.run(hasty.close())


def test_compile_memory(small_manager, tokenizer):
    """A schema under 1 KB whose grammar wants gigabytes (an allOf of 24 patterns) is a 400 naming the limit; the
    grammar is built in a worker process, so only that process runs out of memory."""
    from deployments.manager import ConfigManager

    frugal = ConfigManager(ServerSettings(data_dir=small_manager.settings.data_dir, seed_examples=False,
                                          limits=Limits(compile_memory_mb=64)),
                           tokenizer=tokenizer, redis_client=small_manager.store.client, prefix="cs-frugal:")
    schema = {"type": "string", "allOf": [{"pattern": f"a{{{i},}}"} for i in range(1, 25)]}
    try:
        with pytest.raises(ServiceError) as error:
            small_manager.run(frugal.put("greedy", {"type": "json_schema", "schema": schema}))
        assert error.value.status == 400 and "compile_memory_mb=64" in error.value.message, error.value.message
        assert not frugal.store.versions("greedy")
        assert small_manager.run(frugal.put("fine", {"type": "json_schema", "schema": {"type": "integer"}}))
    finally:
        small_manager.run(frugal.close())


def test_replica_limits(tokenizer, model):
    """A model replica (real model) with small limits: its own checks of the prompt length, the default
    max_new_tokens, and the limits on one-off constraints (a direct handle call skips the ingress)."""
    from deployments.replica import ModelReplica

    limits = Limits(max_labels=2, max_regex_repeat=100, max_prompt_tokens=16, default_max_new_tokens=3)
    replica = ModelReplica(ServerSettings(limits=limits), None, model=model, tokenizer=tokenizer)
    try:
        prompt = "a" + " a" * 15
        assert len(tokenizer.encode(prompt, add_special_tokens=False)) == 16
        out = asyncio.run(replica.generate({"prompt": prompt, "temperature": 0}))  # at the limit: runs
        assert out["usage"]["prompt_tokens"] == 16
        assert out["usage"]["completion_tokens"] <= 3  # default_max_new_tokens
        assert out["outputs"][0]["finish_reason"] == "stop" or out["usage"]["completion_tokens"] == 3
        with pytest.raises(ServiceError) as error:
            asyncio.run(replica.generate({"prompt": prompt + " a", "max_new_tokens": 1}))
        assert error.value.status == 413 and "max_prompt_tokens=16" in error.value.message, error.value.message
        cases = [
            ({"type": "labels", "labels": ["a", "b", "c"]}, "max_labels=2"),
            ({"type": "regex", "pattern": "a{101}"}, "max_regex_repeat=100"),
            ({"type": "json_schema", "schema": _nested_schema(DEFAULTS.max_schema_depth + 1)}, "max_schema_depth="),
            ({"type": "tree", "path": "/etc/passwd"}, "not as a server file"),
        ]
        for inline, expected in cases:
            with pytest.raises(ServiceError) as error:
                asyncio.run(replica.generate({"inline_scenario": inline, "prompt": "x", "max_new_tokens": 1}))
            assert error.value.status == 422 and expected in error.value.message, error.value.message
        for field, value, expected in (("n", 9, "max_n=8"), ("num_beams", 9, "max_num_beams=8"), ("seed", 2**64, "seed")):
            with pytest.raises(ServiceError) as error:
                asyncio.run(replica.generate({"prompt": "x", "max_new_tokens": 1, field: value}))
            assert error.value.status == 422 and expected in error.value.message, error.value.message
        out = asyncio.run(replica.generate({"inline_scenario": {"type": "regex", "pattern": "a{3}"}, "prompt": "x", "max_new_tokens": 5}))
        assert out["outputs"][0]["text"] == "aaa"
    finally:
        replica.shutdown()
