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
