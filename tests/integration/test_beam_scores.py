"""Each beam output reports the score it was ranked by, HF ``generate``'s ``sequences_scores`` (the real model).

The engine's beams against ``model.generate(num_beams=k, num_return_sequences=k, output_scores=True)`` with our
processor chain as its ``logits_processor``: the same sequences in the same order, and each output's ``score``
equal to HF's (summed log-probabilities of the masked distribution over the tokens, the end token included,
divided by their number: ``length_penalty`` 1). Both ways of ranking are covered: from a tree's or a label trie's
tables (``processors/lane_beams.py``) and over the masked vocabulary (the same scenarios with the table path turned
off, and free text cut by ``max_new_tokens``). Then the replica's answer (``/v1/generate``'s outputs) and the OpenAI choices built
from it carry the same scores, a stop string that cuts a beam leaves its score as ranked, and sampled outputs carry
``null``."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import LogitsProcessorList

from config import ServerSettings
from deployments.engines import EngineRequest, EventCollector, SamplingParams
from deployments.engines.transformers import DecodeEngine
from deployments.examples import build_phrase_tree, chat_root_token_id
from deployments.openai.api import openai_response
from deployments.openai.models import ChatCompletionResponse, CompletionResponse
from deployments.protocol import GenerateResponse
from helpers import chat_prompt_ids
from processors import ConstrainedLogitsProcessor, build_prompt_ids, compile_scenario
from processors.scenarios import load_scenario

pytestmark = pytest.mark.integration

LABELS = ["Sports", "Technology", "Politics", "New York", "New York City", "Technology > AI > NLP", "Technology > AI"]
PHRASES = ["red apple", "red apple pie", "green pear", "blue sky at night", "yellow sun", "purple rain"]
COUNT = "Count: 1, 2, 3,"
REL = 1e-4


def _case(tokenizer, name):
    """(compiled scenario or None, prompt ids, beams, max_new_tokens) of one scenario."""
    if name.startswith("labels"):
        compiled = compile_scenario(load_scenario({"type": "labels", "labels": LABELS}), tokenizer)
        return compiled, chat_prompt_ids(tokenizer, "Topic of: 'The election results are in.'", compiled), 4, 16
    if name.startswith("tree"):
        tree = build_phrase_tree(tokenizer, PHRASES, root=chat_root_token_id(tokenizer), end=tokenizer.eos_token_id)
        compiled = compile_scenario(load_scenario({"type": "tree", "tree": tree}), tokenizer)
        return compiled, chat_prompt_ids(tokenizer, "Name a colourful thing.", compiled), 4, 12
    return None, build_prompt_ids(None, tokenizer, prompt=COUNT), 3, 5  # free text: every beam cut by length


@torch.no_grad()
def _hf(model, tokenizer, compiled, prompt, k, max_new):
    """HF beam search of the same request: [(tokens up to and with the first end token, sequences_score)]."""
    x = torch.tensor([prompt])
    eos = [tokenizer.eos_token_id]
    kwargs = {}
    if compiled is not None:
        proc = ConstrainedLogitsProcessor([compiled], tokenizer=tokenizer)
        kwargs["logits_processor"] = LogitsProcessorList([proc])
        eos = list(proc.stop_token_ids)
    out = model.generate(x, attention_mask=torch.ones_like(x), num_beams=k, num_return_sequences=k, do_sample=False,
                         max_new_tokens=max_new, length_penalty=1.0, early_stopping=False, output_scores=True,
                         return_dict_in_generate=True, eos_token_id=eos, pad_token_id=tokenizer.eos_token_id, **kwargs)
    beams = []
    for ids, score in zip(out.sequences[:, len(prompt):].tolist(), out.sequences_scores.tolist()):
        end = next((i for i, t in enumerate(ids) if t in eos), None)
        beams.append((ids if end is None else ids[: end + 1], score))
    return beams


@pytest.mark.parametrize("name", ["labels", "labels-masked", "tree", "tree-masked", "free-text-length"])
def test_beam_scores_equal_hf_sequences_scores(model, tokenizer, name, monkeypatch):
    from deployments.engines.transformers import engine as engine_module
    from deployments.engines.transformers import wide as wide_module

    compiled, prompt, k, max_new = _case(tokenizer, name)
    masked = name.endswith("-masked")
    if masked:  # the same scenario, beams ranked over the masked vocabulary
        monkeypatch.setattr(engine_module, "plan_tree_beams", lambda cursors: None)
        monkeypatch.setattr(wide_module, "plan_tree_beams", lambda cursors: None)
    expected = _hf(model, tokenizer, compiled, prompt, k, max_new)
    engine = DecodeEngine(model, tokenizer, prefix_cache_tokens=0).start()
    try:
        collector = EventCollector()
        engine.submit(EngineRequest(prompt_ids=prompt, compiled=compiled, max_new_tokens=max_new, n=k, num_beams=k,
                                    sampling=SamplingParams(temperature=0)), collector)
        outputs = collector.wait(180)
        tree_ranked = engine.stats()["tree_ranked_steps"]
    finally:
        engine.stop()
    # the ranking path this case is about was taken
    assert (tree_ranked > 0) == (compiled is not None and not masked), tree_ranked
    got = [outputs[i] for i in range(k)]
    assert [out.token_ids for out in got] == [ids for ids, _ in expected]
    for out, (ids, hf_score) in zip(got, expected):
        assert out.score == pytest.approx(hf_score, rel=REL), (name, ids)
        assert out.finish_reason == ("stop" if ids[-1] == tokenizer.eos_token_id else "length")
    if name == "free-text-length":
        assert all(out.finish_reason == "length" for out in got)
    assert [out.score for out in got] == sorted((out.score for out in got), reverse=True)


@torch.no_grad()
def _mean_logprob(model, prompt, ids):
    """The score of one sequence written apart from the engine: its tokens' log-probabilities under the model
    (unconstrained: nothing is masked), averaged over its tokens."""
    logits = model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1: -1].float()
    logp = torch.log_softmax(logits, dim=-1)
    return float(logp[torch.arange(len(ids)), torch.tensor(ids)].sum()) / len(ids)


def test_replica_and_openai_answers_carry_the_scores(model, tokenizer):
    from deployments.replica import ModelReplica

    replica = ModelReplica(ServerSettings(), None, model=model, tokenizer=tokenizer)
    try:
        prompt = build_prompt_ids(None, tokenizer, prompt=COUNT)
        base = {"prompt": COUNT, "num_beams": 3, "n": 3, "max_new_tokens": 6}
        beams = GenerateResponse.model_validate(asyncio.run(replica.generate(base)))
        assert beams.usage.prompt_tokens == len(prompt)
        scores = [out.score for out in beams.outputs]
        assert scores == sorted(scores, reverse=True) and all(s <= 0 for s in scores), scores
        for out in beams.outputs:
            assert out.score == pytest.approx(_mean_logprob(model, prompt, out.token_ids), rel=REL), out

        # a stop string cuts the beams' text; each keeps the score its beam was ranked by
        stopped = GenerateResponse.model_validate(asyncio.run(replica.generate({**base, "stop": [","]})))
        cut = 0
        for out, whole in zip(stopped.outputs, beams.outputs):
            assert out.score == whole.score and whole.text.startswith(out.text), (out, whole)
            cut += out.finish_reason == "stop" and "," in whole.text
        assert cut == 3, stopped.outputs  # every output was cut (the last one too, whose end came last)

        # the OpenAI choices: the same score as an extra field, through the routes' response models
        for chat, model_cls in ((False, CompletionResponse), (True, ChatCompletionResponse)):
            body = model_cls.model_validate(openai_response(beams, chat=chat, model="m")).model_dump()
            assert [choice["score"] for choice in body["choices"]] == scores

        # sampled outputs: no score
        sampled = GenerateResponse.model_validate(asyncio.run(replica.generate(
            {"prompt": COUNT, "n": 2, "max_new_tokens": 4, "temperature": 1.0, "seed": 1})))
        dumped = sampled.model_dump()
        assert [out["score"] for out in dumped["outputs"]] == [None, None]
        body = openai_response(sampled, chat=True, model="m")
        assert [choice["score"] for choice in body["choices"]] == [None, None]
    finally:
        replica.shutdown()
