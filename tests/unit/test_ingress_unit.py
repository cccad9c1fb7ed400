"""The ingress's HTTP surface in-process: request parsing, limits, auth, OpenAI mapping, SSE framing, errors.

The FastAPI app runs under ``fastapi.testclient.TestClient`` (real HTTP semantics, no Ray). The model
replicas and the config manager are replaced by :class:`FakeHandle` objects that record calls and answer
from small functions. These stand-ins are acceptable only here, because these tests target how the
ingress parses requests and maps errors; the service end to end (real Serve, real replicas, real Redis)
is tested over HTTP under ``tests/serve``.
"""

from __future__ import annotations

import json
import os
import stat

import pytest
from fastapi.testclient import TestClient

from config.settings import Limits
from deployments.auth import check_bearer, mask_token, resolve_admin_token, token_file_path
from deployments.ingress import Ingress
from deployments.json_body import parse_json_body
from deployments.openai.api import served_model_name
from deployments.protocol import ServiceError

TOKEN = "test-admin-token-0123456789"
KNOWN = ["sentiment", "person"]


def _response(request: dict, texts=("positive",), finish="stop") -> dict:
    outputs = [{"text": t, "token_ids": [1, 2], "finish_reason": finish, "error": None} for t in texts]
    return {
        "scenario": request.get("scenario"),
        "version": 3 if request.get("scenario") else None,
        "outputs": outputs,
        "usage": {"prompt_tokens": 5, "completion_tokens": 2 * len(outputs), "total_tokens": 5 + 2 * len(outputs)},
    }


async def fake_generate(request: dict) -> dict:
    if request.get("scenario") not in (None, *KNOWN):
        raise ServiceError(404, f"unknown scenario {request['scenario']!r}", {"known": KNOWN})
    if request.get("scenario") == "person":
        raise RuntimeError("boom: /secret/path/replica.py line 42")
    return _response(request, texts=[f"out{i}" for i in range(request["n"])])


async def fake_generate_stream(request: dict):
    if request.get("scenario") not in (None, *KNOWN):
        raise ServiceError(404, f"unknown scenario {request['scenario']!r}", {"known": KNOWN})
    for index in range(request["n"]):
        for piece in ("pos", "itive"):
            yield {"type": "token", "index": index, "token_id": 7, "text": piece, "finish_reason": None, "response": None, "error": None}
    if request.get("scenario") == "person":
        raise RuntimeError("boom mid-stream /secret/path")
    yield {"type": "done", "index": 0, "response": _response(request, texts=["positive"] * request["n"])}


class FakeHandle:
    """Stand-in for a Serve ``DeploymentHandle`` (unit tests of the ingress only, see the module docstring).

    ``handle.method.remote(*args)`` records the call and returns an awaitable of ``methods[method](*args)``;
    on ``handle.options(stream=True)`` it returns the async iterator that the method (an async generator) makes.
    """

    def __init__(self, calls: list | None = None, stream: bool = False, **methods):
        self.methods = methods
        self.calls = [] if calls is None else calls
        self.stream = stream

    def options(self, stream: bool = False, **_):
        return FakeHandle(self.calls, stream, **self.methods)

    def __getattr__(self, name: str):
        if name.startswith("_") or name not in self.methods:
            raise AttributeError(name)
        handle = self

        class _Method:
            @staticmethod
            def remote(*args):
                # a generate request goes as its model (pickled by Ray); these stand-ins read it as its dict
                args = tuple(a.model_dump() if hasattr(a, "model_dump") else a for a in args)
                handle.calls.append((name, args))
                result = handle.methods[name](*args)
                return result if handle.stream else _awaitable(result)

        return _Method()


async def _awaitable(result):
    return await result if hasattr(result, "__await__") else result


