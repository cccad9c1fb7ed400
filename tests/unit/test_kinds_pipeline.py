"""Constraint kinds as plug-ins, the tokenizer info and the scenario pipeline, on the 35-token tokenizer.

* the registry is the one map from ``type`` names to kinds, and agrees with the config union;
* every kind compiles through ``compile_scenario`` and makes its cursor through the registry;
* ``TokenizerInfo`` is built once per tokenizer (the llguidance tokenizer too) and does not keep it alive;
* ``ScenarioCompiler``: one ``ScenarioError`` per failure (invalid, limit, compile, timeout), the same message on
  every path, the one-off rules, the content-hash cache (and the refusals it remembers), and the HTTP statuses
  chosen at the edge.
"""

from __future__ import annotations

import asyncio
import gc
import pickle
import time
import weakref

import pytest

from config import Limits, ScenarioError
from processors.scenarios import SCENARIO_TYPES, load_scenario, parse_scenario, scenario_model
from processors import (
    BITMASK, CompiledScenario, GrammarCursor, GrammarSpec, LabelCursor, RowCursor, ScenarioCompiler, TokenizerInfo, TreeCursor,
    compile_scenario, constraint_cursor, get_lltokenizer, registry,
)
from processors.compile_worker import CompileMemoryExceeded
from processors.testing import build_tokenizer, tid

TREE = {"type": "tree", "tree": {"start_token_id": tid(" New"), "end_token_id": 2,
                                 "prefix_dict": {str(tid(" New")): [tid(" York")],
                                                 f"{tid(' New')}_{tid(' York')}": [2, tid(" City")]}}}
BODIES = {
    "tree": TREE,
    "labels": {"type": "labels", "labels": ["yes", "no"]},
    "json_schema": {"type": "json_schema", "schema": {"enum": ["yes", "no"]}},
    "json": {"type": "json"},
    "regex": {"type": "regex", "pattern": "(yes|no)"},
    "grammar": {"type": "grammar", "grammar": 'start: "yes" | "no"'},
    "tools": {"type": "tools", "tools": [{"type": "function", "function": {"name": "ping"}}]},
}


@pytest.fixture()
def compiler(tok):
    return ScenarioCompiler(tok, Limits(), grammar_worker=None, cache_size=4)


# --------------------------------------------------------------------------------------------- the registry


def test_registry_names_every_config_model_and_nothing_else():
    assert registry.names() == SCENARIO_TYPES == tuple(BODIES)
    for name in registry.names():
        kind = registry.get(name)
        assert kind.type_name == name and kind.config_model is scenario_model(name)
    with pytest.raises(ValueError, match="unknown scenario type 'nope'; known: tree, labels"):
        registry.get("nope")
    with pytest.raises(TypeError, match="unsupported constraint str"):
        registry.kind_of("tree")
    assert scenario_model("nope") is None and scenario_model(["tree"]) is None


# what each kind can do, as the engines, the replica and the manager read it (never the kind's name)
CAPABILITIES = {
    "tree": {"items": True, "patch": True, "grammar": False},
    "labels": {"items": True, "patch": True, "grammar": False},
    "json_schema": {"items": False, "patch": False, "grammar": True},
    "json": {"items": False, "patch": False, "grammar": True},
    "regex": {"items": False, "patch": False, "grammar": True},
    "grammar": {"items": False, "patch": False, "grammar": True},
    "tools": {"items": False, "patch": False, "grammar": True},
}


@pytest.mark.parametrize("name", list(BODIES))
def test_every_kind_states_its_capabilities_and_its_compiled_scenarios_carry_them(tok, name):
    import dataclasses

    compiled = compile_scenario(load_scenario(BODIES[name]), tok)
    assert dataclasses.asdict(compiled.capabilities) == CAPABILITIES[name]
    assert compiled.capabilities is registry.get(name).capabilities
    # a grammar kind's rows are grammar matchers: the engines build their first masks off the decode loop
    assert compiled.capabilities.grammar == isinstance(compiled.constraint, GrammarSpec)
    # the capabilities survive the trip to a replica (the compiled scenario is pickled)
    assert pickle.loads(pickle.dumps(compiled)).capabilities == compiled.capabilities


