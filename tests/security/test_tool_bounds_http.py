"""Tools and the JSON inside request fields, over HTTP on the shared app.

* Thousands of tools are refused by ``limits.max_tools`` before any tool is read, quickly, and the ingress keeps
  answering meanwhile (``GET /v1/models``, served on the ingress's event loop, is timed from another thread);
  the tool work that is within the bounds runs off the event loop. A stored tool set past the limit is refused
  the same way and nothing is stored.
* ``tool_choice: "none"`` gets the same ``parameters`` checks as any other choice.
* Every request field that takes JSON, nested 10,000 deep (in the body, or as JSON text in a string such as a
  tool call's ``arguments``), and 500 deep (parseable, past every depth limit), is a 4xx naming the field or the
  limit: never a 500.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from config import Limits

pytestmark = pytest.mark.serve

DEFAULTS = Limits()
TIMEOUT = 300
ROUTES = ("/v1/chat/completions", "/v1/responses")
#: a generous bound that tells "answered at once" from the seconds-long behaviour of the unbounded tool setup
QUICK_S = 10.0
#: the worst latency of the probe while the heavy requests run: a stalled event loop shows as seconds
PROBE_S = 2.0


def _tools(count: int, flat: bool = False, parameters: dict | None = None) -> list[dict]:
    """``count`` function tools named f0, f1, ... (``flat``: the Responses API's shape)."""
    out = []
    for i in range(count):
        function = {"name": f"f{i}", **({"parameters": parameters} if parameters is not None else {})}
        out.append({"type": "function", **function} if flat else {"type": "function", "function": function})
    return out


def _body(route: str, **fields) -> dict:
    if route == "/v1/responses":
        return {"input": "Hi", "max_output_tokens": 2, **fields}
    return {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **fields}


class _Probe:
    """Times ``GET /v1/models`` (answered by the ingress's event loop alone) in a loop on another thread."""

    def __init__(self, url: str):
        self.url, self.times, self.errors = url, [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.monotonic()
            try:
                r = requests.get(f"{self.url}/v1/models", timeout=120)
                if r.status_code != 200:
                    self.errors.append(r.status_code)
            except requests.RequestException as exc:
                self.errors.append(repr(exc))
            self.times.append(time.monotonic() - start)
            time.sleep(0.05)

    def __enter__(self) -> _Probe:
        self._thread.start()
        while len(self.times) < 3:  # the probe runs before the request under test is sent
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        time.sleep(0.3)
        self._stop.set()
        self._thread.join(timeout=150)

    @property
    def worst(self) -> float:
        return max(self.times)


def _refused(r: requests.Response, status: int, *words: str) -> str:
    assert r.status_code == status, (r.status_code, r.text[:500])
    message = r.json()["error"]["message"]
    for word in words:
        assert word in message, message
    return message


# ----------------------------------------------------------------------------------------------------- many tools


@pytest.mark.parametrize("route", ROUTES)
def test_thousands_of_tools_are_refused_at_once_and_the_ingress_keeps_answering(serve_app, route):
    """6,000 parameterless tools (a 330 KB body): a 422 naming max_tools, in well under a second of work (it
    took 75 s, with the event loop held, before the bound)."""
    body = _body(route, tools=_tools(6000, flat=route == "/v1/responses"))
    with _Probe(serve_app.url) as probe:
        start = time.monotonic()
        r = requests.post(f"{serve_app.url}{route}", json=body, timeout=TIMEOUT)
        took = time.monotonic() - start
    message = _refused(r, 422, f"max_tools={DEFAULTS.max_tools}", "6000 tools")
    assert message.startswith("tools"), message
    print(f"{route}: 6000 tools answered in {took:.3f} s; /v1/models worst {probe.worst:.3f} s")
    assert took < QUICK_S, took
    assert not probe.errors and probe.worst < PROBE_S, (probe.worst, probe.errors)
    # at the limit: past the count check (the answer is the model's; tool_choice none: no constraint to compile)
    body = _body(route, tools=_tools(DEFAULTS.max_tools, flat=route == "/v1/responses"), tool_choice="none")
    r = requests.post(f"{serve_app.url}{route}", json=body, timeout=TIMEOUT)
    assert r.status_code == 200 or "max_tools" not in r.text, r.text[:500]


def test_the_tool_work_within_the_bounds_runs_off_the_event_loop(serve_app):
    """128 tools whose parameters together are just under max_schema_bytes: seconds of JSON-schema checking per
    request. Three such requests at once leave the ingress answering other requests (the checks used to run on
    its event loop); each is refused by its last tool's invalid schema, named."""
    params = {"type": "object", "properties": {f"p{j}": {"type": "string", "minLength": 1} for j in range(48)}}
    size = len(json.dumps(params, separators=(",", ":")))
    count = min(DEFAULTS.max_tools, DEFAULTS.max_schema_bytes // (size + 8))
    tools = _tools(count, parameters=params)
    last = count - 1
    tools[last]["function"]["parameters"] = {"type": "object", "properties": {"a": {"type": "no-such-type"}}}
    body = _body("/v1/chat/completions", tools=tools, tool_choice="required")
    with _Probe(serve_app.url) as probe, ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda _: requests.post(f"{serve_app.url}/v1/chat/completions", json=body,
                                                        timeout=TIMEOUT), range(3)))
    for r in answers:
        _refused(r, 422, f"tools[{last}].function.parameters")
    assert not probe.errors and probe.worst < PROBE_S, (probe.worst, probe.errors)


def test_a_stored_tool_set_past_max_tools_is_refused_and_nothing_is_stored(serve_app):
    name = "sec-tools-many"
    start = time.monotonic()
    r = requests.put(f"{serve_app.url}/admin/scenarios/{name}", json={"type": "tools", "tools": _tools(6000)},
                     headers=serve_app.admin, timeout=TIMEOUT)
    took = time.monotonic() - start
    message = _refused(r, 422, f"max_tools={DEFAULTS.max_tools}")
    assert "tools" in message and took < QUICK_S, (message, took)
    r = requests.get(f"{serve_app.url}/admin/scenarios/{name}/versions", headers=serve_app.admin, timeout=60)
    assert r.status_code == 404, r.text
    # at the limit it is stored (and compiled: a call of any of them)
    r = requests.put(f"{serve_app.url}/admin/scenarios/{name}",
                     json={"type": "tools", "tools": _tools(DEFAULTS.max_tools)}, headers=serve_app.admin,
                     timeout=TIMEOUT)
    try:
        assert r.status_code == 200, r.text[:500]
    finally:
        requests.delete(f"{serve_app.url}/admin/scenarios/{name}", headers=serve_app.admin, timeout=60)


# ----------------------------------------------------------------------------------------------------- tool_choice none


def _deep_schema(steps: int) -> dict:
    """A schema of ``steps`` nested objects: JSON nesting depth ``2 * steps - 1``."""
    schema: dict = {"type": "string"}
    for _ in range(steps - 1):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("choice", ["none", "auto"])
def test_the_parameters_limits_apply_whatever_the_tool_choice(serve_app, route, choice):
    flat = route == "/v1/responses"
    field = "tools[0].function.parameters"
    deep = _deep_schema(DEFAULTS.max_schema_depth // 2 + 1)  # one level past max_schema_depth, within the body's
    r = requests.post(f"{serve_app.url}{route}", json=_body(route, tools=_tools(1, flat, deep), tool_choice=choice),
                      timeout=TIMEOUT)
    _refused(r, 422, field, f"max_schema_depth={DEFAULTS.max_schema_depth}")
    large = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 100}
                                              for i in range(4000)}}  # about 400 KB
    r = requests.post(f"{serve_app.url}{route}", json=_body(route, tools=_tools(1, flat, large), tool_choice=choice),
                      timeout=TIMEOUT)
    _refused(r, 422, field, f"max_schema_bytes={DEFAULTS.max_schema_bytes}")
    bad = {"type": "object", "properties": {"a": {"type": "no-such-type"}}}  # not a JSON schema
    r = requests.post(f"{serve_app.url}{route}", json=_body(route, tools=_tools(1, flat, bad), tool_choice=choice),
                      timeout=TIMEOUT)
    _refused(r, 422, field)


