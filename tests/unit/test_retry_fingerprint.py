"""Unit-level test of the ingress's rule "never retry a request that killed a replica".

The ingress runs in-process under ``TestClient`` with a stand-in for the model replicas' handle that raises Ray's
real ``ActorDiedError`` the way a handle call does when the replica process dies with the call in flight. Killing
real replicas twice per case would cost minutes of app restarts; the replica-kill path end to end (a real SIGKILL,
the request retried on the other replica) is tests/faults/test_processes.py.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from deployments.ingress import DeathMemory, Ingress, request_fingerprint

ray_exceptions = pytest.importorskip("ray.exceptions")  # the ingress recognises a death only with Ray loaded

TOKEN = "test-admin-token-0123456789"
NOT_RETRIED = "this request was in flight when a replica died; not retried"


class Replicas:
    """Stand-in for the model replicas' handle: a request whose prompt is in ``kills`` kills the replica it is on,
    a request in ``dies_once`` is on a replica that dies the first time (a bystander), the rest are answered."""

    def __init__(self, kills=(), dies_once=()):
        self.kills, self.dies_once = set(kills), set(dies_once)
        self.calls: list[str] = []  # the prompt of every call
        self.deaths = 0

    def _run(self, payload) -> dict:
        payload = payload.model_dump() if hasattr(payload, "model_dump") else payload  # the ingress sends the model
        prompt = payload["prompt"]
        self.calls.append(prompt)
        if prompt in self.kills or prompt in self.dies_once:
            self.dies_once.discard(prompt)
            self.deaths += 1
            raise ray_exceptions.ActorDiedError()
        return {"scenario": None, "version": None,
                "outputs": [{"text": "ok", "token_ids": [1], "finish_reason": "stop", "error": None}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

    # the handle surface the ingress uses
    def options(self, **_):
        return self

    @property
    def generate(self):
        replicas = self

        class _Method:
            @staticmethod
            def remote(payload):
                async def call():
                    return replicas._run(payload)
                return call()

        return _Method()

    @property
    def ping(self):  # another replica is alive: the ingress pings one before it retries after a death

        class _Method:
            @staticmethod
            def remote():
                async def call():
                    return "replica-2"
                return call()

        return _Method()

    @property
    def generate_stream(self):
        replicas = self

        class _Method:
            @staticmethod
            def remote(payload):
                async def events():
                    response = replicas._run(payload)
                    yield {"type": "done", "index": 0, "response": response}
                return events()

        return _Method()


def _client(tmp_path, replicas: Replicas) -> TestClient:
    ingress = Ingress({"data_dir": str(tmp_path), "admin_token": TOKEN}, replicas, None)
    return TestClient(ingress.http_app, raise_server_exceptions=False)


def _generate(client: TestClient, prompt: str, **extra):
    return client.post("/v1/generate", json={"prompt": prompt, "max_new_tokens": 2, **extra})


def test_a_request_that_kills_replicas_is_retried_once_then_503(tmp_path):
    replicas = Replicas(kills={"poison"})
    client = _client(tmp_path, replicas)
    r = _generate(client, "poison")
    assert r.status_code == 503, r.text
    assert r.json()["error"]["message"] == NOT_RETRIED
    assert replicas.calls == ["poison", "poison"] and replicas.deaths == 2  # one retry, not more
    # The client sends it again: it reaches one replica (which dies) and is not retried.
    r = _generate(client, "poison")
    assert r.status_code == 503 and r.json()["error"]["message"] == NOT_RETRIED
    assert replicas.calls == ["poison"] * 3
    # Other requests are served as usual.
    assert _generate(client, "fine").status_code == 200
    assert replicas.calls[-1] == "fine"


def test_a_bystander_of_one_death_is_retried_and_answered(tmp_path):
    replicas = Replicas(dies_once={"bystander"})
    client = _client(tmp_path, replicas)
    r = _generate(client, "bystander")
    assert r.status_code == 200, r.text
    assert replicas.calls == ["bystander", "bystander"]
    assert _generate(client, "bystander").status_code == 200  # sent again: served (no death this time)


def test_streams_follow_the_same_rule(tmp_path):
    replicas = Replicas(kills={"poison"})
    client = _client(tmp_path, replicas)
    r = _generate(client, "poison", stream=True)
    assert r.status_code == 503 and r.json()["error"]["message"] == NOT_RETRIED
    assert replicas.calls == ["poison", "poison"]
    r = _generate(client, "poison")  # the same request, not streamed: the same fingerprint
    assert r.status_code == 503 and replicas.calls == ["poison"] * 3


def test_the_fingerprint_and_the_memory():
    base = {"prompt": "x", "max_new_tokens": 2, "seed": 1, "stream": False}
    assert request_fingerprint(base) == request_fingerprint({**base, "stream": True})
    assert request_fingerprint(base) == request_fingerprint(dict(reversed(list(base.items()))))
    assert request_fingerprint(base) != request_fingerprint({**base, "seed": 2})
    memory = DeathMemory(size=2)
    assert memory.record("a") is False and memory.record("a") is True
    memory.record("b")
    memory.record("c")  # "a" is the oldest: forgotten
    assert memory.record("a") is False
