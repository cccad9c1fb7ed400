"""The regex limits: what ``max_regex_repeat`` counts, and that both regex limits reach every regex inside a
JSON schema (``pattern``, ``patternProperties`` keys, ``propertyNames``), named by its JSON path.

Pure functions of ``config.settings`` and the OpenAI mapping of ``deployments.openai.api`` (no model, no Ray).
"""

from __future__ import annotations

import pytest

from config import Limits
from config.settings import LimitExceeded, regex_repeat, schema_patterns
from deployments.openai.api import ChatCompletionRequest, openai_to_generate
from deployments.protocol import ServiceError
from processors.scenarios import check_limits

DEFAULTS = Limits()


@pytest.mark.parametrize("pattern, size", [
    ("(a{10000})" * 400, 4_000_000),  # sequential repeats add up (each alone is under the limit)
    ("a{10000}b{10000}", 20_000),
    ("[0-9]{3}-[0-9]{4}", 8),  # 3 + 1 + 4
    ("(a{100}){100}", 10_000),  # nested ones multiply
    ("((a{100}){100}){100}", 1_000_000),
    ("(ab|c{7}){3}", 27),  # every branch is built: (2 + 7) * 3
    ("a{2,}b{3,5}", 7),  # an open repetition counts its lower bound, a closed one its upper bound
    (r"\p{L}{3}\x{41}", 4),  # braces of an escape are not a repetition
    (r"a\{99\}[{]{2}", 7),  # escaped or in a class: literal braces
    ("(a+)*b?", 2),  # *, + and ? add nothing
    ("a+", 1),
    ("", 0),
])
def test_regex_repeat_counts_the_written_out_size(pattern, size):
    assert regex_repeat(pattern) == size


def test_regex_repeat_of_a_huge_literal_is_over_any_limit():
    assert regex_repeat("a{" + "9" * 40 + "}") >= 10**18
    assert regex_repeat("(a{" + "9" * 40 + "}){1000}") >= 10**18  # capped, no overflow of a huge product


def test_sequential_repeats_are_refused_in_total():
    """400 sequential repeats of 10000 pass each regex limit alone (4 million copies): the total is refused."""
    pattern = "(a{10000})" * 400
    assert len(pattern) <= DEFAULTS.max_regex_length
    with pytest.raises(LimitExceeded) as error:
        check_limits({"type": "regex", "pattern": pattern}, DEFAULTS)
    assert error.value.limit_name == "max_regex_repeat" and error.value.field == "pattern"
    assert "4000000" in str(error.value) and f"max_regex_repeat={DEFAULTS.max_regex_repeat}" in str(error.value)
    check_limits({"type": "regex", "pattern": "(a{10000})"}, DEFAULTS)  # one of them is fine
    with pytest.raises(LimitExceeded):
        Limits(max_regex_repeat=50).check_regex("(a{10}){6}")


def _schema_error(schema, limits: Limits = DEFAULTS) -> LimitExceeded:
    with pytest.raises(LimitExceeded) as error:
        check_limits({"type": "json_schema", "schema": schema}, limits)
    return error.value


def test_every_pattern_in_a_schema_is_checked_and_named_by_its_path():
    huge, long = "a{1000000}", "a" * (DEFAULTS.max_regex_length + 1)
    cases = [
        ({"type": "string", "pattern": huge}, "schema.pattern"),
        ({"type": "object", "properties": {"code": {"type": "string", "pattern": huge}}},
         "schema.properties.code.pattern"),
        ({"type": "string", "allOf": [{"pattern": "a{1,}"}, {"pattern": "b"}, {"pattern": huge}]},
         "schema.allOf[2].pattern"),
        ({"type": "object", "patternProperties": {huge: {"type": "string"}}},
         f'schema.patternProperties["{huge}"]'),
        ({"type": "object", "patternProperties": {"^x": {"type": "string", "pattern": huge}}},
         'schema.patternProperties["^x"].pattern'),
        ({"type": "object", "propertyNames": {"pattern": huge}}, "schema.propertyNames.pattern"),
        ({"$defs": {"zip code": {"type": "string", "pattern": huge}}, "$ref": "#/$defs/zip code"},
         'schema.$defs["zip code"].pattern'),
        ({"type": "array", "items": {"anyOf": [{"type": "null"}, {"type": "string", "pattern": huge}]}},
         "schema.items.anyOf[1].pattern"),
        ({"type": "object", "properties": {"pattern": {"type": "string", "pattern": huge}}},  # a property named pattern
         "schema.properties.pattern.pattern"),
    ]
    for schema, path in cases:
        error = _schema_error(schema)
        assert error.field == path and error.limit_name == "max_regex_repeat", (path, str(error))
        assert str(error).startswith(f"{path}: ") and "max_regex_repeat=10000" in str(error)
    error = _schema_error({"type": "object", "properties": {"a": {"type": "string", "pattern": long}}})
    assert error.field == "schema.properties.a.pattern" and error.limit_name == "max_regex_length"


def test_data_and_names_in_a_schema_are_not_regexes():
    huge = "a{1000000}"
    schema = {
        "type": "object",
        "properties": {"pattern": {"type": "string"}, huge: {"type": "string"}},  # names, not regexes
        "enum": [{"pattern": huge}], "const": {"pattern": huge}, "default": {"pattern": huge},
        "examples": [{"pattern": huge}],
    }
    check_limits({"type": "json_schema", "schema": schema}, DEFAULTS)
    assert list(schema_patterns(schema)) == []


def test_the_allof_schema_of_the_issue_passes_the_regex_limits():
    """Its patterns are small: what bounds it is the compile worker (tests/security/test_compile_bounds.py)."""
    schema = {"type": "string", "allOf": [{"pattern": f"a{{{i},}}"} for i in range(1, 25)]}
    check_limits({"type": "json_schema", "schema": schema}, DEFAULTS)
    assert [path for path, _ in schema_patterns(schema)] == [f"schema.allOf[{i}].pattern" for i in range(24)]


@pytest.mark.parametrize("extra, field", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"code": {"type": "string", "pattern": "(a{10000})" * 3}}}}}},
     "response_format.json_schema.schema.properties.code.pattern"),
    ({"structured_outputs": {"json": {"type": "string", "allOf": [{"pattern": "x"}, {"pattern": "x{20000}"}]}}},
     "structured_outputs.json.allOf[1].pattern"),
    ({"structured_outputs": {"regex": "(a{10000})" * 400}}, "structured_outputs.regex"),
])
def test_openai_one_off_constraints_name_the_pattern_by_the_field_sent(extra, field):
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **extra})
    with pytest.raises(ServiceError) as error:
        openai_to_generate(body, DEFAULTS)
    assert error.value.status == 422
    assert error.value.message.startswith(f"{field}: "), error.value.message
    assert "max_regex_repeat=10000" in error.value.message and error.value.detail["field"] == field
