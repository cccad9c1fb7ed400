"""Tree tables (``build_tree_tables``/``MaskTables``) and ``TreeLogitsProcessor`` against the tree-file semantics.

The oracle is the spec itself in plain Python with strings (docs/design.md, "Tree file format"): state starts at
``str(start)``; allowed = ``prefix_dict[state]`` or only the end token when missing/empty; after ``t`` the state
is ``state + sep + str(t)``; after the end token the row is finished.
"""

from __future__ import annotations

import dataclasses
import itertools
import pickle
import random

import numpy as np
import pytest
import torch

from processors import DONE, LEAF, MaskTables, TreeCursor, TreeLogitsProcessor, build_tree_tables
from processors.masks import ALLOW
from processors.testing import allowed_ids, drive, greedy, tree_data

V = 32
START, END, PAD = 30, 2, 0
PREFIX = {
    "30": [5, 6, 7, 5],  # 5 twice: merged
    "30_5": [8, 2],
    "30_5_8": [9, 2],
    "30_5_8_9": [2],
    "30_6": [],  # empty list: only the end token
    # "30_7" is missing: only the end token
}
PATHS = {(5, 2), (5, 8, 2), (5, 8, 9, 2), (6, 2), (7, 2)}


def oracle_allowed(prefix, state: str | None, end: int) -> set[int]:
    if state is None:  # finished
        return {end}
    return set(prefix.get(state) or [end])


def oracle_check(prefix, start, end, tokens, sep="_") -> tuple[int, ...]:
    """Assert ``tokens`` (generated ids) follow the tree; return the path up to and including the end token."""
    state = str(start)
    for i, t in enumerate(tokens):
        allowed = oracle_allowed(prefix, state, end)
        assert t in allowed, f"token {t} at position {i} not in {sorted(allowed)} (state {state!r}, row {tokens})"
        if t == end:
            assert all(x == end for x in tokens[i:]), f"tokens after the end token: {tokens}"
            return tuple(tokens[: i + 1])
        state = state + sep + str(t)
    return tuple(tokens)


def all_paths(prefix, start, end, sep="_") -> set[tuple[int, ...]]:
    out = set()

    def walk(state, path):
        for t in oracle_allowed(prefix, state, end):
            if t == end:
                out.add(path + (t,))
            else:
                walk(state + sep + str(t), path + (t,))

    walk(str(start), ())
    return out


@pytest.fixture(scope="module")
def tables() -> MaskTables:
    return build_tree_tables(tree_data(PREFIX, START, END), V)


def state_of(tables, tokens) -> int:
    s = tables.root
    for t in tokens:
        s = tables.step(s, t)
    return s


# -- tables ---------------------------------------------------------------------------------------------------


def test_oracle_paths_are_the_expected_ones():
    assert all_paths(PREFIX, START, END) == PATHS


def test_root_candidates_sorted_and_merged(tables):
    assert tables.root == 0
    assert tables.allowed(tables.root).tolist() == [5, 6, 7]
    assert tables.n_states == len(PREFIX)
    assert tables.n_edges == 3 + 2 + 2 + 1  # the duplicate 5 is one edge
    assert tables.vocab_size == V and tables.end_token_id == END


def test_transitions_follow_key_sep_token(tables):
    keys = list(PREFIX)
    assert tables.step(tables.root, 5) == keys.index("30_5")
    assert tables.step(keys.index("30_5"), 8) == keys.index("30_5_8")
    assert tables.step(keys.index("30_5_8"), 9) == keys.index("30_5_8_9")
    assert tables.step(tables.root, 6) == keys.index("30_6")
    assert tables.step(tables.root, 7) == LEAF  # "30_7" is missing
    assert tables.step(tables.root, 11) == LEAF  # not a candidate at all
    assert tables.allowed(keys.index("30_5_8")).tolist() == [2, 9]


def test_missing_and_empty_states_allow_only_end(tables):
    empty = state_of(tables, [6])
    assert empty >= 0 and tables.allowed(empty).size == 0
    for tokens in ([6], [7]):
        cursor = TreeCursor(tables)
        for t in tokens:
            cursor.advance(t)
        step = cursor.step()
        assert step.kind == ALLOW and step.payload.tolist() == [END] and step.fallback == END
        assert cursor.fell_back and not cursor.finished and cursor.error is None


