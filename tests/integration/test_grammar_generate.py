"""The ``grammar`` kind end to end on a real replica (default model and tokenizer): one-off Lark grammars, sampled
and greedy, blocking and streamed, and a stored-style scenario with think mode. Every output is parsed under its
grammar with the ``lark`` package (llguidance's own matcher when ``lark`` is not installed)."""

from __future__ import annotations

import asyncio

import pytest

from config import ServerSettings

ANSWER = '''start: answer
answer: "yes" | "no" | NUMBER | "[" NUMBER "]" | "[" NUMBER "," NUMBER "]"
NUMBER: /[0-9]{1,4}/
'''
# a small sentence grammar with a space between words (no %ignore: the output is exactly a sentence)
SENTENCE = '''start: subject " " verb " " object "."
subject: "The cat" | "A dog" | "My friend"
verb: "likes" | "sees" | "eats"
object: "fish" | "the ball" | NUMBER " apples"
NUMBER: /[1-9][0-9]?/
'''
CHAT = [{"role": "user", "content": "Is the sky blue? Answer yes, no, or a number."}]


def accepts(grammar: str, text: str, tokenizer) -> bool:
    """Whether ``text`` is a sentence of ``grammar``: lark's parser, else a fresh llguidance matcher fed the text."""
    try:
        import lark
    except ImportError:
        import llguidance

        from processors.tokenizer_info import TokenizerInfo

        matcher = llguidance.LLMatcher(TokenizerInfo.of(tokenizer).lltokenizer, grammar, log_level=0)
        return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()
    try:
        lark.Lark(grammar).parse(text)
    except lark.exceptions.LarkError:
        return False
    return True


@pytest.fixture(scope="module")
def replica(model, tokenizer):
    from deployments.replica import ModelReplica

    rep = ModelReplica(ServerSettings(), None, model=model, tokenizer=tokenizer)
    yield rep
    rep.shutdown()


def run(replica, body):
    return asyncio.run(replica.generate(body))


def stream(replica, body):
    async def collect():
        return [event async for event in replica.generate_stream({**body, "stream": True})]

    return asyncio.run(collect())


def test_the_checker_tells_sentences_apart(tokenizer):
    assert accepts(ANSWER, "[12,7]", tokenizer) and accepts(SENTENCE, "The cat likes 3 apples.", tokenizer)
    assert not accepts(ANSWER, "maybe", tokenizer) and not accepts(SENTENCE, "The cat likes fish", tokenizer)


@pytest.mark.parametrize("grammar", [ANSWER, SENTENCE], ids=["answer", "sentence"])
def test_every_output_is_a_sentence_of_the_grammar(replica, tokenizer, grammar):
    scenario = {"type": "grammar", "grammar": grammar}
    sampled = run(replica, {"inline_scenario": scenario, "messages": CHAT, "n": 6, "temperature": 1.3, "seed": 5,
                            "max_new_tokens": 40})
    greedy = run(replica, {"inline_scenario": scenario, "prompt": "Answer:", "temperature": 0, "max_new_tokens": 40})
    outputs = sampled["outputs"] + greedy["outputs"]
    assert len(outputs) == 7
    for out in outputs:
        assert out["finish_reason"] == "stop" and out["error"] is None, out
        assert out["attempts"] == 1, out  # exact grammar: never regenerated
        assert accepts(grammar, out["text"], tokenizer), out["text"]
    assert len({out["text"] for out in sampled["outputs"]}) > 1  # sampling does explore the grammar


def test_a_streamed_grammar_output_is_the_final_one(replica, tokenizer):
    scenario = {"type": "grammar", "grammar": SENTENCE}
    events = stream(replica, {"inline_scenario": scenario, "prompt": "Write a sentence:", "temperature": 0.9,
                              "seed": 2, "max_new_tokens": 40})
    final = events[-1]["response"]["outputs"][0]
    text = "".join(e.get("text") or "" for e in events if e["type"] == "token")
    assert final["finish_reason"] == "stop" and text == final["text"], (text, final)
    assert accepts(SENTENCE, final["text"], tokenizer), final["text"]


def test_a_grammar_after_a_think_block(replica, tokenizer):
    scenario = {"type": "grammar", "grammar": ANSWER, "think": {"max_thinking_tokens": 8}}
    result = run(replica, {"inline_scenario": scenario, "messages": CHAT, "n": 2, "temperature": 1.0, "seed": 4,
                           "max_new_tokens": 48})
    for out in result["outputs"]:
        assert out["finish_reason"] == "stop", out
        assert accepts(ANSWER, out["answer"], tokenizer), out


def test_a_grammar_that_does_not_compile_is_a_400_naming_it(replica):
    from deployments.protocol import ServiceError

    with pytest.raises(ServiceError) as error:
        run(replica, {"inline_scenario": {"type": "grammar", "grammar": "start: missing_rule"}, "prompt": "x"})
    assert error.value.status == 400 and "grammar: invalid Lark grammar" in error.value.message, error.value.message
