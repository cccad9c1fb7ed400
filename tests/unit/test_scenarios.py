"""Scenario models: discriminated parsing, every validation rule and its message, files, and round trips."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel, ValidationError

import config
from config import ThinkConfig, scenario_to_dict
from processors.kinds.tree.treefile.load import load_tree
from processors.kinds.json_schema.spec import JsonSchemaScenario, JsonScenario
from processors.kinds.labels.spec import LabelsScenario
from processors.kinds.regex.spec import RegexScenario
from processors.kinds.tree.spec import TreeScenario, TreeSpec
from processors.scenarios import ScenarioAdapter, load_scenario

TREE = {"start_token_id": 225, "end_token_id": 2, "prefix_dict": {"225": [10, 11], "225_10": [2]}}


def error_text(body) -> str:
    with pytest.raises(ValidationError) as excinfo:
        load_scenario(body)
    return str(excinfo.value)


# -- the models themselves -------------------------------------------------------------------------------------


def test_every_field_has_a_description():
    models = [ThinkConfig, TreeSpec, TreeScenario, LabelsScenario, JsonSchemaScenario, JsonScenario, RegexScenario]
    for model in models:
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"
        assert model.model_config.get("extra") == "forbid"


def test_public_api_is_exported():
    for name in config.__all__:
        assert hasattr(config, name), name


@pytest.mark.parametrize(
    ("body", "cls"),
    [
        ({"type": "tree", "tree": TREE}, TreeScenario),
        ({"type": "tree", "path": "/data/tree.json"}, TreeScenario),
        ({"type": "labels", "labels": ["yes", "no"]}, LabelsScenario),
        ({"type": "json_schema", "schema": {"type": "object"}}, JsonSchemaScenario),
        ({"type": "json"}, JsonScenario),
        ({"type": "regex", "pattern": r"\d{3}"}, RegexScenario),
    ],
)
def test_each_kind_parses_and_round_trips(body, cls):
    scenario = load_scenario(body)
    assert isinstance(scenario, cls)
    stored = scenario_to_dict(scenario)
    assert json.loads(json.dumps(stored)) == stored
    assert load_scenario(stored) == scenario
    assert ScenarioAdapter.validate_python(stored) == scenario


def test_common_fields_and_defaults():
    scenario = load_scenario(
        {
            "type": "json",
            "description": "any JSON",
            "system_prompt": "Answer in JSON.",
            "think": {"max_thinking_tokens": 64},
            "max_new_tokens": 100,
            "temperature": 0.0,
            "top_p": 1.0,
            "top_k": 0,
        }
    )
    assert scenario.think == ThinkConfig(max_thinking_tokens=64, begin="<think>\n", end="</think>\n\n")
    assert (scenario.max_new_tokens, scenario.temperature, scenario.top_p, scenario.top_k) == (100, 0.0, 1.0, 0)
    assert scenario_to_dict(load_scenario({"type": "json"})) == {"type": "json"}


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"think": {"max_thinking_tokens": 0}}, "think.max_thinking_tokens"),
        ({"think": {"max_thinking_tokens": 5, "begin": ""}}, "think.begin"),
        ({"think": {}}, "think.max_thinking_tokens"),
        ({"think": {"max_thinking_tokens": 5, "color": "red"}}, "think.color"),
    ],
)
def test_common_field_errors_name_the_field(extra, field):
    assert f"json.{field}" in error_text({"type": "json", **extra})


def test_think_markers_must_differ():
    text = error_text({"type": "json", "think": {"max_thinking_tokens": 5, "begin": "<t>", "end": "<t>"}})
    assert "think.begin and think.end must differ" in text


def test_unknown_type_and_missing_type():
    text = error_text({"type": "cfg", "pattern": "x"})
    assert "'cfg'" in text and "'tree', 'labels', 'json_schema', 'json', 'regex', 'grammar'" in text
    assert "discriminator 'type'" in error_text({"labels": ["a"]})


@pytest.mark.parametrize(
    "body",
    [
        {"type": "json", "schema": {}},
        {"type": "labels", "labels": ["a"], "choices": ["b"]},
        {"type": "regex", "pattern": "a", "regex": "b"},
        {"type": "tree", "tree": TREE, "root": 1},  # unknown fields INSIDE the tree: a warning (tree file rules)
    ],
)
def test_extra_fields_are_rejected(body):
    assert "Extra inputs are not permitted" in error_text(body)


# -- tree ------------------------------------------------------------------------------------------------------


def test_tree_needs_exactly_one_of_tree_or_path():
    message = "exactly one of 'tree' (inline) or 'path'"
    assert message in error_text({"type": "tree"})
    assert message in error_text({"type": "tree", "tree": TREE, "path": "t.json"})


def test_inline_tree_errors_match_the_file_loader(tmp_path):
    bad = {**TREE, "prefix_dict": {"225": [10, 3.0], "225_x1": [2], "225_10": [-1]}}
    text = error_text({"type": "tree", "tree": bad})
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError) as file_error:
        load_tree(path)
    for message in [
        'prefix_dict["225"][1]: candidate must be an integer, got number 3.0 (not an integer)',
        "prefix_dict[\"225_x1\"]: malformed key: part 'x1' is not a non-negative integer",
    ]:
        assert message in text
        assert message in str(file_error.value)
    assert "tree.tree" in text
    # a negative id is skipped with a warning, unless strict
    assert "id -1 is negative" not in text
    with pytest.raises(ValueError, match=r'prefix_dict\["225_10"\]\[0\]: id -1 is negative'):
        load_tree(path, strict=True)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"sep": "0"}, "must not contain digits or '-'"),
        ({"start_token_id": -1}, "tree.tree.start_token_id"),
        ({"end_token_id": 2.0}, "tree.tree.end_token_id"),
        ({"start_token_id": True}, "tree.tree.start_token_id"),
        ({"prefix_dict": {"1": [2]}}, "prefix_dict[\"1\"]: key must be '225' or start with '225_'"),
    ],
)
def test_inline_tree_field_errors(change, message):
    assert message in error_text({"type": "tree", "tree": {**TREE, **change}, "strict": True})


def test_inline_tree_missing_root_only_warns():
    scenario = load_scenario({"type": "tree", "tree": {**TREE, "prefix_dict": {"225_10": [2]}}})
    assert load_tree(scenario.tree).warnings


def test_inline_tree_loads_as_tree_data():
    scenario = load_scenario({"type": "tree", "tree": TREE, "append_start_token": False})
    assert scenario.append_start_token is False
    assert load_tree(scenario.tree).to_dict() == {**TREE, "sep": "_"}


# -- labels ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"labels": []}, "labels\n  List should have at least 1 item"),
        ({"labels": ["a", ""]}, "labels[1]: a label must not be empty"),
        ({"labels": ["a", " b"]}, "labels[1]: label ' b' has leading or trailing whitespace"),
        ({"labels": ["a\n"]}, "labels[0]: label 'a\\n' has leading or trailing whitespace"),
        ({"labels": ["spam", "ham", "spam"]}, "labels[2]: duplicate label 'spam'"),
        ({"labels": ["a,b", "c"], "multi_label": True}, "labels[0]: label 'a,b' contains the separator ','"),
        ({"labels": ["a", "b"], "max_labels": 2}, "max_labels is only meaningful with multi_label"),
        ({"labels": ["a"], "multi_label": True, "max_labels": 0}, "labels.max_labels"),
        ({"labels": ["a"], "multi_label": True, "separator": ""}, "labels.separator"),
    ],
)
def test_label_rules(body, message):
    assert message in error_text({"type": "labels", **body})


def test_labels_valid_variants():
    multi = load_scenario({"type": "labels", "labels": ["a b", "c"], "multi_label": True, "separator": ";",
                           "max_labels": 2})
    assert (multi.multi_label, multi.separator, multi.max_labels) == (True, ";", 2)
    single = load_scenario({"type": "labels", "labels": ["a,b", "c"]})  # the separator only matters for multi
    assert single.labels == ["a,b", "c"]


# -- json_schema / json / regex --------------------------------------------------------------------------------


def test_schema_alias_round_trip():
    schema = {"type": "object", "properties": {"x": {"type": "integer", "default": None}}, "required": ["x"]}
    scenario = load_scenario({"type": "json_schema", "schema": schema})
    assert scenario.json_schema == schema
    dumped = scenario.model_dump(by_alias=True)
    assert dumped["schema"] == schema and "json_schema" not in dumped
    assert scenario_to_dict(scenario) == {"type": "json_schema", "schema": schema}  # None inside kept
    assert JsonSchemaScenario(type="json_schema", json_schema=schema) == scenario  # populate by name
    assert JsonSchemaScenario.model_validate(dumped) == scenario


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"type": "strin"}, "schema: invalid JSON Schema at type:"),
        ({"properties": {"a": {"type": 5}}}, "schema: invalid JSON Schema at properties/a/type: 5"),
        ({"required": "x"}, "schema: invalid JSON Schema at required: 'x' is not of type 'array'"),
    ],
)
def test_invalid_json_schema(schema, message):
    assert message in error_text({"type": "json_schema", "schema": schema})


def test_json_schema_missing_or_not_an_object():
    assert "json_schema.schema\n  Field required" in error_text({"type": "json_schema"})
    assert "json_schema.schema" in error_text({"type": "json_schema", "schema": [1]})


def test_regex_pattern_required_and_non_empty():
    assert "regex.pattern\n  Field required" in error_text({"type": "regex"})
    assert "regex.pattern" in error_text({"type": "regex", "pattern": ""})


# -- files -----------------------------------------------------------------------------------------------------


def from_file(cls, path):
    """A scenario of kind ``cls`` loaded from a JSON or YAML file; a ``ValueError`` when the file holds another."""
    scenario = load_scenario(path)
    if not isinstance(scenario, cls):
        raise ValueError(f"{os.fspath(path)}: expected a {cls.__name__}, got type {scenario.type!r}")
    return scenario


def test_json_and_yaml_files(tmp_path):
    body = {"type": "labels", "labels": ["positive", "negative"], "temperature": 0.2}
    (tmp_path / "s.json").write_text(json.dumps(body))
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(body))
    (tmp_path / "s.yml").write_text(yaml.safe_dump(body))
    expected = load_scenario(body)
    for name in ("s.json", "s.yaml", "s.yml"):
        assert load_scenario(tmp_path / name) == expected
        assert load_scenario(str(tmp_path / name)) == expected
    assert from_file(LabelsScenario, tmp_path / "s.yaml") == expected
    with pytest.raises(ValueError, match="expected a RegexScenario, got type 'labels'"):
        from_file(RegexScenario, tmp_path / "s.json")


def test_relative_tree_path_resolves_against_the_scenario_file(tmp_path):
    (tmp_path / "trees").mkdir()
    (tmp_path / "scenarios").mkdir()
    (tmp_path / "trees" / "t.json").write_text(json.dumps(TREE))
    (tmp_path / "scenarios" / "s.yaml").write_text("type: tree\npath: ../trees/t.json\n")
    scenario = load_scenario(tmp_path / "scenarios" / "s.yaml")
    assert Path(scenario.path) == (tmp_path / "trees" / "t.json").resolve()
    assert len(load_tree(scenario.path)) == 2
    absolute = str(tmp_path / "trees" / "t.json")
    (tmp_path / "scenarios" / "abs.json").write_text(json.dumps({"type": "tree", "path": absolute}))
    assert load_scenario(tmp_path / "scenarios" / "abs.json").path == absolute
    assert load_scenario({"type": "tree", "path": "rel.json"}).path == "rel.json"  # dicts stay as given


def test_invalid_body_in_file_raises_validation_error_naming_the_field(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("type: labels\nlabels: [a, b]\nmulti_label: true\nmax_labels: 0\n")
    with pytest.raises(ValidationError) as excinfo:
        load_scenario(path)
    assert "labels.max_labels" in str(excinfo.value)


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("s.json", "", "is empty"),
        ("s.json", "{not json", "is not valid JSON"),
        ("s.yaml", "type: [unclosed", "is not valid YAML"),
        ("s.json", "[1, 2]", "must hold a mapping at the top level, got list"),
        ("s.yaml", "just text", "must hold a mapping at the top level, got str"),
    ],
)
def test_unreadable_scenario_files(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError) as excinfo:
        load_scenario(path)
    assert message in str(excinfo.value) and str(path) in str(excinfo.value)
    assert not isinstance(excinfo.value, ValidationError)


def test_missing_scenario_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="scenario file not found: .*nope.json"):
        load_scenario(tmp_path / "nope.json")


def test_load_scenario_rejects_other_types():
    with pytest.raises(TypeError, match="expects a dict or a path"):
        load_scenario(["type", "json"])
    assert issubclass(ThinkConfig, BaseModel)


def test_scenario_types_name_every_member_of_the_union():
    import typing

    from processors.scenarios import SCENARIO_TYPES
    from processors.scenarios import Scenario

    members = typing.get_args(typing.get_args(Scenario)[0])
    assert tuple(typing.get_args(m.model_fields["type"].annotation)[0] for m in members) == SCENARIO_TYPES


# -- the description's bound ------------------------------------------------------------------------------------

DESCRIBED = {
    "tree": {"type": "tree", "tree": TREE},
    "labels": {"type": "labels", "labels": ["yes", "no"]},
    "json_schema": {"type": "json_schema", "schema": {"enum": ["yes", "no"]}},
    "json": {"type": "json"},
    "regex": {"type": "regex", "pattern": "(yes|no)"},
    "grammar": {"type": "grammar", "grammar": 'start: "yes" | "no"'},
    "tools": {"type": "tools", "tools": [{"type": "function", "function": {"name": "ping"}}]},
}


def test_every_kind_has_a_body_for_the_description_bound():
    from processors.scenarios import SCENARIO_TYPES

    assert tuple(DESCRIBED) == SCENARIO_TYPES


@pytest.mark.parametrize("kind", list(DESCRIBED))
def test_a_description_past_max_description_bytes_is_refused_naming_it(kind):
    """Every kind: a description of max_description_bytes (UTF-8) passes, one byte more is a limit error naming
    the field and the limit (a 422 at the HTTP edge), counted in bytes, not characters."""
    from config import Limits, ScenarioError
    from processors.scenarios import parse_scenario

    limits = Limits(max_description_bytes=32)
    at = "\u00e9" * 16  # 16 characters, 32 bytes
    assert parse_scenario({**DESCRIBED[kind], "description": at}, limits).description == at
    with pytest.raises(ScenarioError) as excinfo:
        parse_scenario({**DESCRIBED[kind], "description": at + "x"}, limits)
    error = excinfo.value
    assert (error.kind, error.field, ScenarioError.STATUS[error.kind]) == ("limit", "description", 422)
    assert error.detail["limit_name"] == "max_description_bytes" and error.detail["limit"] == 32
    assert error.message == "description: 33 bytes exceeds the limit max_description_bytes=32", error.message


def test_a_20_mib_description_is_refused_by_default():
    from config import Limits, ScenarioError
    from processors.scenarios import parse_scenario

    limits = Limits()
    with pytest.raises(ScenarioError, match=f"max_description_bytes={limits.max_description_bytes}"):
        parse_scenario({**DESCRIBED["labels"], "description": "x" * (20 << 20)}, limits)
    assert parse_scenario({**DESCRIBED["labels"], "description": "x" * limits.max_description_bytes}, limits)
