"""The Ray Serve app end to end over real HTTP: 2 model replicas, the config manager, a real Redis.

Every constrained answer is checked against the scenario version the response reports.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
import requests

from processors.kinds.tree.treefile.load import is_tree_path
from deployments.examples import build_phrase_tree, chat_root_token_id
from helpers import user_messages
from serve_app import check_label, labels_hot_swap_under_load

pytestmark = pytest.mark.serve

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
LABELS = ["Sports", "Technology", "Politics", "New York City"]
PHRASES = ["red apple", "green pear", "blue sky at night"]


@pytest.fixture(scope="module")
def stored(serve_app, tokenizer):
    tree = build_phrase_tree(tokenizer, PHRASES, root=chat_root_token_id(tokenizer), end=tokenizer.eos_token_id)
    bodies = {
        "t-labels": {"type": "labels", "labels": LABELS},
        "t-tree": {"type": "tree", "tree": tree},
        "t-schema": {"type": "json_schema", "schema": SCHEMA},
        "t-json": {"type": "json", "max_new_tokens": 40},
        "t-regex": {"type": "regex", "pattern": "[0-9]{3}-[0-9]{4}"},
    }
    for name, body in bodies.items():
        serve_app.put(name, body)
    return bodies


def _valid(name, bodies, out):
    if name == "t-labels":
        check_label(out, LABELS)
    elif name == "t-tree":
        assert is_tree_path(bodies["t-tree"]["tree"], out["token_ids"]), out
    elif name == "t-schema":
        if out["finish_reason"] == "stop":
            jsonschema.validate(json.loads(out["text"]), SCHEMA)
    elif name == "t-json":
        if out["finish_reason"] == "stop":
            json.loads(out["text"])
    elif name == "t-regex":
        assert out["finish_reason"] == "stop" and re.fullmatch(r"[0-9]{3}-[0-9]{4}", out["text"]), out


@pytest.mark.parametrize("name", ["t-labels", "t-tree", "t-schema", "t-json", "t-regex"])
def test_each_kind_generates_valid_output(serve_app, stored, name):
    r = serve_app.generate({"scenario": name, "messages": user_messages("Answer, please."), "n": 3, "temperature": 1.2, "max_new_tokens": 48})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["scenario"] == name and body["version"] >= 1
    assert len(body["outputs"]) == 3
    for out in body["outputs"]:
        _valid(name, stored, out)


def test_example_scenarios_seeded_and_listed(serve_app):
    r = requests.get(f"{serve_app.url}/v1/scenarios", timeout=30)
    assert r.status_code == 200
    listing = r.json()
    items = listing["scenarios"] if isinstance(listing, dict) else listing
    types = {s["type"] for s in items}
    assert {"labels", "json_schema", "tree"} <= types


def test_unknown_scenario_404_lists_known(serve_app, stored):
    r = serve_app.generate({"scenario": "no-such", "prompt": "x"})
    assert r.status_code == 404
    err = r.json()["error"]
    assert "no-such" in err["message"] and "t-labels" in err["known"]


def test_invalid_body_422_names_field(serve_app):
    r = serve_app.generate({"scenario": "t-labels", "prompt": "x", "max_new_tokens": 0})
    assert r.status_code == 422
    assert "max_new_tokens" in r.text


def test_sixteen_concurrent_clients_mixing_scenarios(serve_app, stored):
    names = list(stored)

    def one(i):
        name = names[i % len(names)]
        r = serve_app.generate({"scenario": name, "messages": user_messages(f"Request {i}"), "temperature": 1.0, "max_new_tokens": 40, "seed": i})
        assert r.status_code == 200, r.text
        body = r.json()
        for out in body["outputs"]:
            _valid(name, stored, out)
        return name

    with ThreadPoolExecutor(16) as pool:
        done = list(pool.map(one, range(32)))
    assert len(done) == 32


def test_streaming_sse(serve_app, stored):
    with requests.post(f"{serve_app.url}/v1/generate", json={"scenario": "t-labels", "prompt": "Topic:", "stream": True}, stream=True, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in r.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    parsed = [json.loads(e) for e in events[:-1]]
    final = parsed[-1]
    assert final["type"] == "done"
    out = final["response"]["outputs"][0]
    check_label(out, LABELS)
    streamed = "".join(e.get("text") or "" for e in parsed if e["type"] == "token")
    assert streamed == out["text"]


def test_admin_requires_token(serve_app):
    url = f"{serve_app.url}/admin/scenarios/t-labels"
    assert requests.get(url, timeout=30).status_code == 401
    assert requests.get(url, headers={"Authorization": "Bearer wrong"}, timeout=30).status_code == 401
    assert requests.put(url, json={"type": "labels", "labels": ["x"]}, timeout=30).status_code == 401
    assert requests.get(url, headers=serve_app.admin, timeout=30).status_code == 200
    # public routes need no token
    assert requests.get(f"{serve_app.url}/v1/scenarios", timeout=30).status_code == 200


def test_bad_scenario_is_never_stored(serve_app, stored):
    before = requests.get(f"{serve_app.url}/admin/scenarios/t-labels/versions", headers=serve_app.admin, timeout=30).json()
    r = requests.put(f"{serve_app.url}/admin/scenarios/t-labels", json={"type": "labels", "labels": []}, headers=serve_app.admin, timeout=60)
    assert r.status_code == 422
    r = requests.put(
        f"{serve_app.url}/admin/scenarios/t-labels",
        json={"type": "tree", "tree": {"start_token_id": 1, "end_token_id": 2, "prefix_dict": {"1": [10**7]}}},
        headers=serve_app.admin, timeout=60,
    )
    assert r.status_code in (400, 422), r.text
    after = requests.get(f"{serve_app.url}/admin/scenarios/t-labels/versions", headers=serve_app.admin, timeout=30).json()
    assert after == before


def test_hot_swap_under_load(serve_app):
    """Ten PUTs while 16 clients send requests: every answer is one of the labels of the version it reports."""
    labels_hot_swap_under_load(serve_app, "t-swap")


def test_rollback_restores_old_behaviour(serve_app):
    name = "t-roll"
    v1 = serve_app.put(name, {"type": "labels", "labels": ["apple", "pear"]})["version"]
    v2 = serve_app.put(name, {"type": "labels", "labels": ["car", "boat"]})["version"]
    r = serve_app.generate({"scenario": name, "prompt": "Item:", "n": 4, "temperature": 1.5})
    for out in r.json()["outputs"]:
        check_label(out, ["car", "boat"])
    r = requests.post(f"{serve_app.url}/admin/scenarios/{name}/rollback", json={"version": v1}, headers=serve_app.admin, timeout=60)
    assert r.status_code == 200, r.text
    v3 = r.json()["version"]
    assert v3 > v2
    body = serve_app.generate({"scenario": name, "prompt": "Item:", "n": 4, "temperature": 1.5}).json()
    assert body["version"] == v3
    for out in body["outputs"]:
        check_label(out, ["apple", "pear"])
    hist = requests.get(f"{serve_app.url}/admin/scenarios/{name}/versions", headers=serve_app.admin, timeout=30).json()
    items = hist["versions"] if isinstance(hist, dict) else hist
    assert [h["version"] for h in items][-3:] == [v1, v2, v3] or sorted(h["version"] for h in items)[-3:] == [v1, v2, v3]


def test_delete_then_404(serve_app):
    serve_app.put("t-del", {"type": "labels", "labels": ["a b", "c d"]})
    r = requests.delete(f"{serve_app.url}/admin/scenarios/t-del", headers=serve_app.admin, timeout=60)
    assert r.status_code == 200, r.text
    assert serve_app.generate({"scenario": "t-del", "prompt": "x"}).status_code == 404


def test_openai_client_chat_completions(serve_app, stored, client):
    resp = client.chat.completions.create(
        model="default", messages=user_messages("Which topic is a football match?"), max_tokens=12, n=2,
        extra_body={"scenario": "t-labels"},
    )
    assert len(resp.choices) == 2
    for choice in resp.choices:
        assert choice.message.content.strip() in LABELS
    one_off = client.chat.completions.create(
        model="default", messages=user_messages("Say yes or no."), max_tokens=8,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert one_off.choices[0].message.content.strip() in ("yes", "no")
    schema_resp = client.chat.completions.create(
        model="default", messages=user_messages("A person as JSON."), max_tokens=48,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}},
    )
    choice = schema_resp.choices[0]
    if choice.finish_reason == "stop":
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_replica_started_after_put_serves_current_version(serve_app, model, tokenizer):
    from ray import serve

    from deployments.replica import ModelReplica

    v = serve_app.put("t-late", {"type": "labels", "labels": ["late one", "late two"]})["version"]
    manager = serve.get_deployment_handle("ConfigManager", app_name="constrained")
    replica = ModelReplica(serve_app.args, manager, model=model, tokenizer=tokenizer)
    try:
        assert replica.versions()["t-late"] == v
        current = {s["name"]: s["version"] for s in _listing(serve_app)}
        assert replica.versions() == current
    finally:
        replica.shutdown()


def _listing(serve_app):
    body = requests.get(f"{serve_app.url}/v1/scenarios", timeout=30).json()
    return body["scenarios"] if isinstance(body, dict) else body


def test_restart_keeps_scenarios_and_history(serve_app):
    before = {s["name"]: s["version"] for s in _listing(serve_app)}
    hist_before = requests.get(f"{serve_app.url}/admin/scenarios/t-roll/versions", headers=serve_app.admin, timeout=30).json()
    serve_app.restart()
    after = {s["name"]: s["version"] for s in _listing(serve_app)}
    assert after == before
    hist_after = requests.get(f"{serve_app.url}/admin/scenarios/t-roll/versions", headers=serve_app.admin, timeout=30).json()
    assert hist_after == hist_before
    r = serve_app.generate({"scenario": "t-roll", "prompt": "Item:", "temperature": 1.5})
    check_label(r.json()["outputs"][0], ["apple", "pear"])
