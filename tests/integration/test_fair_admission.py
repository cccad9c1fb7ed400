"""The engine shares its admission between clients: a request of another client takes one of the next free rows
instead of waiting behind one client's whole burst (the ingress lets one client hold up to
``max_inflight_rows_per_client`` rows, more than a batch). Real model, real engine; asserted on the order of the
engine's events, not on seconds."""

from __future__ import annotations

import time

import pytest

from deployments.engines import EngineRequest, SamplingParams
from deployments.engines.protocol import TokenEvent
from deployments.engines.transformers import DecodeEngine
from processors import build_prompt_ids
from test_wide_fairness import Log

pytestmark = pytest.mark.integration


def _request(tokenizer, client: str | None, max_new_tokens: int) -> EngineRequest:
    prompt = build_prompt_ids(None, tokenizer, messages=[{"role": "user", "content": "Count from one to fifty."}])
    return EngineRequest(prompt_ids=prompt, compiled=None, max_new_tokens=max_new_tokens,
                         sampling=SamplingParams(temperature=0.0), client=client)


@pytest.mark.parametrize("fair", [True, False])
def test_another_clients_request_is_not_behind_one_clients_burst(model, tokenizer, fair):
    """Two rows fit a batch. Client ``a`` has two requests decoding and sends two more, then client ``b`` one: ``b``'s request starts in the
    first rows that free up, before ``a``'s fourth (one request of each client in turn). Without client identities
    (``fair=False``: the same client, ``None``, for all) it is first come first served: ``a``'s fourth first."""
    engine = DecodeEngine(model, tokenizer, max_batch_size=2, prefix_cache_tokens=0).start()
    log = Log()
    try:
        for i in range(2):  # the batch's two rows, decoding before the others arrive
            engine.submit(_request(tokenizer, "a" if fair else None, 12), log.collector(f"a{i}"))
        deadline = time.monotonic() + 120
        while not {"a0", "a1"} <= {n for n, e in list(log.events) if isinstance(e, TokenEvent)}:
            assert time.monotonic() < deadline, "the first two requests never started"
            time.sleep(0.005)
        for i in range(2, 4):
            engine.submit(_request(tokenizer, "a" if fair else None, 12), log.collector(f"a{i}"))
        engine.submit(_request(tokenizer, "b" if fair else None, 2), log.collector("b"))
        log.wait()
    finally:
        engine.stop()
    first = {name: log.first(name, TokenEvent) for name in ("a0", "a1", "a2", "a3", "b")}
    assert max(first["a0"], first["a1"]) < min(first["a2"], first["a3"], first["b"])  # two rows at a time
    if fair:
        assert first["b"] < first["a3"], first
    else:
        assert first["a3"] < first["b"], first
