"""The admin PATCH and catalog uploads against the real config manager (embedded Redis, real tokenizer,
no replicas): a PATCH changes exactly its delta, keeps to ``max_tree_keys``, and a replay (the same
``Idempotency-Key``) gets its first answer exactly, also for a PATCH that changed nothing; a refused catalog
upload or PATCH leaves no content file behind in ``data/tree-content``.

The served items are read from the tables the manager serves (the compiled tree), not from the stored body: every
path from the root to the end token, walked as the decoding walks them.
"""

from __future__ import annotations

import itertools
import os
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from config import Limits
from deployments.protocol import ServiceError

ROOT, END = 1000, 2
TOKENS = [3, 4, 5, 6, 7, 8]
MAX_KEYS = 64


@pytest.fixture(scope="module")
def manager(start_manager):
    """The real config manager with max_tree_keys=64 (a catalog or a PATCH past it is refused)."""
    with start_manager("patch-bounds", limits=Limits(max_tree_keys=MAX_KEYS)) as manager:
        yield manager


def served_items(manager, name: str) -> set[tuple[int, ...]]:
    """Every token path the served tables of ``name`` allow from the root to the end token (without it)."""
    from processors.tables import DONE, LEAF

    tables = manager.scenarios.served[name].compiled.constraint
    offsets, tokens, nexts = tables.offsets.tolist(), tables.tokens.tolist(), tables.next_state.tolist()
    out: set[tuple[int, ...]] = set()
    stack: list[tuple[int, tuple[int, ...]]] = [(tables.root, ())]
    while stack:
        state, path = stack.pop()
        if state == LEAF or offsets[state] == offsets[state + 1]:  # no continuation: only the end token
            out.add(path)
            continue
        for token, nxt in zip(tokens[offsets[state]:offsets[state + 1]], nexts[offsets[state]:offsets[state + 1]]):
            if token == tables.end_token_id:
                assert nxt == DONE
                out.add(path)
            else:
                stack.append((nxt, path + (token,)))
    return out


def _tree(prefix_dict: dict[str, list[int]]) -> dict:
    return {"type": "tree", "tree": {"start_token_id": ROOT, "end_token_id": END, "prefix_dict": prefix_dict}}


_names = itertools.count()


def _patched(manager, prefix_dict, add, remove):
    """PUT the tree, PATCH it; ``(items before, items after, answer)``."""
    name = f"p23-{next(_names)}"
    manager.run(manager.put(name, _tree(prefix_dict)))
    before = served_items(manager, name)
    answer = manager.run(manager.patch(name, {"add": [list(i) for i in add], "remove": [list(i) for i in remove]}))
    return name, before, served_items(manager, name), answer


def test_report_cases_change_exactly_the_delta(manager):
    # an unreachable key (1000_7 is not a candidate of 1000) does not become an item
    name, before, after, answer = _patched(
        manager, {"1000": [5, 6], "1000_5": [2], "1000_6": [2], "1000_7": [8], "1000_7_8": [2]}, [(6, 7)], [])
    assert before == {(5,), (6,)} and answer["added"] == 1
    assert after == {(5,), (6,), (6, 7)}, after
    # an empty list allows only the end token: (5) is an item and stays one
    _, before, after, _ = _patched(manager, {"1000": [5, 6], "1000_5": [], "1000_6": [2]}, [(6, 7)], [])
    assert before == {(5,), (6,)} and after == {(5,), (6,), (6, 7)}, after
    # the end token at the root: the empty answer is an item and stays one (also once the catalog is read back)
    name, before, after, _ = _patched(manager, {"1000": [2, 5], "1000_5": [2]}, [(6,)], [])
    assert before == {(), (5,)} and after == {(), (5,), (6,)}, after
    _, _, again, _ = _patched(manager, {"1000": [2, 5]}, [(7,)], [(5,)])
    assert again == {(), (7,)}, again

    from deployments.manager import ConfigManager

    second = ConfigManager(manager.settings, tokenizer=manager.tokenizer, redis_client=manager.store.client)
    try:  # a manager starting on the store parses the stored catalog (its "[]" line) again
        assert served_items(second, name) == {(), (5,), (6,)}
    finally:
        manager.run(second.close())


_path = st.lists(st.sampled_from(TOKENS), min_size=0, max_size=3).map(tuple)
_cands = st.lists(st.sampled_from(TOKENS + [END]), max_size=4, unique=True)


