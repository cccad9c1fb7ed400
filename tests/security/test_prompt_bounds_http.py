"""One 20 MB text must not take the model replicas down for everyone.

A text of 20 MB (under the 32 MiB body limit) in a ``function_call_output`` on ``/v1/responses``, a tool's
``description`` with ``tool_choice: "none"`` on chat, a chat message or a ``/v1/generate`` prompt used to be
tokenized whole on the replica's event loop before ``max_prompt_tokens`` was checked: a plain-text 500 after about
7 s, the replica missed the ingress's liveness pings, and other clients got 500s and then 503 "no live model
replica". Now a text that cannot fit in ``max_prompt_tokens`` tokens is refused by its length in bytes, before it is
tokenized (no token of the tokenizer is longer than ``max_token_bytes`` bytes, so a prompt of B bytes has at least
B / max_token_bytes tokens): a JSON 413 naming ``max_prompt_tokens``, and another client's requests keep being
served meanwhile.

The probe client sends from another address (127.0.0.2), so the per-client bounds never count it with the big
requests. The time bounds are generous: they tell "answered at once" from "held for seconds", not speeds.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from config import Limits

pytestmark = pytest.mark.serve

BIG = "x " * 10_000_000  # 20 MB of text, 10 million tokens (the texts of the report)
TIMEOUT = 120
# a probe answer after this long was held (quiet: about 0.2 s; before the fix the probe got 503s, one after 6.9 s)
HELD_S = 5.0
# the big requests are answered within this (ten 20 MB bodies at once, sent and parsed, on a small loaded machine:
# up to 4.6 s; before the fix each was a 503 after 7-9 s, with the replicas' event loops tokenizing)
ANSWERED_S = 20.0


def _big_requests() -> list[tuple[str, str, dict]]:
    tool = {"type": "function", "function": {"name": "lookup", "description": BIG,
                                              "parameters": {"type": "object", "properties": {}}}}
    return [
        ("responses function_call_output", "/v1/responses", {
            "input": [{"role": "user", "content": "What did the lookup say?"},
                      {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": "{}"},
                      {"type": "function_call_output", "call_id": "call_1", "output": BIG}],
            "max_output_tokens": 4}),
        ("chat tool description, tool_choice none", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Hi"}], "tools": [tool], "tool_choice": "none", "max_tokens": 4}),
        ("chat message", "/v1/chat/completions", {"messages": [{"role": "user", "content": BIG}], "max_tokens": 4}),
        ("generate prompt", "/v1/generate", {"prompt": BIG, "max_new_tokens": 4}),
        ("generate message", "/v1/generate", {"messages": [{"role": "user", "content": BIG}], "max_new_tokens": 4}),
    ]


class _Probe:
    """Another client: a small request every 0.2 s from 127.0.0.2; each answer's status and time are kept."""

    def __init__(self, url: str):
        self.url = url
        self.results: list[tuple[int, float, str]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        session = requests.Session()
        session.mount("http://", _SourceAdapter("127.0.0.2"))
        while not self.stop.is_set():
            started = time.monotonic()
            try:
                r = session.post(f"{self.url}/v1/generate", json={"prompt": "Hi", "max_new_tokens": 1}, timeout=TIMEOUT)
                self.results.append((r.status_code, time.monotonic() - started, r.text[:300]))
            except requests.RequestException as exc:
                self.results.append((0, time.monotonic() - started, repr(exc)))
            self.stop.wait(0.2)

    def __enter__(self) -> "_Probe":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(TIMEOUT)


class _SourceAdapter(requests.adapters.HTTPAdapter):
    def __init__(self, source: str):
        self.source = source
        super().__init__()

    def init_poolmanager(self, *args, **kwargs):
        kwargs["source_address"] = (self.source, 0)
        return super().init_poolmanager(*args, **kwargs)


def test_twenty_megabyte_texts_are_a_413_at_once_and_other_clients_are_served(serve_app):
    limit = Limits().max_prompt_tokens
    cases = _big_requests()

    def send(case):
        what, path, body = case
        started = time.monotonic()
        r = requests.post(f"{serve_app.url}{path}", json=body, timeout=TIMEOUT)
        return what, r, time.monotonic() - started

    with _Probe(serve_app.url) as probe:
        time.sleep(1.0)  # a few probe answers before
        with ThreadPoolExecutor(len(cases)) as pool:  # all at once: both replicas would be hit
            answers = list(pool.map(send, cases + cases))
        time.sleep(1.0)  # and a few after
    for what, r, took in answers:
        assert r.headers.get("content-type", "").startswith("application/json"), (what, r.status_code, r.text[:300])
        assert r.status_code == 413, (what, r.status_code, r.text[:300])
        error = r.json()["error"]
        assert error["limit_name"] == "max_prompt_tokens" and error["limit"] == limit, (what, error)
        assert f"max_prompt_tokens={limit}" in error["message"], (what, error)
        assert took < ANSWERED_S, (what, took)  # refused before the text is tokenized
    assert len(probe.results) >= 5, probe.results
    failed = [res for res in probe.results if res[0] != 200]
    assert not failed, failed
    slowest = max(took for _, took, _ in probe.results)
    assert slowest < HELD_S, sorted(took for _, took, _ in probe.results)[-5:]
    # the service is well after: /healthz is 200 and a small request is served
    assert requests.get(f"{serve_app.url}/healthz", timeout=TIMEOUT).status_code == 200
    assert serve_app.generate({"prompt": "Hi", "max_new_tokens": 1}).status_code == 200


def test_the_byte_bound_on_a_replica(tokenizer, model):
    """The bound itself, on a replica with ``max_prompt_tokens=16`` (a direct call, no ingress): ``max_token_bytes``
    is the longest token of the vocabulary (each token decoded alone, special tokens included), a prompt one byte
    over ``16 * max_token_bytes`` is refused by its bytes, and one at the bound is tokenized and refused by its
    token count."""
    import asyncio

    from config import ServerSettings
    from deployments.protocol import ServiceError
    from deployments.replica import ModelReplica
    from processors.tokenizer_info import TokenizerInfo

    replica = ModelReplica(ServerSettings(limits=Limits(max_prompt_tokens=16)), None, model=model, tokenizer=tokenizer)
    try:
        longest = replica.max_token_bytes
        assert longest == max(len(b) for b in TokenizerInfo.of(tokenizer).token_bytes)
        most = 16 * longest
        for body in ({"prompt": "a " * (most // 2) + "a"}, {"messages": [{"role": "user", "content": "a" * most}]}):
            with pytest.raises(ServiceError) as error:
                asyncio.run(replica.generate({**body, "max_new_tokens": 1}))
            assert error.value.status == 413 and error.value.detail["max_prompt_bytes"] == most, error.value.message
            assert "bytes of text" in error.value.message and "max_prompt_tokens=16" in error.value.message
        with pytest.raises(ServiceError) as error:  # at the bound: tokenized, then refused by its tokens
            asyncio.run(replica.generate({"prompt": "a " * (most // 2), "max_new_tokens": 1}))
        assert error.value.status == 413 and "tokens exceeds the limit max_prompt_tokens=16" in error.value.message
    finally:
        replica.shutdown()