@pytest.mark.parametrize("name", list(BODIES))
def test_every_kind_compiles_and_makes_its_cursor(tok, name):
    compiled = compile_scenario(load_scenario(BODIES[name]), tok)
    kind = registry.get(name)
    assert compiled.kind == name and isinstance(compiled.constraint, kind.compiled_type)
    assert registry.kind_of(compiled.constraint).compiled_type is kind.compiled_type
    cursor = kind.cursor(compiled.constraint, TokenizerInfo.of(tok))
    assert type(cursor) is type(constraint_cursor(compiled.constraint, tok))
    expected = {"tree": TreeCursor, "labels": TreeCursor}.get(name, GrammarCursor)
    assert isinstance(cursor, expected)
    assert compiled.start_token_id == (tid(" New") if name == "tree" else None)
    if kind.needs_tokenizer:
        assert cursor.step().kind == BITMASK
        with pytest.raises(ValueError, match="tokenizer="):
            kind.cursor(compiled.constraint, None)
    row = RowCursor(compiled, TokenizerInfo.of(tok))  # a TokenizerInfo works wherever a tokenizer does
    assert row.step().kind == cursor.step().kind


def test_multi_label_kind_uses_the_label_cursor(tok):
    compiled = compile_scenario(load_scenario({"type": "labels", "labels": ["yes", "no"], "multi_label": True}), tok)
    assert isinstance(registry.get("labels").cursor(compiled.constraint, None), LabelCursor)


# --------------------------------------------------------------------------------------------- the tokenizer info


def test_tokenizer_info_is_built_once_per_tokenizer(tok):
    info = TokenizerInfo.of(tok)
    assert TokenizerInfo.of(info) is info
    assert (info.vocab_size, info.eos_token_ids, info.eos_token_id) == (len(tok), (tok.eos_token_id,), tok.eos_token_id)
    assert info.tokenizer is tok and info.logits_width is None
    again = TokenizerInfo.of(tok)
    assert again.lltokenizer is info.lltokenizer is get_lltokenizer(tok) is get_lltokenizer(info)
    assert info.token_text(tid(" York")) == " York" and info.token_bytes[tid(" York")] == b" York"
    wide = info.with_logits_width(len(tok) + 8)
    assert wide.logits_width == len(tok) + 8 and wide.lltokenizer is info.lltokenizer
    with pytest.raises(ValueError, match="below the vocabulary size"):
        info.with_logits_width(len(tok) - 1)

    class GenerationConfig:
        eos_token_id = [tok.eos_token_id, 0]

    assert TokenizerInfo.of(tok, model_config=GenerationConfig()).eos_token_ids == (tok.eos_token_id, 0)
    back = pickle.loads(pickle.dumps(info))
    assert back.vocab_size == info.vocab_size and back.eos_token_ids == info.eos_token_ids


def test_tokenizer_info_does_not_keep_the_tokenizer_alive():
    fresh = build_tokenizer.__wrapped__()
    info = TokenizerInfo.of(fresh)
    assert TokenizerInfo.of(fresh)._lazy is info._lazy
    ref = weakref.ref(fresh)
    del fresh, info
    gc.collect()
    assert ref() is None


# --------------------------------------------------------------------------------------------- the pipeline


def test_compiler_prepares_every_kind_and_caches_one_off_bodies(compiler):
    for body in BODIES.values():
        assert isinstance(compiler.prepare_now(body), CompiledScenario)
    first = asyncio.run(compiler.prepare(BODIES["regex"], one_off=True))
    assert asyncio.run(compiler.prepare(dict(reversed(BODIES["regex"].items())), one_off=True)) is first  # same content
    assert compiler.prepare_blocking(BODIES["regex"], one_off=True) is first
    assert asyncio.run(compiler.prepare(BODIES["regex"])) is not first  # stored scenarios are not cached
    assert len(compiler.cache) == 1


