"""JSON-schema keywords the grammar library cannot enforce: the relaxed grammar, its notes, the full validator.

For each keyword: the schema compiles (it used to be refused), the note names the keyword and where it is, the
grammar still accepts a valid instance (a relaxation only widens), and an instance the relaxed grammar accepts
but the schema forbids is refused by the validator the replica runs on finished outputs. Grammars are real
llguidance grammars checked against the real tokenizer; instances are fed to a real matcher token by token.
"""

from __future__ import annotations

import json

import llguidance
import pytest

from config import ScenarioError
from processors import ScenarioCompiler, compile_json_schema
from processors.schema_check import (OutputValidator, admits_repeated_keys, close_objects, parse_json_strict,
                                     relax_schema)
from processors.tokenizer_info import TokenizerInfo


def compile_(schema, tokenizer):
    return compile_json_schema(schema, tokenizer, eos_token_id=tokenizer.eos_token_id)


def accepts(spec, tokenizer, text: str) -> bool:
    """Whether the grammar lets a row write exactly ``text`` and then end."""
    matcher = llguidance.LLMatcher(TokenizerInfo.of(tokenizer).lltokenizer, spec.grammar, log_level=0)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


# schema, the note it must produce, an instance valid under the schema, an instance the grammar lets through
# although the schema forbids it
CASES = {
    "not": ({"type": "integer", "minimum": 0, "maximum": 9, "not": {"enum": [3]}}, "not at #", "4", "3"),
    "if/then/else": ({"type": "integer", "if": {"minimum": 5}, "then": {"multipleOf": 2}, "else": {"maximum": 1}},
                     "if at #", "6", "4"),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems at #",
                    "[1,2]", "[1,1]"),
    "contains": ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, "contains at #",
                 "[1,5]", "[1,2]"),
    "dependentRequired": ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                           "dependentRequired": {"a": ["b"]}, "additionalProperties": False},
                          "dependentRequired at #", '{"a":1,"b":2}', '{"a":1}'),
    "dependentSchemas": ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                          "dependentSchemas": {"a": {"required": ["b"]}}, "additionalProperties": False},
                         "dependentSchemas at #", '{"a":1,"b":2}', '{"a":1}'),
    "oneOf": ({"oneOf": [{"type": "integer", "minimum": 2}, {"type": "integer", "maximum": 4}]},
              "oneOf (exclusivity) at #", "7", "3"),
    "propertyNames": ({"type": "object", "propertyNames": {"maxLength": 2}, "additionalProperties": {"type": "integer"}},
                      "propertyNames at #", '{"ab":1}', '{"abc":1}'),
    "minProperties": ({"type": "object", "minProperties": 2, "additionalProperties": {"type": "integer"}},
                      "minProperties", '{"a":1,"b":2}', '{"b":1,"b":2}'),
    "nested not": ({"type": "object", "properties": {"n": {"type": "integer", "not": {"const": 0}}},
                    "required": ["n"], "additionalProperties": False}, "not at #/properties/n", '{"n":1}', '{"n":0}'),
    "unknown format": ({"type": "string", "format": "uri-template", "maxLength": 20}, "format 'uri-template' at #",
                       '"/a{b}"', '"/a{"'),
}


@pytest.mark.parametrize("name", list(CASES))
def test_relaxed_keyword_compiles_noted_and_validated(name, tokenizer):
    schema, note, valid, forbidden = CASES[name]
    spec = compile_(schema, tokenizer)
    assert any(n.startswith(note) for n in spec.unenforced), spec.unenforced
    assert not spec.exact
    validator = OutputValidator(schema)
    assert accepts(spec, tokenizer, valid) and validator.error(valid) is None
    assert accepts(spec, tokenizer, forbidden), "the relaxed grammar was expected to let this through"
    assert validator.error(forbidden) is not None
    assert spec.output_error(forbidden) is not None and spec.output_error(valid) is None


def test_repeated_key_passes_min_properties_in_the_grammar_but_not_the_validator(tokenizer):
    schema = {"type": "object", "minProperties": 2}
    spec = compile_(schema, tokenizer)
    assert accepts(spec, tokenizer, '{"b":1,"b":2}')  # the grammar library's gap
    error = spec.output_error('{"b":1,"b":2}')
    assert error is not None and "duplicate key 'b'" in error
    assert spec.output_error('{"b":1,"c":2}') is None
    assert spec.output_error('{"b":1}') is not None  # one property only