# ----------------------------------------------------------------------------------------------------- deep JSON


def _deep_text(depth: int, kind: str = "array") -> str:
    """JSON text nested ``depth`` deep: an array of arrays, an object of objects, or a JSON schema (objects under
    ``properties``)."""
    if kind == "array":
        return "[" * depth + "]" * depth
    if kind == "object":
        return '{"a":' * (depth - 1) + "{}" + "}" * (depth - 1)
    steps = (depth + 1) // 2  # a schema step is two levels: {"properties": {"a": ...}}
    return '{"type":"object","properties":{"a":' * (steps - 1) + '{"type":"string"}' + "}}" * (steps - 1)


class _Deep:
    """A value nested ``depth`` deep in a body: :func:`_send` writes its JSON text in place (``json.dumps`` cannot
    write one this deep)."""

    def __init__(self, depth: int, kind: str = "array"):
        self.depth, self.kind = depth, kind


def _send(url: str, route: str, body: dict) -> requests.Response:
    """POST ``body`` with each :class:`_Deep` in it written as its JSON text."""
    pieces: list[str] = []

    def default(value):
        pieces.append(_deep_text(value.depth, value.kind))
        return f"@@DEEP{len(pieces) - 1}@@"

    text = json.dumps(body, default=default)
    for i, piece in enumerate(pieces):
        text = text.replace(f'"@@DEEP{i}@@"', piece)
    return requests.post(f"{url}{route}", data=text.encode(), headers={"content-type": "application/json"},
                         timeout=TIMEOUT)


