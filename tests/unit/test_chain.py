"""The per-row chain (``ConstrainedLogitsProcessor``): mixed batches, think gating, stop tokens, prompts."""

from __future__ import annotations

import pickle

import pytest
import torch

from processors import (
    CompiledScenario,
    ConstrainedLogitsProcessor,
    RowCursor,
    build_label_tables,
    build_prompt_ids,
    build_tree_tables,
    compile_think,
)
from processors.testing import EOS, allowed_ids, build_tokenizer, decode, drive, greedy, tid, tree_data

TOK = build_tokenizer()
V = len(TOK)
E_EOS = TOK.eos_token_id
PAD = TOK.pad_token_id
S = tid(":")  # tree start token
E = tid("}")  # tree end token: not the model's EOS
NEW, YORK, CITY, SPORTS = tid(" New"), tid(" York"), tid(" City"), tid(" Sports")
T_OPEN, T_CLOSE, NL, NLNL = tid("<think>"), tid("</think>"), tid("\n"), tid("\n\n")
PREFIX = {
    f"{S}": [NEW, SPORTS],
    f"{S}_{NEW}": [YORK],
    f"{S}_{NEW}_{YORK}": [E, CITY],
    f"{S}_{NEW}_{YORK}_{CITY}": [E],
    # "{S}_{SPORTS}" is missing: only the end token
}
TREE_PATHS = {(NEW, YORK, E), (NEW, YORK, CITY, E), (SPORTS, E)}
LABELS = ["New York", "Sports", "Technology"]
MULTI = ["New York", "New York City", "Sports", "Technology", "Technology > AI"]


def scenario(kind, constraint, think=None, start=None, **settings):
    return CompiledScenario(
        kind=kind,
        constraint=constraint,
        think=think,
        eos_token_ids=(E_EOS,),
        vocab_size=V,
        start_token_id=start,
        settings=settings,
    )


@pytest.fixture(scope="module")
def tok():
    return TOK


@pytest.fixture(scope="module")
def tree_cs():
    return scenario("tree", build_tree_tables(tree_data(PREFIX, S, E), V), start=S)


@pytest.fixture(scope="module")
def labels_cs(tok):
    return scenario("labels", build_label_tables(LABELS, tok, eos_token_id=E_EOS, vocab_size=V))


@pytest.fixture(scope="module")
def multi_cs(tok):
    lt = build_label_tables(MULTI, tok, eos_token_id=E_EOS, vocab_size=V, multi_label=True, max_labels=3)
    return scenario("labels", lt)


@pytest.fixture(scope="module")
def think_spec(tok):
    return compile_think(3, "<think>\n", "</think>\n\n", tok)


# -- validity of one generated row per scenario ------------------------------------------------------------------


def tail_is(gen, i, token):
    assert all(t == token for t in gen[i + 1 :]), f"tokens after the end: {gen}"


def valid_tree(gen):
    assert E in gen, f"tree row did not end: {gen}"
    i = gen.index(E)
    assert tuple(gen[: i + 1]) in TREE_PATHS, gen
    tail_is(gen, i, E)
    return tuple(gen[: i + 1])


def valid_label(gen, labels=LABELS):
    assert E_EOS in gen, f"labels row did not end: {gen}"
    i = gen.index(E_EOS)
    text = decode(TOK, gen[:i])
    assert text.startswith(" ") and text[1:] in labels, text
    tail_is(gen, i, E_EOS)
    return text[1:]


def valid_multi(gen, max_labels=3):
    assert E_EOS in gen, f"multi-label row did not end: {gen}"
    i = gen.index(E_EOS)
    parts = decode(TOK, gen[:i]).split(",")
    labels = [p[1:] for p in parts]
    assert all(p.startswith(" ") for p in parts) and all(lab in MULTI for lab in labels), parts
    assert len(labels) == len(set(labels)) and len(labels) <= max_labels, labels
    tail_is(gen, i, E_EOS)
    return labels


def split_think(gen, budget=3):
    assert T_CLOSE in gen, f"no end marker: {gen}"
    i = gen.index(T_CLOSE)
    assert i <= budget and E_EOS not in gen[:i], gen
    assert gen[i + 1] == NLNL, gen
    return gen[: i], gen[i + 2 :]


