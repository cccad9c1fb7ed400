"""The vector lane (processors.lanes) against the per-row path: for random batches of tree, label, multi-label and
free rows (mixed scenarios in one batch, rows restarting, invalid tokens forced in now and then), the masked
logits and every row's state are identical after every step."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from processors import CompiledScenario, ConstrainedLogitsProcessor, build_label_tables, build_tree_tables
from processors import lanes
from processors.lanes import BUDGET, OFF, PLAIN, lane_of
from processors.testing import build_tokenizer, tid, tree_data

TOK = build_tokenizer()
V = len(TOK)
E_EOS = TOK.eos_token_id
S, E = tid(":"), tid("}")
NEW, YORK, CITY, SPORTS = tid(" New"), tid(" York"), tid(" City"), tid(" Sports")
PREFIX = {
    f"{S}": [NEW, SPORTS, E_EOS],  # the model's EOS as a tree candidate: it also stops the row
    f"{S}_{NEW}": [YORK],
    f"{S}_{NEW}_{YORK}": [E, CITY],
    f"{S}_{NEW}_{YORK}_{CITY}": [E],
    f"{S}_{E_EOS}": [E],
    # "{S}_{SPORTS}" is missing: a LEAF (only the end token, the row falls back)
}


def scenario(kind, constraint):
    return CompiledScenario(kind=kind, constraint=constraint, think=None, eos_token_ids=(E_EOS,), vocab_size=V)


def random_tree(seed: int, n_keys: int = 300):
    """A random prefix tree over the test vocabulary (depth 1-5, ends on the end token)."""
    rng = np.random.default_rng(seed)
    prefix: dict[str, set[int]] = {}
    pool = [t for t in range(V) if t not in (E, E_EOS, S)]
    for _ in range(n_keys):
        key = f"{S}"
        for _ in range(int(rng.integers(1, 6))):
            t = int(rng.choice(pool[:40]))
            prefix.setdefault(key, set()).add(t)
            key = f"{key}_{t}"
        prefix.setdefault(key, set()).add(E)
    return scenario("tree", build_tree_tables(tree_data({k: sorted(v) for k, v in prefix.items()}, S, E), V))


@pytest.fixture(scope="module")
def scenarios():
    labels = build_label_tables(["New York", "Sports", "Technology", "New York City"], TOK, eos_token_id=E_EOS, vocab_size=V)
    multi = build_label_tables(["New York", "Sports", "Technology"], TOK, eos_token_id=E_EOS, vocab_size=V,
                               multi_label=True, max_labels=2)
    return [
        scenario("tree", build_tree_tables(tree_data(PREFIX, S, E), V)),
        random_tree(0),
        random_tree(1),
        scenario("labels", labels),
        scenario("labels", multi),
        None,  # free text
    ]


def row_state(cursor):
    c = cursor.constraint
    return (cursor.done, cursor.generated, cursor.error, cursor.fell_back,
            None if c is None else (getattr(c, "state", None), getattr(c, "error", None)))


def test_lane_codes(scenarios):
    proc = ConstrainedLogitsProcessor(scenarios, tokenizer=TOK, prompt_len=1)
    proc(torch.full((len(scenarios), 1), S), torch.zeros(len(scenarios), V))
    codes = [lane_of(c) for c in proc.cursors]
    assert codes[:4] == [PLAIN, PLAIN, PLAIN, PLAIN]  # trees and single labels
    assert codes[4] == OFF and codes[5] == OFF  # multi-label and free rows keep the per-row path
    assert BUDGET not in codes
    assert lane_of(object()) == OFF


def all_tables(scenarios):
    out = []
    for sc in scenarios:
        c = None if sc is None else sc.constraint
        for t in (c, getattr(c, "tables", None), getattr(getattr(c, "bare_form", None), "tables", None)):
            if hasattr(t, "find_edges"):
                out.append(t)
    return out


@pytest.fixture(params=["keys", "find_edges"])
def search(request, monkeypatch, scenarios):
    """How the lane advances: by its keys of small tables (``lanes._lane_keys``), or by ``MaskTables.find_edges``
    as for tables past ``lanes._LANE_KEYS_EDGES`` (made so here by a bound of 0)."""
    if request.param == "find_edges":
        monkeypatch.setattr(lanes, "_LANE_KEYS_EDGES", 0)
    for t in all_tables(scenarios):
        t.__dict__.pop("_lane_keys", None)
    yield request.param
    for t in all_tables(scenarios):
        t.__dict__.pop("_lane_keys", None)


@pytest.mark.parametrize("seed", range(6))
def test_vector_lane_equals_per_row_path(scenarios, seed, search):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 24))
    per_row = [scenarios[int(rng.integers(0, len(scenarios)))] for _ in range(n)]
    vec = ConstrainedLogitsProcessor(per_row, tokenizer=TOK, prompt_len=1, vectorized=True)
    ref = ConstrainedLogitsProcessor(per_row, tokenizer=TOK, prompt_len=1, vectorized=False)
    ids = torch.full((n, 1), S)
    lanes_seen = 0
    for step in range(14):
        raw = torch.randn(n, V, generator=torch.Generator().manual_seed(seed * 100 + step))
        a = vec(ids, raw.clone())
        b = ref(ids, raw.clone())
        assert torch.equal(a, b), f"seed {seed} step {step}: masked logits differ"
        assert [row_state(c) for c in vec.cursors] == [row_state(c) for c in ref.cursors], f"step {step}: states differ"
        lanes_seen += sum(lane_of(c) != OFF for c in vec.cursors)
        # next tokens: mostly sampled from what is allowed, sometimes anything (an invalid token: the row's
        # cursor reports it and falls back), sometimes the end token or EOS
        tokens = []
        for r in range(n):
            allowed = torch.isfinite(a[r]).nonzero().flatten()
            u = rng.random()
            if u < 0.08:
                tokens.append(int(rng.integers(0, V)))
            elif u < 0.12:
                tokens.append(int(rng.choice([E, E_EOS])))
            else:
                tokens.append(int(allowed[int(rng.integers(0, allowed.numel()))]))
        ids = torch.cat([ids, torch.tensor(tokens)[:, None]], dim=1)
    assert lanes_seen > 0
    made = [t.__dict__["_lane_keys"] for t in all_tables(scenarios) if "_lane_keys" in t.__dict__]
    assert made and all((k is not None) == (search == "keys") for k in made)  # the search the test meant


def test_lane_keys_stay_in_the_process_that_made_them(scenarios):
    """The lane's keys of small tables are made at the first advance and never pickled with the tables."""
    tables = scenarios[0].constraint
    tables.__dict__.pop("_lane_keys", None)
    proc = ConstrainedLogitsProcessor([scenarios[0]] * 2, tokenizer=TOK, prompt_len=1, vectorized=True)
    for ids in (torch.full((2, 1), S), torch.tensor([[S, NEW], [S, NEW]])):
        proc(ids, torch.zeros(2, V))
    keys = tables.__dict__["_lane_keys"]
    assert keys.tolist() == sorted(s * V + int(tables.tokens[e]) for s in range(tables.n_states)
                                   for e in range(tables.offsets[s], tables.offsets[s + 1]))
    back = pickle.loads(pickle.dumps(tables))
    assert "_lane_keys" not in back.__dict__ and back.version == tables.version