def _manager() -> FakeHandle:
    async def put(name, body):
        # the ingress sends the body as bytes; the manager parses it (the real parser, as ConfigManager.put)
        body = parse_json_body(body, Limits(max_body_bytes=4096, max_new_tokens=100, max_n=4), scenario=True)
        if body.get("type") == "bogus":
            raise ServiceError(422, "type: unknown scenario type 'bogus'")
        return {"name": name, "version": 4}

    async def get(name, version=None):
        if name not in KNOWN:
            raise ServiceError(404, f"unknown scenario {name!r}", {"known": KNOWN})
        return {"name": name, "version": version or 3, "scenario": {"type": "labels", "labels": ["a"]}, "created_at": 1.5, "action": "put"}

    async def health():
        return {"status": "ok", "redis": "ok"}

    async def replica_versions():
        return {"replica-1": {"sentiment": 3}}

    return FakeHandle(
        put=put,
        get=get,
        delete=lambda name: _awaitable_value(None),
        versions=lambda name: _awaitable_value([{"version": 1}, {"version": 2}]),
        rollback=lambda name, version: _awaitable_value({"name": name, "version": 5}),
        list=lambda: _awaitable_value([{"name": "sentiment", "type": "labels", "version": 3}]),
        health=health,
        replica_versions=replica_versions,
    )


async def _awaitable_value(value):
    return value


@pytest.fixture
def setup(tmp_path):
    model = FakeHandle(generate=fake_generate, generate_stream=fake_generate_stream,
                       ping=lambda: _awaitable_value("replica-1"))
    manager = _manager()
    settings = {"data_dir": str(tmp_path), "admin_token": TOKEN, "limits": {"max_body_bytes": 4096, "max_new_tokens": 100, "max_n": 4}}
    ingress = Ingress(settings, model, manager)
    client = TestClient(ingress.http_app, raise_server_exceptions=False)
    return client, model, manager


def _error(resp, status):
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert body["error"]["status"] == status
    return body["error"]


def _sse(resp) -> list[str]:
    assert resp.headers["content-type"].startswith("text/event-stream")
    text = resp.text
    assert text.endswith("data: [DONE]\n\n")
    frames = text.split("\n\n")[:-1]
    assert all(f.startswith("data: ") and "\n" not in f for f in frames), frames
    return [f.removeprefix("data: ") for f in frames]


# ------------------------------------------------------------------------------------------- auth


def test_generated_admin_token_file(tmp_path, caplog):
    settings = {"data_dir": str(tmp_path / "d"), "admin_token": None}
    with caplog.at_level("INFO"):
        token = resolve_admin_token(settings)
    path = token_file_path(settings)
    assert path.exists() and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert resolve_admin_token(settings) == token and len(token) >= 32
    assert str(path) in caplog.text and token not in caplog.text
    assert resolve_admin_token({"data_dir": str(tmp_path), "admin_token": "given"}) == "given"


def test_bearer_check_and_mask():
    assert check_bearer(f"Bearer {TOKEN}", TOKEN) and check_bearer(f"bearer  {TOKEN} ", TOKEN)
    assert not check_bearer(None, TOKEN) and not check_bearer(TOKEN, TOKEN) and not check_bearer("Bearer x", TOKEN)
    assert not check_bearer(f"Basic {TOKEN}", TOKEN)
    assert mask_token(TOKEN) == "test…" and TOKEN not in mask_token(TOKEN)


def test_admin_requires_token(setup):
    client, _, manager = setup
    body = {"type": "labels", "labels": ["yes", "no"]}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        resp = client.put("/admin/scenarios/yesno", json=body, headers=headers)
        error = _error(resp, 401)
        assert resp.headers["www-authenticate"] == "Bearer"
        assert "token" in error["message"]
    assert not manager.calls
    resp = client.put("/admin/scenarios/yesno", json=body, headers={"Authorization": f"Bearer {TOKEN}"})
    assert resp.status_code == 200 and resp.json() == {"name": "yesno", "version": 4}
    # the body goes to the manager as the bytes received, parsed there once
    assert [(m, n, json.loads(raw)) for m, (n, raw) in manager.calls] == [("put", "yesno", body)]


def test_admin_routes(setup):
    client, _, manager = setup
    auth = {"Authorization": f"Bearer {TOKEN}"}
    got = client.get("/admin/scenarios/sentiment?version=2", headers=auth).json()
    assert got["version"] == 2 and got["scenario"]["type"] == "labels" and got["action"] == "put"
    error = _error(client.get("/admin/scenarios/nope", headers=auth), 404)
    assert error["known"] == KNOWN
    assert client.delete("/admin/scenarios/sentiment", headers=auth).json() == {"name": "sentiment", "deleted": True}
    assert client.get("/admin/scenarios/sentiment/versions", headers=auth).json()["versions"] == [{"version": 1}, {"version": 2}]
    assert client.post("/admin/scenarios/sentiment/rollback", json={"version": 1}, headers=auth).json()["version"] == 5
    assert "version" in _error(client.post("/admin/scenarios/s/rollback", json={"version": 0}, headers=auth), 422)["message"]
    assert "not valid JSON" in _error(client.put("/admin/scenarios/s", content=b"{nope", headers=auth), 422)["message"]
    assert "object" in _error(client.put("/admin/scenarios/s", json=[1], headers=auth), 422)["message"]
    assert "name" in _error(client.put("/admin/scenarios/bad%20name", json={"type": "json"}, headers=auth), 422)["message"]
    assert "bogus" in _error(client.put("/admin/scenarios/s", json={"type": "bogus"}, headers=auth), 422)["message"]


