"""One request must not stall, crash or starve the others.

The decode engine with the real model: a beam request, a tiny temperature, a failing row, a long prompt and a
grammar whose first mask is slow each run next to an ordinary request, which must keep decoding and finish
normally. "Keeps decoding" is counted in tokens of the ordinary request that arrive while the other one is
being admitted, not in seconds, so the assertions do not depend on the machine's speed.
"""

from __future__ import annotations

import re
import time

import pytest
import torch

from processors.scenarios import load_scenario
from deployments.engines.transformers import engine as engine_module
from deployments.engines import EngineRequest, EventCollector, SamplingParams
from deployments.engines.transformers import DecodeEngine
from helpers import chat_prompt_ids
from processors import build_prompt_ids, compile_scenario
from processors.grammar import compile_regex

LABELS = ["Sports", "Technology", "Politics", "New York City"]


class Events(EventCollector):
    """An :class:`EventCollector` that also tells when the tokens arrived."""

    def first_token_at(self) -> float:
        """Arrival time (``time.perf_counter``) of the first token."""
        if not self.times:
            raise RuntimeError("no token yet")
        return self.times[0][0]

    def tokens_between(self, start: float, end: float) -> int:
        """How many tokens arrived strictly between two ``time.perf_counter`` readings."""
        return sum(1 for t, _ in self.times if start < t < end)


@pytest.fixture(scope="module")
def engine(model, tokenizer):
    eng = DecodeEngine(model, tokenizer, max_batch_size=16, prefill_chunk_tokens=256).start()
    yield eng
    eng.stop()


def _background(engine, tokenizer, max_new=200):
    """An ordinary greedy request that decodes for a while; returns (ticket, events)."""
    ev = Events()
    job = engine.submit(EngineRequest(prompt_ids=chat_prompt_ids(tokenizer, "Count from 1 to 500, separated by commas."),
                                      compiled=None, max_new_tokens=max_new, sampling=SamplingParams(temperature=0)), ev)
    deadline = time.time() + 60
    while not ev.times and time.time() < deadline:
        time.sleep(0.02)
    assert ev.times, "the background job never started"
    return job, ev


def _solo_greedy(model, prompt, max_new, eos):
    x = torch.tensor([prompt])
    out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new, pad_token_id=eos)
    ids = out[0, len(prompt):].tolist()
    return ids[: ids.index(eos) + 1] if eos in ids else ids


def test_beam_request_shares_the_batch_and_can_be_cancelled(engine, tokenizer):
    # what this guards against: a beam request that cannot end early (no EOS before 1024 tokens is likely) ran
    # alone through generate, blocking every other request until it ended, and ignored cancellation
    beam_ev = Events()
    beam = engine.submit(EngineRequest(prompt_ids=build_prompt_ids(None, tokenizer, prompt="Count from 1 to 10000: 1, 2, 3,"),
                                       compiled=None, max_new_tokens=1024, n=8, num_beams=8), beam_ev)
    time.sleep(1.0)
    other_ev = Events()
    engine.submit(EngineRequest(prompt_ids=chat_prompt_ids(tokenizer, "Say hello."), compiled=None, max_new_tokens=8,
                                sampling=SamplingParams(temperature=0)), other_ev)
    assert other_ev.done.wait(120), "a short request waited behind a beam request"
    assert other_ev.error is None and other_ev.finished[0].finish_reason in ("stop", "length")
    assert not beam_ev.done.is_set(), "the beam request should still be running (it needs 1024 steps)"
    cancelled_at = time.perf_counter()
    beam.cancel()
    assert beam_ev.done.wait(30), "a cancelled beam request went on"
    assert beam_ev.error == "cancelled"
    # its rows leave the batch at the next step
    deadline = time.time() + 30
    while engine.active_rows and time.time() < deadline:
        time.sleep(0.05)
    assert engine.active_rows == 0
    assert time.perf_counter() - cancelled_at < 30


def test_batched_sampling_follows_each_rows_parameters(tokenizer):
    # one batch, four rows with different settings: greedy, a tiny temperature, top-k 1 (greedy too) and
    # seeded sampling, which must reproduce and stay inside its top-k / top-p set
    from deployments.engines.transformers import sample_rows

    torch.manual_seed(0)
    logits = torch.randn(4, 1000) * 3
    logits[:, 500:] = float("-inf")  # masked tokens are never drawn
    best = logits.argmax(dim=-1)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1e-39), SamplingParams(temperature=1.0, top_k=1),
              SamplingParams(temperature=2.0, top_k=5, top_p=0.9, seed=3)]
    draws = []
    for _ in range(2):
        gens = [None, None, None, torch.Generator().manual_seed(3)]
        draws.append(sample_rows(logits, params, gens).tolist())
    assert draws[0] == draws[1]
    assert draws[0][:3] == best[:3].tolist()
    top5 = set(torch.topk(logits[3], 5).indices.tolist())
    seen = set()
    gen = torch.Generator().manual_seed(1)
    for _ in range(200):
        seen.add(sample_rows(logits[3:], params[3:], [gen]).item())
    assert seen <= top5 and len(seen) >= 2
    free = SamplingParams(temperature=1.0)
    many = {sample_rows(logits[:1], [free], [gen]).item() for _ in range(300)}
    assert max(many) < 500 and len(many) > 5


