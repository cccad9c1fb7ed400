"""The service's Prometheus metrics, scraped over real HTTP from Ray's metrics endpoint of the shared app.

Ray exports every few seconds, so each check polls the endpoint until the expected values show up (or a
deadline passes). Counters are cumulative over the whole test session, hence ``>=`` on counts; the scenario
names here are used by no other test.
"""

from __future__ import annotations

import time

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from deployments.examples import build_phrase_tree, chat_root_token_id
from helpers import user_messages

pytestmark = pytest.mark.serve

LABELS = "m-labels"
FALLBACK = "m-fallback"
EXPORT_DEADLINE_S = 90.0


def scrape(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """``{sample name: [(labels, value)]}`` of the ``ray_cs_*`` samples on the endpoint now."""
    text = requests.get(url, timeout=10).text
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("ray_cs_"):
                samples.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return samples


def total(samples, name: str, **labels: str) -> float:
    return sum(value for tags, value in samples.get(name, []) if all(tags.get(k) == v for k, v in labels.items()))


def wait_for(url: str, check, what: str) -> dict:
    """Scrape until ``check(samples)`` holds; fail naming ``what`` with the last scrape after the deadline."""
    deadline = time.monotonic() + EXPORT_DEADLINE_S
    samples: dict = {}
    while time.monotonic() < deadline:
        samples = scrape(url)
        if check(samples):
            return samples
        time.sleep(1.0)
    pytest.fail(f"{what}: not exported within {EXPORT_DEADLINE_S:g} s; ray_cs_* samples: "
                f"{ {k: v for k, v in samples.items() if not k.endswith('_bucket')} }")


@pytest.fixture(scope="module")
def traffic(serve_app, tokenizer):
    """Two PUTs, then generate requests: plain, streamed, on a tree that falls back, on an unknown name."""
    root = chat_root_token_id(tokenizer)
    serve_app.put(LABELS, {"type": "labels", "labels": ["yes", "no", "maybe"]})
    version = serve_app.put(LABELS, {"type": "labels", "labels": ["yes", "no"]})["version"]
    # The tree allows one first token and has no entry after it: every row falls back to the end token.
    first = build_phrase_tree(tokenizer, ["red apple"], root=root, end=tokenizer.eos_token_id)["prefix_dict"][str(root)]
    tree = {"start_token_id": root, "end_token_id": tokenizer.eos_token_id, "prefix_dict": {str(root): first}}
    serve_app.put(FALLBACK, {"type": "tree", "tree": tree})

    tokens = 0
    for i in range(3):
        r = serve_app.generate({"scenario": LABELS, "messages": user_messages(f"Question {i}?"), "n": 2, "seed": i})
        assert r.status_code == 200, r.text
        tokens += r.json()["usage"]["completion_tokens"]
    r = requests.post(f"{serve_app.url}/v1/generate", json={"scenario": LABELS, "prompt": "Yes or no:", "stream": True},
                      stream=True, timeout=120)
    assert r.status_code == 200
    streamed = [line for line in r.iter_lines() if line.startswith(b"data: {") and b'"token_id":' in line]
    tokens += sum(1 for line in streamed if b'"token_id":null' not in line)
    r = serve_app.generate({"scenario": FALLBACK, "messages": user_messages("A fruit?"), "n": 2})
    assert r.status_code == 200, r.text
    fallback_tokens = r.json()["usage"]["completion_tokens"]
    assert all(out["token_ids"] == [first[0], tokenizer.eos_token_id] for out in r.json()["outputs"]), r.text
    r = serve_app.generate({"scenario": "m-no-such-scenario", "prompt": "x"})
    assert r.status_code == 404, r.text
    return {"version": version, "tokens": tokens, "fallback_tokens": fallback_tokens}


def test_requests_and_tokens_per_scenario(serve_app, traffic):
    url = serve_app.metrics_url
    samples = wait_for(url, lambda s: (
        total(s, "ray_cs_requests_total", scenario=LABELS, outcome="ok") >= 4
        and total(s, "ray_cs_generated_tokens_total", scenario=LABELS) >= traffic["tokens"]
        and total(s, "ray_cs_requests_total", scenario="_unknown", outcome="error") >= 1
    ), "requests and tokens per scenario")
    # tags: Serve's own plus ours; never the client's unknown name
    tags, _ = next(t for t in samples["ray_cs_requests_total"] if t[0].get("scenario") == LABELS)
    assert {"deployment", "replica", "application", "scenario", "outcome"} <= set(tags), tags
    assert tags["deployment"] == "ModelReplica"
    assert not any(t.get("scenario") == "m-no-such-scenario" for t, _ in samples["ray_cs_requests_total"])
    # plausible: two outputs of one or two tokens per plain request, a few tokens streamed
    assert total(samples, "ray_cs_generated_tokens_total", scenario=LABELS) < 1000


def test_fallback_rows_per_scenario(serve_app, traffic):
    samples = wait_for(serve_app.metrics_url, lambda s: (
        total(s, "ray_cs_fallback_rows_total", scenario=FALLBACK) >= 2
        and total(s, "ray_cs_generated_tokens_total", scenario=FALLBACK) >= traffic["fallback_tokens"]
    ), "fallback rows")
    assert total(samples, "ray_cs_fallback_rows_total", scenario=LABELS) == 0


def test_decode_steps_recorded_from_the_engine_thread(serve_app, traffic):
    samples = wait_for(serve_app.metrics_url, lambda s: (
        total(s, "ray_cs_decode_step_seconds_count") > 0 and total(s, "ray_cs_chain_seconds_total") > 0
    ), "decode step metrics")
    steps = total(samples, "ray_cs_decode_step_seconds_count")
    assert total(samples, "ray_cs_decode_step_seconds_bucket", le="+Inf") == steps
    step_seconds = total(samples, "ray_cs_decode_seconds_total")
    chain_seconds = total(samples, "ray_cs_chain_seconds_total")
    assert 0 < chain_seconds < step_seconds, (chain_seconds, step_seconds)
    assert 0.0001 < step_seconds / steps < 10, (step_seconds, steps)  # seconds per step on any machine


def test_scenario_version_per_replica(serve_app, traffic):
    version = traffic["version"]

    def served_everywhere(s):
        replicas = {t["replica"] for t, v in s.get("ray_cs_scenario_version", []) if t.get("scenario") == LABELS and v == version}
        return len(replicas) >= 2

    # what the replicas acknowledged to the manager (the fact), before what Ray exported (the metric)
    deadline = time.monotonic() + EXPORT_DEADLINE_S
    while True:
        acked = requests.get(f"{serve_app.url}/healthz", timeout=10).json().get("replicas") or {}
        serving = {rid for rid, r in acked.items() if r.get("versions", {}).get(LABELS) == version}
        if len(serving) >= 2:
            break
        assert time.monotonic() < deadline, f"{LABELS} version {version} not acknowledged by two replicas: {acked}"
        time.sleep(1.0)
    samples = wait_for(serve_app.metrics_url, served_everywhere,
                       f"{LABELS} version {version} on both replicas (acknowledged by {sorted(serving)})")
    for tags, value in samples["ray_cs_scenario_version"]:
        assert tags["deployment"] == "ModelReplica" and value >= 0, tags


def test_hot_swap_latency(serve_app, traffic):
    samples = wait_for(serve_app.metrics_url, lambda s: (
        total(s, "ray_cs_hot_swap_seconds_count", scenario=LABELS, action="put") >= 2
    ), "hot-swap latency")
    tags = next(t for t, _ in samples["ray_cs_hot_swap_seconds_count"] if t.get("scenario") == LABELS)
    assert tags["deployment"] == "ConfigManager" and tags["action"] == "put"
    # a label set reaches both replicas in well under the 30 s broadcast timeout
    assert total(samples, "ray_cs_hot_swap_seconds_bucket", scenario=LABELS, action="put", le="10.0") >= 2
