"""Both engines in one app: ``engine: vllm`` with ``beam_replicas: 1`` runs a second
model deployment, ``BeamReplica``, on the transformers engine; the ingress sends requests with ``num_beams`` > 1
there and every other request to the vLLM replica, over real HTTP. A second Serve app beside the tier's shared one
(its own config manager and embedded Redis, route prefix ``/beams``), removed at the end of this module.

Every output is checked against its constraint (and, for beams with item controls, the controls); the replicas'
own counters show which engine ran each request.
"""

from __future__ import annotations

import itertools

import pytest

pytest.importorskip("vllm.v1.engine.async_llm", reason="the vLLM tier runs in .venv-vllm: bash scripts/test_vllm.sh")

import requests  # noqa: E402

from serve_app import check_label  # noqa: E402
from vllm_checks import VLLMServeApp  # noqa: E402

pytestmark = pytest.mark.vllm

BEAM_APP = "constrained-vllm-beams"
LABELS = ["Sports", "Technology", "Politics", "New York City", "Weather"]
CODES = [1000 + 7 * i for i in range(6)]
ROOT = 2000
CATALOG = [tuple(p) for p in itertools.product(CODES, repeat=2)]  # 36 two-token items


class BeamApp(VLLMServeApp):
    """The second app: one vLLM replica, one transformers-engine BeamReplica, under ``/beams``."""

    def __init__(self, data_dir: str, port: int):
        super().__init__(data_dir, port)
        self.url = f"{self.url}/beams"
        self.args = {**self.args, "beam_replicas": 1, "torch_threads": 1}

    def start(self) -> None:
        from ray import serve

        from deployments.app import build_app

        serve.run(build_app(self.args), name=BEAM_APP, route_prefix="/beams", blocking=False)
        self.wait_ready_one()

    def replica_stats(self, deployment: str) -> dict:
        from ray import serve

        return serve.get_deployment_handle(deployment, app_name=BEAM_APP).health.remote().result(timeout_s=60)["stats"]


@pytest.fixture(scope="module")
def beam_app(app, tmp_path_factory, tokenizer):
    """Started after the shared app (the same Serve instance and HTTP port)."""
    from ray import serve

    from deployments.storage.redis_server import stop_orphaned_servers

    data_dir = str(tmp_path_factory.mktemp("vllm-beams-data"))
    handle = BeamApp(data_dir, app.port)
    handle.start()
    eos = tokenizer.eos_token_id
    prefix = {str(ROOT): list(CODES), **{f"{ROOT}_{a}": list(CODES) for a in CODES},
              **{f"{ROOT}_{a}_{b}": [eos] for a in CODES for b in CODES}}
    handle.put("b-labels", {"type": "labels", "labels": LABELS})
    handle.put("b-tree", {"type": "tree", "tree": {"start_token_id": ROOT, "end_token_id": eos, "prefix_dict": prefix}})
    yield handle
    try:
        serve.delete(BEAM_APP)
    finally:
        stop_orphaned_servers(data_dir)


def test_both_model_deployments_register_with_the_manager(beam_app):
    body = requests.get(f"{beam_app.url}/healthz", timeout=30).json()
    assert body["status"] == "ok" and len(body["replicas"]) == 2, body  # the vLLM replica and the BeamReplica
    for versions in body["replicas"].values():
        assert {"b-labels", "b-tree"} <= set(versions.get("versions", versions)), body


def test_beam_requests_run_on_the_transformers_replica_and_the_rest_on_vllm(beam_app, tokenizer):
    vllm_before = beam_app.replica_stats("ModelReplica")["requests"]
    beams_before = beam_app.replica_stats("BeamReplica")
    r = beam_app.generate({"scenario": "b-labels", "prompt": "Headline: storm hits the coast. Section:",
                           "num_beams": 4, "n": 4}, timeout=300)
    assert r.status_code == 200, r.text
    outs = r.json()["outputs"]
    for out in outs:
        check_label(out, LABELS)
    assert len({o["text"] for o in outs}) == 4  # beams end on different sequences
    scores = [o["score"] for o in outs]  # the transformers replica's beam scores, best first
    assert all(isinstance(s, float) and s <= 0 for s in scores) and scores == sorted(scores, reverse=True), scores
    beams_after = beam_app.replica_stats("BeamReplica")
    assert beams_after != beams_before and beam_app.replica_stats("ModelReplica")["requests"] == vllm_before

    r = beam_app.generate({"scenario": "b-labels", "prompt": "Topic:", "n": 3, "temperature": 1.0}, timeout=300)
    assert r.status_code == 200, r.text
    for out in r.json()["outputs"]:
        check_label(out, LABELS)
        assert out["score"] is None  # sampled on vLLM: no beam score
    assert beam_app.replica_stats("ModelReplica")["requests"] == vllm_before + 1
    assert beam_app.replica_stats("BeamReplica") == beams_after


def test_beams_with_item_controls(beam_app, tokenizer):
    eos = tokenizer.eos_token_id
    excluded = set(CATALOG[:20])
    body = {"scenario": "b-tree", "prompt": "Recommended items:", "num_beams": 4, "n": 4, "max_new_tokens": 6,
            "exclude": [list(i) for i in excluded]}
    r = beam_app.generate(body, timeout=300)
    assert r.status_code == 200, r.text
    items = []
    for out in r.json()["outputs"]:
        assert out["error"] is None and out["finish_reason"] == "stop" and out["token_ids"][-1] == eos, out
        item = tuple(out["token_ids"][:-1])
        assert item in CATALOG and item not in excluded, out
        items.append(item)
    assert len(set(items)) == 4, items
    r = beam_app.generate({**body, "stream": True})  # as on the transformers engine: beams are not streamed
    assert r.status_code == 422 and "beam search cannot be streamed" in r.text, r.text


def test_openai_route_with_beams_is_routed_too(beam_app):
    r = requests.post(f"{beam_app.url}/v1/completions", json={"model": "default", "prompt": "Topic:", "max_tokens": 8,
                                                             "scenario": "b-labels", "num_beams": 3, "n": 3}, timeout=300)
    assert r.status_code == 200, r.text
    texts = [c["text"].strip() for c in r.json()["choices"]]
    assert len(texts) == 3 and all(t in LABELS for t in texts), texts
    scores = [c["score"] for c in r.json()["choices"]]
    assert all(isinstance(s, float) for s in scores) and scores == sorted(scores, reverse=True), scores


def test_without_beam_replicas_beams_stay_a_400_naming_the_setting(app):
    r = app.generate({"prompt": "Topic:", "num_beams": 2, "max_new_tokens": 4})
    assert r.status_code == 400, r.text
    assert "beam_replicas" in r.json()["error"]["message"] and r.json()["error"]["setting"] == "beam_replicas"


def test_deployment_options_add_the_beam_deployment_only_for_vllm():
    from config import ServerSettings
    from deployments.app import deployment_options

    assert "beams" not in deployment_options(ServerSettings(engine="vllm"))
    assert "beams" not in deployment_options(ServerSettings(engine="transformers", beam_replicas=2))
    opts = deployment_options(ServerSettings(engine="vllm", beam_replicas=2, num_cpus_per_replica=3))["beams"]
    assert opts["name"] == "BeamReplica" and opts["num_replicas"] == 2 and opts["ray_actor_options"]["num_cpus"] == 3