# -- mixed batches -----------------------------------------------------------------------------------------------


def test_mixed_batch_every_row_valid_for_its_scenario(tok, tree_cs, labels_cs, multi_cs, think_spec):
    think_labels = scenario("labels", labels_cs.constraint, think=think_spec)
    rows = [tree_cs, labels_cs, multi_cs, None, think_labels]
    prompts = [[tid("ok"), S], [tid("ok")], [PAD, tid("ok")], [tid("no")], [T_OPEN, NL]]
    width = max(map(len, prompts))
    input_ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    k = 12
    input_ids = input_ids.repeat_interleave(k, dim=0)  # num_return_sequences = k
    proc = ConstrainedLogitsProcessor(rows, tokenizer=tok, prompt_len=width)
    assert set(proc.stop_token_ids) == {E_EOS, E}

    def logits(step, ids):
        return torch.randn(ids.shape[0], V, generator=torch.Generator().manual_seed(100 + step))

    def check(step, ids, raw, masked):
        for r, cursor in enumerate(proc.cursors):
            live = allowed_ids(masked[r])
            assert torch.equal(masked[r, sorted(live)], raw[r, sorted(live)])  # allowed logits untouched
            if cursor.finished:
                assert live == {cursor.end_token_id}
            elif rows[r // k] is None:
                assert torch.equal(masked[r], raw[r])  # unconstrained and not finished: free

    seen = {"tree": set(), "labels": set(), "think": set()}
    for seed in range(3):
        proc.reset()
        out = drive(proc, input_ids, V, 16, seed=seed, logits=logits, check=check)
        gens = out[:, width:].tolist()
        for r, gen in enumerate(gens):
            kind = r // k
            if kind == 0:
                seen["tree"].add(valid_tree(gen))
            elif kind == 1:
                seen["labels"].add(valid_label(gen))
            elif kind == 2:
                valid_multi(gen)
            elif kind == 3:
                if E_EOS in gen:
                    tail_is(gen, gen.index(E_EOS), E_EOS)
            else:
                _, answer = split_think(gen)
                seen["think"].add(valid_label(answer))
        assert proc.errors == [None] * len(gens)
        # tree rows that took " Sports" reached a missing state: reported as fallback rows, and only they
        assert proc.fallback_rows == [r for r in range(k) if gens[r][0] == SPORTS]
    assert seen["tree"] == TREE_PATHS
    assert seen["labels"] == set(LABELS) and seen["think"] == set(LABELS)


def test_greedy_with_invalid_favourites(tok, tree_cs, labels_cs, multi_cs):
    rows = [tree_cs, labels_cs, multi_cs]
    proc = ConstrainedLogitsProcessor(rows, tokenizer=tok)

    def logits(step, ids):
        raw = torch.zeros(ids.shape[0], V)
        raw[:, tid("yes")] = 100.0  # invalid for every scenario
        raw[:, E_EOS] = 50.0  # EOS whenever allowed (never valid for the tree row before its end)
        raw[:, tid(",")] = 40.0
        raw[:, SPORTS] = 30.0
        raw[:, NEW] = 20.0
        return raw

    start = torch.tensor([[tid("ok"), S], [tid("ok"), tid("ok")], [tid("ok"), tid("ok")]])
    out = drive(proc, start, V, 8, pick=greedy, logits=logits)
    gens = out[:, 2:].tolist()
    assert valid_tree(gens[0]) == (SPORTS, E)
    assert valid_label(gens[1]) == "Sports"
    assert valid_multi(gens[2]) == ["Sports"]
    assert proc.fallback_rows == [0]  # "{S}_{SPORTS}" has no entry
    assert proc.errors == [None, None, None]


def test_think_gating(tok, labels_cs, tree_cs, think_spec):
    think_labels = scenario("labels", labels_cs.constraint, think=think_spec)
    think_tree = scenario("tree", tree_cs.constraint, think=think_spec, start=S)
    proc = ConstrainedLogitsProcessor([think_labels, think_tree], tokenizer=tok, prompt_len=2)
    p = [T_OPEN, NL]
    seqs = [list(p), list(p)]
    everything_but_stop = set(range(V)) - {E_EOS, T_OPEN}  # while thinking: no stop token, no nested <think>

    def step(tokens):
        for s, t in zip(seqs, tokens):
            s.append(t)
        return proc(torch.tensor(seqs), torch.zeros(2, V))

    out = proc(torch.tensor(seqs), torch.zeros(2, V))
    assert allowed_ids(out[0]) == everything_but_stop
    assert allowed_ids(out[1]) == set(range(V)) - {E_EOS, E, T_OPEN}  # the tree's end token is a stop token too
    # label and tree tokens while thinking are just text: the constraints do not move
    out = step([NEW, NEW])
    root_labels = proc.cursors[0].constraint.state
    assert proc.cursors[0].thinking and root_labels == labels_cs.constraint.tables.root
    assert proc.cursors[1].constraint.state == tree_cs.constraint.root
    out = step([YORK, T_CLOSE])  # row 1 starts the end marker early
    assert allowed_ids(out[1]) == {NLNL}
    assert allowed_ids(out[0]) == everything_but_stop
    out = step([tid("ok"), NLNL])  # row 0 has now thought 3 tokens: budget spent
    assert allowed_ids(out[0]) == {T_CLOSE}
    assert allowed_ids(out[1]) == {NEW, SPORTS}  # the tree from its root, not from " New"
    assert not proc.cursors[1].thinking
    out = step([T_CLOSE, NEW])
    assert allowed_ids(out[0]) == {NLNL}
    assert allowed_ids(out[1]) == {YORK}
    out = step([NLNL, YORK])
    assert allowed_ids(out[0]) == {NEW, SPORTS, tid(" Tech")}  # " York" is not allowed: the label starts here
    assert allowed_ids(out[1]) == {E, CITY}
    out = step([NEW, E])
    assert allowed_ids(out[0]) == {YORK}
    assert allowed_ids(out[1]) == {E} and proc.cursors[1].finished
    out = step([YORK, E])
    assert allowed_ids(out[0]) == {E_EOS}
    out = step([E_EOS, E])
    assert allowed_ids(out[0]) == {E_EOS} and proc.cursors[0].finished
    assert proc.errors == [None, None]


def test_think_without_constraint_bans_reentry_only(tok, think_spec):
    cs = scenario("json", None, think=think_spec)
    proc = ConstrainedLogitsProcessor([cs], tokenizer=tok, prompt_len=2)
    p = [T_OPEN, NL]
    raw = torch.randn(1, V, generator=torch.Generator().manual_seed(3))
    out = proc(torch.tensor([p + [T_CLOSE, NLNL]]), raw.clone())
    assert allowed_ids(out[0]) == set(range(V)) - {T_OPEN, T_CLOSE}
    keep = sorted(allowed_ids(out[0]))
    assert torch.equal(out[0, keep], raw[0, keep])
    out = proc(torch.tensor([p + [T_CLOSE, NLNL, E_EOS]]), raw.clone())
    assert allowed_ids(out[0]) == {E_EOS}


def test_stop_tokens(tok, tree_cs, labels_cs):
    assert tree_cs.end_token_id == E and tree_cs.stop_token_ids == (E, E_EOS)
    assert labels_cs.end_token_id == E_EOS and labels_cs.stop_token_ids == (E_EOS,)
    proc = ConstrainedLogitsProcessor([labels_cs, tree_cs, None], tokenizer=tok)
    assert proc.stop_token_ids == (E_EOS, E)
    # the model's EOS in a tree row ends it (a stop token) and is reported: the tree did not allow it
    p = [tid("ok"), S]
    proc(torch.tensor([p, p, p]), torch.zeros(3, V))
    out = proc(torch.tensor([p + [NEW], p + [E_EOS], p + [E_EOS]]), torch.zeros(3, V))
    assert proc.cursors[1].finished and proc.errors[1] is not None
    assert allowed_ids(out[1]) == {E}
    assert allowed_ids(out[2]) == {E_EOS} and proc.errors[2] is None
    # an unconstrained row stops on any stop token given as eos_token_ids
    proc = ConstrainedLogitsProcessor([None], eos_token_ids=[E_EOS, E])
    proc(torch.tensor([p]), torch.zeros(1, V))
    out = proc(torch.tensor([p + [E]]), torch.zeros(1, V))
    assert allowed_ids(out[0]) == {E_EOS}


def test_interference_is_reported_and_forces_the_end(tok, tree_cs, labels_cs):
    proc = ConstrainedLogitsProcessor([tree_cs, labels_cs], tokenizer=tok)
    p = [tid("ok"), S]
    proc(torch.tensor([p, p]), torch.zeros(2, V))
    out = proc(torch.tensor([p + [CITY], p + [YORK]]), torch.zeros(2, V))
    assert allowed_ids(out[0]) == {E} and allowed_ids(out[1]) == {E_EOS}
    assert all(e is not None for e in proc.errors)


def test_per_row_list_expanded_for_num_return_sequences(tok, tree_cs, labels_cs):
    proc = ConstrainedLogitsProcessor([tree_cs, labels_cs], tokenizer=tok)
    out = proc(torch.full((6, 2), S), torch.zeros(6, V))
    tree_root, label_root = {NEW, SPORTS}, {NEW, SPORTS, tid(" Tech")}
    assert [allowed_ids(r) for r in out] == [tree_root] * 3 + [label_root] * 3
    bad = ConstrainedLogitsProcessor([tree_cs, labels_cs, None], tokenizer=tok)
    with pytest.raises(ValueError, match="3 row specs for a batch of 4 rows"):
        bad(torch.full((4, 2), S), torch.zeros(4, V))
    # one scenario for every row
    one = ConstrainedLogitsProcessor(tree_cs, tokenizer=tok)
    out = one(torch.full((5, 2), S), torch.zeros(5, V))
    assert all(allowed_ids(r) == tree_root for r in out)


def test_beam_reorder_in_the_chain(tok, tree_cs, labels_cs):
    proc = ConstrainedLogitsProcessor(tree_cs, tokenizer=tok)
    p = [tid("ok"), S]
    proc(torch.tensor([p, p]), torch.zeros(2, V))
    proc(torch.tensor([p + [SPORTS], p + [NEW]]), torch.zeros(2, V))
    out = proc(torch.tensor([p + [NEW, YORK], p + [NEW, YORK]]), torch.zeros(2, V))
    assert [allowed_ids(r) for r in out] == [{E, CITY}, {E, CITY}]
    out = proc(torch.tensor([p + [NEW, YORK, CITY], p + [NEW, YORK, E]]), torch.zeros(2, V))
    assert [allowed_ids(r) for r in out] == [{E}, {E}]
    assert proc.cursors[1].finished and not proc.cursors[0].finished
    assert proc.errors == [None, None]


def test_padded_vocab_masked_for_constrained_rows(tok, tree_cs, multi_cs):
    width = V + 8
    proc = ConstrainedLogitsProcessor([tree_cs, multi_cs], tokenizer=tok)
    raw = torch.zeros(2, width)
    raw[:, V:] = 1e3
    out = proc(torch.tensor([[tid("ok"), S]] * 2), raw)
    assert torch.isneginf(out[:, V:]).all()
    assert out.argmax(dim=-1).tolist()[0] in (NEW, SPORTS)


def test_padded_vocab_masked_for_free_and_thinking_rows(tok, labels_cs, think_spec):
    # ids that exist only in padded logits are never sampled, by unconstrained or thinking rows either
    thinking = CompiledScenario(kind="labels", constraint=labels_cs.constraint, think=think_spec,
                                eos_token_ids=(E_EOS,), vocab_size=V)
    width = V + 8
    proc = ConstrainedLogitsProcessor([None, thinking], tokenizer=tok)
    raw = torch.zeros(2, width)
    raw[:, V:] = 1e3
    out = proc(torch.tensor([[tid("ok"), T_OPEN]] * 2), raw.clone())
    assert torch.isneginf(out[:, V:]).all()
    assert (out[0, :V] == 0).all(), "a free row keeps every real token untouched"


def test_constructor_refusals(tok, tree_cs):
    wrong_vocab = CompiledScenario(kind="tree", constraint=tree_cs.constraint, think=None, eos_token_ids=(E_EOS,), vocab_size=V + 1)
    with pytest.raises(ValueError, match=f"vocabulary of {V + 1}, tokenizer has {V}"):
        ConstrainedLogitsProcessor([tree_cs, wrong_vocab], tokenizer=tok)
    with pytest.raises(TypeError, match="row 1"):
        ConstrainedLogitsProcessor([tree_cs, "tree"], tokenizer=tok)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="must not be empty"):
        ConstrainedLogitsProcessor([], tokenizer=tok)
    with pytest.raises(ValueError, match="eos_token_ids"):
        ConstrainedLogitsProcessor([None])
    assert ConstrainedLogitsProcessor([None], tokenizer=tok).eos_token_ids == (E_EOS,)
    with pytest.raises(ValueError, match="eos_token_ids"):
        RowCursor(None)