def test_end_token_freezes_the_state(tables):
    assert tables.step(tables.root, END) == DONE
    for t in range(V):
        assert tables.step(DONE, t) == DONE
    cursor = TreeCursor(tables)
    cursor.advance(5)
    cursor.advance(END)
    assert cursor.finished and cursor.state == DONE
    for t in (5, 8, 17, END):
        cursor.advance(t)
        assert cursor.state == DONE
        assert cursor.step().payload.tolist() == [END]


def test_end_token_as_a_candidate_and_not_in_tree(tables):
    # "30_5" lists the end token: its edge leads to DONE
    s = state_of(tables, [5])
    i = tables.edge(s, END)
    assert i >= 0 and tables.next_state[i] == DONE


def test_tables_are_immutable(tables):
    for name in ("offsets", "tokens", "next_state"):
        arr = getattr(tables, name)
        assert not arr.flags.writeable
        with pytest.raises(ValueError):
            arr[0] = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        tables.root = 3  # type: ignore[misc]


def test_tables_pickle_round_trip(tables):
    back = pickle.loads(pickle.dumps(tables))
    assert back.version == tables.version
    for name in ("offsets", "tokens", "next_state"):
        a, b = getattr(tables, name), getattr(back, name)
        assert np.array_equal(a, b) and a.dtype == b.dtype
        assert not b.flags.writeable
        with pytest.raises(ValueError):
            b[0] = 1
    assert (back.root, back.end_token_id, back.vocab_size) == (tables.root, tables.end_token_id, tables.vocab_size)
    assert back.allowed(back.root).tolist() == [5, 6, 7]


def test_version_is_a_content_hash(tables):
    same = build_tree_tables(tree_data(dict(PREFIX), START, END), V)
    assert same.version == tables.version and same is not tables
    # the same tree with candidates in another order and without the duplicate compiles identically
    reordered = dict(PREFIX, **{"30": [7, 5, 6]})
    assert build_tree_tables(tree_data(reordered, START, END), V).version == tables.version
    changed = [
        dict(PREFIX, **{"30": [5, 6]}),
        dict(PREFIX, **{"30_5_8_9": [2, 10]}),
        {**PREFIX, "30_7": [2]},
    ]
    versions = {build_tree_tables(tree_data(p, START, END), V).version for p in changed}
    assert len(versions) == 3 and tables.version not in versions
    assert build_tree_tables(tree_data(PREFIX, START, 3), V).version != tables.version
    assert isinstance(tables.version, str) and len(tables.version) >= 16


def test_ids_outside_vocab_refused():
    with pytest.raises(ValueError, match=r"\[0, 32\)"):
        build_tree_tables(tree_data({"30": [5, 32]}, START, END), V)
    with pytest.raises(ValueError, match="end_token_id"):
        build_tree_tables(tree_data({"30": [5]}, START, 40), V)
    with pytest.raises(ValueError):
        build_tree_tables(tree_data({"30": [-1]}, START, END), V)


def test_mask_tables_validate_their_arrays():
    with pytest.raises(ValueError, match="sorted"):
        MaskTables(offsets=[0, 2], tokens=[6, 5], next_state=[-1, -1], root=0, end_token_id=2, vocab_size=V)
    with pytest.raises(ValueError, match="offsets"):
        MaskTables(offsets=[0, 3], tokens=[5, 6], next_state=[-1, -1], root=0, end_token_id=2, vocab_size=V)
    with pytest.raises(ValueError, match="root"):
        MaskTables(offsets=[0, 1], tokens=[5], next_state=[-1], root=4, end_token_id=2, vocab_size=V)


def test_missing_root_entry_allows_only_end():
    tables = build_tree_tables(tree_data({"30_5": [2]}, START, END), V)
    assert tables.root == LEAF
    proc = TreeLogitsProcessor(tables)
    out = proc(torch.full((2, 3), START), torch.zeros(2, V))
    for row in out:
        assert allowed_ids(row) == {END}
    assert proc.fallback_rows == [0, 1]


def test_custom_separator():
    prefix = {"30": [5], "30/5": [6], "30/5/6": [2]}
    tables = build_tree_tables(tree_data(prefix, START, END, sep="/"), V)
    assert state_of(tables, [5, 6]) == 2
    assert tables.allowed(state_of(tables, [5])).tolist() == [6]


def _chain_tree(n: int):
    """A chain of n states, each with 3 candidates (one continues)."""
    prefix = {}
    key = "1"
    for _ in range(n):
        prefix[key] = [3, 4, 2]
        key = key + "_3"
    return tree_data(prefix, 1, 2)


