"""Think mode (budget, forced end marker, stop tokens, no re-entry) and the finished-row guard."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from processors import (
    MultiSeqLogitsProcessor,
    RowCursor,
    ThinkCursor,
    ThinkModeLogitsProcessor,
    ThinkSpec,
    compile_think,
)
from processors.testing import allowed_ids, drive, greedy, tid

BEGIN, END = "<think>\n", "</think>\n\n"
T_OPEN, T_CLOSE = tid("<think>"), tid("</think>")
NL, NLNL = tid("\n"), tid("\n\n")


def spec_for(tok, budget):
    return compile_think(budget, BEGIN, END, tok)


def phases(gen, budget, eos):
    """Split one row's generated ids into (thinking, marker, answer) and check the think rules."""
    assert eos not in gen[: gen.index(T_CLOSE) if T_CLOSE in gen else len(gen)], f"EOS while thinking: {gen}"
    assert T_CLOSE in gen, f"the end marker never came: {gen}"
    i = gen.index(T_CLOSE)
    thinking, marker, answer = gen[:i], gen[i : i + 2], gen[i + 2 :]
    assert len(thinking) <= budget, f"{len(thinking)} thinking tokens > budget {budget}"
    assert marker == [T_CLOSE, NLNL], f"the end marker was not forced: {gen}"
    assert T_OPEN not in answer and T_CLOSE not in answer, f"think block reopened: {gen}"
    return thinking, marker, answer


def test_compile_think(tok):
    spec = spec_for(tok, 5)
    assert spec.begin_ids == (T_OPEN, NL) and spec.end_ids == (T_CLOSE, NLNL)
    assert spec.begin == BEGIN and spec.end == END
    assert pickle.loads(pickle.dumps(spec)).version == spec.version
    assert spec_for(tok, 6).version != spec.version and spec_for(tok, 5).version == spec.version
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.max_thinking_tokens = 3  # type: ignore[misc]


def test_think_spec_refusals(tok):
    with pytest.raises(ValueError, match="max_thinking_tokens"):
        ThinkSpec(max_thinking_tokens=-1, begin_ids=(T_OPEN,), end_ids=(T_CLOSE,))
    with pytest.raises(ValueError, match="at least one token"):
        ThinkSpec(max_thinking_tokens=3, begin_ids=(), end_ids=(T_CLOSE,))
    with pytest.raises(ValueError, match="think end marker"):
        compile_think(3, BEGIN, "</think>é", tok)
    with pytest.raises(ValueError, match="stop_token_ids"):
        ThinkModeLogitsProcessor(spec_for(tok, 3), stop_token_ids=[])


@pytest.mark.parametrize("budget", [0, 1, 4])
def test_budget_never_exceeded_with_random_sampling(tok, eos, budget):
    spec = spec_for(tok, budget)
    prompt = torch.tensor([[tid("ok"), T_OPEN, NL]] * 48)
    proc = ThinkModeLogitsProcessor(spec, stop_token_ids=[eos])

    def check(step, ids, raw, masked):
        for row, cursor in enumerate(proc.cursors):
            live = allowed_ids(masked[row])
            if cursor.phase == 0:  # thinking: free but for the stop tokens and the begin marker, or the forced end
                if cursor.thought >= budget:
                    assert live == {T_CLOSE}
                else:
                    assert live == set(range(len(tok))) - {eos, T_OPEN}
                    assert torch.equal(masked[row, :eos], raw[row, :eos])
            elif cursor.phase == 1:
                assert live == {NLNL}
            else:
                assert live == set(range(len(tok))) - {T_OPEN, T_CLOSE}

    out = drive(proc, prompt, len(tok), budget + 6, seed=budget, check=check)
    lengths = set()
    for gen in out[:, 3:].tolist():
        thinking, _, answer = phases(gen, budget, eos)
        lengths.add(len(thinking))
        assert len(answer) >= 4
    assert proc.errors == [None] * 48
    if budget:
        assert budget in lengths  # some rows ran out of budget (most do with 32 tokens)


