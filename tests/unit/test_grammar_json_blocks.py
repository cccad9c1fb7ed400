"""``%json {...}`` inside a Lark grammar (llguidance's extension) is a JSON schema like any other: it is held to the
JSON-schema limits (it once skipped them: 200 levels deep or 400 KB passed) and compiled without free whitespace
between JSON tokens, as the json and json_schema kinds are (it once allowed ``{ "a" :  1 }``)."""

from __future__ import annotations

import json

import pytest

from config.settings import LimitExceeded, Limits
from processors.kinds.grammar.spec import check_grammar, grammar_json_schemas, grammar_regexes


def _deep(levels: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_a_json_schema_in_a_grammar_is_held_to_the_schema_limits():
    limits = Limits()
    with pytest.raises(LimitExceeded) as info:
        check_grammar(f"start: %json {json.dumps(_deep(200))}", limits)
    assert info.value.limit_name == "max_schema_depth" and "line 1" in str(info.value.what)
    with pytest.raises(LimitExceeded) as info:
        levels = 10_000  # deeper than the JSON parser goes
        text = '{"type":"object","properties":{"a":' * levels + '{"type":"integer"}' + "}}" * levels
        check_grammar(f'start: "x" | y\ny: %json {text}', Limits(max_grammar_bytes=4 * 1024 * 1024))
    assert info.value.limit_name == "max_schema_depth" and "line 2" in str(info.value.what)
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "d" * 100}
                                             for i in range(3000)}}
    with pytest.raises(LimitExceeded) as info:
        check_grammar(f"start: %json {json.dumps(wide)}", Limits(max_grammar_bytes=4 * 1024 * 1024))
    assert info.value.limit_name == "max_schema_bytes"
    with pytest.raises(LimitExceeded) as info:  # a pattern inside the schema: the regex limits
        check_grammar('start: %json {"type": "string", "pattern": "a{1000000}"}', limits)
    assert info.value.limit_name == "max_regex_repeat"
    check_grammar(f'start: %json {json.dumps(_deep(5))}\nX: /[a-z]+/', limits)  # within the limits


def test_the_scanner_finds_schemas_and_regexes_apart():
    grammar = 'start: a | b\na: %json {"type": "string", "pattern": "/x/"}\n// %json {"no": 1}\nb: "%json {}" /[0-9]+/'
    schemas = grammar_json_schemas(grammar)
    assert [(line, json.loads(grammar[s:e])) for line, s, e in schemas] == [
        (2, {"type": "string", "pattern": "/x/"})]
    assert grammar_regexes(grammar) == [(4, "[0-9]+")]  # not the slashes inside the schema, the comment or the string


def test_a_json_schema_in_a_grammar_allows_no_free_whitespace(tokenizer):
    from processors.grammar import new_matcher
    from processors.kinds.grammar.kind import compile_lark

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "x-guidance": {"whitespace_flexible": True}}  # the schema cannot ask for it either
    spec = compile_lark(f"start: %json {json.dumps(schema)}", tokenizer, eos_token_id=tokenizer.eos_token_id)

    def accepts(text: str) -> bool:
        matcher = new_matcher(spec, tokenizer)
        return all(matcher.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False)) \
            and matcher.is_accepting()

    assert accepts('{"a":1}')
    assert not accepts('{ "a" :  1 }')
