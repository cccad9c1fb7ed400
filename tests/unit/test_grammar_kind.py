"""The ``grammar`` kind (a Lark grammar, built by llguidance): its config model, its limits, its compile errors
naming the field, and its one-off forms on the OpenAI routes (``structured_outputs.grammar``, ``guided_grammar``).

Compiles use the default model's tokenizer and a real grammar worker (the bounded compile path)."""

from __future__ import annotations

import pytest

from config import Limits, ScenarioError, scenario_to_dict
from processors.kinds.grammar.spec import GrammarScenario
from processors.scenarios import parse_scenario
from deployments.openai.api import ChatCompletionRequest, openai_to_generate
from deployments.protocol import ServiceError
from processors import ScenarioCompiler, registry

GRAMMAR = 'start: "yes" | "no" | NUMBER\nNUMBER: /[0-9]{1,6}/\n'


@pytest.fixture(scope="module")
def compiler(tokenizer):
    compiler = ScenarioCompiler(tokenizer, Limits(), grammar_worker=True)
    yield compiler
    compiler.grammar_worker.close()


def invalid(body, limits: Limits | None = None) -> ScenarioError:
    with pytest.raises(ScenarioError) as error:
        parse_scenario(body, limits or Limits())
    return error.value


def test_a_valid_grammar_scenario_parses_and_round_trips():
    body = {"type": "grammar", "grammar": GRAMMAR, "max_new_tokens": 8, "strict": True}
    scenario = parse_scenario(body, Limits())
    assert isinstance(scenario, GrammarScenario) and scenario.grammar == GRAMMAR
    assert scenario_to_dict(scenario) == body
    assert registry.get("grammar").config_model is GrammarScenario


@pytest.mark.parametrize("body, message", [
    ({"type": "grammar"}, "grammar: Field required"),
    ({"type": "grammar", "grammar": ""}, "grammar: String should have at least 1 character"),
    ({"type": "grammar", "grammar": " \n\t"}, "grammar: must not be blank"),
    ({"type": "grammar", "grammar": 5}, "grammar: Input should be a valid string"),
    ({"type": "grammar", "grammar": GRAMMAR, "pattern": "x"}, "pattern: Extra inputs are not permitted"),
])
def test_an_invalid_grammar_body_names_the_field(body, message):
    error = invalid(body)
    assert error.kind == "invalid" and message in error.message, error.message
    assert error.describe().startswith("invalid scenario: ")


def test_limits_bound_the_grammar_and_its_regexes():
    error = invalid({"type": "grammar", "grammar": GRAMMAR}, Limits(max_grammar_bytes=16))
    assert error.kind == "limit" and error.field == "grammar"
    assert error.message == f"grammar: {len(GRAMMAR)} bytes exceeds the limit max_grammar_bytes=16"
    error = invalid({"type": "grammar", "grammar": 'start: "a" x\nx: /(b{100}){1000}/'})
    assert error.kind == "limit" and error.detail["limit_name"] == "max_regex_repeat"
    assert error.message.startswith("grammar: the regex on line 2: a size of 100000"), error.message
    error = invalid({"type": "grammar", "grammar": "start: /" + "a" * 5000 + "/"})
    assert error.detail["limit_name"] == "max_regex_length", error.message
    # a slash inside a string and a // comment are not regexes
    parse_scenario({"type": "grammar", "grammar": 'start: "a/b{99999}/" // /c{99999}/\n'}, Limits())


def test_a_grammar_compiles_exact_and_needs_no_check_after_generation(compiler):
    compiled = compiler.prepare_now({"type": "grammar", "grammar": GRAMMAR}, one_off=True)
    spec = compiled.constraint
    assert compiled.kind == spec.kind == "grammar"
    assert spec.exact and not spec.validates and spec.output_error("anything") is None  # never regenerated
    assert spec.end_token_id in compiled.stop_token_ids


@pytest.mark.parametrize("grammar, problem", [
    ("start: bar", 'unknown name: "bar"'),
    ('answer: "yes"', "no start rule found"),
    ('start: "a" (', "Expected token"),
])
def test_a_grammar_that_does_not_compile_names_the_field(compiler, grammar, problem):
    with pytest.raises(ScenarioError) as error:
        compiler.prepare_now({"type": "grammar", "grammar": grammar})
    assert error.value.kind == "compile" and error.value.field == "grammar"
    assert error.value.message.startswith("does not compile for the served tokenizer: grammar: invalid Lark grammar: ")
    assert problem in error.value.message, error.value.message


def chat(**extra):
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Yes or no?"}], **extra})


@pytest.mark.parametrize("extra", [{"structured_outputs": {"grammar": GRAMMAR}}, {"guided_grammar": GRAMMAR}])
def test_openai_one_off_grammar(extra):
    request, _ = openai_to_generate(chat(**extra), Limits())
    assert request.inline_scenario == {"type": "grammar", "grammar": GRAMMAR}


@pytest.mark.parametrize("extra, field", [
    ({"structured_outputs": {"grammar": GRAMMAR, "regex": "a"}}, "structured_outputs"),
    ({"guided_grammar": GRAMMAR, "guided_regex": "a"}, "guided_grammar"),
    ({"structured_outputs": {"grammar": "start: /a{99999}/"}}, "structured_outputs.grammar"),
    ({"guided_grammar": "start: /a{99999}/"}, "guided_grammar"),
])
def test_openai_grammar_errors_name_the_openai_field(extra, field):
    try:
        body = chat(**extra)
    except Exception as error:  # the exactly-one rule of structured_outputs is the body model's
        assert "give exactly one of 'choice', 'json', 'regex', 'grammar'" in str(error)
        return
    with pytest.raises(ServiceError) as error:
        openai_to_generate(body, Limits())
    assert error.value.status == 422 and field in error.value.message, error.value.message