def test_no_nested_thinking(tok, eos):
    """While thinking, the begin marker's first token is banned, even when the model wants nothing else; emitted
    anyway (interference), it fails the row like any other invalid token."""
    proc = ThinkModeLogitsProcessor(spec_for(tok, 4), stop_token_ids=[eos])

    def logits(step, ids):
        raw = torch.zeros(ids.shape[0], len(tok))
        raw[:, T_OPEN] = 50.0  # the model keeps asking for a nested <think>
        raw[:, T_CLOSE] = -50.0
        return raw

    out = drive(proc, torch.tensor([[tid("ok"), T_OPEN, NL]]), len(tok), 10, greedy, logits=logits)
    gen = out[0, 3:].tolist()
    thinking, _, _ = phases(gen, 4, eos)
    assert T_OPEN not in thinking and len(thinking) == 4
    cursor = ThinkCursor(spec_for(tok, 4), [eos])
    assert T_OPEN in cursor.step().payload.tolist()  # a BAN step: the begin marker is among the banned ids
    cursor.advance(T_OPEN)
    assert cursor.error is not None and "inside the think block" in cursor.error
    assert cursor.step().payload.tolist() == [eos]


def test_budget_exhausted_forces_the_whole_marker(tok, eos):
    """The model never wants to stop thinking and prefers EOS: greedy still produces budget + marker."""
    budget = 3
    proc = ThinkModeLogitsProcessor(spec_for(tok, budget), stop_token_ids=[eos])

    def logits(step, ids):
        raw = torch.zeros(ids.shape[0], len(tok))
        raw[:, eos] = 100.0
        raw[:, T_CLOSE] = -1e4
        raw[:, NLNL] = -1e4
        raw[:, T_OPEN] = 50.0
        raw[:, tid("ok")] = 10.0
        return raw

    out = drive(proc, torch.tensor([[T_OPEN, NL]]), len(tok), budget + 4, pick=greedy, logits=logits)
    gen = out[0, 2:].tolist()
    assert gen[:budget] == [tid("ok")] * budget  # free thinking, but no nested <think> (banned while thinking)
    assert gen[budget : budget + 2] == [T_CLOSE, NLNL]
    assert gen[budget + 2 :] == [eos, eos]  # answer: stop tokens allowed again, <think> banned


def test_first_marker_token_starts_the_forcing(tok, eos):
    proc = ThinkModeLogitsProcessor(spec_for(tok, 100), stop_token_ids=[eos], prompt_len=2)
    p = [T_OPEN, NL]
    rows = [p + [tid("ok")], p + [tid("ok")]]
    out = proc(torch.tensor(rows), torch.zeros(2, len(tok)))
    out = proc(torch.tensor([r + [t] for r, t in zip(rows, [T_CLOSE, tid("yes")])]), torch.zeros(2, len(tok)))
    assert allowed_ids(out[0]) == {NLNL}  # the rest of the marker is forced right away
    assert allowed_ids(out[1]) == set(range(len(tok))) - {eos, T_OPEN}
    assert proc.cursors[0].thought == 1 and proc.cursors[1].thought == 2


def test_answer_bans_only_the_marker_first_tokens(tok, eos):
    spec = spec_for(tok, 10)
    cursor = ThinkCursor(spec, [eos])
    for t in (tid("ok"), T_CLOSE, NLNL):
        cursor.advance(t)
    assert cursor.in_answer
    raw = torch.randn(1, len(tok), generator=torch.Generator().manual_seed(1))
    proc = ThinkModeLogitsProcessor(spec, stop_token_ids=[eos], prompt_len=2)
    out = proc(torch.tensor([[T_OPEN, NL, tid("ok"), T_CLOSE, NLNL]]), raw.clone())
    assert allowed_ids(out[0]) == set(range(len(tok))) - {T_OPEN, T_CLOSE}
    keep = [i for i in range(len(tok)) if i not in (T_OPEN, T_CLOSE)]
    assert torch.equal(out[0, keep], raw[0, keep])