# ------------------------------------------------------------------------------------------- /v1/generate


def test_generate_passes_request(setup):
    client, model, _ = setup
    resp = client.post("/v1/generate", json={"scenario": "sentiment", "prompt": "Great!", "max_new_tokens": 5, "n": 2, "top_k": 3})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["scenario"] == "sentiment" and body["version"] == 3 and [o["text"] for o in body["outputs"]] == ["out0", "out1"]
    name, (request,) = model.calls[0]
    assert name == "generate" and request["max_new_tokens"] == 5 and request["n"] == 2 and request["top_k"] == 3
    assert request["inline_scenario"] is None and request["prompt"] == "Great!"


@pytest.mark.parametrize(
    "body, field",
    [
        ({"prompt": "x", "max_new_tokens": 0}, "max_new_tokens"),
        ({"prompt": "x", "max_new_tokens": 101}, "max_new_tokens"),
        ({"prompt": "x", "n": 5}, "n"),
        ({"prompt": "x", "num_beams": 9}, "num_beams"),
        ({"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, "prompt"),
        ({}, "prompt"),
        ({"messages": [{"role": "robot", "content": "y"}]}, "messages.0.role"),
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "inline_scenario": {"type": "json"}}, "inline_scenario"),
        ({"prompt": "x", "bogus": 1}, "bogus"),
    ],
)
def test_generate_422_names_field(setup, body, field):
    client, model, _ = setup
    error = _error(client.post("/v1/generate", json=body), 422)
    assert field in error["message"]
    assert "Traceback" not in json.dumps(error)
    assert not model.calls


def test_invalid_json_is_422(setup):
    client, _, _ = setup
    _error(client.post("/v1/generate", content=b"{not json", headers={"content-type": "application/json"}), 422)


def test_body_too_large_is_413(setup):
    client, model, _ = setup
    error = _error(client.post("/v1/generate", json={"prompt": "x" * 5000}), 413)
    assert "4096" in error["message"]

    def chunks():  # no Content-Length: counted while it streams in
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}'

    _error(client.post("/v1/generate", content=chunks(), headers={"content-type": "application/json"}), 413)
    assert not model.calls


def test_unknown_scenario_404_lists_known(setup):
    client, _, _ = setup
    error = _error(client.post("/v1/generate", json={"scenario": "nope", "prompt": "x"}), 404)
    assert error["known"] == KNOWN and "nope" in error["message"]
    error = _error(client.post("/v1/generate", json={"scenario": "nope", "prompt": "x", "stream": True}), 404)
    assert error["known"] == KNOWN


def test_unexpected_error_is_generic_500(setup, caplog):
    client, _, _ = setup
    with caplog.at_level("ERROR"):
        resp = client.post("/v1/generate", json={"scenario": "person", "prompt": "x"})
    error = _error(resp, 500)
    assert error["message"] == "internal server error" and error["error_id"]
    assert "boom" not in resp.text and "secret" not in resp.text and "Traceback" not in resp.text
    assert error["error_id"] in caplog.text and "boom" in caplog.text  # the log has what the client does not


def test_unknown_route_is_json_404(setup):
    client, _, _ = setup
    _error(client.get("/v1/nothing"), 404)


def test_generate_sse_framing(setup):
    client, _, _ = setup
    resp = client.post("/v1/generate", json={"scenario": "sentiment", "prompt": "x", "stream": True, "n": 2})
    assert resp.status_code == 200
    events = [json.loads(f) for f in _sse(resp)[:-1]]
    tokens = [e for e in events if e["type"] == "token"]
    assert [(e["index"], e["text"]) for e in tokens] == [(0, "pos"), (0, "itive"), (1, "pos"), (1, "itive")]
    assert events[-1]["type"] == "done" and events[-1]["response"]["version"] == 3


