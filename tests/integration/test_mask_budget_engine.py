"""The grammar mask budget in the decode engine (real model, real llguidance): a row whose grammar mask passes
``mask_step_budget_ms`` ends with ``finish_reason: "error"`` naming the setting, and the rows beside it keep
decoding. Before the budget the ambiguous grammar's masks were computed on the decode thread, a second and more
each after some tens of tokens, so the ordinary row beside it got one token every few seconds and the grammar row
went on to its 1,024 tokens."""

from __future__ import annotations

import pytest

from processors.scenarios import load_scenario
from deployments.engines import EngineRequest, EventCollector, SamplingParams
from deployments.engines.transformers import DecodeEngine
from helpers import chat_prompt_ids
from processors import compile_scenario
from processors.mask_budget import SETTING, WALL_FACTOR

AMBIGUOUS = 'start: x+ "\u2603"\nx: "a" | "ab" | "abc" | "b" | "bc" | "c" | x x | x x x'
BUDGET_MS = 100


@pytest.fixture(scope="module")
def engine(model, tokenizer):
    eng = DecodeEngine(model, tokenizer, max_batch_size=16, mask_step_budget_ms=BUDGET_MS).start()
    yield eng
    eng.stop()


def test_a_row_over_the_mask_budget_ends_and_the_others_keep_decoding(engine, tokenizer):
    compiled = compile_scenario(load_scenario({"type": "grammar", "grammar": AMBIGUOUS}), tokenizer)
    chain: list[float] = []  # per decode step: the seconds the processor chain (the masks included) took
    engine.on_step = lambda step_seconds, chain_seconds: chain.append(chain_seconds)
    try:
        other = EventCollector()
        engine.submit(EngineRequest(prompt_ids=chat_prompt_ids(tokenizer, "Count from 1 to 500, separated by commas."),
                                    compiled=None, max_new_tokens=300, sampling=SamplingParams(temperature=0)), other)
        slow = [EventCollector() for _ in range(2)]
        for ev in slow:  # two one-row requests: their masks are computed side by side
            engine.submit(EngineRequest(prompt_ids=chat_prompt_ids(tokenizer, "Write letters.", compiled), compiled=compiled,
                                        max_new_tokens=1024, sampling=SamplingParams(temperature=0)), ev)
        for ev in slow:
            out = ev.wait(300)[0]
            assert out.finish_reason == "error", out
            assert SETTING in out.error and f"{BUDGET_MS} ms" in out.error, out.error
            assert len(out.token_ids) < 1024
        ended = max(t for ev in slow for t, _ in ev.times)
        # the ordinary row decoded all along, and no step waited seconds for a mask
        assert sum(1 for t, _ in other.times if t <= ended) >= 10, "the ordinary row barely decoded beside them"
        assert max(chain) < WALL_FACTOR * BUDGET_MS / 1000 + 2.0, f"one step's masks took {max(chain):.1f} s"
        assert other.wait(300)[0].finish_reason in ("stop", "length")
        assert engine._mask_budget.stats["late_rows"] == 2
    finally:
        engine.on_step = None


def _grammar_run(model, tokenizer, compiled, *, beside: bool, budget_ms: float):
    """The ambiguous grammar row's output (greedy), alone or beside an ordinary row, on a fresh engine; returns the
    grammar row's finished event, the ordinary row's collector (or None) and the engine's stats."""
    eng = DecodeEngine(model, tokenizer, max_batch_size=4, mask_step_budget_ms=budget_ms).start()
    try:
        other = None
        if beside:
            other = EventCollector()
            eng.submit(EngineRequest(prompt_ids=chat_prompt_ids(tokenizer, "Count from 1 to 500, separated by commas."),
                                     compiled=None, max_new_tokens=400, sampling=SamplingParams(temperature=0)), other)
        slow = EventCollector()
        eng.submit(EngineRequest(prompt_ids=chat_prompt_ids(tokenizer, "Write letters.", compiled), compiled=compiled,
                                 max_new_tokens=100, sampling=SamplingParams(temperature=0)), slow)
        out = slow.wait(300)[0]
        if other is not None:
            other.wait(300)
        return out, slow, other, eng.stats()
    finally:
        eng.stop()


def test_a_row_whose_mask_is_slow_sits_out_steps_and_decodes_the_same(model, tokenizer):
    """A grammar row whose mask is still computing sits out the step instead of holding it: the ordinary row beside
    it reads two tokens or more while the grammar row waits for one mask, and the grammar row's tokens are the ones it
    decodes when every step waits for its mask (alone on its engine). Before, every step waited for the mask."""
    compiled = compile_scenario(load_scenario({"type": "grammar", "grammar": AMBIGUOUS}), tokenizer)
    held_out, held_ev, other, held_stats = _grammar_run(model, tokenizer, compiled, beside=True, budget_ms=5000)
    alone_out, _, _, alone_stats = _grammar_run(model, tokenizer, compiled, beside=False, budget_ms=5000)
    assert held_stats["held_row_steps"] > 0, "the grammar row never sat out a step"
    assert alone_stats["held_row_steps"] == 0  # nobody else to serve: the step waited for the mask
    # the same tokens (one may have been ended by the budget earlier than the other: compare the common part)
    a, b = held_out.token_ids, alone_out.token_ids
    k = min(len(a), len(b))
    assert k >= 20 and a[:k] == b[:k], (a, b)
    text = tokenizer.decode(a[:k])
    assert set(text) <= set("abc\u2603"), text  # within the grammar's alphabet
    # while the grammar row waited for one of its masks, the ordinary row read several tokens
    grammar_times = [t for t, _ in held_ev.times]
    gaps = [sum(1 for t, _ in other.times if t0 < t < t1) for t0, t1 in zip(grammar_times, grammar_times[1:])]
    assert max(gaps) >= 2, gaps