def test_vector_lane_in_a_reordered_batch_falls_back_to_the_base_sync(scenarios):
    """Beam search reorders rows: the base class matches and copies cursors; the lane then goes on from there."""
    per_row = [scenarios[0], scenarios[0], scenarios[3], scenarios[3]]
    vec = ConstrainedLogitsProcessor(per_row, tokenizer=TOK, prompt_len=1, vectorized=True)
    ref = ConstrainedLogitsProcessor(per_row, tokenizer=TOK, prompt_len=1, vectorized=False)
    first_label = TOK.encode(" Sports", add_special_tokens=False)[0]
    seqs = [
        torch.tensor([[S], [S], [S], [S]]),
        torch.tensor([[S, NEW], [S, SPORTS], [S, first_label], [S, first_label]]),
        torch.tensor([[S, NEW, YORK], [S, NEW, YORK], [S, first_label, E_EOS], [S, first_label, E_EOS]]),  # row 1 copies row 0
    ]
    for ids in seqs:
        raw = torch.randn(4, V)
        assert torch.equal(vec(ids, raw.clone()), ref(ids, raw.clone()))
        assert [row_state(c) for c in vec.cursors] == [row_state(c) for c in ref.cursors]


@pytest.mark.parametrize("seed", range(4))
def test_vector_lane_with_token_budgets_equals_per_row_path(scenarios, seed):
    """Rows as the engines build them: every tree and single-label row carries its token budget (the budget rule:
    a token whose target cannot reach an item's end in the tokens left is masked). The lane takes them (code
    BUDGET) and must give the per-row path's masks, states and budgets, down to rows that run out of tokens."""
    from processors import RowCursor
    from processors.lanes import advance_rows, mask_rows

    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(2, 20))
    specs = [(scenarios[int(rng.integers(0, len(scenarios)))], int(rng.integers(1, 7))) for _ in range(n)]
    vec = [RowCursor(c, TOK, eos_token_ids=(E_EOS,), max_new_tokens=k) for c, k in specs]
    ref = [r.copy() for r in vec]
    assert any(lane_of(r) == BUDGET for r in vec) or all(c is None or c.kind != "tree" for c, _ in specs)

    def state(r):
        c = r.constraint
        return row_state(r) + ((getattr(c, "remaining", None), getattr(c, "last_edge", None),
                                list(getattr(c, "path", []) or [])) if c is not None else ())

    for step in range(8):
        raw = torch.randn(n, V, generator=torch.Generator().manual_seed(seed * 10 + step))
        a, b = raw.clone(), raw.clone()
        assert mask_rows(a, vec, vectorized=True) == mask_rows(b, ref, vectorized=False) == {}
        assert torch.equal(a, b), f"step {step}: masked logits differ"
        tokens = []
        for r in range(n):
            allowed = torch.isfinite(a[r]).nonzero().flatten()
            u = rng.random()
            tokens.append(int(rng.integers(0, V)) if u < 0.06 else int(allowed[int(rng.integers(0, allowed.numel()))]))
        assert advance_rows(vec, tokens, vectorized=True) == advance_rows(ref, tokens, vectorized=False) == {}
        assert [state(r) for r in vec] == [state(r) for r in ref], f"step {step}: states differ"