def test_generate_sse_error_mid_stream(setup):
    client, _, _ = setup
    resp = client.post("/v1/generate", json={"scenario": "person", "prompt": "x", "stream": True})
    assert resp.status_code == 200
    last = json.loads(_sse(resp)[-2])
    assert last["type"] == "error" and last["status"] == 500 and "boom" not in resp.text


# ------------------------------------------------------------------------------------------- OpenAI routes


def _sent(model) -> dict:
    return model.calls[-1][1][0]


def test_completions_mapping_and_shape(setup):
    client, model, _ = setup
    resp = client.post(
        "/v1/completions",
        json={
            "model": served_model_name(None), "prompt": ["Review: great"], "max_tokens": 7, "temperature": 0.5,
            "top_p": 0.9, "n": 2, "seed": 11, "scenario": "sentiment", "top_k": 4, "stop": "\n",
            "frequency_penalty": 0, "logit_bias": {}, "user": "u", "echo": False,  # ignored, or at their neutral value
        },
    )
    assert resp.status_code == 200, resp.text
    sent = _sent(model)
    assert sent["prompt"] == "Review: great" and sent["scenario"] == "sentiment" and sent["inline_scenario"] is None
    assert (sent["max_new_tokens"], sent["temperature"], sent["top_p"], sent["n"], sent["seed"], sent["top_k"]) == (7, 0.5, 0.9, 2, 11, 4)
    assert sent["stop"] == ["\n"] and sent["num_beams"] == 1 and sent["logprobs"] is None
    body = resp.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-") and isinstance(body["created"], int)
    assert body["model"] == served_model_name(None)
    assert body["choices"] == [
        {"index": 0, "text": "out0", "finish_reason": "stop", "logprobs": None, "attempts": 1, "error": None, "score": None},
        {"index": 1, "text": "out1", "finish_reason": "stop", "logprobs": None, "attempts": 1, "error": None, "score": None},
    ]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}
    assert body["scenario"] == "sentiment" and body["scenario_version"] == 3


def test_chat_shape_and_messages(setup):
    client, model, _ = setup
    resp = client.post(
        "/v1/chat/completions",
        json={
            "messages": [
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}], "name": "bob"},
            ],
            "max_completion_tokens": 9, "max_tokens": 3, "tools": [], "presence_penalty": 0,
        },
    )
    assert resp.status_code == 200, resp.text
    sent = _sent(model)
    assert sent["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    assert sent["max_new_tokens"] == 9 and sent["prompt"] is None
    body = resp.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "out0", "reasoning_content": None},
                                "finish_reason": "stop", "logprobs": None, "attempts": 1, "error": None, "score": None}]
    assert set(body["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}


@pytest.mark.parametrize(
    "extra, status, names",
    [
        ({"model": "gpt-4o"}, 404, ["gpt-4o"]),
        ({"frobnicate": 1}, 400, ["frobnicate"]),
        ({"frobnicate": 1, "zap": True}, 400, ["frobnicate", "zap"]),
        ({"frequency_penalty": 0.5}, 400, ["frequency_penalty"]),
        ({"logit_bias": {"1": 2}}, 400, ["logit_bias"]),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {
            "name": "g"}}}, 400, ["tool_choice.function.name"]),  # tools work (tests/unit/test_tool_calls.py)
        ({"tool_choice": "required"}, 400, ["tool_choice"]),
        ({"echo": 0}, 400, ["echo"]),  # 0 is not false
        ({"logprobs": True, "stream": True}, 400, ["logprobs"]),
        ({"top_logprobs": 2}, 422, ["top_logprobs"]),
        ({"logprobs": 3}, 422, ["logprobs"]),
        ({"guided_choice": ["a"], "guided_regex": "a"}, 422, ["guided_choice", "guided_regex"]),
        ({"guided_choice": []}, 422, ["guided_choice"]),
        ({"stop": [""]}, 422, ["stop"]),
        ({"num_beams": 0}, 422, ["num_beams"]),
    ],
)
def test_openai_refusals_name_the_field(setup, extra, status, names):
    client, model, _ = setup
    error = _error(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], **extra}), status)
    assert all(name in error["message"] for name in names), error
    assert not model.calls


