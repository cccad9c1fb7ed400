"""The transformers backend in bfloat16 (setting ``dtype``): a real ModelReplica that loads the default model itself
in that dtype serves every constraint kind validly; masking and sampling stay in float32."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest
import torch

from config import ServerSettings

pytestmark = pytest.mark.integration

LABELS = ["Sports", "Technology", "Politics"]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
CHAT = [{"role": "user", "content": "Describe a person as JSON, then pick a section."}]


@pytest.fixture(scope="module")
def replica(tokenizer):
    from deployments.replica import ModelReplica

    rep = ModelReplica(ServerSettings(dtype="bfloat16"), None, tokenizer=tokenizer)  # loads the model itself
    yield rep
    rep.shutdown()


def test_the_setting_reaches_the_model_and_outputs_keep_their_constraints(replica):
    assert next(replica.model.parameters()).dtype == torch.bfloat16
    run = lambda body: asyncio.run(replica.generate(body))  # noqa: E731
    labels = run({"inline_scenario": {"type": "labels", "labels": LABELS}, "messages": CHAT, "n": 4,
                  "temperature": 1.5, "seed": 3})
    assert [o["finish_reason"] for o in labels["outputs"]] == ["stop"] * 4
    assert all(o["text"] in LABELS for o in labels["outputs"]), labels
    person = run({"inline_scenario": {"type": "json_schema", "schema": SCHEMA}, "messages": CHAT, "n": 2,
                  "temperature": 0.8, "seed": 5, "max_new_tokens": 48})
    for out in person["outputs"]:
        if out["finish_reason"] == "stop":
            jsonschema.validate(json.loads(out["text"]), SCHEMA)
        else:
            assert out["finish_reason"] == "length", out
    regex = run({"inline_scenario": {"type": "regex", "pattern": "[0-9]{3}-[0-9]{4}"}, "prompt": "Phone:",
                 "temperature": 1.0, "seed": 7})
    assert all(re.fullmatch("[0-9]{3}-[0-9]{4}", o["text"]) for o in regex["outputs"]), regex


def test_other_dtypes_are_refused():
    with pytest.raises(ValueError, match="dtype"):
        ServerSettings(dtype="float64")