def test_repeated_keys_are_invalid_for_any_json(tokenizer):
    spec = compile_(None, tokenizer)
    assert spec.kind == "json" and spec.repeatable_keys and not spec.exact
    assert spec.output_error('{"a":[{"x":1,"x":1}]}') is not None
    assert spec.output_error('{"a":[{"x":1,"y":1}]}') is None


def test_exact_rewrites_add_no_note_and_are_enforced(tokenizer):
    names = {"type": "object", "propertyNames": {"pattern": "^[a-c]$"}, "additionalProperties": {"type": "integer"}}
    spec = compile_(names, tokenizer)
    assert spec.unenforced == ()
    assert accepts(spec, tokenizer, '{"a":1}') and not accepts(spec, tokenizer, '{"d":1}')
    closed = {"type": "object", "properties": {"x": {"type": "integer"}}, "unevaluatedProperties": False}
    spec = compile_(closed, tokenizer)
    assert spec.unenforced == () and spec.exact
    assert accepts(spec, tokenizer, '{"x":1}') and not accepts(spec, tokenizer, '{"x":1,"y":2}')
    single = {"oneOf": [{"type": "integer", "maximum": 3}]}  # exactly one of one: that one
    spec = compile_(single, tokenizer)
    assert spec.unenforced == () and not accepts(spec, tokenizer, "4")


def test_counts_written_as_floats_are_the_same_schema(tokenizer):
    schema = {"type": "array", "items": {"type": "integer"}, "maxItems": 2.0}
    spec = compile_(schema, tokenizer)
    assert spec.unenforced == ()
    assert accepts(spec, tokenizer, "[1,2]") and not accepts(spec, tokenizer, "[1,2,3]")


def test_if_then_else_keeps_the_union_of_its_branches(tokenizer):
    schema, _, _, _ = CASES["if/then/else"]
    spec = compile_(schema, tokenizer)
    # 3 is neither a multiple of 2 nor <= 1: no branch allows it, so the grammar already refuses it
    assert not accepts(spec, tokenizer, "3")
    assert not spec.repeatable_keys  # an integer: no object anywhere


def test_overlapping_pattern_properties_merged(tokenizer):
    schema = {"type": "object", "patternProperties": {"a*": {"type": "integer"}, "aaa*": {"maximum": 20}},
              "additionalProperties": False}
    spec = compile_(schema, tokenizer)
    assert any(n.startswith("patternProperties") for n in spec.unenforced)
    assert accepts(spec, tokenizer, '{"aaaa":30}')  # merged: one of the two schemas holds
    assert spec.output_error('{"aaaa":30}') is not None  # the schema wants both
    assert spec.output_error('{"aaaa":3}') is None


def test_relaxation_does_not_touch_property_names_or_values():
    schema = {"type": "object", "properties": {"not": {"const": {"not": 1}}, "uniqueItems": {"type": "boolean"}},
              "enum": [{"if": 1}]}
    relaxed, notes = relax_schema(schema)
    assert relaxed == schema and notes == []
    assert schema["properties"]["not"] == {"const": {"not": 1}}  # input unchanged