def test_compiled_scenario_is_versioned_and_picklable(tree_cs, labels_cs, think_spec):
    back = pickle.loads(pickle.dumps(tree_cs))
    assert back.version == tree_cs.version and back.constraint.version == tree_cs.constraint.version
    assert not back.constraint.tokens.flags.writeable
    assert scenario("tree", tree_cs.constraint, start=S).version == tree_cs.version
    assert scenario("tree", tree_cs.constraint, start=None).version != tree_cs.version
    assert scenario("tree", tree_cs.constraint, think=think_spec, start=S).version != tree_cs.version
    assert scenario("tree", tree_cs.constraint, start=S, max_new_tokens=5).version != tree_cs.version
    assert labels_cs.version != tree_cs.version


# -- prompts -----------------------------------------------------------------------------------------------------


def test_build_prompt_ids_tree_start_token(tok, tree_cs):
    ok = tok.encode("ok", add_special_tokens=False)
    assert build_prompt_ids(tree_cs, tok, prompt="ok") == ok + [S]
    assert build_prompt_ids(tree_cs, tok, prompt="ok:") == ok + [S]  # already ends with the start token
    no_start = scenario("tree", tree_cs.constraint, start=None)  # append_start_token = false
    assert build_prompt_ids(no_start, tok, prompt="ok") == ok
    assert build_prompt_ids(None, tok, prompt="ok") == ok