def test_openai_extras_pass_through(setup):
    client, model, _ = setup
    body = {"messages": [{"role": "user", "content": "x"}], "model": served_model_name(None), "num_beams": 3, "n": 2,
            "stop": ["a", "b"], "logprobs": True, "top_logprobs": 2, "user": "u", "store": False,
            "guided_regex": "[0-9]+", "presence_penalty": 0.0, "tool_choice": "none"}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    sent = _sent(model)
    assert (sent["num_beams"], sent["n"], sent["stop"], sent["logprobs"]) == (3, 2, ["a", "b"], 2)
    assert sent["inline_scenario"] == {"type": "regex", "pattern": "[0-9]+"}
    assert client.post("/v1/completions", json={"prompt": "x", "logprobs": 0}).status_code == 200
    assert _sent(model)["logprobs"] == 0
    assert client.post("/v1/completions", json={"prompt": "x", "model": "default"}).status_code == 200  # the alias


SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


@pytest.mark.parametrize(
    "extra, inline",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}}, {"type": "json_schema", "schema": SCHEMA}),
        ({"response_format": {"type": "json_object"}}, {"type": "json_schema", "schema": {"type": "object"}}),
        ({"response_format": {"type": "text"}}, None),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, {"type": "labels", "labels": ["yes", "no"], "multi_label": False, "separator": ","}),
        ({"structured_outputs": {"json": SCHEMA}}, {"type": "json_schema", "schema": SCHEMA}),
        ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, {"type": "json_schema", "schema": SCHEMA}),
        ({"structured_outputs": {"regex": "[0-9]{3}"}}, {"type": "regex", "pattern": "[0-9]{3}"}),
    ],
)
def test_one_off_constraints(setup, extra, inline):
    client, model, _ = setup
    resp = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], **extra})
    assert resp.status_code == 200, resp.text
    assert _sent(model)["inline_scenario"] == inline and _sent(model)["scenario"] is None


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 101}, "max_tokens"),
        ({"max_completion_tokens": 500}, "max_completion_tokens"),
        ({"n": 5}, "n"),
        ({"top_k": -1}, "top_k"),
        ({"scenario": 5}, "scenario"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "json_schema"),
        ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "start: /a{99999}/"}}, "structured_outputs.grammar"),  # max_regex_repeat
        ({"structured_outputs": {"grammar": " "}}, "structured_outputs.grammar"),
        ({"guided_grammar": ""}, "guided_grammar"),
        ({"structured_outputs": {"choice": [" padded"]}}, "structured_outputs.choice"),
        ({"structured_outputs": {"json": "{nope"}}, "structured_outputs.json"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": 5}}}}, "response_format.json_schema.schema"),
        ({"scenario": "sentiment", "response_format": {"type": "json_object"}}, "response_format"),
        ({"messages": [{"role": "function", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages.0.content"),
    ],
)
def test_openai_422_names_field(setup, extra, field):
    client, model, _ = setup
    error = _error(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], **extra}), 422)
    assert field in error["message"], error
    assert not model.calls


def test_completions_prompt_list_must_hold_one(setup):
    client, _, _ = setup
    assert "prompt" in _error(client.post("/v1/completions", json={"prompt": ["a", "b"]}), 422)["message"]