def _call(arguments) -> dict:
    return {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}


def _history(arguments) -> list[dict]:
    """A chat conversation with an earlier call of f whose ``arguments`` are given, and its result."""
    return [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "tool_calls": [_call(arguments)]},
            {"role": "tool", "tool_call_id": "call_1", "content": "done"}]


def _items(arguments, output="done") -> list[dict]:
    return [{"role": "user", "content": "Hi"},
            {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": arguments},
            {"type": "function_call_output", "call_id": "call_1", "output": output}]


def _tool(parameters) -> list[dict]:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


CHAT, COMPLETIONS, RESPONSES, GENERATE = "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/generate"
MSGS = [{"role": "user", "content": "Hi"}]


def _string_cases(depth: int) -> list[tuple[str, str, dict, str]]:
    """(route, what, body, field named): JSON given as text in a string field, nested ``depth`` deep."""
    text, schema = _deep_text(depth), _deep_text(depth, "schema")
    native = [{**m, "content": m["content"] or ""} for m in _history(text)]
    return [
        (CHAT, "tool call arguments", {"messages": _history(text), "max_tokens": 2},
         "messages[1].tool_calls[0].function.arguments"),
        (CHAT, "tool call arguments (objects)", {"messages": _history(_deep_text(depth, "object")), "max_tokens": 2},
         "messages[1].tool_calls[0].function.arguments"),
        (GENERATE, "tool call arguments", {"messages": native, "max_new_tokens": 2},
         "messages[1].tool_calls[0].function.arguments"),
        (RESPONSES, "function_call arguments", {"input": _items(text), "max_output_tokens": 2}, "input[1].arguments"),
        (CHAT, "structured_outputs.json", {"messages": MSGS, "structured_outputs": {"json": schema}},
         "structured_outputs.json"),
        (CHAT, "guided_json", {"messages": MSGS, "guided_json": schema}, "guided_json"),
        (COMPLETIONS, "structured_outputs.json", {"prompt": "x", "structured_outputs": {"json": schema}},
         "structured_outputs.json"),
        (COMPLETIONS, "guided_json", {"prompt": "x", "guided_json": schema}, "guided_json"),
        (RESPONSES, "structured_outputs.json", {"input": "Hi", "structured_outputs": {"json": schema}},
         "structured_outputs.json"),
    ]


def _body_cases(depth: int) -> list[tuple[str, str, dict, bool]]:
    """(route, what, body, read): a value nested ``depth`` deep in the body itself, in every field that takes
    JSON; ``read`` false for a field the service accepts and ignores (OpenAI's ``metadata``)."""
    deep, schema = _Deep(depth), _Deep(depth, "schema")
    few = {"max_tokens": 2}
    return [
        (CHAT, "tools parameters", {"messages": MSGS, "tools": _tool(schema), **few}, True),
        (CHAT, "tools parameters, tool_choice none", {"messages": MSGS, "tools": _tool(schema), "tool_choice": "none",
                                                      **few}, True),
        (CHAT, "response_format schema", {"messages": MSGS, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}, **few}, True),
        (CHAT, "structured_outputs.json", {"messages": MSGS, "structured_outputs": {"json": schema}, **few}, True),
        (CHAT, "guided_json", {"messages": MSGS, "guided_json": schema, **few}, True),
        (CHAT, "message content", {"messages": [{"role": "user", "content": deep}], **few}, True),
        (CHAT, "tool call arguments (not a string)", {"messages": _history(deep), **few}, True),
        (CHAT, "logit_bias", {"messages": MSGS, "logit_bias": {"a": deep}, **few}, True),
        (CHAT, "tool_choice", {"messages": MSGS, "tools": _tool(None),
                               "tool_choice": {"type": "function", "function": {"name": deep}}, **few}, True),
        (CHAT, "metadata", {"messages": MSGS, "metadata": {"a": deep}, **few}, False),
        (COMPLETIONS, "prompt", {"prompt": deep, **few}, True),
        (COMPLETIONS, "response_format schema", {"prompt": "x", "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}, **few}, True),
        (COMPLETIONS, "structured_outputs.json", {"prompt": "x", "structured_outputs": {"json": schema}, **few}, True),
        (COMPLETIONS, "metadata", {"prompt": "x", "metadata": {"a": deep}, **few}, False),
        (GENERATE, "tools parameters", {"messages": MSGS, "tools": _tool(schema), "max_new_tokens": 2}, True),
        (GENERATE, "tool call arguments (not a string)", {
            "messages": [{**m, "content": m["content"] or ""} for m in _history({"a": deep})], "max_new_tokens": 2},
         True),
        (GENERATE, "message content", {"messages": [{"role": "user", "content": deep}]}, True),
        (GENERATE, "exclude", {"prompt": "x", "exclude": deep}, True),
        (RESPONSES, "tools parameters", {"input": "Hi", "tools": [{"type": "function", "name": "f",
                                                                   "parameters": schema}]}, True),
        (RESPONSES, "tools parameters, tool_choice none", {"input": "Hi", "tool_choice": "none", "tools": [
            {"type": "function", "name": "f", "parameters": schema}]}, True),
        (RESPONSES, "text.format schema", {"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x",
                                                                              "schema": schema}}}, True),
        (RESPONSES, "structured_outputs.json", {"input": "Hi", "structured_outputs": {"json": schema}}, True),
        (RESPONSES, "input content", {"input": [{"role": "user", "content": deep}]}, True),
        (RESPONSES, "function_call arguments (not a string)", {"input": _items(deep)}, True),
        (RESPONSES, "function_call_output output", {"input": _items("{}", deep)}, True),
        (RESPONSES, "metadata", {"input": "Hi", "metadata": {"a": deep}}, True),
        (RESPONSES, "tool_choice", {"input": "Hi", "tools": [{"type": "function", "name": "f"}],
                                    "tool_choice": {"type": "function", "name": deep}}, True),
    ]


