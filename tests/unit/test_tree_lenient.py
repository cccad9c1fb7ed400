"""RTP-LLM parity of the tree loader: what RTP-LLM loads is accepted with warnings, ``strict`` refuses
it; and the fast paths (numpy scan of files, hashed keys in the table builder) agree with the exact ones."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from processors.kinds.tree.treefile.load import TreeFileError, load_tree
from processors.scenarios import load_scenario
from processors.kinds.tree.treefile import builder as tree_builder
from processors.kinds.tree.treefile import load as tree_file
from processors.tables import DONE, LEAF, _build_by_strings, build_tree_tables

BASE = {"start_token_id": 225, "end_token_id": 2, "sep": "_",
        "prefix_dict": {"225": [5, 6], "225_5": [2], "225_6": [7], "225_6_7": [2]}}


def source(tmp_path, kind, body):
    if kind == "dict":
        return body
    path = tmp_path / "tree.json"
    path.write_text(json.dumps(body), encoding="utf-8")
    return path


def paths(tables, limit=8):
    """Every complete path of compiled tables (token ids up to and including the end token), by walking them."""
    out, stack = [], [(tables.root, [])]
    while stack:
        state, ids = stack.pop()
        allowed = tables.allowed(state).tolist() if state >= 0 else []
        if not allowed:
            out.append(ids + [tables.end_token_id])
            continue
        for token in allowed:
            nxt = tables.step(state, token)
            if nxt == DONE:
                out.append(ids + [token])
            elif len(ids) < limit:
                stack.append((nxt, ids + [token]) if nxt != LEAF else (LEAF, ids + [token]))
    return sorted(out)


SEED_PATHS = [[5, 2], [6, 7, 2]]

CASES = {
    "foreign-keys": ({**BASE, "prefix_dict": {**BASE["prefix_dict"], "226_5": [9], "user:abc": [1], "2250": [3]}},
                     "3 key(s) do not start with the root '225'", "key must be '225' or start with '225_'"),
    "unknown-field": ({**BASE, "version": "2024-01", "meta": {"owner": "x", "n": [1, 2]}},
                      'unknown top-level field "version" ignored', 'unknown top-level field "version"'),
    "dash-sep": ({**BASE, "sep": "-", "prefix_dict": {k.replace("_", "-"): v for k, v in BASE["prefix_dict"].items()}},
                 "sep \"-\" contains '-' (accepted", "must not contain digits or '-'"),
    "negative-ids": ({**BASE, "prefix_dict": {**BASE["prefix_dict"], "225": [5, -1, 6, -7]}},
                     "2 candidate id(s) negative or beyond int32 skipped", "id -1 is negative"),
    "beyond-int32": ({**BASE, "prefix_dict": {**BASE["prefix_dict"], "225_6": [7, 2**31, 2**40, 10**30]}},
                     "3 candidate id(s) negative or beyond int32 skipped", "is too large"),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("kind", ["dict", "file"])
def test_rtp_llm_cases_load_with_a_warning_and_strict_refuses_them(tmp_path, kind, case):
    body, warning, refusal = CASES[case]
    tree = load_tree(source(tmp_path, kind, body), vocab_size=49152)
    assert any(warning in w for w in tree.warnings), tree.warnings
    tables = build_tree_tables(tree, 49152)
    assert tables.warnings == tree.warnings
    # whatever was accepted, the decode graph is the seed tree's: skipped ids are not allowed, keys outside the
    # root are never reached, unknown fields change nothing
    assert paths(tables) == SEED_PATHS
    strict_source = source(tmp_path, kind, body)
    if case == "beyond-int32":  # without a vocabulary, ids past int32 but within int64 are not refused by strict
        with pytest.raises(TreeFileError, match="out of range for vocab_size 49152"):
            load_tree(strict_source, vocab_size=49152, strict=True)
        with pytest.raises(TreeFileError, match=refusal):
            load_tree(strict_source, strict=True)
        return
    with pytest.raises(TreeFileError, match=refusal):
        load_tree(strict_source, vocab_size=49152, strict=True)


def test_skipped_ids_keep_the_positions_of_their_neighbours_in_messages():
    body = {**BASE, "prefix_dict": {"225": [-1, 5, 60000]}}
    with pytest.raises(TreeFileError) as excinfo:
        load_tree(body, vocab_size=49152)  # lenient: -1 skipped, but 60000 is past the vocabulary
    assert 'prefix_dict["225"][2]: id 60000 is out of range for vocab_size 49152' in str(excinfo.value)
    assert excinfo.value.total == 1


@pytest.mark.parametrize("sep", ["1", "a1", ""])
def test_digits_in_sep_stay_refused_when_lenient(sep):
    with pytest.raises(TreeFileError, match="sep"):
        load_tree({**BASE, "sep": sep})


def test_malformed_keys_under_the_root_stay_refused_when_lenient():
    with pytest.raises(TreeFileError, match=r"malformed key: part 'x' is not a non-negative integer"):
        load_tree({**BASE, "prefix_dict": {**BASE["prefix_dict"], "225_x": [2]}})


def test_the_scenario_option_strict(tmp_path):
    lenient = {"type": "tree", "tree": CASES["foreign-keys"][0]}
    assert load_scenario(lenient).tree is not None
    with pytest.raises(ValueError, match="key must be '225' or start with '225_'"):
        load_scenario({**lenient, "strict": True})
    extra = {"type": "tree", "tree": CASES["unknown-field"][0]}
    assert load_scenario(extra).tree.ignored_fields == {"version": "2024-01", "meta": {"owner": "x", "n": [1, 2]}}
    with pytest.raises(ValueError, match='unknown top-level field "version"'):
        load_scenario({**extra, "strict": True})


def test_compile_passes_strict_and_keeps_warnings(tokenizer):
    from processors import ScenarioCompiler
    from config import ScenarioError

    compiler = ScenarioCompiler(tokenizer, grammar_worker=None)
    body = {"type": "tree", "tree": CASES["negative-ids"][0]}
    compiled = compiler.prepare_now(body)
    assert any("skipped" in w for w in compiled.constraint.warnings)
    with pytest.raises(ScenarioError, match="id -1 is negative"):
        compiler.prepare_now({**body, "strict": True})


# -- the fast paths agree with the exact ones ----------------------------------------------------------------


def _random_tree(rng: random.Random, sep: str) -> dict:
    vocab = rng.choice([10, 300, 49152])
    start, end = rng.randrange(vocab), rng.randrange(vocab)
    nodes = [[start]]
    for _ in range(rng.randrange(1, 80)):
        nodes.append(rng.choice(nodes) + [rng.randrange(vocab)])
    prefix: dict[str, list[int]] = {}
    for node in nodes:
        if rng.random() < 0.85:
            prefix[sep.join(map(str, node))] = [rng.randrange(vocab) for _ in range(rng.randrange(0, 4))]
    for node in nodes[1:]:
        parent = sep.join(map(str, node[:-1]))
        if parent in prefix:
            prefix[parent].append(node[-1])
            if rng.random() < 0.2:
                prefix[parent].append(end)
    if rng.random() < 0.3:
        prefix[sep.join(map(str, [start + 1, 4]))] = [1]
    return {"start_token_id": start, "end_token_id": end, "sep": sep, "prefix_dict": prefix, "_vocab": vocab}


@pytest.mark.parametrize("seed", range(40))
def test_numpy_scan_and_hashed_build_match_ijson_and_the_string_build(tmp_path, monkeypatch, seed):
    rng = random.Random(seed)
    body = _random_tree(rng, rng.choice(["_", "-", "::", "/", " "]))
    vocab = body.pop("_vocab")
    path = tmp_path / "t.json"
    path.write_text(json.dumps(body, indent=rng.choice([None, 0, 2]), separators=rng.choice([None, (",", ":")])))
    scanned = load_tree(path, vocab_size=vocab)
    monkeypatch.setattr(tree_file, "scan_tree_file", lambda p: None)  # the ijson parser
    streamed = load_tree(path, vocab_size=vocab)
    assert scanned.to_dict() == streamed.to_dict() == {k: v for k, v in body.items()}
    assert scanned.warnings == streamed.warnings
    for tree in (scanned, streamed, load_tree(body, vocab_size=vocab)):
        fast = build_tree_tables(tree, vocab)
        exact = _build_by_strings(tree, np.asarray(tree.offsets), np.asarray(tree.candidates), vocab)
        assert fast.version == exact.version
        assert fast.next_state.tolist() == exact.next_state.tolist() and fast.root == exact.root


@pytest.mark.parametrize("text", [
    '{"start_token_id": 1, "end_token_id": 2, "prefix_dict": {"1": [3], "1_3": [2],}}',
    '{"start_token_id": 1, "end_token_id": 2, "prefix_dict": {"1": [3 4]}}',
    '{"start_token_id": 1, "end_token_id": 2, "prefix_dict": {"1": [03]}}',
    '{"start_token_id": 1, "end_token_id": 2, "prefix_dict": {"1": [3,]}}',
    '{"start_token_id": 1, "end_token_id": 2, "prefix_dict": {"1" [3]}}',
    '{"start_token_id": 1, "end_token_id": 2, "prefix_dict": {"1": [3]}',
    '{"start_token_id": 1, "end_token_id": 2, "prefix_dict": {"1": [3], S: [4]}}',
    '{"start_token_id": 1, "end_token_id": 2, "prefix_dict": {"1": [3]}} x',
    '{"start_token_id": 1, "end_token_id": 2, "prefix_dict": {"1": [--3]}}',
])
def test_invalid_json_is_refused_whichever_parser_reads_it(tmp_path, text):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(TreeFileError, match="invalid JSON|trailing|must be"):
        load_tree(path)
    assert tree_file.scan_tree_file(str(path)) is None  # the numpy scan hands every one of these to ijson


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_scan_reads_a_tree_across_blocks(tmp_path, monkeypatch, threads):
    from processors.kinds.tree.treefile import scan as tree_fast

    monkeypatch.setattr(tree_fast, "SCAN_THREADS", threads)  # blocks read on this many threads
    monkeypatch.setattr(tree_fast, "CHUNK_BYTES", 64)  # many blocks, cut at "]," boundaries
    monkeypatch.setattr(tree_builder, "_BLOB_BLOCK", 40)  # keys hashed in many blocks too
    rng = random.Random(3)
    body = _random_tree(rng, "_")
    vocab = body.pop("_vocab")
    body["zzz_after"] = 1
    path = tmp_path / "t.json"
    path.write_text(json.dumps(body))
    scan = tree_fast.scan_tree_file(str(path))
    assert scan is not None and len(scan.key_blocks) > 3
    tree = load_tree(path, vocab_size=vocab)
    assert tree.to_dict()["prefix_dict"] == body["prefix_dict"]
    assert any('"zzz_after" ignored' in w for w in tree.warnings)
    whole = load_tree({k: v for k, v in body.items() if k != "zzz_after"}, vocab_size=vocab)
    assert build_tree_tables(tree, vocab).version == build_tree_tables(whole, vocab).version


def test_an_inline_tree_is_read_once_and_ids_past_the_vocabulary_still_refused(tokenizer, monkeypatch):
    from config import ScenarioError
    from processors import ScenarioCompiler

    loads = []
    finish = tree_file._TreeBuilder.finish
    monkeypatch.setattr(tree_file._TreeBuilder, "finish", lambda self, *a: loads.append(a) or finish(self, *a))
    compiler = ScenarioCompiler(tokenizer, grammar_worker=None)
    compiled = compiler.prepare_now({"type": "tree", "tree": BASE})
    assert len(loads) == 1 and paths(compiled.constraint) == SEED_PATHS  # the validation's load, reused
    loads.clear()
    big = {**BASE, "prefix_dict": {**BASE["prefix_dict"], "225_6_7": [60000]}}
    with pytest.raises(ScenarioError, match=r'prefix_dict\["225_6_7"\]\[0\]: id 60000 is out of range'):
        compiler.prepare_now({"type": "tree", "tree": big})
    assert len(loads) == 2  # validated without a vocabulary, loaded again for the exact message
    loads.clear()
    key = {**BASE, "prefix_dict": {**BASE["prefix_dict"], "225_60000": [2]}}
    with pytest.raises(ScenarioError, match="token id 60000 in the key is out of range"):
        compiler.prepare_now({"type": "tree", "tree": key})
    strict = compiler.prepare_now({"type": "tree", "tree": BASE, "strict": True})
    assert strict.constraint.version == compiled.constraint.version


@pytest.mark.parametrize("seed", range(30))
def test_item_metrics_settled_leaves_first_equal_the_round_based_reference(seed):
    from processors import tables as tables_module

    rng = random.Random(100 + seed)
    body = _random_tree(rng, "_")
    vocab = body.pop("_vocab")
    tables = build_tree_tables(load_tree(body, vocab_size=vocab), vocab)
    fast, reference = tables_module._item_metrics(tables), _item_metrics_by_rounds(tables)
    assert fast[0].tolist() == reference[0].tolist() and fast[1].tolist() == reference[1].tolist()
    assert fast[2:] == reference[2:]


def test_item_metrics_of_a_label_trie_equal_the_reference(tokenizer):
    from processors import build_label_tables
    from processors import tables as tables_module

    labels = ["red", "red wine", "green", "greenhouse gas", "blue", "blue moon", "blueberry", "black"]
    lt = build_label_tables(labels, tokenizer, eos_token_id=tokenizer.eos_token_id, vocab_size=len(tokenizer))
    fast, reference = tables_module._item_metrics(lt.tables), _item_metrics_by_rounds(lt.tables)
    assert fast[0].tolist() == reference[0].tolist() and fast[1].tolist() == reference[1].tolist()
    assert fast[2:] == reference[2:]
    assert int(fast[1][lt.tables.root]) == len(labels)  # every label is one item below the root


def test_json_depth_of_a_large_prefix_dict_skips_the_walk_but_not_the_depth():
    from config.settings import json_depth

    flat = {str(i): [i, i + 1] for i in range(200)}
    assert json_depth({"tree": {"prefix_dict": flat}}) == 4
    nested = {**flat, "x": [1, [2, [3]]]}
    assert json_depth({"tree": {"prefix_dict": nested}}) == 6  # one nested value: walked, depth counted
    assert json_depth([[1, 2]] * 100) == 2 and json_depth([[{"a": 1}]] * 100) == 3


from processors.tables import _UNSET, _freeze  # noqa: E402 (the reference below)


def _item_metrics_by_rounds(tables) -> tuple[np.ndarray, np.ndarray, bool, int]:
    """The reference: every edge each round until nothing changes (one round per level of the deepest path)."""
    n_states = tables.n_states
    offsets = tables.offsets
    nxt = tables.next_state.astype(np.int64)
    counts = np.diff(offsets)
    nonempty = counts > 0
    starts = offsets[:-1][nonempty]
    to_state = nxt >= 0
    state_of_edge = np.repeat(np.arange(n_states, dtype=np.int64), counts)
    # target values of the special targets
    special_min = np.where(nxt == DONE, 0, 1).astype(np.int64)
    min_rem = np.full(n_states, _UNSET, dtype=np.int64)
    min_rem[~nonempty] = 1
    max_rem = min_rem.copy()
    max_rem[nonempty] = 0
    items = np.zeros(n_states, dtype=np.int64)
    items[~nonempty] = 1
    special_items = (~to_state).astype(np.float64)
    targets = nxt[to_state]
    for _ in range(n_states + 1):
        edge_min = special_min.copy()
        edge_min[to_state] = min_rem[targets]
        edge_min = np.minimum(edge_min + 1, _UNSET)
        new_min = min_rem.copy()
        if starts.size:
            new_min[nonempty] = np.minimum.reduceat(edge_min, starts)
        edge_max = special_min.copy()
        edge_max[to_state] = max_rem[targets]
        new_max = max_rem.copy()
        if starts.size:
            new_max[nonempty] = np.maximum.reduceat(np.minimum(edge_max + 1, _UNSET), starts)
        edge_items = special_items.copy()
        edge_items[to_state] = items[targets]
        new_items = items.copy()
        if starts.size:
            new_items[nonempty] = np.bincount(state_of_edge, weights=edge_items, minlength=n_states)[nonempty].astype(np.int64)
        if np.array_equal(new_min, min_rem) and np.array_equal(new_items, items) and np.array_equal(new_max, max_rem):
            break
        min_rem, items, max_rem = new_min, new_items, new_max
    # uniform: from every state all items are equally far (fixed-depth catalogs); min_remaining is then exact for
    # any subset of items, which lets the item cursor skip its search for a free item that fits
    uniform = bool(np.array_equal(min_rem, max_rem))
    deepest = int(max_rem.max()) if n_states else 1  # the longest way to an end, end token included
    return (_freeze(min_rem.astype(np.int32)), _freeze(np.minimum(items, np.iinfo(np.int32).max).astype(np.int32)),
            uniform, deepest)