def test_memory_is_linear_in_edges():
    small = build_tree_tables(_chain_tree(1000), V)
    big = build_tree_tables(_chain_tree(4000), V)
    assert big.n_edges == 4 * small.n_edges
    ratio = big.nbytes / small.nbytes
    assert 3.9 < ratio < 4.1
    # offsets, tokens and next_state int32 (offsets per state, the others per edge): nothing else (no global keys)
    assert big.offsets.dtype == np.int32
    assert big.nbytes == 4 * (big.n_states + 1) + (4 + 4) * big.n_edges
    assert not hasattr(big, "keys")


@pytest.mark.parametrize("seed", range(6))
def test_batched_edge_search_matches_a_scan_of_each_state(seed):
    """find_edges / locate against a plain scan of each state's edges: every state (empty ones included), tokens
    present and absent, below and above a state's range, the end token, ids outside the vocabulary, LEAF / DONE and
    out-of-range states, in one batch."""
    rng = np.random.default_rng(seed)
    n_states, vocab = int(rng.integers(1, 60)), 40
    counts = rng.integers(0, 12, size=n_states)
    counts[rng.random(n_states) < 0.2] = 0
    offsets = np.concatenate(([0], np.cumsum(counts)))
    tokens = np.concatenate([np.sort(rng.choice(vocab, size=c, replace=False)) for c in counts]).astype(np.int32)
    nxt = rng.integers(-2, n_states, size=tokens.size).astype(np.int32)
    t = MaskTables(offsets=offsets, tokens=tokens, next_state=nxt, root=0, end_token_id=int(rng.integers(0, vocab)),
                   vocab_size=vocab)
    states = rng.integers(-2, n_states + 2, size=500)
    want = rng.integers(-3, vocab + 3, size=500)
    expect = []
    for s, w in zip(states.tolist(), want.tolist()):
        hit = -1
        if 0 <= s < n_states:
            for e in range(offsets[s], offsets[s + 1]):
                if tokens[e] == w:
                    hit = e
        expect.append(hit)
        assert t.edge(s, w) == hit
    assert t.find_edges(states, want).tolist() == expect
    assert np.concatenate([t.find_edges(states[i:i + 7], want[i:i + 7]) for i in range(0, 500, 7)]).tolist() == expect
    valid = (states >= 0) & (states < n_states)
    s, w = states[valid], want[valid]
    for side in ("left", "right"):
        at = t.locate(s, w, side=side)
        ref = [offsets[x] + int(np.searchsorted(tokens[offsets[x]:offsets[x + 1]], y, side=side))
               for x, y in zip(s.tolist(), w.tolist())]
        assert at.tolist() == ref
    assert t.find_edges(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)).size == 0


@pytest.mark.parametrize("seed", range(4))
def test_batched_edge_search_of_narrow_and_wide_states(seed):
    """find_edges on batches that take each of its two batched searches, against :meth:`MaskTables.edge` per row:
    narrow states (few edges in all: every edge of every row compared at once) and wide ones (past that bound:
    the bisection inside each row's slice), with absent tokens, ids outside the vocabulary and non-states mixed in."""
    rng = np.random.default_rng(seed)
    vocab, n_states = 6000, 40
    counts = rng.integers(0, 4, size=n_states)
    wide = rng.choice(n_states, size=6, replace=False)
    counts[wide] = rng.integers(1500, 4000, size=wide.size)
    offsets = np.concatenate(([0], np.cumsum(counts)))
    tokens = np.concatenate([np.sort(rng.choice(vocab, size=c, replace=False)) for c in counts]).astype(np.int32)
    t = MaskTables(offsets=offsets, tokens=tokens, next_state=np.full(tokens.size, LEAF, dtype=np.int32), root=0,
                   end_token_id=0, vocab_size=vocab)
    narrow = np.flatnonzero((counts > 0) & (counts < 4))
    for pool, n_rows in ((narrow, 200), (wide, 60)):
        states = rng.choice(pool, size=n_rows)
        present = tokens[offsets[states] + rng.integers(0, counts[states])]
        want = np.where(rng.random(n_rows) < 0.7, present, rng.integers(-2, vocab + 2, size=n_rows))
        states[rng.random(n_rows) < 0.1] = rng.choice([LEAF, DONE, n_states, n_states + 5])
        edges_in_all = int(counts[states[(states >= 0) & (states < n_states)]].sum())
        assert (edges_in_all <= 4096) == (pool is narrow)  # which search the batch takes (tables._GATHER_EDGES)
        got = t.find_edges(states, want)
        assert got.tolist() == [t.edge(s, w) for s, w in zip(states.tolist(), want.tolist())]
        assert (got >= 0).sum() > n_rows // 2


