"""The processor chain with the real default model (SmolLM2-135M-Instruct) through ``model.generate``.

Every generated sequence is checked against its own constraint: the label set, the tree, the
schema, the think budget. Sampling runs at high temperature so that the model's preferences do
not hide a hole in the masks.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from transformers import LogitsProcessorList

from processors.scenarios import load_scenario
from deployments.examples import build_phrase_tree, chat_root_token_id
from helpers import chat_prompt_ids
from processors import ConstrainedLogitsProcessor, compile_scenario

pytestmark = pytest.mark.integration

LABELS = ["Sports", "Technology", "Politics", "New York", "New York City", "Technology > AI > NLP", "Technology > AI"]
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


def _generate(model, tokenizer, compiled_rows, prompts_ids, **kwargs):
    """Left-pad ``prompts_ids`` and run generate with the chain; return (new ids per row, processor)."""
    width = max(len(p) for p in prompts_ids)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts_ids])
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts_ids])
    proc = ConstrainedLogitsProcessor(compiled_rows, tokenizer=tokenizer)
    torch.manual_seed(kwargs.pop("seed", 0))
    out = model.generate(
        input_ids,
        attention_mask=attention,
        logits_processor=LogitsProcessorList([proc]),
        eos_token_id=list(proc.stop_token_ids),
        pad_token_id=pad,
        **kwargs,
    )
    return out[:, width:].tolist(), proc


def _until_stop(ids, stop_ids):
    """The generated ids up to and including the first stop token; (ids, ended)."""
    for i, t in enumerate(ids):
        if t in stop_ids:
            return ids[: i + 1], True
    return ids, False


def _assert_one_label(tokenizer, ids, labels, eos):
    body, ended = _until_stop(ids, {eos})
    assert ended, f"row did not end: {tokenizer.decode(ids)!r}"
    text = tokenizer.decode(body[:-1], clean_up_tokenization_spaces=False)
    assert text.startswith(" ") and text[1:] in labels, f"{text!r} is not one of {labels}"
    return text[1:]


@pytest.fixture(scope="module")
def labels_compiled(tokenizer):
    return compile_scenario(load_scenario({"type": "labels", "labels": LABELS}), tokenizer)


def test_labels_100_samples_at_high_temperature(model, tokenizer, labels_compiled):
    prompt = chat_prompt_ids(tokenizer, "Which topic fits: 'The new phone has a faster chip.'?", labels_compiled)
    seen = []
    for seed in range(4):
        rows, proc = _generate(
            model, tokenizer, labels_compiled, [prompt] * 25,
            do_sample=True, temperature=2.0, top_k=0, max_new_tokens=16, seed=seed,
        )
        for ids in rows:
            seen.append(_assert_one_label(tokenizer, ids, LABELS, tokenizer.eos_token_id))
        assert proc.errors == [None] * 25
    assert len(seen) == 100
    assert len(set(seen)) >= 3, f"sampling at T=2 should reach several labels, got {set(seen)}"


def test_greedy_with_invalid_favourite_still_valid(model, tokenizer, labels_compiled):
    # top_k=1: the model's favourite first token (not a label) is masked, a label is still chosen
    prompt = chat_prompt_ids(tokenizer, "Say hello.", labels_compiled)
    rows, _ = _generate(model, tokenizer, labels_compiled, [prompt], do_sample=True, top_k=1, max_new_tokens=16)
    _assert_one_label(tokenizer, rows[0], LABELS, tokenizer.eos_token_id)


def test_multi_label(model, tokenizer):
    compiled = compile_scenario(
        load_scenario({"type": "labels", "labels": LABELS, "multi_label": True, "separator": ",", "max_labels": 3}),
        tokenizer,
    )
    prompt = chat_prompt_ids(tokenizer, "Tag: 'Senators debate AI rules in New York City.'", compiled)
    rows, proc = _generate(
        model, tokenizer, compiled, [prompt] * 24, do_sample=True, temperature=1.8, max_new_tokens=40
    )
    counts = set()
    for ids in rows:
        body, ended = _until_stop(ids, {tokenizer.eos_token_id})
        assert ended
        parts = [p.strip() for p in tokenizer.decode(body[:-1]).split(",")]
        assert all(p in LABELS for p in parts), parts
        assert len(parts) == len(set(parts)), f"a label twice: {parts}"
        assert 1 <= len(parts) <= 3
        counts.add(len(parts))
    assert proc.errors == [None] * 24
    assert 3 in counts, "at T=1.8 some row should reach max_labels"


def _assert_tree_path(tree, ids):
    key = str(tree["start_token_id"])
    end = tree["end_token_id"]
    for t in ids:
        allowed = tree["prefix_dict"].get(key) or [end]
        assert t in allowed, f"token {t} not allowed at {key}"
        if t == end:
            return
        key = f"{key}_{t}"
    raise AssertionError(f"path did not end with the end token: {ids}")


@pytest.fixture(scope="module")
def tree_case(tokenizer):
    # The chat template's generation prompt ends with "assistant\n": its last token is the root,
    # so append_start_token is a no-op, as in RTP-LLM's tree decode.
    tree = build_phrase_tree(
        tokenizer,
        ["red apple", "red apple pie", "green pear", "blue sky at night", "yellow sun", "purple rain"],
        root=chat_root_token_id(tokenizer),
        end=tokenizer.eos_token_id,
    )
    compiled = compile_scenario(load_scenario({"type": "tree", "tree": tree}), tokenizer)
    return tree, compiled


def test_tree_outputs_are_paths(model, tokenizer, tree_case):
    tree, compiled = tree_case
    prompt = chat_prompt_ids(tokenizer, "Name a colourful thing.", compiled)
    assert prompt[-1] == tree["start_token_id"]
    rows, proc = _generate(model, tokenizer, compiled, [prompt] * 16, do_sample=True, temperature=2.0, max_new_tokens=12)
    for ids in rows:
        _assert_tree_path(tree, ids)
    assert proc.fallback_rows == []
    assert proc.errors == [None] * 16


def test_tree_end_token_not_eos_stops_row(model, tokenizer, tree_case):
    # a tree whose end token is not the model's EOS: stop_token_ids carries it into generate
    tree, _ = tree_case
    end = tokenizer.encode(".", add_special_tokens=False)[0]
    tree2 = build_phrase_tree(tokenizer, ["red apple", "green pear"], root=tree["start_token_id"], end=end)
    compiled = compile_scenario(load_scenario({"type": "tree", "tree": tree2}), tokenizer)
    prompt = chat_prompt_ids(tokenizer, "Fruit?", compiled)
    rows, _ = _generate(model, tokenizer, compiled, [prompt] * 6, do_sample=True, temperature=2.0, max_new_tokens=12)
    for ids in rows:
        _assert_tree_path(tree2, ids)


def test_beams_and_num_return_sequences(model, tokenizer, labels_compiled, tree_case):
    prompt = chat_prompt_ids(tokenizer, "Topic of: 'The election results are in.'", labels_compiled)
    rows, proc = _generate(
        model, tokenizer, labels_compiled, [prompt], num_beams=4, num_return_sequences=4, do_sample=False,
        max_new_tokens=16,
    )
    assert len(rows) == 4
    got = [_assert_one_label(tokenizer, ids, LABELS, tokenizer.eos_token_id) for ids in rows]
    assert len(set(got)) == 4, f"beams should return distinct labels: {got}"
    tree, compiled = tree_case
    tprompt = chat_prompt_ids(tokenizer, "Colourful?", compiled)
    rows, _ = _generate(
        model, tokenizer, [compiled, compiled], [tprompt, tprompt[:-3] + tprompt[-1:]],
        do_sample=True, temperature=1.5, num_return_sequences=5, max_new_tokens=12,
    )
    assert len(rows) == 10
    for ids in rows:
        _assert_tree_path(tree, ids)
    rows, _ = _generate(
        model, tokenizer, compiled, [tprompt], num_beams=3, num_return_sequences=3, do_sample=False, max_new_tokens=12
    )
    for ids in rows:
        _assert_tree_path(tree, ids)


def test_batch_mixing_three_scenarios_left_padded(model, tokenizer, labels_compiled, tree_case):
    tree, tree_compiled = tree_case
    schema_compiled = compile_scenario(load_scenario({"type": "json_schema", "schema": PERSON_SCHEMA}), tokenizer)
    rows_spec = [labels_compiled, tree_compiled, schema_compiled] * 2
    prompts = [
        chat_prompt_ids(tokenizer, "Topic: 'A goal in the final minute.'", labels_compiled),
        chat_prompt_ids(tokenizer, "Name a colourful thing, please, anything at all.", tree_compiled),
        chat_prompt_ids(tokenizer, "A person as JSON.", schema_compiled),
        chat_prompt_ids(tokenizer, "Topic of a long text about parliament, votes and parties in the capital?", labels_compiled),
        chat_prompt_ids(tokenizer, "Colour?", tree_compiled),
        chat_prompt_ids(tokenizer, "Give me one made-up person living in Tokyo as a JSON object.", schema_compiled),
    ]
    assert len({len(p) for p in prompts}) > 1, "prompts must differ in length to exercise left padding"
    rows, proc = _generate(model, tokenizer, rows_spec, prompts, do_sample=True, temperature=1.5, max_new_tokens=48)
    for spec, ids in zip(rows_spec, rows):
        if spec is labels_compiled:
            _assert_one_label(tokenizer, ids, LABELS, tokenizer.eos_token_id)
        elif spec is tree_compiled:
            _assert_tree_path(tree, ids)
        else:
            _assert_json_prefix_or_valid(tokenizer, ids, PERSON_SCHEMA)
    assert proc.errors == [None] * 6


def _assert_json_prefix_or_valid(tokenizer, ids, schema):
    """A finished row parses and validates; an unfinished one was cut by max_new_tokens only."""
    body, ended = _until_stop(ids, {tokenizer.eos_token_id})
    text = tokenizer.decode(body[:-1] if ended else body)
    if ended:
        jsonschema.validate(json.loads(text), schema)
        return True
    assert len(ids) == len(body), "an unfinished row must have used every new token"
    return False


def test_json_schema_outputs_validate(model, tokenizer):
    compiled = compile_scenario(load_scenario({"type": "json_schema", "schema": PERSON_SCHEMA}), tokenizer)
    prompt = chat_prompt_ids(tokenizer, "Describe one person as JSON with name, age and city.", compiled)
    rows, proc = _generate(model, tokenizer, compiled, [prompt] * 8, do_sample=True, temperature=1.0, max_new_tokens=48)
    finished = sum(_assert_json_prefix_or_valid(tokenizer, ids, PERSON_SCHEMA) for ids in rows)
    assert finished >= 4, f"only {finished}/8 rows finished within 48 tokens"
    assert proc.errors == [None] * 8


def test_json_objects_hold_only_the_declared_keys(model, tokenizer):
    """A schema that sets no ``additionalProperties`` generates only the keys it declares (the prompt asks for more):
    every finished row parses to an object whose keys are among ``properties``, and validates."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 130}}}
    compiled = compile_scenario(load_scenario({"type": "json_schema", "schema": schema}), tokenizer)
    prompt = chat_prompt_ids(tokenizer, "Describe one person as JSON with name, age, city, job and hobbies.", compiled)
    rows, proc = _generate(model, tokenizer, compiled, [prompt] * 8, do_sample=True, temperature=1.0, max_new_tokens=48,
                           seed=3)
    finished = 0
    for ids in rows:
        body, ended = _until_stop(ids, {tokenizer.eos_token_id})
        if not ended:
            continue
        finished += 1
        value = json.loads(tokenizer.decode(body[:-1]))
        assert isinstance(value, dict) and set(value) <= {"name", "age"}, value
        jsonschema.validate(value, schema)
    assert finished >= 4, f"only {finished}/8 rows finished within 48 tokens"
    assert proc.errors == [None] * 8


def test_think_mode_budget_then_constrained_answer(model, tokenizer):
    budget = 6
    compiled = compile_scenario(
        load_scenario({"type": "labels", "labels": LABELS, "think": {"max_thinking_tokens": budget}}), tokenizer
    )
    prompt = chat_prompt_ids(tokenizer, "Think, then give the topic of: 'Parliament passed the budget.'", compiled)
    assert tokenizer.decode(prompt).endswith("<think>\n")
    end_ids = list(compiled.think.end_ids)
    rows, proc = _generate(model, tokenizer, compiled, [prompt] * 12, do_sample=True, temperature=1.5, max_new_tokens=30)
    for ids in rows:
        pos = next((i for i in range(len(ids)) if ids[i : i + len(end_ids)] == end_ids), None)
        assert pos is not None, f"no end marker in {tokenizer.decode(ids)!r}"
        assert pos <= budget, f"thought {pos} tokens with a budget of {budget}"
        assert tokenizer.eos_token_id not in ids[:pos], "a row must not end while thinking"
        _assert_one_label(tokenizer, ids[pos + len(end_ids) :], LABELS, tokenizer.eos_token_id)
    assert proc.errors == [None] * 12