@pytest.mark.parametrize("seed", range(6))
def test_vector_lane_with_filters_equals_per_row_path(scenarios, seed):
    """Rows under a request's filter (``ItemRequest.base``: random items of a random tree left out), some with a
    token budget, some with none, beside plain rows: the lane (code FILTER; a row whose budget could bind goes to
    its own path for that step) gives the per-row path's masks, states, budgets and paths at every step, and a row
    only ever finishes an item that passes."""
    from processors import RowCursor
    from processors.items import ItemRequest
    from processors.kinds.tree.filters.edges import filter_book
    from processors.lanes import FILTER, advance_rows, mask_rows

    rng = np.random.default_rng(300 + seed)
    compiled = random_tree(10 + seed, n_keys=200)
    tables = compiled.constraint
    # the items and their terminals, from a walk of the tables (not the code under test)
    items: list[tuple[tuple[int, ...], int]] = []
    stack = [(tables.root, ())]
    while stack:
        state, path = stack.pop()
        lo, hi = int(tables.offsets[state]), int(tables.offsets[state + 1])
        for e in range(lo, hi):
            tok, nxt = int(tables.tokens[e]), int(tables.next_state[e])
            if nxt >= 0:
                stack.append((nxt, path + (tok,)))
            elif tok == E:
                items.append((path, e))
            else:
                items.append((path + (tok,), e))
    passing = rng.random(len(items)) < 0.3
    passing[int(rng.integers(0, len(items)))] = True
    terminals = np.array([term for _, term in items], dtype=np.int64)
    book = filter_book(tables, terminals, passing)
    allowed_items = {path for (path, _), ok in zip(items, passing) if ok}
    n = int(rng.integers(4, 16))
    specs = [(compiled, [None, 3, 12][int(rng.integers(0, 3))], bool(rng.random() < 0.7)) for _ in range(n)]
    vec = [RowCursor(c, TOK, eos_token_ids=(E_EOS,), max_new_tokens=k,
                     items=ItemRequest(base=book) if f else None) for c, k, f in specs]
    ref = [r.copy() for r in vec]
    assert any(lane_of(r) == FILTER for r in vec)

    def state(r):
        c = r.constraint
        return row_state(r) + (c.remaining, c.last_edge, list(c.path))

    outs: list[list[int]] = [[] for _ in range(n)]
    for step in range(12):
        raw = torch.randn(n, V, generator=torch.Generator().manual_seed(seed * 10 + step))
        a, b = raw.clone(), raw.clone()
        assert mask_rows(a, vec, vectorized=True) == mask_rows(b, ref, vectorized=False) == {}
        assert torch.equal(a, b), f"step {step}: masked logits differ"
        tokens = [int(torch.isfinite(a[r]).nonzero().flatten()[int(rng.integers(0, int(torch.isfinite(a[r]).sum())))])
                  for r in range(n)]
        for r in range(n):
            if not vec[r].done:
                outs[r].append(tokens[r])
        assert advance_rows(vec, tokens, vectorized=True) == advance_rows(ref, tokens, vectorized=False) == {}
        assert [state(r) for r in vec] == [state(r) for r in ref], f"step {step}: states differ"
    finished = [tuple(t for t in outs[r] if t != E) for r in range(n)
                if specs[r][2] and vec[r].done and outs[r] and outs[r][-1] == E]
    assert finished, "no filtered row finished an item"
    for out in finished:
        assert out in allowed_items, out