def test_beam_outputs_stay_valid_next_to_sampled_rows(engine, tokenizer):
    labels = compile_scenario(load_scenario({"type": "labels", "labels": LABELS}), tokenizer)
    bg_job, bg = _background(engine, tokenizer, max_new=40)
    ev = Events()
    engine.submit(EngineRequest(prompt_ids=chat_prompt_ids(tokenizer, "Topic: a vote in parliament", labels), compiled=labels,
                      max_new_tokens=12, num_beams=4, n=3), ev)
    outs = ev.wait()
    assert sorted(outs) == [0, 1, 2]
    texts = [tokenizer.decode(o.token_ids[:-1]) for o in outs.values()]
    for o, text in zip(outs.values(), texts):
        assert o.finish_reason == "stop" and text[0] == " " and text[1:] in LABELS, text
    assert len(set(texts)) == 3, "returned beams must be different sequences"
    bg.wait()


def test_tiny_temperature_is_greedy_and_fails_nobody(engine, model, tokenizer):
    # what this guards against: logits / 1e-39 overflowed to inf/NaN, the sampler raised and the engine failed
    # every active job
    _, bg = _background(engine, tokenizer, max_new=30)
    prompt = chat_prompt_ids(tokenizer, "Name a colour.")
    ev = Events()
    engine.submit(EngineRequest(prompt_ids=prompt, compiled=None, max_new_tokens=6, sampling=SamplingParams(temperature=1e-39)), ev)
    out = ev.wait()[0]
    assert out.token_ids == _solo_greedy(model, prompt, 6, tokenizer.eos_token_id)
    assert bg.wait()[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("value", [float("inf"), float("nan"), -1.0])
def test_sampling_params_refuse_non_finite_values(value):
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=value)


def test_a_failing_row_fails_only_its_own_request(engine, tokenizer, monkeypatch):
    # Fault injection (named as such): the sampler raises for the rows of one request, which stands for any
    # per-row failure the engine cannot foresee (a NaN row, a bug in a cursor). The others must not notice.
    # The batched sampler fails for any batch holding such a row, and so does the row-by-row fallback for
    # exactly those rows.
    from deployments.engines.transformers import rows as rows_module  # the row-by-row fallback lives there

    real_rows, real_row = engine_module.sample_rows, rows_module.sample_row

    def faulty_sample_rows(logits, params, generators):
        if any(p.seed == 4242 for p in params):
            raise RuntimeError("injected fault")
        return real_rows(logits, params, generators)

    def faulty_sample_row(logits, params, generator):
        if params.seed == 4242:
            raise RuntimeError("injected fault")
        return real_row(logits, params, generator)

    monkeypatch.setattr(engine_module, "sample_rows", faulty_sample_rows)
    monkeypatch.setattr(rows_module, "sample_row", faulty_sample_row)
    _, bg = _background(engine, tokenizer, max_new=30)
    ev = Events()
    engine.submit(EngineRequest(prompt_ids=chat_prompt_ids(tokenizer, "Hi."), compiled=None, max_new_tokens=8, n=2,
                      sampling=SamplingParams(temperature=1.0, seed=4242)), ev)
    assert ev.done.wait(60)
    assert ev.error is None
    assert all(o.finish_reason == "error" and "injected fault" in o.error for o in ev.finished.values())
    assert bg.wait()[0].finish_reason in ("stop", "length")


def test_long_prompt_keeps_only_last_logits_and_others_keep_decoding(engine, model, tokenizer):
    # what this guards against: prefill computed logits for every prompt position (4090 x 49152 floats) in one
    # forward, and every other request waited for the whole prefill
    widths = []
    hook = model.lm_head.register_forward_hook(lambda mod, inp, out: widths.append(out.shape[1]))
    try:
        _, bg = _background(engine, tokenizer, max_new=120)
        words = ("alpha beta gamma delta epsilon zeta eta theta iota kappa " * 400).split()
        prompt = build_prompt_ids(None, tokenizer, prompt=" ".join(words))[:3000]
        ev = Events()
        submitted = time.perf_counter()
        engine.submit(EngineRequest(prompt_ids=prompt, compiled=None, max_new_tokens=4, n=4,
                          sampling=SamplingParams(temperature=0)), ev)
        outs = ev.wait()
        assert len(outs) == 4 and all(len(o.token_ids) >= 1 for o in outs.values())
        between = bg.tokens_between(submitted, ev.first_token_at())
        bg.wait()
    finally:
        hook.remove()
    assert max(widths) == 1, f"the model computed logits for {max(widths)} positions in one forward"
    # 3000 tokens in chunks of 256: 12 chunks, each followed by a decode step of the running request
    assert between >= 8, f"the running request got only {between} tokens during a 3000-token prefill"


def test_slow_first_grammar_mask_does_not_stall_other_rows(engine, tokenizer):
    # the first mask of this regex costs ~1 s per row: it must not be computed on the engine thread
    pattern = "(a{10000})" * 400
    spec = compile_regex(pattern, tokenizer, eos_token_id=tokenizer.eos_token_id)
    compiled = compile_scenario(load_scenario({"type": "regex", "pattern": "a+"}), tokenizer)
    from dataclasses import replace

    compiled = replace(compiled, constraint=spec)
    _, bg = _background(engine, tokenizer, max_new=150)
    ev = Events()
    submitted = time.perf_counter()
    engine.submit(EngineRequest(prompt_ids=chat_prompt_ids(tokenizer, "Write the letter a many times."), compiled=compiled,
                      max_new_tokens=3, n=8, sampling=SamplingParams(temperature=1.0, seed=1)), ev)
    outs = ev.wait()
    for o in outs.values():
        assert re.fullmatch("a*", tokenizer.decode(o.token_ids, skip_special_tokens=True)), o
    between = bg.tokens_between(submitted, ev.first_token_at())
    bg.wait()
    assert between >= 3, f"the running request got only {between} tokens while 8 slow first masks were computed"
