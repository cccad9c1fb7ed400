"""Label sets: single label, shared prefixes, multi-label with a separator, hierarchy, and the refusals."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest
import torch

from processors import (
    CursorLogitsProcessor,
    LabelCursor,
    LabelTables,
    TreeCursor,
    TreeLogitsProcessor,
    build_label_tables,
    tokenize_continuation,
)
from processors.testing import EOS, allowed_ids, decode, drive, greedy, tid

LABELS = ["New York", "New York City", "Sports", "Technology", "Technology > AI", "Technology > AI > NLP"]
PROMPT = [tid("ok"), tid(":")]


def build(tok, labels=LABELS, **kw):
    return build_label_tables(list(labels), tok, eos_token_id=tok.eos_token_id, vocab_size=len(tok), **kw)


def until_eos(gen, eos):
    assert eos in gen, f"row did not end: {gen}"
    i = gen.index(eos)
    assert all(t == eos for t in gen[i:]), f"tokens after EOS: {gen}"
    return gen[:i]


def single_check(tok, labels):
    """EOS live exactly when the text so far is a complete label; every live token keeps a label reachable."""
    eos = tok.eos_token_id
    complete = {" " + lab for lab in labels}

    def check(step, ids, raw, masked):
        for row, gen in enumerate(ids[:, len(PROMPT) :].tolist()):
            live = allowed_ids(masked[row])
            if eos in gen:
                assert live == {eos}
                continue
            text = decode(tok, gen)
            assert (eos in live) == (text in complete), (text, live)
            for t in live - {eos}:
                nxt = decode(tok, gen + [t])
                assert any(c.startswith(nxt) for c in complete), f"{nxt!r} leads nowhere"

    return check


# -- single label ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cursor_kind", ["tree", "label"])
def test_single_label_every_sample_is_exactly_one_label(tok, eos, cursor_kind):
    lt = build(tok)
    if cursor_kind == "tree":  # what the chain uses for single-label scenarios
        proc = TreeLogitsProcessor(lt.tables)
    else:
        proc = CursorLogitsProcessor(lambda: LabelCursor(lt))
    prompt = torch.tensor([PROMPT] * 96)
    seen = set()
    for seed in range(3):
        proc.reset()
        out = drive(proc, prompt, len(tok), 8, seed=seed, check=single_check(tok, LABELS))
        for gen in out[:, len(PROMPT) :].tolist():
            text = decode(tok, until_eos(gen, eos))
            assert text.startswith(" ") and text[1:] in LABELS, text
            seen.add(text[1:])
        assert proc.errors == [None] * 96
    assert seen == set(LABELS)  # shared prefixes do not hide the longer or the shorter label


def test_shared_prefix_eos_only_after_a_complete_label(tok, eos):
    lt = build(tok)
    cursor = TreeCursor(lt.tables)
    for t in (tid(" New"),):
        cursor.advance(t)
    assert set(cursor.step().payload.tolist()) == {tid(" York")}  # "New" alone is no label
    cursor.advance(tid(" York"))
    assert set(cursor.step().payload.tolist()) == {tid(" City"), eos}  # "New York" done, "New York City" open
    cursor.advance(tid(" City"))
    assert set(cursor.step().payload.tolist()) == {eos}


def test_hierarchical_labels(tok, eos):
    lt = build(tok, ["Technology > AI", "Technology > AI > NLP"])
    cursor = TreeCursor(lt.tables)
    expected = [
        (tid(" Tech"), {tid("nology")}),
        (tid("nology"), {tid(" >")}),  # "Technology" alone is not a label here
        (tid(" >"), {tid(" AI")}),
        (tid(" AI"), {tid(" >"), eos}),
        (tid(" >"), {tid(" NLP")}),
        (tid(" NLP"), {eos}),
    ]
    assert set(cursor.step().payload.tolist()) == {tid(" Tech")}
    for token, allowed in expected:
        cursor.advance(token)
        assert set(cursor.step().payload.tolist()) == allowed
    assert cursor.error is None


def test_greedy_with_an_invalid_favourite_still_gives_a_label(tok, eos):
    lt = build(tok)

    def logits(step, ids):
        raw = torch.zeros(ids.shape[0], len(tok))
        raw[:, tid(" yes")] = 100.0  # never part of a label
        raw[:, eos] = 90.0  # EOS is preferred whenever it is valid
        raw[:, tid(" New")] = 10.0
        return raw

    proc = TreeLogitsProcessor(lt.tables)
    out = drive(proc, torch.tensor([PROMPT]), len(tok), 6, pick=greedy, logits=logits)
    assert decode(tok, until_eos(out[0, len(PROMPT) :].tolist(), eos)) == " New York"


def test_single_label_logits_unchanged_on_allowed_ids(tok):
    lt = build(tok)
    raw = torch.randn(2, len(tok), generator=torch.Generator().manual_seed(0))
    out = TreeLogitsProcessor(lt.tables)(torch.tensor([PROMPT, PROMPT]), raw.clone())
    root = [tid(" New"), tid(" Sports"), tid(" Tech")]
    assert torch.equal(out[:, root], raw[:, root])
    assert allowed_ids(out[0]) == set(root)


def test_eos_mid_label_is_reported(tok, eos):
    lt = build(tok)
    for cursor in (TreeCursor(lt.tables), LabelCursor(lt), LabelCursor(build(tok, multi_label=True))):
        cursor.advance(tid(" New"))
        cursor.advance(eos)
        assert cursor.finished
        assert cursor.error is not None, type(cursor).__name__
    # a repeated label ended with EOS (only " City" was allowed) is reported too
    cursor = LabelCursor(build(tok, multi_label=True))
    for t in (tid(" New"), tid(" York"), tid(","), tid(" New"), tid(" York")):
        cursor.advance(t)
    assert cursor.error is None
    cursor.advance(eos)
    assert cursor.finished and cursor.error is not None
    assert cursor.emitted == ["New York"]


# -- multi-label -----------------------------------------------------------------------------------------------


def parse_multi(tok, gen, eos) -> list[str]:
    text = decode(tok, until_eos(gen, eos))
    parts = text.split(",")
    for p in parts:
        assert p.startswith(" "), text
    return [p[1:] for p in parts]


@pytest.mark.parametrize("max_labels", [None, 2])
def test_multi_label_samples(tok, eos, max_labels):
    lt = build(tok, multi_label=True, separator=",", max_labels=max_labels)
    comma = tid(",")
    complete = {" " + lab for lab in LABELS}

    def check(step, ids, raw, masked):
        for row, gen in enumerate(ids[:, len(PROMPT) :].tolist()):
            live = allowed_ids(masked[row])
            if eos in gen:
                assert live == {eos}
                continue
            text = decode(tok, gen)
            done, _, current = text.rpartition(",")
            done_labels = [p[1:] for p in done.split(",")] if done else []
            new_complete = current in complete and current[1:] not in done_labels
            assert (eos in live) == new_complete, (text, live)
            n = len(done_labels) + 1
            may_continue = n < len(LABELS) and (max_labels is None or n < max_labels)
            assert (comma in live) == (new_complete and may_continue), (text, live)

    proc = CursorLogitsProcessor(lambda: LabelCursor(lt))
    prompt = torch.tensor([PROMPT] * 64)
    counts = set()
    for seed in range(3):
        proc.reset()
        out = drive(proc, prompt, len(tok), 40, seed=seed, check=check)
        for row, gen in enumerate(out[:, len(PROMPT) :].tolist()):
            labels = parse_multi(tok, gen, eos)
            assert all(lab in LABELS for lab in labels), labels
            assert len(labels) == len(set(labels)), f"a label twice: {labels}"
            if max_labels is not None:
                assert len(labels) <= max_labels
            assert sorted(proc.cursors[row].emitted) == sorted(labels)
            counts.add(len(labels))
        assert proc.errors == [None] * 64
    assert max(counts) >= 2  # the separator is actually used


def test_no_label_twice_after_all_labels_sharing_a_first_token(tok, eos):
    lt = build(tok, multi_label=True)
    cursor = LabelCursor(lt)
    comma = tid(",")
    for t in (tid(" New"), tid(" York"), comma):
        cursor.advance(t)
    root = set(cursor.step().payload.tolist())
    assert root == {tid(" New"), tid(" Sports"), tid(" Tech")}  # "New York City" is still open
    cursor.advance(tid(" New"))
    cursor.advance(tid(" York"))
    # "New York" was emitted: neither EOS nor the separator may complete it again
    assert set(cursor.step().payload.tolist()) == {tid(" City")}
    cursor.advance(tid(" City"))
    assert set(cursor.step().payload.tolist()) == {eos, comma}
    cursor.advance(comma)
    assert set(cursor.step().payload.tolist()) == {tid(" Sports"), tid(" Tech")}  # " New" is closed
    # the whole Technology family, shortest first, each re-entering the shared " Tech" branch
    for label in (["Technology"], ["Technology", " >", " AI"], ["Technology", " >", " AI", " >", " NLP"]):
        pieces = [" Tech", "nology"] + label[1:]
        for piece in pieces:
            assert tid(piece) in cursor.step().payload.tolist(), (label, piece)
            cursor.advance(tid(piece))
        if len(label) < 5:
            assert set(cursor.step().payload.tolist()) >= {eos, comma}
            cursor.advance(comma)
    assert cursor.error is None
    # after "Technology > AI > NLP" the labels left are Sports only
    assert set(cursor.step().payload.tolist()) == {eos, comma}
    cursor.advance(comma)
    assert set(cursor.step().payload.tolist()) == {tid(" Sports")}
    cursor.advance(tid(" Sports"))
    assert set(cursor.step().payload.tolist()) == {eos}  # every label used: no separator
    cursor.advance(eos)
    assert cursor.finished and cursor.error is None
    assert sorted(cursor.emitted) == sorted(LABELS)


def test_max_labels_and_greedy_on_the_separator(tok, eos):
    lt = build(tok, multi_label=True, max_labels=2)

    def logits(step, ids):
        raw = torch.zeros(ids.shape[0], len(tok))
        raw[:, tid(",")] = 100.0  # the model wants to list labels forever
        raw[:, tid(" Sports")] = 20.0
        raw[:, tid(" New")] = 10.0
        raw[:, tid(" City")] = 5.0
        return raw

    proc = CursorLogitsProcessor(lambda: LabelCursor(lt))
    out = drive(proc, torch.tensor([PROMPT]), len(tok), 12, pick=greedy, logits=logits)
    labels = parse_multi(tok, out[0, len(PROMPT) :].tolist(), eos)
    assert labels == ["Sports", "New York City"]
    assert proc.errors == [None]


def test_multi_token_separator_is_forced_token_by_token(tok, eos):
    lt = build(tok, ["Sports", "New York"], multi_label=True, separator=",\n")
    assert lt.separator_ids == (tid(","), tid("\n"))
    cursor = LabelCursor(lt)
    cursor.advance(tid(" Sports"))
    assert set(cursor.step().payload.tolist()) == {eos, tid(",")}
    cursor.advance(tid(","))
    assert cursor.step().payload.tolist() == [tid("\n")]
    cursor.advance(tid("\n"))
    assert set(cursor.step().payload.tolist()) == {tid(" New")}
    assert lt.parse(" Sports,\n New York") == ["Sports", "New York"]
    # a wrong token in the middle of the separator
    bad = LabelCursor(lt)
    for t in (tid(" Sports"), tid(","), tid(" New")):
        bad.advance(t)
    assert bad.error is not None and bad.step().payload.tolist() == [eos]


def test_multi_label_parse_and_copy(tok):
    lt = build(tok, multi_label=True)
    assert lt.parse(" New York, Sports") == ["New York", "Sports"]
    a = LabelCursor(lt)
    a.advance(tid(" Sports"))
    a.advance(tid(","))
    b = a.copy()
    b.advance(tid(" Tech"))
    b.advance(tid("nology"))
    b.advance(tid(","))
    assert a.emitted == ["Sports"] and sorted(b.emitted) == ["Sports", "Technology"]
    assert tid(" Tech") in a.step().payload.tolist()


# -- tables and refusals ---------------------------------------------------------------------------------------


def test_label_tables_immutable_picklable_versioned(tok):
    lt = build(tok, multi_label=True)
    back = pickle.loads(pickle.dumps(lt))
    assert back.version == lt.version and back.labels == lt.labels
    for name in ("edge_lo", "edge_hi", "terminal"):
        assert np.array_equal(getattr(back, name), getattr(lt, name))
        assert not getattr(back, name).flags.writeable
    assert not back.tables.tokens.flags.writeable
    with pytest.raises(dataclasses.FrozenInstanceError):
        lt.max_labels = 3  # type: ignore[misc]
    assert build(tok, multi_label=True).version == lt.version
    assert build(tok, multi_label=False).version != lt.version
    assert build(tok, multi_label=True, max_labels=2).version != lt.version
    assert build(tok, LABELS[:-1], multi_label=True).version != lt.version
    assert isinstance(lt, LabelTables) and lt.n_labels == len(LABELS)


def test_round_trip_failure_names_the_label(tok):
    with pytest.raises(ValueError, match="café"):
        build(tok, ["Sports", "café"])
    with pytest.raises(ValueError, match="hello"):
        build(tok, ["hello"])
    with pytest.raises(ValueError, match="round trip"):
        tokenize_continuation(tok, " café", what="label")


def test_duplicate_labels_refused(tok):
    with pytest.raises(ValueError, match="'Sports'"):
        build(tok, ["Sports", "New York", "Sports"])


def test_separator_colliding_with_a_label_refused(tok):
    with pytest.raises(ValueError, match="separator"):
        build(tok, ["New York", "New York, City"], multi_label=True, separator=",")
    with pytest.raises(ValueError, match="Technology"):
        build(tok, ["Technology", "Technology > AI"], multi_label=True, separator=" >")
    # the same labels are fine in single-label mode and with another separator
    build(tok, ["New York", "New York, City"])
    build(tok, ["Technology", "Technology > AI"], multi_label=True, separator=",")


def test_other_refusals(tok):
    with pytest.raises(ValueError, match="empty"):
        build(tok, [])
    with pytest.raises(ValueError, match="end token"):
        build(tok, [EOS])  # " <eos>" round-trips but contains the EOS id
    with pytest.raises(ValueError, match="max_labels"):
        build(tok, multi_label=True, max_labels=0)
    with pytest.raises(ValueError, match="separator"):
        build(tok, multi_label=True, separator="")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        build_label_tables(["Sports"], tok, eos_token_id=tok.eos_token_id, vocab_size=5)