def test_admits_repeated_keys():
    closed = {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": False}
    assert not admits_repeated_keys(closed)
    assert admits_repeated_keys({"type": "object", "properties": {"a": {}}, "additionalProperties": False})
    assert admits_repeated_keys({"type": "object", "properties": {"a": {"type": "array", "items": True}},
                                 "additionalProperties": False})
    assert not admits_repeated_keys({"anyOf": [closed, {"type": "string"}]})
    assert not admits_repeated_keys({"type": "integer", "anyOf": [{"minimum": 2}, {"multipleOf": 3}]})
    assert admits_repeated_keys({"type": "array", "items": {"minimum": 2}})  # an item may be any object
    assert admits_repeated_keys({"type": "object", "patternProperties": {"^x": {}}, "additionalProperties": False})


def test_strict_json_parse():
    with pytest.raises(ValueError, match="duplicate key"):
        parse_json_strict('{"a":1,"a":2}')
    for bad in ("NaN", "[Infinity]", '{"a":1} x', ""):
        with pytest.raises(ValueError):
            parse_json_strict(bad)
    assert parse_json_strict('{"a":[1,{"b":null}]}') == {"a": [1, {"b": None}]}


def test_formats_are_checked_by_the_validator():
    validator = OutputValidator({"type": "string", "format": "date"})
    assert validator.error('"2021-02-29"') is not None  # not a leap year: the grammar's pattern lets it through
    assert validator.error('"2024-02-29"') is None
    assert OutputValidator({"type": "string", "format": "date-time"}).error('"1998-12-31T23:58:60Z"') is not None


def test_strict_refuses_unenforceable_keywords_naming_them(tokenizer):
    compiler = ScenarioCompiler(tokenizer, grammar_worker=False)
    body = {"type": "json_schema", "strict": True,
            "schema": {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}},
                       "not": {"required": ["x"]}}}
    with pytest.raises(ScenarioError) as info:
        compiler.prepare_blocking(body)
    err = info.value
    assert err.kind == "compile" and "strict: true" in err.message
    assert "uniqueItems at #/properties/tags" in err.message and "not at #" in err.message
    assert set(err.detail["unenforced"]) == {"not at #", "uniqueItems at #/properties/tags"}
    assert err.detail["field"] == "schema"
    # the same schema without strict is served; an exactly enforced one with strict too
    assert compiler.prepare_blocking(dict(body, strict=False)).constraint.unenforced
    exact = {"type": "json_schema", "strict": True, "schema": {"type": "object", "properties": {"a": {"type": "integer"}},
                                                                "required": ["a"], "additionalProperties": False}}
    assert compiler.prepare_blocking(exact).constraint.exact


def test_relaxation_runs_in_the_grammar_worker(tokenizer):
    compiler = ScenarioCompiler(tokenizer)  # grammars built in the bounded worker process
    try:
        compiled = compiler.prepare_blocking({"type": "json_schema", "schema": CASES["not"][0]})
        assert compiled.constraint.unenforced == ("not at #",)
        assert compiler.grammar_worker.pid is not None
    finally:
        compiler.close()


def test_schema_text_is_the_original(tokenizer):
    schema = CASES["uniqueItems"][0]
    spec = compile_(schema, tokenizer)
    assert json.loads(spec.schema) == schema


# an object that declares its keys generates only them (processors.schema_check.close_objects)

