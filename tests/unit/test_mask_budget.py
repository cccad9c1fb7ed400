"""At the cursor level: a per-step budget for a row's grammar mask work
(:class:`processors.mask_budget.MaskBudget`, setting ``mask_step_budget_ms``).

An ambiguous grammar (``start: x+ "☃"``, ``x: "a" | "ab" | ... | x x | x x x``) costs more llguidance
work at every token (a second and more per mask after about 40 tokens of ``aaaa``). Its row must be reported late
once one step's mask passes the budget, its cursor must then allow only its end token without touching its matcher,
and a cheap row settled in the same calls must never be reported. Real tokenizer, real llguidance matchers.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from processors.scenarios import load_scenario
from processors import RowCursor, compile_scenario
from processors.grammar import GrammarCursor, compile_grammar, compile_regex
from processors.mask_budget import SETTING, WALL_FACTOR, MaskBudget, late_message
from processors.masks import ALLOW, BITMASK

AMBIGUOUS = 'start: x+ "\u2603"\nx: "a" | "ab" | "abc" | "b" | "bc" | "c" | x x | x x x'


@pytest.fixture(scope="module")
def aaaa(tokenizer) -> int:
    ids = tokenizer.encode("aaaa", add_special_tokens=False)
    assert len(ids) == 1
    return ids[0]


def test_an_ambiguous_grammar_row_is_reported_late_and_the_others_settle(tokenizer, aaaa):
    compiled = compile_scenario(load_scenario({"type": "grammar", "grammar": AMBIGUOUS}), tokenizer)
    slow = RowCursor(compiled, tokenizer)
    cheap = GrammarCursor(compile_regex("[a-z]{1,4000}", tokenizer, eos_token_id=tokenizer.eos_token_id), tokenizer)
    budget = MaskBudget(50)
    late: dict[int, str] = {}
    longest = 0.0
    for _ in range(200):
        assert slow.mask_due and cheap.mask_due
        t0 = time.perf_counter()
        late, waiting = budget.settle([cheap, slow])
        assert not waiting  # nothing deferrable: every mask is waited for
        longest = max(longest, time.perf_counter() - t0)
        if late:
            break
        for cursor in (cheap, slow):
            assert not cursor.mask_due  # computed by settle: step() only reads it
            payload = cursor.step().payload
            assert payload is not None and (payload[aaaa // 32] >> (aaaa % 32)) & 1
            cursor.advance(aaaa)
    assert list(late) == [1], f"the ambiguous row was never late in 200 steps: {late}"
    message = late[1]
    assert SETTING in message and "50 ms" in message, message
    # the late row: its end token only, from now on, and an error naming the setting; the matcher is left alone
    assert slow.error == message and not slow.mask_due
    end = slow.step()
    assert end.kind == ALLOW and end.payload.tolist() == [tokenizer.eos_token_id]
    twin = slow.copy()  # a copy never deep-copies a matcher a worker may still be using
    assert twin.error == message and twin.step().kind == ALLOW
    slow.advance(tokenizer.eos_token_id)
    assert slow.finished and slow.error == message
    # the cheap row was settled in the same call and goes on
    assert cheap.error is None and cheap.step().kind == BITMASK
    # no settle call waited seconds: at most the budget's wall bound, plus slack for a loaded machine
    assert longest < WALL_FACTOR * 0.05 + 2.0, longest
    assert budget.stats["late_rows"] == 1
    budget.close()


def test_settled_masks_are_the_masks_step_computes(tokenizer, aaaa):
    spec = compile_grammar("lark", AMBIGUOUS, tokenizer, kind="grammar", eos_token_id=tokenizer.eos_token_id)
    settled, inline = GrammarCursor(spec, tokenizer), GrammarCursor(spec, tokenizer)
    budget = MaskBudget(10_000)
    for _ in range(5):
        assert budget.settle([settled]) == ({}, set())
        assert np.array_equal(settled.step().payload, inline.step().payload)
        settled.advance(aaaa)
        inline.advance(aaaa)
    budget.close()


def test_no_budget_leaves_the_masks_to_step(tokenizer):
    spec = compile_regex("[a-z]+", tokenizer, eos_token_id=tokenizer.eos_token_id)
    cursor = GrammarCursor(spec, tokenizer)
    budget = MaskBudget(0)
    assert not budget.enabled and budget.settle([cursor]) == ({}, set())
    assert cursor.mask_due  # nothing was computed
    assert cursor.step().kind == BITMASK and not cursor.mask_due
    with pytest.raises(ValueError, match=SETTING):
        MaskBudget(-1)


def test_rows_without_grammar_work_are_left_alone(tokenizer):
    labels = compile_scenario(load_scenario({"type": "labels", "labels": ["yes", "no"]}), tokenizer)
    rows = [RowCursor(labels, tokenizer), RowCursor(None, tokenizer, eos_token_ids=[tokenizer.eos_token_id])]
    budget = MaskBudget(50)
    assert not any(r.mask_due for r in rows)
    assert budget.settle(rows) == ({}, set()) and budget.stats["masks"] == 0


def test_a_deferrable_row_waits_no_longer_than_asked_and_its_mask_is_found_later(tokenizer, aaaa):
    """A row the caller may leave out of a step (``defer``) is not waited for past ``wait_ms``: its mask goes on
    computing and a later call finds it done (the same mask ``step()`` computes) or late; a row settled in the same
    call but not named in ``defer`` is always waited for (never reported pending, however loaded the machine)."""
    spec = compile_grammar("lark", AMBIGUOUS, tokenizer, kind="grammar", eos_token_id=tokenizer.eos_token_id)
    slow, inline = GrammarCursor(spec, tokenizer), GrammarCursor(spec, tokenizer)
    cheap = GrammarCursor(compile_regex("[a-z]{1,4000}", tokenizer, eos_token_id=tokenizer.eos_token_id), tokenizer)
    budget = MaskBudget(60_000)
    deferred_once = False
    for _ in range(80):
        late, waiting = budget.settle([cheap, slow], defer=[1], wait_ms=1)
        assert not late and 0 not in waiting and not cheap.mask_due
        if waiting:
            # the call came back while the slow mask was still computing (had it waited, the mask would be done)
            deferred_once = True
            assert waiting == {1}
            # the mask is still being computed: a second call does not start another one
            masks = budget.stats["masks"]
            while waiting:
                late, waiting = budget.settle([slow], defer=[0], wait_ms=50)
                assert not late and budget.stats["masks"] == masks
        assert not slow.mask_due
        assert np.array_equal(slow.step().payload, inline.step().payload)
        for cursor in (cheap, slow, inline):
            cursor.advance(aaaa)
        if deferred_once:
            break
    assert deferred_once, "no mask of the ambiguous grammar took over 1 ms in 80 tokens"
    assert budget.stats["deferred"] >= 1
    budget.close()


def test_a_deferred_row_over_its_budget_is_late_on_a_later_call(tokenizer, aaaa):
    compiled = compile_scenario(load_scenario({"type": "grammar", "grammar": AMBIGUOUS}), tokenizer)
    slow = RowCursor(compiled, tokenizer)
    budget = MaskBudget(50)
    for _ in range(200):
        late, waiting = budget.settle([slow], defer=[0], wait_ms=0)
        while waiting and not late:
            time.sleep(0.01)
            late, waiting = budget.settle([slow], defer=[0], wait_ms=0)
        if late:
            break
        slow.step()
        slow.advance(aaaa)
    assert list(late) == [0] and not waiting
    assert slow.error == late[0] and late[0].startswith(late_message(50, 0, 0).split("(")[0])
    budget.close()