def test_chat_stream_chunks(setup):
    client, _, _ = setup
    resp = client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}], "scenario": "sentiment", "stream": True, "n": 2, "stream_options": {"include_usage": True}},
    )
    assert resp.status_code == 200
    chunks = [json.loads(f) for f in _sse(resp)[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert [c["delta"] for c in chunks[0]["choices"]] == [{"role": "assistant", "content": ""}] * 2
    text = {0: "", 1: ""}
    finish = {}
    for c in chunks[1:]:
        for choice in c["choices"]:
            text[choice["index"]] += choice["delta"].get("content", "")
            if choice["finish_reason"]:
                finish[choice["index"]] = choice["finish_reason"]
    assert text == {0: "positive", 1: "positive"} and finish == {0: "stop", 1: "stop"}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 9


def test_completions_stream_chunks(setup):
    client, _, _ = setup
    resp = client.post("/v1/completions", json={"prompt": "x", "stream": True})
    chunks = [json.loads(f) for f in _sse(resp)[:-1]]
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "positive"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_openai_stream_error_chunk(setup):
    client, _, _ = setup
    resp = client.post("/v1/completions", json={"prompt": "x", "stream": True, "scenario": "person"})
    last = json.loads(_sse(resp)[-2])
    assert last["error"]["status"] == 500 and "boom" not in resp.text


def test_official_openai_client(setup):
    openai = pytest.importorskip("openai")
    client, model, _ = setup
    oa = openai.OpenAI(base_url=f"{client.base_url}/v1", api_key="unused", http_client=client)
    chat = oa.chat.completions.create(
        model=served_model_name(None),
        messages=[{"role": "user", "content": "x"}],
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
        max_tokens=8,
        extra_body={"top_k": 2},
    )
    assert chat.choices[0].message.content == "out0" and chat.usage.total_tokens == 7
    assert _sent(model)["inline_scenario"] == {"type": "json_schema", "schema": SCHEMA} and _sent(model)["top_k"] == 2
    stream = oa.completions.create(model=served_model_name(None), prompt="x", stream=True, extra_body={"scenario": "sentiment"})
    assert "".join(c.choices[0].text for c in stream if c.choices) == "positive"
    with pytest.raises(openai.NotFoundError) as caught:
        oa.completions.create(model=served_model_name(None), prompt="x", extra_body={"scenario": "nope"})
    assert caught.value.body["known"] == KNOWN
    with pytest.raises(openai.NotFoundError) as caught:
        oa.completions.create(model="gpt-4o", prompt="x")
    assert "gpt-4o" in caught.value.message
    assert [m.id for m in oa.models.list()] == [served_model_name(None)]


# ------------------------------------------------------------------------------------------- listing, health, docs


def test_models_scenarios_health(setup):
    client, _, manager = setup
    assert client.get("/v1/models").json()["data"][0]["id"] == "SmolLM2-135M-Instruct"
    assert client.get("/v1/scenarios").json()["scenarios"] == [{"name": "sentiment", "type": "labels", "version": 3}]
    health = client.get("/healthz").json()
    assert health == {"status": "ok", "ingress": "ok", "manager": {"status": "ok", "redis": "ok"}, "replicas": {"replica-1": {"sentiment": 3}}, "replicas_error": None}

    async def down():
        return {"status": "degraded", "redis": "down"}

    manager.methods["health"] = down
    assert client.get("/healthz").json()["status"] == "degraded"

    async def unreachable():
        raise ConnectionError("manager gone")

    manager.methods["health"] = manager.methods["replica_versions"] = unreachable
    resp = client.get("/healthz")
    assert resp.status_code == 200
    assert resp.json()["status"] == "degraded" and resp.json()["manager"]["status"] == "unreachable"
    assert resp.json()["replicas"] == {} and resp.json()["replicas_error"] == "internal server error"


def test_served_model_name():
    assert served_model_name(None) == "SmolLM2-135M-Instruct"
    assert served_model_name("/models/qwen.Q4.gguf") == "qwen.Q4"
    assert served_model_name("/ckpt/my-model/") == "my-model"


def test_openapi_documents_everything(setup):
    client, _, _ = setup
    spec = client.get("/openapi.json").json()
    assert {"/v1/generate", "/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/scenarios", "/healthz",
            "/admin/scenarios/{name}", "/admin/scenarios/{name}/versions", "/admin/scenarios/{name}/rollback"} <= set(spec["paths"])
    schemas = spec["components"]["schemas"]
    assert "inline_scenario" not in schemas["GenerateBody"]["properties"]
    assert {"LabelsScenario", "JsonSchemaScenario", "TreeScenario"} <= set(schemas)
    put = spec["paths"]["/admin/scenarios/{name}"]["put"]
    assert "oneOf" in json.dumps(put["requestBody"]) and put["security"]
    assert client.get("/docs").status_code == 200


def test_every_generating_route_is_counted_per_client(setup):
    """Every public POST route generates (the admin routes are behind the token): each must be in
    ``guards.GENERATE_PATHS``, the paths the per-client bounds count, so that a new route cannot be missed (the
    Responses API once was: every Responses client was one "unknown" client, never refused)."""
    from fastapi.routing import APIRoute

    from deployments.guards import GENERATE_PATHS

    client, _, _ = setup
    public_posts = {route.path for route in client.app.routes if isinstance(route, APIRoute)
                    and "POST" in route.methods and not route.path.startswith("/admin/")}
    assert {"/v1/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses"} <= public_posts
    assert public_posts <= GENERATE_PATHS, sorted(public_posts - GENERATE_PATHS)
    assert GENERATE_PATHS <= public_posts, sorted(GENERATE_PATHS - public_posts)  # no stale entry
