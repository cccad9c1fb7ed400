"""Finished JSON outputs validated and regenerated, with the real model through a real ModelReplica.

The schemas use ``not``, which the grammar cannot enforce: the grammar lets the model write a number the schema
forbids, the replica's check refuses it and the output is generated again. Every output returned with
``finish_reason: stop`` is checked here against the schema with this module's own check (``jsonschema``, repeated
keys refused), never against a text.
"""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest

from config import ServerSettings

#: an integer the grammar lets through from 0 to 9, of which the schema allows 6 to 9 only
MOSTLY_LOW = {"type": "integer", "minimum": 0, "maximum": 9, "not": {"enum": [0, 1, 2, 3, 4, 5]}}
#: no integer satisfies it, but the grammar (without ``not``) allows 0 to 3: every attempt fails
NOTHING = {"type": "integer", "minimum": 0, "maximum": 3, "not": {"type": "integer"}}
PROMPT = [{"role": "user", "content": "Pick a number from 0 to 9."}]


def _no_repeats(pairs):
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), f"repeated key in {keys}"
    return dict(pairs)


def assert_valid(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text, object_pairs_hook=_no_repeats), schema,
                        format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


@pytest.fixture(scope="module")
def replica(model, tokenizer):
    from deployments.replica import ModelReplica

    rep = ModelReplica(ServerSettings(json_regenerate_attempts=16), None, model=model, tokenizer=tokenizer)
    yield rep
    rep.shutdown()


def attempts_setting(replica, value: int) -> None:
    """``json_regenerate_attempts`` = ``value``, with a per-request budget that lets every output use them all (the
    budget has tests of its own: tests/security/test_regenerate_usage.py)."""
    requests = replica.requests  # the request handling reads them from its settings
    requests.settings = requests.settings.model_copy(update={"json_regenerate_attempts": value,
                                                             "json_regenerate_budget": float(value)})


def body(schema, **extra):
    return {"inline_scenario": {"type": "json_schema", "schema": schema}, "messages": PROMPT,
            "max_new_tokens": 8, **extra}


def stream(replica, request) -> list[dict]:
    async def collect():
        return [event async for event in replica.generate_stream(dict(request, stream=True))]
    return asyncio.run(collect())


def test_invalid_outputs_are_regenerated_and_every_stop_output_is_valid(replica):
    attempts_setting(replica, 16)
    regenerated = 0
    for seed in (3, 4, 5):
        result = asyncio.run(replica.generate(body(MOSTLY_LOW, n=6, temperature=1.3, seed=seed)))
        for out in result["outputs"]:
            assert 1 <= out["attempts"] <= 16
            if out["finish_reason"] == "stop":
                assert_valid(out["text"], MOSTLY_LOW)
                regenerated += out["attempts"] > 1
            else:  # 16 attempts all forbidden: never returned as stop
                assert out["finish_reason"] == "error" and out["attempts"] == 16, out
                assert out["error"].startswith("invalid output after 16 attempts: "), out
        if regenerated:
            break
    assert regenerated, "no output needed a second attempt: the schema no longer exercises regeneration"


def test_exhausted_attempts_end_with_error_and_keep_the_last_attempt(replica, tokenizer):
    attempts_setting(replica, 2)
    try:
        for sampling in ({"temperature": 1.0, "seed": 7}, {"temperature": 0}):
            result = asyncio.run(replica.generate(body(NOTHING, n=2, **sampling)))
            assert len(result["outputs"]) == 2
            for out in result["outputs"]:
                assert out["finish_reason"] == "error" and out["attempts"] == 2, out
                assert out["error"].startswith("invalid output after 2 attempts: fails the schema"), out
                # the last attempt is returned: what the grammar allowed, and the tokens it was decoded from
                assert json.loads(out["text"]) in (0, 1, 2, 3)
                assert tokenizer.decode(out["token_ids"], skip_special_tokens=True) == out["text"]
    finally:
        attempts_setting(replica, 16)


def test_one_attempt_validates_without_regenerating(replica):
    attempts_setting(replica, 1)
    try:
        result = asyncio.run(replica.generate(body(NOTHING, temperature=1.0, seed=1)))
        (out,) = result["outputs"]
        assert out["finish_reason"] == "error" and out["attempts"] == 1
        assert out["error"].startswith("invalid output after 1 attempt: ")
    finally:
        attempts_setting(replica, 16)


