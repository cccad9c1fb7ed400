"""The service with ``engine: vllm`` end to end over real HTTP: one Ray Serve app (one start) whose model replica
runs the real vLLM engine with our chain inside it, the config manager with an embedded Redis, the ingress.

Every scenario kind with n > 1, seeds, streaming, the OpenAI route, beam search refused, a hot swap under load
(every answer checked against the version the response reports) and a replica started late that serves the
current versions; every output is checked against its constraint.
"""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("vllm.v1.engine.async_llm", reason="the vLLM tier runs in .venv-vllm: bash scripts/test_vllm.sh")

import requests  # noqa: E402

from helpers import user_messages  # noqa: E402
from serve_app import check_label, labels_hot_swap_under_load  # noqa: E402
from vllm_checks import APP, check_output  # noqa: E402

pytestmark = pytest.mark.vllm

LABELS = ["Sports", "Technology", "Politics", "New York City"]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def bodies(app, tokenizer):
    from deployments.examples import build_phrase_tree, chat_root_token_id

    dot = tokenizer.encode(".", add_special_tokens=False)[0]
    tree = build_phrase_tree(tokenizer, ["red apple", "green pear", "blue sky at night"],
                             root=chat_root_token_id(tokenizer), end=dot)
    out = {
        "v-labels": {"type": "labels", "labels": LABELS},
        "v-multi": {"type": "labels", "labels": LABELS, "multi_label": True, "separator": ",", "max_labels": 3},
        "v-tree": {"type": "tree", "tree": tree},
        "v-schema": {"type": "json_schema", "schema": SCHEMA},
        "v-json": {"type": "json", "max_new_tokens": 40},
        "v-regex": {"type": "regex", "pattern": "[0-9]{3}-[0-9]{4}"},
        "v-think": {"type": "labels", "labels": LABELS, "think": {"max_thinking_tokens": 6}},
    }
    for name, body in out.items():
        app.put(name, body)
    return out


def _check(body, out, tokenizer):
    assert out["error"] is None, out
    check_output(body["type"], body, out["text"], out["token_ids"], out["finish_reason"], tokenizer)


def test_every_kind_with_n_3_concurrently(app, bodies, tokenizer):
    from concurrent.futures import ThreadPoolExecutor

    def one(name):
        r = app.generate({"scenario": name, "messages": user_messages("Answer: a topic, a thing, a person or a number."),
                          "n": 3, "temperature": 1.2, "max_new_tokens": 48}, timeout=300)
        return name, r

    with ThreadPoolExecutor(len(bodies)) as pool:
        results = list(pool.map(one, bodies))
    for name, r in results:
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["scenario"] == name and body["version"] >= 1 and len(body["outputs"]) == 3
        for out in body["outputs"]:
            _check(bodies[name], out, tokenizer)


def test_seed_reproduces_over_http(app, bodies):
    req = {"scenario": "v-json", "prompt": "A JSON value:", "n": 2, "temperature": 1.0, "seed": 42, "max_new_tokens": 20}
    first = app.generate(req).json()["outputs"]
    second = app.generate(req).json()["outputs"]
    assert [o["token_ids"] for o in first] == [o["token_ids"] for o in second]


def test_high_temperature_stays_valid(app, bodies, tokenizer):
    r = app.generate({"scenario": "v-labels", "messages": user_messages("Topic?"), "n": 4, "temperature": 5.0, "seed": 1})
    assert r.status_code == 200, r.text
    for out in r.json()["outputs"]:
        check_label(out, LABELS)


def test_streaming_tokens_add_up_to_the_answer(app, bodies, tokenizer):
    with requests.post(f"{app.url}/v1/generate", json={"scenario": "v-schema", "messages": user_messages("A person."),
                                                        "stream": True, "max_new_tokens": 40, "seed": 3},
                       stream=True, timeout=120) as r:
        assert r.status_code == 200
        events = [json.loads(line[len("data: "):]) for line in r.iter_lines(decode_unicode=True)
                  if line and line.startswith("data: ") and line != "data: [DONE]"]
    pieces = "".join(e.get("text", "") for e in events if e["type"] == "token")
    done = [e for e in events if e["type"] == "done"]
    assert len(done) == 1
    out = done[0]["response"]["outputs"][0]
    assert pieces == out["text"]
    _check(bodies["v-schema"], out, tokenizer)


def test_openai_chat_completions_with_a_scenario_and_a_one_off_constraint(app, bodies, client):
    resp = client.chat.completions.create(model="default", messages=user_messages("Which topic is a football match?"),
                                          max_tokens=12, n=2, extra_body={"scenario": "v-labels"})
    assert [c.message.content.strip() in LABELS for c in resp.choices] == [True, True]
    one_off = client.chat.completions.create(model="default", messages=user_messages("Say yes or no."), max_tokens=8,
                                             extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert one_off.choices[0].message.content.strip() in ("yes", "no")


def test_beam_search_is_a_400_naming_the_transformers_backend(app, bodies):
    r = app.generate({"scenario": "v-labels", "prompt": "Topic:", "num_beams": 4})
    assert r.status_code == 400, r.text
    assert "transformers" in r.json()["error"]["message"]


def test_healthz_reports_the_vllm_replica_and_its_versions(app, bodies):
    body = requests.get(f"{app.url}/healthz", timeout=30).json()
    assert body["status"] == "ok", body
    (versions,) = [v.get("versions", v) for v in body["replicas"].values()]
    for name in bodies:
        assert name in versions, versions


def test_hot_swap_under_load(app, bodies):
    """Ten PUTs while 16 clients send requests: every answer is one of the labels of the version it reports."""
    labels_hot_swap_under_load(app, "v-swap")


def test_late_replica_serves_current_versions(app, bodies, tokenizer):
    """A vLLM-backed replica started after the PUTs registers, installs the current versions and serves them."""
    from ray import serve

    from deployments.replica import ModelReplica

    v = app.put("v-late", {"type": "labels", "labels": ["late one", "late two"]})["version"]
    manager = serve.get_deployment_handle("ConfigManager", app_name=APP)
    replica = ModelReplica(app.args, manager)
    try:
        assert replica.engine.name == "vllm"
        assert replica.model is None  # vLLM holds the weights; the replica loaded only the tokenizer
        assert replica.versions()["v-late"] == v
        listing = requests.get(f"{app.url}/v1/scenarios", timeout=30).json()
        listing = listing["scenarios"] if isinstance(listing, dict) else listing
        assert replica.versions() == {s["name"]: s["version"] for s in listing}
        out = asyncio.run(replica.generate({"scenario": "v-late", "prompt": "Which one?", "n": 2, "temperature": 1.0}))
        assert out["version"] == v
        for o in out["outputs"]:
            check_label(o, ["late one", "late two"])
        # a PUT now waits for this replica's ack too, and it serves the new version at once
        v2 = app.put("v-late", {"type": "labels", "labels": ["later one", "later two"]})["version"]
        assert replica.versions()["v-late"] == v2
        out = asyncio.run(replica.generate({"scenario": "v-tree", "messages": user_messages("A thing."), "n": 2, "temperature": 1.5}))
        for o in out["outputs"]:
            _check(bodies["v-tree"], o, tokenizer)
    finally:
        replica.shutdown()
