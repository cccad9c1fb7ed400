"""Helpers of the vLLM tier: the vLLM-backed app's handle, an event collector and the per-kind output checks."""

from __future__ import annotations

import json
import re
import time

import requests
from serve_app import ADMIN_TOKEN, ServeApp

from deployments.engines import EventCollector

#: vLLM settings of every engine this tier starts (small, quick to start)
VLLM_TEST_SETTINGS = {"vllm_enforce_eager": True, "vllm_kv_cache_gb": 0.5}
#: the Serve application name of the tier's app (conftest.py's ``app`` fixture)
APP = "constrained-vllm"


class VLLMServeApp(ServeApp):
    """The shared app's handle, with one vLLM-backed model replica."""

    def __init__(self, data_dir: str, port: int):
        super().__init__(data_dir, port)
        self.args = {
            "data_dir": data_dir, "admin_token": ADMIN_TOKEN, "num_replicas": 1, "max_batch_size": 16,
            "num_cpus_per_replica": 1, "engine": "vllm", **VLLM_TEST_SETTINGS,
        }

    def start(self) -> None:
        from ray import serve

        from deployments.app import build_app

        serve.run(build_app(self.args), name=APP, route_prefix="/", blocking=False)
        self.wait_ready_one()

    def wait_ready_one(self, timeout: float = 600.0) -> dict:
        deadline = time.time() + timeout
        last = None
        while time.time() < deadline:
            try:
                r = requests.get(f"{self.url}/healthz", timeout=10)
                if r.status_code == 200 and r.json().get("replicas"):
                    return r.json()
                last = r.text
            except requests.RequestException as exc:
                last = exc
            time.sleep(2.0)
        raise RuntimeError(f"app not ready after {timeout} s: {last}")


class Collector(EventCollector):
    """The engine contract's collector, also keeping every event in order (``events``)."""

    def __init__(self):
        super().__init__()
        self.events: list = []

    def __call__(self, ev):
        self.events.append(ev)
        super().__call__(ev)


def check_output(kind: str, body: dict, text: str, token_ids: list[int], finish_reason: str, tokenizer) -> None:
    """Assert that one output satisfies the scenario ``body`` (``kind`` its type); ``text`` without special tokens."""
    import jsonschema

    from processors.kinds.tree.treefile.load import is_tree_path

    eos = tokenizer.eos_token_id
    think = body.get("think")
    if think is not None:
        end_ids = tokenizer.encode(think.get("end", "</think>\n\n"), add_special_tokens=False)
        pos = next((i for i in range(len(token_ids)) if token_ids[i: i + len(end_ids)] == end_ids), None)
        assert pos is not None, f"no think end marker in {tokenizer.decode(token_ids)!r}"
        assert pos <= think["max_thinking_tokens"], f"thought {pos} tokens, budget {think['max_thinking_tokens']}"
        assert eos not in token_ids[:pos], "a row must not end while thinking"
        token_ids = token_ids[pos + len(end_ids):]
        text = tokenizer.decode(token_ids, skip_special_tokens=True)
    if kind == "tree":
        assert finish_reason == "stop" and is_tree_path(body["tree"], token_ids), (token_ids, finish_reason)
        assert token_ids[-1] == body["tree"]["end_token_id"]
        return
    if kind == "labels":
        assert finish_reason == "stop" and token_ids[-1] == eos, (text, finish_reason)
        labels = body["labels"]
        if body.get("multi_label"):
            parts = [p.strip() for p in text.split(body.get("separator", ","))]
            assert all(p in labels for p in parts) and len(parts) == len(set(parts)), parts
            assert len(parts) <= body.get("max_labels", len(labels)), parts
        else:
            # the label alone: bare where the answer starts a message, after a space where it continues text
            assert text in labels or (text.startswith(" ") and text[1:] in labels), text
        return
    if kind == "regex":
        assert finish_reason == "stop" and re.fullmatch(body["pattern"], text), (text, finish_reason)
        return
    if kind in ("json", "json_schema"):
        if finish_reason == "length":
            return  # cut by the budget: valid as far as it goes (the cursor reported no error)
        assert finish_reason == "stop", (text, finish_reason)
        value = json.loads(text)
        if kind == "json_schema":
            jsonschema.validate(value, body["schema"])
        return
    raise AssertionError(f"unknown kind {kind}")