def test_build_prompt_ids_think_begin_marker(tok, tree_cs, labels_cs, think_spec):
    think_labels = scenario("labels", labels_cs.constraint, think=think_spec)
    expected = [tid("ok"), T_OPEN, NL]
    assert build_prompt_ids(think_labels, tok, prompt="ok") == expected
    assert build_prompt_ids(think_labels, tok, prompt="ok<think>\n") == expected  # not doubled
    # with think mode the tree starts after the end marker: no start token in the prompt
    think_tree = scenario("tree", tree_cs.constraint, think=think_spec, start=S)
    assert build_prompt_ids(think_tree, tok, prompt="ok") == expected


def test_build_prompt_ids_messages_and_system_prompt(labels_cs):
    tok = build_tokenizer.__wrapped__()  # a private copy: the chat template is set on it
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}ok:{% endif %}"
    )
    cs = scenario("labels", labels_cs.constraint, system_prompt="yes")
    ids = build_prompt_ids(cs, tok, messages=[{"role": "user", "content": "no"}])
    assert ids == tok.encode("system:yes\nuser:no\nok:", add_special_tokens=False)
    # a system message of the request wins over the scenario's
    ids = build_prompt_ids(cs, tok, messages=[{"role": "system", "content": "no"}, {"role": "user", "content": "no"}])
    assert ids == tok.encode("system:no\nuser:no\nok:", add_special_tokens=False)
    with pytest.raises(ValueError, match="exactly one"):
        build_prompt_ids(cs, tok, prompt="ok", messages=[])
    with pytest.raises(ValueError, match="exactly one"):
        build_prompt_ids(cs, tok)


def test_chain_end_to_end_with_prompt_ids(tok, tree_cs):
    ids = build_prompt_ids(tree_cs, tok, prompt="ok")
    proc = ConstrainedLogitsProcessor(tree_cs, tokenizer=tok)
    out = drive(proc, torch.tensor([ids] * 16), V, 6, seed=9)
    for gen in out[:, len(ids) :].tolist():
        valid_tree(gen)


def test_vocab_sanity():
    assert TOK.decode([E_EOS]) == EOS