def test_unsorted_edges_inside_a_state_are_refused_and_state_boundaries_are_not():
    ok = MaskTables(offsets=np.array([0, 2, 2, 4]), tokens=np.array([3, 7, 1, 5]), next_state=np.array([-1] * 4),
                    root=0, end_token_id=0, vocab_size=10)  # 7 then 1: a new state, not a descent
    assert ok.find_edges(np.array([0, 2, 2, 1]), np.array([7, 1, 7, 3])).tolist() == [1, 2, -1, -1]
    for bad in ([3, 3, 1, 5], [7, 3, 1, 5]):
        with pytest.raises(ValueError, match="sorted"):
            MaskTables(offsets=np.array([0, 2, 2, 4]), tokens=np.array(bad), next_state=np.array([-1] * 4), root=0,
                       end_token_id=0, vocab_size=10)


@pytest.mark.parametrize("seed", range(5))
def test_random_trees_match_the_oracle(seed):
    rng = random.Random(seed)
    prefix: dict[str, list[int]] = {}
    frontier = ["20"]
    while frontier and len(prefix) < 60:
        key = frontier.pop(rng.randrange(len(frontier)))
        if rng.random() < 0.1:
            continue  # missing state
        cands = [rng.randrange(3, V) for _ in range(rng.randrange(0, 5))]
        if rng.random() < 0.3:
            cands.append(END)
        prefix[key] = cands
        frontier.extend(key + "_" + str(c) for c in set(cands) if c != END)
    tables = build_tree_tables(tree_data(prefix, 20, END), V)
    # every key's state allows exactly the oracle's set, and every transition lands on the oracle's key
    keys = list(prefix)
    for key in keys:
        s = keys.index(key)
        expected = set(prefix[key])
        assert set(tables.allowed(s).tolist()) == expected
        for t in expected:
            nxt = tables.step(s, t)
            target = key + "_" + str(t)
            if t == END:
                assert nxt == DONE
            elif target in prefix:
                assert nxt == keys.index(target)
            else:
                assert nxt == LEAF
    # and a cursor walk with uniform random choices is always an oracle path
    for _ in range(50):
        cursor = TreeCursor(tables)
        tokens = []
        for _ in range(12):
            t = int(rng.choice(cursor.step().payload.tolist()))
            tokens.append(t)
            cursor.advance(t)
        oracle_check(prefix, 20, END, tokens)
        assert cursor.error is None


# -- TreeLogitsProcessor --------------------------------------------------------------------------------------


def _generated(ids: torch.Tensor, prompt_len: int) -> list[list[int]]:
    return ids[:, prompt_len:].tolist()


def test_random_walk_reaches_every_path_and_only_paths(tables):
    prompt = torch.tensor([[PAD, 17, 5, START]] * 64)  # a candidate id in the prompt must not be replayed
    seen = set()
    for seed in range(4):
        proc = TreeLogitsProcessor(tables)

        def check(step, ids, raw, masked):
            for row, gen in enumerate(_generated(ids, 4)):
                oracle = {END} if END in gen else None
                state = str(START)
                if oracle is None:
                    for t in gen:
                        state += "_" + str(t)
                    oracle = oracle_allowed(PREFIX, state, END)
                assert allowed_ids(masked[row]) == oracle

        out = drive(proc, prompt, V, 6, seed=seed, check=check)
        for gen in _generated(out, 4):
            path = oracle_check(PREFIX, START, END, gen)
            assert path[-1] == END, f"row did not end within 6 steps: {gen}"
            seen.add(path)
        assert proc.errors == [None] * 64
    assert seen == PATHS


def test_allowed_logits_are_not_changed(tables):
    torch.manual_seed(0)
    raw = torch.randn(3, V)
    proc = TreeLogitsProcessor(tables)
    masked = proc(torch.full((3, 2), START), raw.clone())
    allowed = [5, 6, 7]
    assert torch.equal(masked[:, allowed], raw[:, allowed])
    others = [i for i in range(V) if i not in allowed]
    assert torch.isneginf(masked[:, others]).all()