def test_a_stream_shows_only_the_accepted_attempt(replica):
    attempts_setting(replica, 16)
    events = stream(replica, body(MOSTLY_LOW, n=3, temperature=1.3, seed=11))
    assert events[-1]["type"] == "done", events[-1]
    outputs = events[-1]["response"]["outputs"]
    texts: dict[int, str] = {}
    ends: dict[int, str] = {}
    for ev in events[:-1]:
        assert ev["type"] == "token"
        if ev["token_id"] is None:
            ends[ev["index"]] = ev["finish_reason"]
        else:
            assert ev["index"] not in ends, "a token after its output ended"
            texts[ev["index"]] = texts.get(ev["index"], "") + ev["text"]
    for index, out in enumerate(outputs):
        assert texts.get(index, "") == out["text"], "the stream showed text the response does not have"
        assert ends[index] == out["finish_reason"]
        if out["finish_reason"] == "stop":
            assert_valid(out["text"], MOSTLY_LOW)


def test_a_stream_of_an_exhausted_output_ends_with_error(replica):
    attempts_setting(replica, 3)
    try:
        events = stream(replica, body(NOTHING, temperature=1.0, seed=2))
        finish = [ev for ev in events if ev["type"] == "token" and ev["token_id"] is None]
        assert [ev["finish_reason"] for ev in finish] == ["error"]
        (out,) = events[-1]["response"]["outputs"]
        assert out["attempts"] == 3 and out["finish_reason"] == "error"
        shown = "".join(ev["text"] for ev in events if ev["type"] == "token")
        assert shown == out["text"]  # one attempt shown: the last
    finally:
        attempts_setting(replica, 16)


def test_outputs_of_other_kinds_take_one_attempt(replica):
    result = asyncio.run(replica.generate({"inline_scenario": {"type": "regex", "pattern": "[0-9]{2}"},
                                           "prompt": "Two digits:", "n": 2, "temperature": 1.0, "seed": 1}))
    assert [o["attempts"] for o in result["outputs"]] == [1, 1]
    exact = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 6, "maximum": 9}},
             "required": ["n"], "additionalProperties": False}
    result = asyncio.run(replica.generate(body(exact, max_new_tokens=16, n=2, temperature=1.0, seed=1)))
    for out in result["outputs"]:
        assert out["attempts"] == 1
        if out["finish_reason"] == "stop":
            assert_valid(out["text"], exact)


def test_strict_put_is_refused_by_the_manager_and_nothing_is_stored(tokenizer, data_dir):
    """strict: true at the config manager's PUT (real Redis, the manager's own compile path): a 400 naming each
    keyword the grammar cannot enforce, nothing stored; an exactly enforced schema is stored."""
    from deployments.manager import ConfigManager
    from deployments.protocol import ServiceError
    from deployments.storage.redis_server import connect_redis

    manager = ConfigManager(ServerSettings(data_dir=data_dir, seed_examples=False), tokenizer=tokenizer,
                            redis_client=connect_redis(None, data_dir), replica_timeout_s=1.0,
                            broadcast_timeout_s=5.0, reconcile_interval_s=0.5)
    tags = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}, "not": {"required": ["x"]}}

    async def go():
        try:
            with pytest.raises(ServiceError) as info:
                await manager.put("tags", {"type": "json_schema", "strict": True, "schema": tags})
            err = info.value
            assert err.status == 400
            assert err.message.startswith("scenario 'tags' cannot be enforced as written (strict: true): ")
            assert "uniqueItems at #/properties/tags" in err.message and "not at #" in err.message
            assert set(err.detail["unenforced"]) == {"uniqueItems at #/properties/tags", "not at #"}
            assert await manager.list() == []  # nothing stored
            assert await manager.put("tags", {"type": "json_schema", "schema": tags}) == {"name": "tags", "version": 1}
            closed = {"type": "object", "properties": {"n": {"type": "integer"}}, "additionalProperties": False}
            assert (await manager.put("closed", {"type": "json_schema", "strict": True, "schema": closed}))["version"] == 1
        finally:
            await manager.close()

    asyncio.run(go())