def test_single_token_end_marker_goes_straight_to_the_answer(eos):
    spec = ThinkSpec(max_thinking_tokens=2, begin_ids=(T_OPEN,), end_ids=(T_CLOSE,))
    cursor = ThinkCursor(spec, [eos])
    cursor.advance(tid("ok"))
    cursor.advance(T_CLOSE)
    assert cursor.in_answer
    cursor = ThinkCursor(spec, [eos])
    cursor.advance(tid("ok"))
    cursor.advance(tid("ok"))
    assert cursor.step().payload.tolist() == [T_CLOSE]


def test_wrong_token_while_forcing_is_reported(tok, eos):
    cursor = ThinkCursor(spec_for(tok, 4), [eos])
    cursor.advance(T_CLOSE)
    cursor.advance(tid("ok"))  # interference: "\n\n" was forced
    assert cursor.error is not None and str(NLNL) in cursor.error
    # the Cursor contract (processors/base.py): after an invalid token only the end token is allowed
    assert not cursor.in_answer and cursor.step().payload.tolist() == [eos]


def test_think_copy_is_independent(tok, eos):
    a = ThinkCursor(spec_for(tok, 4), [eos])
    a.advance(tid("ok"))
    b = a.copy()
    b.advance(T_CLOSE)
    assert a.thought == 1 and not a.in_answer and a.step().kind != b.step().kind


def test_several_stop_tokens_are_all_banned_while_thinking(tok, eos):
    proc = ThinkModeLogitsProcessor(spec_for(tok, 4), stop_token_ids=[eos, tid(",")])
    out = proc(torch.tensor([[T_OPEN, NL]]), torch.zeros(1, len(tok)))
    assert allowed_ids(out[0]) == set(range(len(tok))) - {eos, tid(","), T_OPEN}


# -- multi-sequence ----------------------------------------------------------------------------------------------


def test_after_eos_only_eos(tok, eos):
    proc = MultiSeqLogitsProcessor([eos])
    raw = torch.randn(3, len(tok), generator=torch.Generator().manual_seed(2))
    p = [tid("ok")]
    out = proc(torch.tensor([p, p, p]), raw.clone())
    assert torch.equal(out, raw)  # nothing finished: untouched bit for bit
    out = proc(torch.tensor([p + [eos], p + [tid("yes")], p + [eos]]), raw.clone())
    assert allowed_ids(out[0]) == {eos} and allowed_ids(out[2]) == {eos}
    assert torch.equal(out[1], raw[1])
    assert out[0, eos] == raw[0, eos]
    out = proc(torch.tensor([p + [eos, eos], p + [tid("yes"), eos], p + [eos, eos]]), raw.clone())
    assert [allowed_ids(r) for r in out] == [{eos}, {eos}, {eos}]


def test_multiseq_random_rows_never_emit_after_eos(tok, eos):
    proc = MultiSeqLogitsProcessor([eos, tid(",")])
    prompt = torch.tensor([[tid("ok")], [tid("no")]]).repeat_interleave(8, dim=0)  # num_return_sequences=8
    out = drive(proc, prompt, len(tok), 60, seed=5)
    for gen in out[:, 1:].tolist():
        stops = [i for i, t in enumerate(gen) if t in (eos, tid(","))]
        if stops:
            first = stops[0]
            # after either stop token only the lowest EOS id follows
            assert all(t == min(eos, tid(",")) for t in gen[first + 1 :]), gen
    assert sum(1 for gen in out[:, 1:].tolist() if eos in gen or tid(",") in gen) > 8


def test_multiseq_refusals_and_copy(eos):
    with pytest.raises(ValueError, match="eos_token_ids"):
        MultiSeqLogitsProcessor([])
    cursor = RowCursor(None, eos_token_ids=sorted([7, eos]))  # as MultiSeqLogitsProcessor makes its rows
    assert cursor.end_token_id == min(7, eos)
    other = cursor.copy()
    other.advance(7)
    assert other.finished and not cursor.finished
