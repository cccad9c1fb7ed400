"""Issue 23, defect 9: ``usage`` counted only the last attempt of a regenerated JSON output, so a client could have
many attempts generated and be billed for one. Every attempt's tokens count now.

A real model replica with the real model. The schema (``not`` every integer) fails every attempt; each attempt is
a seeded engine request of its own (seed ``s``, then ``s + 1``, ``s + 2`` for one output, see
``deployments/regenerate.py``), so the tokens of every attempt are known from single-attempt runs with those seeds.
"""

from __future__ import annotations

import asyncio

import pytest

from config import ServerSettings

NOTHING = {"type": "integer", "minimum": 0, "maximum": 3, "not": {"type": "integer"}}
ATTEMPTS = 3
SEED = 23


@pytest.fixture(scope="module")
def replica(model, tokenizer):
    from deployments.replica import ModelReplica

    rep = ModelReplica(ServerSettings(json_regenerate_attempts=ATTEMPTS), None, model=model, tokenizer=tokenizer)
    yield rep
    rep.shutdown()


def _body(seed: int, **extra) -> dict:
    return {"inline_scenario": {"type": "json_schema", "schema": NOTHING}, "max_new_tokens": 8, "temperature": 1.0,
            "seed": seed, "messages": [{"role": "user", "content": "Pick a number from 0 to 3."}], **extra}


def _attempts(replica, value: int) -> None:
    replica.settings = replica.settings.model_copy(update={"json_regenerate_attempts": value})


def test_usage_counts_every_attempt(replica):
    # each attempt on its own: one attempt each, the seeds the regeneration uses
    _attempts(replica, 1)
    try:
        single = [asyncio.run(replica.generate(_body(SEED + k)))["outputs"][0]["token_ids"] for k in range(ATTEMPTS)]
    finally:
        _attempts(replica, ATTEMPTS)
    expected = sum(map(len, single))

    result = asyncio.run(replica.generate(_body(SEED)))
    (out,) = result["outputs"]
    assert out["attempts"] == ATTEMPTS and out["finish_reason"] == "error", out
    assert out["token_ids"] == single[-1]  # the last attempt is the one returned
    usage = result["usage"]
    assert usage["completion_tokens"] == expected > len(out["token_ids"]), (usage, single)
    assert usage["total_tokens"] == usage["prompt_tokens"] + expected

    async def stream():
        return [event async for event in replica.generate_stream(dict(_body(SEED), stream=True))]

    done = asyncio.run(stream())[-1]
    assert done["type"] == "done" and done["response"]["usage"] == usage, done