def _message(r: requests.Response) -> str:
    try:
        return r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return r.text


@pytest.mark.parametrize("depth", [500, 10_000])
def test_json_nested_deep_in_a_string_field_is_a_422_naming_it(serve_app, depth):
    """JSON text in a string (a tool call's ``arguments``, a schema given as text) nested past what Python's
    parser can go (10,000) or past the depth limits (500): a 422 naming the field and the depth (the tool call
    arguments were a 500)."""
    failures = []
    for route, what, body, field in _string_cases(depth):
        r = _send(serve_app.url, route, body)
        message = _message(r)
        if r.status_code != 422 or not message.startswith(field) or "depth" not in message:
            failures.append((route, what, r.status_code, message[:200]))
    assert not failures, failures


@pytest.mark.parametrize("depth", [500, 10_000])
def test_every_json_field_nested_deep_in_the_body_is_a_4xx(serve_app, depth):
    """A value nested ``depth`` deep in a field of a body that takes JSON: a 4xx, never a 500 (10,000 deep: the
    body does not parse; 500 deep: the field's own check). A field the service ignores (``metadata`` on the chat
    and completions routes) may be served: it is never read."""
    failures = []
    for route, what, body, read in _body_cases(depth):
        r = _send(serve_app.url, route, body)
        if not (400 <= r.status_code < 500 or (not read and r.status_code == 200)):
            failures.append((route, what, r.status_code, _message(r)[:200]))
    assert not failures, failures


def test_the_issue_requests(serve_app):
    """The report's requests: an earlier call's arguments ``"[" * 3000 + "]" * 3000`` (chat and Responses)
    and, with tool_choice none, parameters nested 200 and 700 deep: each a 422 naming the field."""
    text = _deep_text(3000)
    r = requests.post(f"{serve_app.url}{CHAT}", json={"messages": _history(text), "max_tokens": 2}, timeout=TIMEOUT)
    _refused(r, 422, "messages[1].tool_calls[0].function.arguments", "max_json_depth")
    r = requests.post(f"{serve_app.url}{RESPONSES}", json={"input": _items(text), "max_output_tokens": 2},
                      timeout=TIMEOUT)
    _refused(r, 422, "input[1].arguments", "max_json_depth")
    for depth in (200, 700):
        body = {"messages": MSGS, "max_tokens": 2, "tools": _tool(_Deep(depth, "schema")), "tool_choice": "none"}
        r = _send(serve_app.url, CHAT, body)
        _refused(r, 422, "tools[0].function.parameters", f"max_schema_depth={DEFAULTS.max_schema_depth}")
