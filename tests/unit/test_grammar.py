"""Regex / JSON-schema constraints (llguidance) on the 35-token hand-built tokenizer (two bitmask words)."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
import torch

from processors import (
    BITMASK,
    CompiledScenario,
    ConstrainedLogitsProcessor,
    GrammarCursor,
    GrammarSpec,
    bitmask_to_ids,
    compile_json_schema,
    compile_regex,
    compile_think,
    get_lltokenizer,
)
from processors.grammar import new_matcher
from processors.testing import allowed_ids, decode, drive, greedy, tid

YES_NO = {tid("yes"), tid("no"), tid("y"), tid("n")}
SECOND_WORD = tid("es")  # id >= 32


@pytest.fixture(scope="module")
def yes_no(tok, eos):
    return compile_regex("(yes|no)", tok, eos_token_id=eos)


def scenario(kind, spec, tok, think=None):
    return CompiledScenario(
        kind=kind, constraint=spec, think=think, eos_token_ids=(tok.eos_token_id,), vocab_size=len(tok)
    )


def allowed(cursor) -> set[int]:
    step = cursor.step()
    if step.kind == BITMASK:
        return set(bitmask_to_ids(step.payload).tolist())
    return set(step.payload.tolist())


def test_regex_cursor_allows_only_valid_continuations(tok, eos, yes_no):
    cursor = GrammarCursor(yes_no, tok)
    assert allowed(cursor) == YES_NO  # not " yes" (leading space), not EOS
    cursor.advance(tid("y"))
    # "e" and "es" both continue; llguidance offers only the canonical tokenization of forced text
    assert allowed(cursor) and allowed(cursor) <= {tid("e"), SECOND_WORD}
    cursor.advance(tid("e"))
    assert allowed(cursor) == {tid("s")}
    cursor.advance(tid("s"))
    assert allowed(cursor) == {eos}  # complete: EOS and nothing else
    cursor.advance(eos)
    assert cursor.finished and cursor.error is None
    assert allowed(cursor) == {eos}


def test_regex_samples_through_the_chain(tok, eos, yes_no):
    proc = ConstrainedLogitsProcessor(scenario("regex", yes_no, tok), tokenizer=tok)
    prompt = torch.tensor([[tid("ok"), tid(":")]] * 48)

    def check(step, ids, raw, masked):
        for row, gen in enumerate(ids[:, 2:].tolist()):
            live = allowed_ids(masked[row])
            if eos in gen:
                assert live == {eos}
                continue
            text = decode(tok, gen)
            assert (eos in live) == (text in ("yes", "no")), (text, live)
            for t in live - {eos}:
                assert any(w.startswith(decode(tok, gen + [t])) for w in ("yes", "no"))
            assert torch.equal(masked[row, sorted(live)], raw[row, sorted(live)])

    def logits(step, ids):
        return torch.randn(ids.shape[0], len(tok), generator=torch.Generator().manual_seed(step))

    out = drive(proc, prompt, len(tok), 5, logits=logits, check=check)
    texts = set()
    for gen in out[:, 2:].tolist():
        assert eos in gen, gen
        i = gen.index(eos)
        assert all(t == eos for t in gen[i:])
        texts.add(decode(tok, gen[:i]))
        texts.add(tuple(gen[:i]))
    assert {"yes", "no"} <= texts
    assert texts - {"yes", "no"} >= {(tid("yes"),), (tid("no"),)}  # both tokenizations of each word appear
    assert proc.errors == [None] * 48


def test_greedy_with_an_invalid_favourite(tok, eos, yes_no):
    proc = ConstrainedLogitsProcessor(scenario("regex", yes_no, tok), tokenizer=tok)

    def logits(step, ids):
        raw = torch.zeros(ids.shape[0], len(tok))
        raw[:, tid(" yes")] = 100.0  # invalid: leading space
        raw[:, eos] = 90.0  # invalid until complete
        raw[:, tid("n")] = 10.0
        return raw

    out = drive(proc, torch.tensor([[tid("ok")]]), len(tok), 4, pick=greedy, logits=logits)
    assert out[0, 1:].tolist() == [tid("n"), tid("o"), eos, eos]


def test_padded_vocab_ids_are_masked(tok, yes_no):
    width = len(tok) + 24
    proc = ConstrainedLogitsProcessor(scenario("regex", yes_no, tok), tokenizer=tok)
    raw = torch.zeros(2, width)
    raw[:, len(tok) :] = 1e3
    out = proc(torch.tensor([[tid("ok")], [tid("ok")]]), raw)
    assert torch.isneginf(out[:, len(tok) :]).all()
    assert allowed_ids(out[0]) == YES_NO


def test_json_schema_enum(tok, eos):
    spec = compile_json_schema({"enum": ["yes", "no"]}, tok, eos_token_id=eos)
    assert spec.kind == "json_schema" and spec.vocab_size == len(tok)
    proc = ConstrainedLogitsProcessor(scenario("json_schema", spec, tok), tokenizer=tok)
    out = drive(proc, torch.tensor([[tid("ok")]] * 16), len(tok), 8, seed=4)
    for gen in out[:, 1:].tolist():
        i = gen.index(eos)
        assert json.loads(decode(tok, gen[:i])) in ("yes", "no")
    assert proc.errors == [None] * 16


def test_any_json(tok, eos):
    spec = compile_json_schema(None, tok, eos_token_id=eos)
    assert spec.kind == "json"
    assert compile_json_schema({}, tok, eos_token_id=eos).grammar == spec.grammar
    cursor = GrammarCursor(spec, tok)
    for t in (tid("{"), tid("}")):
        assert t in allowed(cursor)
        cursor.advance(t)
    assert allowed(cursor) == {eos}


@pytest.mark.parametrize(
    "schema",
    [{"type": "nonsense"}, {"minimum": "x"}, {"$ref": "http://example.com/schema.json"}],
)
def test_invalid_json_schema_is_a_value_error(tok, eos, schema):
    with pytest.raises(ValueError, match="invalid"):
        compile_json_schema(schema, tok, eos_token_id=eos)


def test_invalid_regex_is_a_value_error(tok, eos):
    with pytest.raises(ValueError, match=r"\(yes"):
        compile_regex("(yes", tok, eos_token_id=eos)


def test_copy_gives_an_independent_matcher(tok, eos, yes_no):
    a = GrammarCursor(yes_no, tok)
    a.advance(tid("y"))
    b = a.copy()
    assert b.matcher is not a.matcher
    b.advance(tid("e"))
    assert allowed(a) and allowed(a) <= {tid("e"), SECOND_WORD}
    assert allowed(b) == {tid("s")}
    a.advance(tid("e"))
    a.advance(tid("s"))
    a.advance(eos)
    assert a.finished and not b.finished
    assert allowed(b) == {tid("s")}
    c = b.copy()
    c.advance(tid("y"))  # rejected in c only
    assert c.error is not None and b.error is None
    assert allowed(c) == {eos} and allowed(b) == {tid("s")}


def test_rejected_token_forces_end_and_is_reported(tok, eos, yes_no):
    cursor = GrammarCursor(yes_no, tok)
    cursor.advance(tid("ok"))
    assert cursor.error is not None and str(tid("ok")) in cursor.error
    step = cursor.step()
    assert step.payload.tolist() == [eos]
    cursor.advance(eos)
    assert cursor.finished


def test_eos_before_the_grammar_accepts_is_reported(tok, eos, yes_no):
    cursor = GrammarCursor(yes_no, tok)
    cursor.advance(tid("y"))
    cursor.advance(eos)
    assert cursor.finished and "before the grammar accepted" in cursor.error


def test_beam_reorder_copies_matchers(tok, eos, yes_no):
    proc = ConstrainedLogitsProcessor(scenario("regex", yes_no, tok), tokenizer=tok)
    p = [tid("ok")]
    proc(torch.tensor([p, p]), torch.zeros(2, len(tok)))
    proc(torch.tensor([p + [tid("n")], p + [tid("y")]]), torch.zeros(2, len(tok)))
    out = proc(torch.tensor([p + [tid("y"), tid("e")], p + [tid("y"), tid("e")]]), torch.zeros(2, len(tok)))
    assert [allowed_ids(r) for r in out] == [{tid("s")}, {tid("s")}]
    assert proc.cursors[0].constraint.matcher is not proc.cursors[1].constraint.matcher
    out = proc(torch.tensor([p + [tid("y"), tid("e"), tid("s")], p + [tid("y"), tid("e"), tid("e")]]), torch.zeros(2, len(tok)))
    assert allowed_ids(out[0]) == {eos} and allowed_ids(out[1]) == {eos}
    assert proc.errors[0] is None and proc.errors[1] is not None


def test_think_then_grammar(tok, eos, yes_no):
    think = compile_think(2, "<think>\n", "</think>\n\n", tok)
    proc = ConstrainedLogitsProcessor(scenario("regex", yes_no, tok, think=think), tokenizer=tok, prompt_len=2)
    p = [tid("<think>"), tid("\n")]
    out = proc(torch.tensor([p + [tid("y"), tid("e")]]), torch.zeros(1, len(tok)))  # "ye" is thinking text
    assert allowed_ids(out[0]) == {tid("</think>")}  # budget spent
    out = proc(torch.tensor([p + [tid("y"), tid("e"), tid("</think>"), tid("\n\n")]]), torch.zeros(1, len(tok)))
    assert allowed_ids(out[0]) == YES_NO  # the grammar starts fresh after the marker


def test_grammar_spec_refusals_and_cache(tok, eos, yes_no):
    with pytest.raises(ValueError, match="tokenizer="):
        ConstrainedLogitsProcessor(scenario("regex", yes_no, tok))(torch.tensor([[1]]), torch.zeros(1, len(tok)))
    wrong = GrammarSpec(kind="regex", grammar=yes_no.grammar, eos_token_id=eos, vocab_size=len(tok) + 1)
    with pytest.raises(ValueError, match=f"vocabulary of {len(tok) + 1}"):
        new_matcher(wrong, tok)
    assert get_lltokenizer(tok) is get_lltokenizer(tok)
    back = pickle.loads(pickle.dumps(yes_no))
    assert back == yes_no and back.version == yes_no.version
    assert compile_regex("(yes|no)", tok, eos_token_id=eos).version == yes_no.version
    assert compile_regex("(no|yes)", tok, eos_token_id=eos).version != yes_no.version
    assert yes_no.end_token_id == eos


def test_bitmask_step_has_the_packed_layout(tok, eos):
    cursor = GrammarCursor(compile_regex("(yes|no|ye)", tok, eos_token_id=eos), tok)
    cursor.advance(tid("y"))
    step = cursor.step()
    assert SECOND_WORD >= 32
    assert step.kind == BITMASK and step.payload.dtype == np.int32 and step.payload.shape == ((len(tok) + 31) // 32,)
    words = [int(w) for w in step.payload.view(np.uint32)]
    assert words == [1 << tid("e"), 1 << (SECOND_WORD - 32)]