def test_greedy_cannot_pick_the_favourite_invalid_token(tables):
    def logits(step, ids):
        raw = torch.randn(ids.shape[0], V, generator=torch.Generator().manual_seed(step))
        raw[:, 17] = 100.0  # the model's favourite is never a candidate
        raw[:, 8] = 50.0  # valid only after 5
        return raw

    proc = TreeLogitsProcessor(tables)
    out = drive(proc, torch.full((4, 1), START), V, 5, pick=greedy, logits=logits)
    for gen in _generated(out, 1):
        assert 17 not in gen
        oracle_check(PREFIX, START, END, gen)


def test_left_padding_with_padded_prompt_len(tables):
    # rows of different prompt lengths, left-padded to 5; the prompt contains tree ids that must be ignored
    prompt = torch.tensor(
        [
            [PAD, PAD, PAD, 9, START],
            [PAD, 5, 8, 9, START],
            [7, 6, 5, 4, START],
        ]
    )
    for prompt_len in (5, None):
        proc = TreeLogitsProcessor(tables, prompt_len=prompt_len)
        out = drive(proc, prompt, V, 5, seed=1)
        for gen in _generated(out, 5):
            assert oracle_check(PREFIX, START, END, gen)[-1] == END
        assert proc.errors == [None, None, None]


def test_prompt_len_replays_tokens_already_generated(tables):
    # a processor first called mid-generation replays the tokens after prompt_len
    proc = TreeLogitsProcessor(tables, prompt_len=2)
    ids = torch.tensor([[PAD, START, 5, 8], [PAD, START, 6, END]])
    out = proc(ids, torch.zeros(2, V))
    assert allowed_ids(out[0]) == {9, END}
    assert allowed_ids(out[1]) == {END}
    with pytest.raises(ValueError, match="prompt_len"):
        TreeLogitsProcessor(tables, prompt_len=9)(ids, torch.zeros(2, V))
    with pytest.raises(ValueError, match="prompt_len"):
        TreeLogitsProcessor(tables, prompt_len=-1)


def test_num_return_sequences_expansion(tables):
    prompts = torch.tensor([[PAD, START], [9, START]])
    k = 3
    expanded = prompts.repeat_interleave(k, dim=0)
    proc = TreeLogitsProcessor(tables)
    out = drive(proc, expanded, V, 5, seed=3)
    assert out.shape[0] == 2 * k
    for gen in _generated(out, 2):
        assert oracle_check(PREFIX, START, END, gen)[-1] == END


def test_beam_reorder_follows_each_rows_tokens(tables):
    proc = TreeLogitsProcessor(tables)
    p = [PAD, START]
    ids0 = torch.tensor([p, p])
    proc(ids0, torch.zeros(2, V))
    a, b = p + [6], p + [5]  # a: state "30_6" (only end), b: state "30_5" ({8, end})
    out = proc(torch.tensor([a, b]), torch.zeros(2, V))
    assert allowed_ids(out[0]) == {END} and allowed_ids(out[1]) == {8, END}
    # beam search keeps two continuations of b and drops a
    out = proc(torch.tensor([b + [8], b + [END]]), torch.zeros(2, V))
    assert allowed_ids(out[0]) == {9, END}
    assert allowed_ids(out[1]) == {END}
    assert proc.errors == [None, None]
    # the rows swap places: state moves with the tokens, the duplicated cursor is independent
    out = proc(torch.tensor([b + [END, END], b + [8, 9]]), torch.zeros(2, V))
    assert allowed_ids(out[0]) == {END}
    assert allowed_ids(out[1]) == {END}
    assert proc.cursors[1].state == state_of(tables, [5, 8, 9])
    assert proc.cursors[0].finished and not proc.cursors[1].finished
    assert proc.errors == [None, None]


def test_beam_duplicate_rows_get_independent_cursors(tables):
    proc = TreeLogitsProcessor(tables)
    p = [PAD, START]
    proc(torch.tensor([p, p]), torch.zeros(2, V))
    proc(torch.tensor([p + [5], p + [7]]), torch.zeros(2, V))
    # both new rows extend row 0 (p + [5]); they then diverge
    out = proc(torch.tensor([p + [5, 8], p + [5, END]]), torch.zeros(2, V))
    assert proc.cursors[0] is not proc.cursors[1]
    assert allowed_ids(out[0]) == {9, END} and allowed_ids(out[1]) == {END}
    out = proc(torch.tensor([p + [5, 8, 9], p + [5, END, END]]), torch.zeros(2, V))
    assert allowed_ids(out[0]) == {END} and allowed_ids(out[1]) == {END}
    assert proc.errors == [None, None]


