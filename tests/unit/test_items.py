"""Item controls on hand-built trees: the per-state metrics, the token budget (never cut
mid-item), exclude, distinct, multi-item sequences with a separator and in the fixed-width form.

Expected values come from brute force over the tree's items (:func:`items_of`), never from the cursor itself.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
from item_checks import items_of as split_output

from processors.chain import RowCursor
from processors.compile import CompiledScenario
from processors.items import ItemRules, item_rules, min_item_tokens, resolve_exclude
from processors.kinds.tree.kind import check_multi_item
from processors.tables import DONE, build_tree_tables, item_metrics
from processors.tree import TreeCursor
from processors.testing import tree_data

V = 40
START, END, SEP = 30, 2, 20
# items: (5,), (5, 8), (5, 8, 9), (6,) [empty state], (7,) [missing key: LEAF], (11, 12, 13)
PREFIX = {
    "30": [5, 6, 7, 11],
    "30_5": [8, 2],
    "30_5_8": [9, 2],
    "30_5_8_9": [2],
    "30_6": [],
    "30_11": [12],
    "30_11_12": [13],
    "30_11_12_13": [2],
}
ITEMS = {(5,), (5, 8), (5, 8, 9), (6,), (7,), (11, 12, 13)}
# fixed depth 2, 3 x 3 codes: every item ends where only the end token follows
FIXED = {"30": [5, 6, 7], **{f"30_{a}": [8, 9, 10] for a in (5, 6, 7)},
         **{f"30_{a}_{b}": [2] for a in (5, 6, 7) for b in (8, 9, 10)}}
FIXED_ITEMS = {(a, b) for a in (5, 6, 7) for b in (8, 9, 10)}


@pytest.fixture(scope="module")
def tables():
    return build_tree_tables(tree_data(PREFIX, START, END), V)


@pytest.fixture(scope="module")
def fixed():
    return build_tree_tables(tree_data(FIXED, START, END), V)


def items_of(prefix, start=START, end=END, sep="_"):
    """Every item of a prefix dict by brute force: paths from the root to an end token, a missing key or an
    empty list."""
    out = set()

    def walk(key, path):
        cands = prefix.get(key)
        if not cands:
            out.add(path)
            return
        for c in set(cands):
            if c == end:
                out.add(path)
            else:
                walk(key + sep + str(c), path + (c,))

    walk(str(start), ())
    return out


def run(cursor, pick, limit=100):
    """Drive a cursor: ``pick(allowed ids, rng)`` chooses; stops at the end token or when the budget is spent."""
    out = []
    for _ in range(limit):
        if cursor.finished or (cursor.remaining is not None and cursor.remaining <= 0):
            break
        step = cursor.step()
        allowed = step.payload.tolist() if step.payload is not None and len(step.payload) else [step.fallback]
        token = pick(allowed)
        out.append(token)
        cursor.advance(token)
    return out


def split_items(tokens, sep=SEP, end=END):
    """An output's items, split as the integration tests split them (:func:`item_checks.items_of`); an output that
    is only its end token has none."""
    return [] if list(tokens) in ([], [end]) else split_output(list(tokens), end, sep)


def test_brute_force_items_are_the_documented_ones():
    assert items_of(PREFIX) == ITEMS
    assert items_of(FIXED) == FIXED_ITEMS


def test_metrics_match_brute_force(tables):
    min_rem, count, uniform, deepest = item_metrics(tables)
    for state_tokens in [(), (5,), (5, 8), (5, 8, 9), (11,), (11, 12)]:
        s = tables.root
        for t in state_tokens:
            s = tables.step(s, t)
        below = [i[len(state_tokens):] for i in ITEMS if i[: len(state_tokens)] == state_tokens]
        # an item below: its remaining tokens plus the end token
        assert min_rem[s] == min(len(rest) + 1 for rest in below)
        assert count[s] == len(below)
    assert not uniform and deepest == 4  # (11, 12, 13) + end
    assert tables.min_remaining[tables.root] == 2 and tables.item_count[tables.root] == 6
    f_min, f_count, f_uniform, _ = item_metrics(fixed_tables := build_tree_tables(tree_data(FIXED, START, END), V))
    assert f_uniform and f_count[fixed_tables.root] == 9 and f_min[fixed_tables.root] == 3


def test_metrics_are_vectorized_at_scale():
    """A 4-level tree of 20^4 = 160,000 items: counts and depths right (no Python loop over states)."""
    fan = 20
    keys = {"30": list(range(3, 3 + fan))}
    for depth in range(1, 4):
        for path in itertools.product(range(3, 3 + fan), repeat=depth):
            keys["30_" + "_".join(map(str, path))] = list(range(3, 3 + fan)) if depth < 3 else [2]
    del keys  # the dict form is slow to build in Python; build the same shape from arrays instead
    n1, n2, n3 = fan, fan ** 2, fan ** 3
    n_states = 1 + n1 + n2 + n3
    offsets = np.concatenate(([0], np.cumsum([fan] * (1 + n1 + n2) + [fan] * n3)))
    tokens = np.tile(np.arange(3, 3 + fan, dtype=np.int32), n_states)
    nxt = np.concatenate((np.arange(1, 1 + n1 + n2 + n3), np.full(n3 * fan, -1)))  # the last level: LEAF edges
    from processors.tables import MaskTables

    t = MaskTables(offsets=offsets, tokens=tokens, next_state=nxt.astype(np.int32), root=0, end_token_id=2,
                   vocab_size=64)
    min_rem, count, uniform, deepest = item_metrics(t)
    assert count[0] == fan ** 4 and min_rem[0] == 5 and uniform and deepest == 5


# -- the budget -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("budget", range(1, 8))
def test_budget_never_cuts_an_item(tables, budget):
    rng = random.Random(budget)
    for _ in range(200):
        cursor = TreeCursor(tables).bind(budget=budget)
        out = run(cursor, rng.choice)
        assert len(out) <= budget
        body = tuple(out[:-1]) if out and out[-1] == END else tuple(out)
        assert body in ITEMS, f"budget {budget}: {out} is not whole items"
        assert cursor.error is None


def test_budget_masks_long_branches(tables):
    cursor = TreeCursor(tables).bind(budget=2)
    assert set(cursor.step().payload.tolist()) == {5, 6, 7}  # (11, 12, 13) needs 3 tokens
    cursor = TreeCursor(tables).bind(budget=3)
    assert set(cursor.step().payload.tolist()) == {5, 6, 7, 11}
    assert min_item_tokens(tables) == 1


def test_think_leaves_room_for_one_item(tables):
    """With think mode the thinking budget shrinks so that the end marker and the shortest item still fit."""
    from processors.think import ThinkSpec

    think = ThinkSpec(max_thinking_tokens=50, begin_ids=(21,), end_ids=(22, 23))
    compiled = CompiledScenario(kind="tree", constraint=tables, think=think, eos_token_ids=(END,), vocab_size=V)
    row = RowCursor(compiled, eos_token_ids=(END,), max_new_tokens=6)
    assert row.think.limit == 6 - 2 - 1
    tokens = []
    while not row.finished and len(tokens) < 6:
        step = row.step()
        if row.thinking and step.kind != 0:  # free thinking (a BAN step): a filler token, never the end marker
            token = 25
        else:
            token = max(step.payload.tolist())
        tokens.append(token)
        row.advance(token)
    assert tokens[:3] == [25, 25, 25] and tokens[3:5] == [22, 23], tokens  # thinking cut at 3, marker forced
    body = tuple(t for t in tokens[5:] if t != END)
    assert body in ITEMS and len(tokens) <= 6, tokens


# -- exclude --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("excluded", [[(5,)], [(5, 8, 9), (7,)], [(6,), (11, 12, 13), (5, 8)], [(5,), (5, 8)]])
def test_exclude_never_produces_an_excluded_item(tables, excluded):
    rng = random.Random(len(excluded))
    req = resolve_exclude(tables, [list(i) for i in excluded])
    seen = set()
    for _ in range(300):
        out = run(TreeCursor(tables).bind(budget=10, request=req), rng.choice)
        assert out[-1] == END
        item = tuple(out[:-1])
        assert item in ITEMS and item not in excluded, out
        seen.add(item)
    assert seen == ITEMS - set(excluded)  # and nothing else is lost


def test_exclude_with_a_tight_budget_finds_the_longer_free_item(tables):
    """(5,) excluded and a budget of 2: under 5 only (5, 8) fits, so the row must go there, not dead-end."""
    req = resolve_exclude(tables, [[5], [6], [7]])
    for pick in (min, max):
        out = run(TreeCursor(tables).bind(budget=2, request=req), pick)
        assert tuple(out) == (5, 8) or tuple(out[:-1]) == (5, 8), out


def test_exclude_refuses_unknown_and_malformed_items(tables):
    with pytest.raises(ValueError, match=r"exclude\[1\]: .*not an item"):
        resolve_exclude(tables, [[5], [5, 9]])
    with pytest.raises(ValueError, match=r"exclude\[0\]: .*not an item"):
        resolve_exclude(tables, [[11, 12]])  # a prefix of an item is not an item
    with pytest.raises(ValueError, match=r"exclude\[0\]: a tree item is a list of token ids"):
        resolve_exclude(tables, ["5"])
    with pytest.raises(ValueError, match=r"exclude\[0\]"):
        resolve_exclude(tables, [[5, True]])
    assert resolve_exclude(tables, [[5], [5]]).n_excluded == 1


# -- distinct -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(5))
def test_distinct_rows_take_different_items(tables, seed):
    rng = random.Random(seed)
    req = resolve_exclude(tables, [[7]], distinct=True)
    first = TreeCursor(tables).bind(budget=10, request=req)
    rows = [first] + [first.copy() for _ in range(4)]  # 5 rows, 5 free items
    outs = [[] for _ in rows]
    # lock-step decoding like an engine: every row's step first, then each row advances in order,
    # re-drawing when an earlier row of the same step took its item (the engine's rule)
    for _ in range(10):
        live = [i for i, c in enumerate(rows) if not c.finished]
        if not live:
            break
        picks = {i: rng.choice(rows[i].step().payload.tolist()) for i in live}
        for i in live:
            token = picks[i]
            if not rows[i].allows(token):
                token = rng.choice(rows[i].step().payload.tolist())
            outs[i].append(token)
            rows[i].advance(token)
    items = [tuple(o[:-1]) for o in outs]
    assert all(o[-1] == END for o in outs) and all(c.error is None for c in rows)
    assert len(set(items)) == 5 and set(items) == ITEMS - {(7,)}


# -- multi-item sequences -------------------------------------------------------------------------------------

@pytest.mark.parametrize("budget", [1, 3, 5, 7, 9, 11, 13, 20])
def test_multi_item_with_separator(tables, budget):
    rng = random.Random(budget)
    for _ in range(200):
        cursor = TreeCursor(tables).bind(budget=budget, rules=ItemRules(4, SEP))
        out = run(cursor, rng.choice)
        parts = split_items(out)
        assert len(out) <= budget and cursor.error is None, out
        assert parts and all(p in ITEMS for p in parts), f"not whole items: {out}"
        assert len(set(parts)) == len(parts) <= 4, f"an item twice or too many: {out}"


def test_multi_item_exclude_applies_to_every_item(tables):
    rng = random.Random(1)
    req = resolve_exclude(tables, [[5], [6]])
    for _ in range(200):
        parts = split_items(run(TreeCursor(tables).bind(budget=30, request=req, rules=ItemRules(6, SEP)), rng.choice))
        assert not {(5,), (6,)} & set(parts) and len(set(parts)) == len(parts)


def test_multi_item_all_items_then_only_the_end(tables):
    """max_items above the catalog: a greedy row emits every item once, then must end."""
    cursor = TreeCursor(tables).bind(budget=40, rules=ItemRules(10, SEP))
    out = run(cursor, lambda ids: [i for i in ids if i != END][-1] if len(ids) > 1 else ids[0])
    assert sorted(split_items(out)) == sorted(ITEMS) and out[-1] == END


def test_fixed_width_items_back_to_back(fixed):
    rng = random.Random(0)
    for budget in (2, 5, 7, 13):
        for _ in range(100):
            cursor = TreeCursor(fixed).bind(budget=budget, rules=ItemRules(4, None))
            out = run(cursor, rng.choice)
            body = out[:-1] if out[-1] == END else out
            assert len(body) % 2 == 0 and len(out) <= budget, out
            parts = [tuple(body[i:i + 2]) for i in range(0, len(body), 2)]
            assert all(p in FIXED_ITEMS for p in parts) and len(set(parts)) == len(parts) <= 4, out


def test_multi_item_settings_checked_at_compile(tables, fixed):
    check_multi_item(tables, SEP)
    with pytest.raises(ValueError, match="end token"):
        check_multi_item(tables, END)
    with pytest.raises(ValueError, match="also continues"):
        check_multi_item(tables, 8)  # (5,) ends where 8 continues to (5, 8)
    with pytest.raises(ValueError, match="back to back"):
        check_multi_item(tables, None)  # (5,) ends where (5, 8) goes on: not fixed width
    check_multi_item(fixed, None)


def test_item_rules_come_from_the_compiled_settings(tables):
    compiled = CompiledScenario(kind="tree", constraint=tables, think=None, eos_token_ids=(END,), vocab_size=V,
                                settings={"max_items": 3, "separator_token_id": SEP})
    assert item_rules(compiled) == ItemRules(3, SEP)
    row = RowCursor(compiled, eos_token_ids=(END,), max_new_tokens=12)
    assert row.constraint.rules == ItemRules(3, SEP) and row.constraint.remaining == 12
    assert DONE in tables.next_state.tolist()


# -- labels ---------------------------------------------------------------------------------------------------

LABELS = ["Sports", "Technology", "New York City", "New York"]


@pytest.mark.parametrize("budget", range(1, 9))
def test_multi_label_budget_ends_on_a_label(budget):
    from processors.labels import LabelCursor, build_label_tables
    from processors.testing import build_tokenizer, decode

    tok = build_tokenizer()
    lt = build_label_tables(LABELS, tok, eos_token_id=tok.eos_token_id, vocab_size=len(tok), multi_label=True)
    rng = random.Random(budget)
    for _ in range(100):
        cursor = LabelCursor(lt).bind(budget=budget)
        out = run(cursor, rng.choice)
        text = decode(tok, [t for t in out if t != tok.eos_token_id])
        parts = [p.strip() for p in text.split(",")]
        assert len(out) <= budget and cursor.error is None, (out, text)
        assert all(p in LABELS for p in parts) and len(set(parts)) == len(parts), (budget, text)


def test_label_exclude_by_name():
    from processors.labels import build_label_tables
    from processors.testing import build_tokenizer, decode

    tok = build_tokenizer()
    lt = build_label_tables(LABELS, tok, eos_token_id=tok.eos_token_id, vocab_size=len(tok))
    req = resolve_exclude(lt, ["New York", "Sports"])
    rng = random.Random(0)
    seen = set()
    for _ in range(100):
        out = run(TreeCursor(lt.tables).bind(budget=10, request=req), rng.choice)
        seen.add(decode(tok, out[:-1]).strip())
    assert seen == {"Technology", "New York City"}
    with pytest.raises(ValueError, match=r"exclude\[0\]: 'Weather' is not a label"):
        resolve_exclude(lt, ["Weather"])
    with pytest.raises(ValueError, match=r"exclude\[0\]: a label scenario excludes labels"):
        resolve_exclude(lt, [[5, 6]])