ADDRESS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
#: schema, a valid instance, an instance with an undeclared key (valid under the schema as written) the grammar refuses
CLOSED = {
    "tool arguments": ({"type": "object", "properties": {"city": {"type": "string", "description": "The city"}},
                        "required": ["city"]}, '{"city":"Paris"}', '{"city":"Paris","description":"x"}'),
    "nested": ({"type": "object", "properties": {"home": ADDRESS}}, '{"home":{"city":"a"}}',
               '{"home":{"city":"a","zip":"1"}}'),
    "$defs": ({"type": "object", "properties": {"home": {"$ref": "#/$defs/Address"}}, "required": ["home"],
               "$defs": {"Address": ADDRESS}}, '{"home":{"city":"a"}}', '{"home":{"city":"a","zip":"1"}}'),
    "optional model": ({"type": "object", "properties": {"home": {"anyOf": [{"$ref": "#/$defs/Address"},
                                                                            {"type": "null"}], "default": None}},
                        "$defs": {"Address": ADDRESS}}, '{"home":null}', '{"home":{"city":"a","zip":"1"}}'),
    "allOf of one": ({"type": "object", "properties": {"home": {"allOf": [{"$ref": "#/$defs/Address"}],
                                                                "description": "where"}},
                      "$defs": {"Address": ADDRESS}}, '{"home":{"city":"a"}}', '{"home":{"city":"a","zip":"1"}}'),
    "recursive": ({"$ref": "#/$defs/Node", "$defs": {"Node": {"type": "object", "properties": {
        "kids": {"type": "array", "items": {"$ref": "#/$defs/Node"}}}}}}, '{"kids":[{"kids":[]}]}',
        '{"kids":[{"x":1}]}'),
    "array items": ({"type": "array", "items": ADDRESS}, '[{"city":"a"}]', '[{"city":"a","zip":"1"}]'),
    "no keys declared": ({"type": "object", "properties": {}}, "{}", '{"x":1}'),
    "empty key": (ADDRESS, '{"city":"a"}', '{"city":"a","":1}'),
    # llguidance takes min/maxProperties beside optional properties only on a closed object
    "minProperties": ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "minProperties": 1}, '{"b":1}', '{"a":1,"c":2}'),
}
#: schema, an instance with a key no ``properties`` entry declares, valid under the schema and accepted by the grammar
OPEN = {
    "additionalProperties true": ({"type": "object", "properties": {"a": {"type": "integer"}},
                                   "additionalProperties": True}, '{"a":1,"b":2}'),
    "additionalProperties schema": ({"type": "object", "properties": {"a": {"type": "integer"}},
                                     "additionalProperties": {"type": "integer"}}, '{"a":1,"b":2}'),
    "patternProperties": ({"type": "object", "properties": {"a": {"type": "integer"}},
                           "patternProperties": {"^x": {"type": "integer"}}}, '{"a":1,"b":2}'),
    "no properties": ({"type": "object"}, '{"b":2}'),
    "allOf of two": ({"allOf": [{"properties": {"a": {"type": "integer"}}}, {"properties": {"b": {"type": "integer"}}}]},
                     '{"b":2}'),
    "required undeclared": ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"]},
                            '{"b":2}'),
    "branch beside required": ({"type": "object", "required": ["b"],
                                "anyOf": [{"properties": {"a": {"type": "integer"}}}]}, '{"b":2}'),
    "minProperties past the declared": ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                                         "minProperties": 2}, '{"a":1,"b":2}'),
}


@pytest.mark.parametrize("name", list(CLOSED))
def test_an_object_that_declares_its_keys_generates_only_them(name, tokenizer):
    schema, valid, undeclared = CLOSED[name]
    spec = compile_(schema, tokenizer)
    assert accepts(spec, tokenizer, valid) and spec.output_error(valid) is None
    assert not accepts(spec, tokenizer, undeclared), "the grammar let an undeclared key through"
    assert spec.output_error(undeclared) is None  # validated by the schema as written, which allows it
    assert json.loads(spec.schema) == schema and spec.unenforced == ()
    assert spec.exact  # closed objects cannot repeat a key: every output the grammar completes is valid


@pytest.mark.parametrize("name", list(OPEN))
def test_an_object_open_to_other_keys_stays_open(name, tokenizer):
    schema, undeclared = OPEN[name]
    spec = compile_(schema, tokenizer)
    assert accepts(spec, tokenizer, undeclared) and spec.output_error(undeclared) is None
    assert spec.repeatable_keys and not spec.exact


def test_close_objects_where_sound():
    schema = {"type": "object", "properties": {"x": {"$ref": "#/$defs/B"},
                                               "y": {"allOf": [{"$ref": "#/$defs/B"}, {"properties": {"b": {}}}]}},
              "$defs": {"B": {"properties": {"a": {}}}}}
    closed = close_objects(schema)
    assert closed["additionalProperties"] is False
    assert "additionalProperties" not in closed["$defs"]["B"]  # also a branch of an allOf of two: left open
    assert "additionalProperties" not in schema  # the input is not changed
    not_branch = {"type": "object", "properties": {"a": {}}, "not": {"type": "object", "properties": {"b": {}}}}
    assert close_objects(not_branch) == not_branch  # beside an applicator, and inside not: as written
    # references close_objects cannot follow: the schema as written
    for schema in ({"properties": {"a": {"$ref": "#/$defs/missing"}}},
                   {"properties": {"a": {"$ref": "other.json"}}},
                   {"properties": {"a": {"$id": "http://example.com/a", "properties": {"b": {}}}}}):
        assert close_objects(schema) == schema
    assert close_objects({"$defs": {"a/b": ADDRESS}, "$ref": "#/$defs/a~1b"})["$defs"]["a/b"]["additionalProperties"] \
        is False
    assert close_objects(True) is True and close_objects({}) == {}
