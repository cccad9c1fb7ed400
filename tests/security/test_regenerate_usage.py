"""``usage`` counted only the last attempt of a regenerated JSON output, so a client could have
many attempts generated and be billed for one, and the regeneration work of a request was bounded only per output
(``n`` x ``json_regenerate_attempts`` attempts). Every attempt's tokens count now, and the rejected attempts of a
request generate at most ``json_regenerate_budget`` x ``n`` x ``max_new_tokens`` tokens together (a retry starts
only when its whole ``max_new_tokens`` fits what is left).

A real model replica with the real model. The schema (``not`` every integer) fails every attempt; each attempt is
a seeded engine request of its own (seed ``s``, then ``s + 1``, ``s + 2`` for one output, see
``deployments/replica/regenerate.py``), so the tokens of every attempt are known from single-attempt runs with those seeds.
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
    replica.requests.settings = replica.requests.settings.model_copy(update={"json_regenerate_attempts": value})


def _budget(replica, value: float) -> None:
    replica.requests.settings = replica.requests.settings.model_copy(update={"json_regenerate_budget": value})


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


def test_a_zero_budget_never_regenerates(replica):
    _budget(replica, 0.0)
    try:
        result = asyncio.run(replica.generate(_body(SEED, n=3)))
    finally:
        _budget(replica, 2.0)
    assert len(result["outputs"]) == 3
    for out in result["outputs"]:
        assert out["attempts"] == 1 and out["finish_reason"] == "error", out
        assert "json_regenerate_budget=0" in out["error"], out["error"]
    assert result["usage"]["completion_tokens"] == sum(len(o["token_ids"]) for o in result["outputs"])


@pytest.mark.parametrize("budget", [0.05, 0.2, 0.5])
def test_the_budget_bounds_the_tokens_of_a_request(replica, budget):
    """Every attempt fails, so without the budget the request would run n x 3 attempts; with it, what all
    attempts generated stays within (1 + budget) x n x max_new_tokens, and an output that stopped early says why."""
    n, max_new = 4, 8
    _budget(replica, budget)
    try:
        result = asyncio.run(replica.generate(_body(SEED, n=n)))
    finally:
        _budget(replica, 2.0)
    outputs = result["outputs"]
    assert len(outputs) == n and all(o["finish_reason"] == "error" for o in outputs), outputs
    assert result["usage"]["completion_tokens"] <= (1 + budget) * n * max_new, result["usage"]
    # a retry starts only when its whole max_new_tokens fits what is left: none under 8 tokens of budget (0.05, 0.2),
    # some but not the 8 the attempts allow with 16 (0.5)
    retries = sum(o["attempts"] - 1 for o in outputs)
    budget_tokens = int(budget * n * max_new)
    assert (retries == 0) if budget_tokens < max_new else (0 < retries < n * (ATTEMPTS - 1)), \
        [o["attempts"] for o in outputs]
    short = [o for o in outputs if o["attempts"] < ATTEMPTS]
    assert short, "the budget should have stopped some regeneration"
    for out in short:
        assert f"json_regenerate_budget={budget:g}" in out["error"], out["error"]