@pytest.mark.parametrize("body, kind, message, detail", [
    ([1], "invalid", "a scenario body must be a JSON object, got list", set()),
    ({"labels": ["a"]}, "invalid", 'type: missing: a scenario body needs "type", one of tree, labels', {"errors"}),
    ({"type": "labels", "labels": ["a", "a"]}, "invalid", "labels[1]: duplicate label 'a'", {"errors"}),
    ({"type": "labels", "labels": ["a", "b", "c"]}, "limit", "labels: 3 labels exceeds the limit max_labels=2",
     {"field", "limit_name", "limit"}),
    ({"type": "regex", "pattern": "a{101}"}, "limit", "pattern: a size of 101", {"field", "limit_name", "limit"}),
    ({"type": "regex", "pattern": "(yes"}, "compile", "does not compile for the served tokenizer: invalid regex", set()),
    ({"type": "labels", "labels": ["Foo"]}, "compile", "does not survive a tokenizer round trip", set()),
])
def test_one_error_per_failure(tok, body, kind, message, detail):
    compiler = ScenarioCompiler(tok, Limits(max_labels=2, max_regex_repeat=100), grammar_worker=None)
    errors = []
    for run in (compiler.prepare_now, compiler.prepare_blocking, lambda b: asyncio.run(compiler.prepare(b))):
        with pytest.raises(ScenarioError) as error:
            run(body)
        errors.append(error.value)
    assert len({(e.kind, e.message) for e in errors}) == 1, "every path says the same"
    error = errors[0]
    assert error.kind == kind and message in error.message, error.message
    assert set(error.detail) == detail
    assert pickle.loads(pickle.dumps(error)).describe() == error.describe()
    if kind in ("invalid", "limit"):
        assert error.describe() == f"invalid scenario: {error.message}"
        with pytest.raises(ScenarioError) as parsed:
            parse_scenario(body, compiler.limits)  # the same first stage, without processors
        assert parsed.value.message == error.message
    else:
        assert error.describe("scenario", "s") == f"scenario 's' {error.message}"
        assert error.describe("constraint") == f"constraint {error.message}"


def test_a_tree_file_is_for_stored_scenarios_only_and_counted_once_loaded(compiler, tmp_path):
    path = tmp_path / "tree.json"
    path.write_text('{"start_token_id": 3, "end_token_id": 2, "prefix_dict": {"3": [4], "3_4": [2]}}')
    body = {"type": "tree", "path": str(path)}
    with pytest.raises(ScenarioError) as error:
        compiler.prepare_now(body, one_off=True)
    assert error.value.kind == "invalid" and "a one-off tree must be given inline" in error.value.message
    assert error.value.detail == {"field": "path"}
    assert compiler.prepare_now(body).start_token_id == 3
    small = ScenarioCompiler(compiler.info, Limits(max_tree_keys=1), grammar_worker=None)
    with pytest.raises(ScenarioError) as error:
        small.prepare_now(body)
    assert error.value.kind == "limit" and error.value.message == (
        f"path: 2 keys in tree file {path} exceeds the limit max_tree_keys=1")
    assert error.value.detail == {"field": "path", "limit_name": "max_tree_keys", "limit": 1}


def test_timeout_is_one_error(tok):
    compiler = ScenarioCompiler(tok, Limits(compile_timeout_s=0.05), grammar_worker=None)
    for run in (lambda: compiler.run_bounded_blocking(time.sleep, 1),
                lambda: asyncio.run(compiler.run_bounded(time.sleep, 1))):
        with pytest.raises(ScenarioError) as error:
            run()
        assert error.value.kind == "timeout"
        assert error.value.message == "did not compile within 0.05 s (limits.compile_timeout_s=0.05)"
        assert error.value.detail == {"limit_name": "compile_timeout_s", "limit": 0.05}
    assert asyncio.run(compiler.run_bounded(lambda: 7)) == 7


def test_a_refusal_past_the_memory_limit_is_remembered(tok):
    class Worker:  # a grammar worker whose compiles all run out of memory
        vocab_size = len(tok)
        builds = 0

        def build(self, kind, source, options):
            Worker.builds += 1
            raise CompileMemoryExceeded("exceeded the compile memory limit (limits.compile_memory_mb=64)",
                                        "compile_memory_mb", 64)

    compiler = ScenarioCompiler(tok, Limits(), grammar_worker=Worker(), cache_size=2)
    body = {"type": "json_schema", "schema": {"type": "string"}}
    for _ in range(2):
        with pytest.raises(ScenarioError) as error:
            asyncio.run(compiler.prepare(body, one_off=True))
        assert error.value.kind == "compile" and "compile_memory_mb=64" in error.value.message
        assert error.value.detail == {"limit_name": "compile_memory_mb", "limit": 64}
    assert Worker.builds == 1


def test_http_statuses_are_chosen_at_the_edge():
    from deployments.scenario_errors import scenario_service_error

    cases = {"invalid": 422, "limit": 422, "compile": 400, "timeout": 400}
    for kind, status in cases.items():
        error = scenario_service_error(ScenarioError(kind, "m", detail={"limit": 1}), "scenario", name="s")
        assert error.status == status and error.detail == {"name": "s", "limit": 1}
    assert scenario_service_error(ScenarioError("compile", "does not compile: x"), "constraint").message == \
        "constraint does not compile: x"
    assert scenario_service_error(ScenarioError("limit", "labels: x"), "constraint").message == \
        "invalid constraint: labels: x"