@st.composite
def _cases(draw):
    keys = draw(st.lists(_path, min_size=1, max_size=10, unique=True))
    prefix_dict = {"_".join(map(str, (ROOT,) + k)): draw(_cands) for k in keys}
    add = draw(st.lists(_path.filter(bool), max_size=4, unique=True))
    remove = draw(st.lists(_path.filter(bool), max_size=4, unique=True))
    remove = [r for r in remove if r not in add]
    if not add and not remove:
        add = [(3, 3, 3, 3)]
    return prefix_dict, add, remove


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=_cases())
def test_patch_serves_exactly_before_plus_adds_minus_removes(manager, case):
    """Random trees (unreachable keys, empty lists, the end token at the root or anywhere) and random deltas:
    the served items after the PATCH are the items before, plus the adds, minus the removes."""
    prefix_dict, add, remove = case
    try:
        name, before, after, answer = _patched(manager, prefix_dict, add, remove)
    except ServiceError as error:  # only a PATCH that would leave no item at all is refused
        assert error.status == 422 and "without items" in error.message, error.message
        return
    expected = (before | set(add)) - set(remove)
    assert after == expected, (prefix_dict, add, remove, before, after)
    assert (answer["added"], answer["removed"]) == (len(set(add) - before), len(set(remove) & before)), answer


def test_patch_keeps_to_max_tree_keys(manager):
    """A PATCH past max_tree_keys is the 422 a PUT of the same catalog gets; nothing is stored."""
    from processors.kinds.tree.catalog.catalog import Catalog

    items = [(3, i) for i in range(10, 10 + MAX_KEYS)]
    too_many = Catalog.from_items(ROOT, END, items + [(4,)]).content()
    with pytest.raises(ServiceError) as put:
        manager.run(manager.put_items("p23-keys", too_many))
    assert put.value.status == 422 and put.value.detail["limit_name"] == "max_tree_keys"
    manager.run(manager.put_items("p23-keys", Catalog.from_items(ROOT, END, items[:2]).content()))
    with pytest.raises(ServiceError) as patch:
        manager.run(manager.patch("p23-keys", {"add": [list(i) for i in items[2:]] + [[4]]}))
    assert patch.value.status == 422, patch.value.message
    assert patch.value.detail["limit_name"] == "max_tree_keys" and "max_tree_keys" in patch.value.message
    with pytest.raises(ServiceError) as early:  # more adds than the limit: refused before the items are checked
        manager.run(manager.patch("p23-keys", {"add": [[4, i] for i in range(MAX_KEYS + 1)]}))
    assert early.value.status == 422 and early.value.detail["limit_name"] == "max_tree_keys", early.value.message
    assert [v["version"] for v in manager.run(manager.versions("p23-keys"))] == [1]
    # up to the limit is fine
    answer = manager.run(manager.patch("p23-keys", {"add": [list(i) for i in items[2:]]}))
    assert answer["added"] == MAX_KEYS - 2 and answer["version"] == 2


def test_replayed_patch_answers_the_first_answer(manager):
    """The same Idempotency-Key and PATCH again: exactly the first answer (the report too), no new version; a no-op
    PATCH records its key as well, so its replay does not make a version after another write."""
    name = "p23-replay"
    manager.run(manager.put(name, {"type": "labels", "labels": ["a", "b"]}))
    delta = {"add": ["c", "a"], "remove": ["z"]}
    first = manager.run(manager.patch(name, delta, "k-23-first"))
    assert first["changed"] and first["added"] == 1 and first["already_present"] == ["a"]
    again = manager.run(manager.patch(name, delta, "k-23-first"))
    assert again.pop("replayed") is True and again == first, (first, again)

    noop = {"add": ["a"]}
    first_noop = manager.run(manager.patch(name, noop, "k-23-noop"))
    assert first_noop["changed"] is False and first_noop["version"] == first["version"]
    manager.run(manager.patch(name, {"remove": ["a"]}))  # another write: "a" is gone, a replay must not add it
    replay = manager.run(manager.patch(name, noop, "k-23-noop"))
    assert replay.pop("replayed") is True and replay == first_noop, (first_noop, replay)
    record = manager.run(manager.get(name))
    assert record["version"] == first["version"] + 1 and "a" not in record["scenario"]["labels"], record


def test_refused_catalog_upload_leaves_no_content_file(manager):
    """A catalog refused after its content was written (here: its header field fails the scenario check) leaves
    nothing in data/tree-content; an accepted one keeps its file."""
    content_dir = os.path.join(manager.settings.data_dir, "tree-content")
    before = set(os.listdir(content_dir)) if os.path.isdir(content_dir) else set()
    bad = b'{"start_token_id": 1000, "end_token_id": 2, "max_new_tokens": -5}\n[3]\n[4]\n'
    with pytest.raises(ServiceError) as refused:
        manager.run(manager.put_items("p23-refused", bad))
    assert refused.value.status == 422, refused.value.message
    after = set(os.listdir(content_dir)) if os.path.isdir(content_dir) else set()
    assert after == before, after - before
    random_items = b"".join(b"[%d]\n" % t for t in random.Random(23).sample(range(10, 40), 5))
    manager.run(manager.put_items("p23-kept", b'{"start_token_id": 1000, "end_token_id": 2}\n' + random_items))
    kept = set(os.listdir(content_dir)) - before
    assert len(kept) == 1
    # the same items under a refused header: the copy a stored version uses stays
    with pytest.raises(ServiceError):
        manager.run(manager.put_items("p23-refused", bad.split(b"\n")[0] + b"\n" + random_items))
    assert set(os.listdir(content_dir)) - before == kept
