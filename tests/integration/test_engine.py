"""The replica's continuous-batching decode engine with the real model.

Rows that join a running batch must decode exactly as they would alone (greedy), rows of different
scenarios share forward passes and each stays valid for its own scenario, seeds reproduce.
"""

from __future__ import annotations

import time

import pytest
import torch

from processors.scenarios import load_scenario
from deployments.engines import EngineRequest, EventCollector, SamplingParams
from deployments.engines.transformers import DecodeEngine
from helpers import chat_prompt_ids
from processors import compile_scenario

pytestmark = pytest.mark.integration

LABELS = ["Sports", "Technology", "Politics", "New York City"]


Collector = EventCollector


@pytest.fixture(scope="module")
def engine(model, tokenizer):
    eng = DecodeEngine(model, tokenizer, max_batch_size=8).start()
    yield eng
    eng.stop()


def _solo_greedy(model, tokenizer, prompt, max_new):
    x = torch.tensor([prompt])
    out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new,
                         pad_token_id=tokenizer.eos_token_id)
    ids = out[0, len(prompt):].tolist()
    return ids[: ids.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in ids else ids


def test_rows_joining_a_running_batch_decode_as_alone(engine, model, tokenizer):
    prompts = [
        chat_prompt_ids(tokenizer, "What is the capital of France?"),
        chat_prompt_ids(tokenizer, "Write one sentence about the sea, with care and detail."),
        chat_prompt_ids(tokenizer, "2+2=?"),
    ]
    expected = [_solo_greedy(model, tokenizer, p, 24) for p in prompts]
    collectors = []
    prefills_before = engine.stats()["prefills"]
    for p in prompts:
        c = Collector()
        engine.submit(EngineRequest(prompt_ids=p, compiled=None, max_new_tokens=24, sampling=SamplingParams(temperature=0)), c)
        collectors.append(c)
        time.sleep(0.4)  # the next one arrives while the previous ones decode
    for c, exp in zip(collectors, expected):
        assert c.wait()[0].token_ids == exp
    assert engine.stats()["prefills"] - prefills_before >= 2, "jobs should have been admitted at different steps"


def test_prefix_cache_reuses_shared_prompt_start_and_changes_nothing(engine, model, tokenizer):
    # chat prompts share the template and the default system prompt: later ones start after it
    prompts = [chat_prompt_ids(tokenizer, q) for q in ("Name a colour.", "Name a fruit, please.", "Name a big city.")]
    expected = [_solo_greedy(model, tokenizer, p, 16) for p in prompts]
    reused_before = engine.stats()["prefix_tokens_reused"]
    for p, exp in zip(prompts, expected):
        c = Collector()
        engine.submit(EngineRequest(prompt_ids=p, compiled=None, max_new_tokens=16, sampling=SamplingParams(temperature=0)), c)
        assert c.wait()[0].token_ids == exp
    assert engine.stats()["prefix_tokens_reused"] - reused_before >= 2 * engine.prefix_cache.block


def test_mixed_scenarios_share_the_batch_and_stay_valid(engine, tokenizer):
    labels = compile_scenario(load_scenario({"type": "labels", "labels": LABELS}), tokenizer)
    regex = compile_scenario(load_scenario({"type": "regex", "pattern": "[0-9]{2,4}"}), tokenizer)
    jobs = []
    for i in range(6):
        compiled = labels if i % 2 == 0 else regex
        c = Collector()
        engine.submit(EngineRequest(
            prompt_ids=chat_prompt_ids(tokenizer, f"Answer {i}: which topic, or a number?", compiled), compiled=compiled,
            max_new_tokens=12, sampling=SamplingParams(temperature=1.5, seed=i), n=2,
        ), c)
        jobs.append((compiled, c))
    import re

    for compiled, c in jobs:
        for ev in c.wait().values():
            assert ev.finish_reason == "stop", ev
            text = tokenizer.decode(ev.token_ids[:-1])
            if compiled is labels:
                assert text[1:] in LABELS and text[0] == " ", text
            else:
                assert re.fullmatch(r"[0-9]{2,4}", text), text


def test_seed_reproduces_and_n_rows_differ(engine, tokenizer):
    prompt = chat_prompt_ids(tokenizer, "Tell me a word.")
    runs = []
    for _ in range(2):
        c = Collector()
        engine.submit(EngineRequest(prompt_ids=prompt, compiled=None, max_new_tokens=10,
                          sampling=SamplingParams(temperature=1.2, seed=7), n=3), c)
        runs.append({i: ev.token_ids for i, ev in c.wait().items()})
    assert runs[0] == runs[1]
    assert len({tuple(v) for v in runs[0].values()}) > 1, "n rows with one seed must not be copies"


def test_beam_job_runs_as_its_own_batch(engine, tokenizer):
    labels = compile_scenario(load_scenario({"type": "labels", "labels": LABELS}), tokenizer)
    c = Collector()
    engine.submit(EngineRequest(prompt_ids=chat_prompt_ids(tokenizer, "Topic: a vote in parliament", labels), compiled=labels,
                      max_new_tokens=12, num_beams=4, n=4), c)
    outs = c.wait()
    texts = {tokenizer.decode(ev.token_ids[:-1])[1:] for ev in outs.values()}
    assert texts <= set(LABELS) and len(texts) == 4


def test_failed_prefill_fails_only_its_job(engine, tokenizer):
    # a prompt id outside the embedding table makes the prefill raise: that job gets an error event,
    # it does not hang, and a job decoding at the same time finishes normally
    ok = Collector()
    engine.submit(EngineRequest(prompt_ids=chat_prompt_ids(tokenizer, "Count to twenty."), compiled=None, max_new_tokens=24,
                      sampling=SamplingParams(temperature=0)), ok)
    time.sleep(0.3)
    bad = Collector()
    engine.submit(EngineRequest(prompt_ids=[1, 10**7], compiled=None, max_new_tokens=4), bad)
    assert bad.done.wait(60), "the failed job must get an event"
    assert bad.error and "prefill failed" in bad.error
    assert ok.wait()[0].finish_reason in ("stop", "length")