def test_interfering_token_forces_end_and_is_reported(tables):
    proc = TreeLogitsProcessor(tables)
    p = [PAD, START]
    proc(torch.tensor([p, p]), torch.zeros(2, V))
    out = proc(torch.tensor([p + [17], p + [5]]), torch.zeros(2, V))  # 17 is not a root candidate
    assert allowed_ids(out[0]) == {END}
    assert allowed_ids(out[1]) == {8, END}
    assert proc.errors[0] is not None and "17" in proc.errors[0]
    assert proc.errors[1] is None
    # the row is not a fallback row (the tree is fine, the token was not)
    assert proc.fallback_rows == []
    # after the end token the row is finished and stays quiet
    out = proc(torch.tensor([p + [17, END], p + [5, 8]]), torch.zeros(2, V))
    assert allowed_ids(out[0]) == {END} and allowed_ids(out[1]) == {9, END}
    assert proc.cursors[0].finished


def test_end_token_where_the_tree_does_not_allow_it_is_reported(tables):
    cursor = TreeCursor(tables)
    cursor.advance(END)  # the root lists 5, 6, 7 but not the end token
    assert cursor.finished
    assert cursor.error is not None and str(END) in cursor.error
    ok = TreeCursor(tables)
    for t in (5, END):
        ok.advance(t)
    assert ok.finished and ok.error is None
    fell = TreeCursor(tables)
    for t in (7, END):  # a missing state allows only the end token: no error
        fell.advance(t)
    assert fell.finished and fell.error is None and fell.fell_back


def test_fallback_rows_report_missing_and_empty_states(tables):
    proc = TreeLogitsProcessor(tables)
    p = [PAD, START]
    proc(torch.tensor([p, p, p]), torch.zeros(3, V))
    out = proc(torch.tensor([p + [5], p + [6], p + [7]]), torch.zeros(3, V))
    assert proc.fallback_rows == [1, 2]
    assert [allowed_ids(r) for r in out] == [{8, END}, {END}, {END}]
    assert proc.errors == [None, None, None]


def test_no_row_is_ever_all_neg_inf_even_when_upstream_banned_everything(tables):
    proc = TreeLogitsProcessor(tables)
    p = [PAD, START]
    proc(torch.tensor([p, p]), torch.zeros(2, V))
    raw = torch.zeros(2, V)
    raw[0, [8, END]] = float("-inf")  # e.g. bad_words + min_new_tokens removed every allowed token
    raw[1, END] = float("-inf")
    out = proc(torch.tensor([p + [5], p + [6]]), raw)
    assert allowed_ids(out[0]) == {8, END} and (out[0, [8, END]] == 0).all()
    assert allowed_ids(out[1]) == {END}


def test_padded_vocab_ids_are_masked(tables):
    width = V + 16  # the model's logits are wider than the tokenizer
    proc = TreeLogitsProcessor(tables)

    def logits(step, ids):
        raw = torch.zeros(ids.shape[0], width)
        raw[:, V:] = 1000.0
        return raw

    def check(step, ids, raw, masked):
        assert torch.isneginf(masked[:, V:]).all()

    out = drive(proc, torch.full((8, 1), START), width, 5, pick=greedy, logits=logits, check=check)
    for gen in _generated(out, 1):
        oracle_check(PREFIX, START, END, gen)


def test_exhaustive_forced_paths(tables):
    """Force every sequence of up to 4 tokens from a small alphabet and compare the allowed sets to the oracle."""
    alphabet = [5, 6, 7, 8, 9, END]
    for length in range(1, 5):
        for seq in itertools.product(alphabet, repeat=length):
            try:
                oracle_check(PREFIX, START, END, list(seq))
            except AssertionError:
                continue
            cursor = TreeCursor(tables)
            for t in seq:
                cursor.advance(t)
            state = None if END in seq else str(START) + "".join("_" + str(t) for t in seq)
            step = cursor.step()
            assert set(step.payload.tolist()) == oracle_allowed(PREFIX, state, END), seq
            assert cursor.error is None


def test_tree_processor_type_check():
    with pytest.raises(TypeError, match="MaskTables"):
        TreeLogitsProcessor({"30": [5]})  # type: ignore[arg-type]
