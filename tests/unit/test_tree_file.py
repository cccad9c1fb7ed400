"""Tree file loading: streaming parse, every format rule, and the messages that name the offending key."""

from __future__ import annotations

import json
import logging
import pickle

import numpy as np
import pytest

from processors.kinds.tree.treefile.load import TreeData, TreeFileError, load_tree
from processors.kinds.tree.spec import TreeSpec
from processors.kinds.tree.treefile.load import MAX_REPORTED_PROBLEMS

SEED_TREE = {
    "start_token_id": 225,
    "end_token_id": 2,
    "sep": "_",
    "prefix_dict": {"225": [64000, 64003], "225_64000": [64001], "225_64000_64001": [2], "225_64003": []},
}


def write(tmp_path, text: str, name: str = "tree.json"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def tree_json(**overrides) -> str:
    return json.dumps({**SEED_TREE, **overrides})


def problems_of(excinfo) -> str:
    return str(excinfo.value)


# -- valid trees ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["dict", "file", "spec"])
def test_valid_tree_loads_in_file_order(tmp_path, kind):
    source = {"dict": SEED_TREE, "file": write(tmp_path, tree_json()), "spec": TreeSpec(**SEED_TREE)}[kind]
    tree = load_tree(source, vocab_size=65536)
    assert isinstance(tree, TreeData)
    assert (tree.start_token_id, tree.end_token_id, tree.sep) == (225, 2, "_")
    assert tree.keys == ["225", "225_64000", "225_64000_64001", "225_64003"]
    assert len(tree) == 4
    assert tree.offsets.dtype == np.int64 and tree.candidates.dtype == np.int64
    assert tree.offsets.tolist() == [0, 2, 3, 4, 4]
    assert [(k, c.tolist()) for k, c in tree.items()] == [(k, v) for k, v in SEED_TREE["prefix_dict"].items()]
    assert tree.to_dict() == SEED_TREE
    assert tree.warnings == ()
    assert tree.root_key == "225"


def test_path_as_str_and_pathlike(tmp_path):
    path = write(tmp_path, tree_json())
    assert load_tree(str(path)).keys == load_tree(path).keys


def test_sep_defaults_to_underscore_and_custom_sep(tmp_path):
    body = {k: v for k, v in SEED_TREE.items() if k != "sep"}
    assert load_tree(write(tmp_path, json.dumps(body))).sep == "_"
    custom = {"start_token_id": 7, "end_token_id": 0, "sep": "/", "prefix_dict": {"7": [1], "7/1": [0]}}
    assert load_tree(write(tmp_path, json.dumps(custom), "c.json")).keys == ["7", "7/1"]


def test_top_level_fields_in_any_order(tmp_path):
    text = '{"prefix_dict": {"225": [5], "225_5": [2]}, "sep": "_", "end_token_id": 2, "start_token_id": 225}'
    tree = load_tree(write(tmp_path, text))
    assert tree.start_token_id == 225 and tree.keys == ["225", "225_5"]


def test_missing_root_is_a_warning_not_an_error(tmp_path, caplog):
    body = tree_json(prefix_dict={"225_5": [2]})
    with caplog.at_level(logging.WARNING, logger="processors.kinds.tree.treefile.load"):
        tree = load_tree(write(tmp_path, body))
    expected = "no entry for the root key '225': the first step will force the end token"
    assert tree.warnings == (expected,)
    assert expected in caplog.text


def test_empty_candidate_list_and_empty_prefix_dict_are_allowed(tmp_path):
    tree = load_tree(write(tmp_path, tree_json(prefix_dict={"225": []})))
    assert tree.candidates.size == 0 and tree.offsets.tolist() == [0, 0]
    empty = load_tree({"start_token_id": 1, "end_token_id": 0, "prefix_dict": {}})
    assert len(empty) == 0 and empty.warnings


def test_tree_data_is_read_only_and_picklable():
    tree = load_tree(SEED_TREE)
    with pytest.raises(ValueError):
        tree.candidates[0] = 1
    clone = pickle.loads(pickle.dumps(tree))
    assert clone.to_dict() == SEED_TREE


def test_streaming_uses_ijson_not_json_load(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("tree files must be streamed, not loaded whole")

    monkeypatch.setattr(json, "load", refuse)
    monkeypatch.setattr(json, "loads", refuse)
    assert len(load_tree(write(tmp_path, tree_json()))) == 4


# -- file-level errors ----------------------------------------------------------------------------------------


def test_missing_file():
    with pytest.raises(FileNotFoundError):
        load_tree("/nonexistent/tree.json")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "the file is empty"),
        ("   \n", "invalid JSON: parse error: premature EOF"),
        ("[1, 2]", "the top level must be a JSON object, got an array"),
        ('"tree"', 'the top level must be a JSON object, got string "tree"'),
        ('{"start_token_id": 225,', "invalid JSON"),
        (tree_json() + " trailing", "trailing garbage"),
    ],
)
def test_unreadable_documents(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(TreeFileError) as excinfo:
        load_tree(path)
    assert message in problems_of(excinfo)
    assert str(path) in problems_of(excinfo)


def test_missing_required_fields(tmp_path):
    with pytest.raises(TreeFileError) as excinfo:
        load_tree(write(tmp_path, '{"sep": "_"}'))
    text = problems_of(excinfo)
    for name in ("start_token_id", "end_token_id", "prefix_dict"):
        assert f'missing required field "{name}"' in text
    assert excinfo.value.total == 3


@pytest.mark.parametrize("kind", ["dict", "file"])
def test_unknown_top_level_field(tmp_path, kind):
    body = {**SEED_TREE, "comment": {"nested": [1, 2]}}
    source = body if kind == "dict" else write(tmp_path, json.dumps(body))
    with pytest.raises(TreeFileError, match='unknown top-level field "comment"'):
        load_tree(source, strict=True)


def test_duplicate_top_level_field_in_file(tmp_path):
    text = '{"start_token_id": 225, "start_token_id": 225, "end_token_id": 2, "prefix_dict": {}}'
    with pytest.raises(TreeFileError, match='duplicate top-level field "start_token_id"'):
        load_tree(write(tmp_path, text))


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("3.0", "start_token_id: must be an integer, got number 3.0 (not an integer)"),
        ("true", "start_token_id: must be an integer, got boolean true"),
        ('"225"', 'start_token_id: must be an integer, got string "225"'),
        ("null", "start_token_id: must be an integer, got null"),
        ("[225]", "start_token_id: must be an integer, got an array"),
        ("-1", "start_token_id: id -1 is negative"),
    ],
)
def test_bad_start_token_id(tmp_path, raw, message):
    text = '{"start_token_id": %s, "end_token_id": 2, "prefix_dict": {}}' % raw
    with pytest.raises(TreeFileError) as excinfo:
        load_tree(write(tmp_path, text))
    assert message in problems_of(excinfo)


def test_bad_end_token_id_and_vocab_range(tmp_path):
    with pytest.raises(TreeFileError, match="end_token_id: must be an integer, got number 2.5"):
        load_tree(write(tmp_path, tree_json(end_token_id=2.5)))
    with pytest.raises(TreeFileError) as excinfo:
        load_tree(write(tmp_path, tree_json()), vocab_size=200)
    text = problems_of(excinfo)
    assert "start_token_id: id 225 is out of range for vocab_size 200" in text


@pytest.mark.parametrize(
    ("sep", "message"),
    [("", "sep: must not be empty"), ("1", "must not contain digits"), ("-", "must not contain digits or '-'"),
     (5, "sep: must be a string, got number 5")],
)
def test_bad_sep(sep, message):
    with pytest.raises(TreeFileError, match=message):
        load_tree({**SEED_TREE, "sep": sep}, strict=True)


def test_prefix_dict_must_be_an_object(tmp_path):
    with pytest.raises(TreeFileError, match="prefix_dict: must be an object mapping keys to lists, got an array"):
        load_tree(write(tmp_path, tree_json(prefix_dict=[["225", [1]]])))


# -- key and candidate errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("225_x1", "prefix_dict[\"225_x1\"]: malformed key: part 'x1' is not a non-negative integer"),
        ("225_007", "prefix_dict[\"225_007\"]: malformed key: part '007' is not a canonical non-negative integer"),
        ("225_", "prefix_dict[\"225_\"]: malformed key: part '' is not a non-negative integer"),
        ("225_5__6", "prefix_dict[\"225_5__6\"]: malformed key: part '' is not a non-negative integer"),
        ("225_-3", "prefix_dict[\"225_-3\"]: malformed key: part '-3' is not a non-negative integer"),
        ("225_\u0663", "malformed key: part '\u0663' is not a non-negative integer"),
        ("226_1", "prefix_dict[\"226_1\"]: key must be '225' or start with '225_'"),
        ("2250", "prefix_dict[\"2250\"]: key must be '225' or start with '225_'"),
        ("", "prefix_dict[\"\"]: key must be '225' or start with '225_'"),
    ],
)
@pytest.mark.parametrize("kind", ["dict", "file"])
def test_malformed_keys(tmp_path, kind, key, message):
    body = {**SEED_TREE, "prefix_dict": {"225": [1], key: [2]}}
    source = body if kind == "dict" else write(tmp_path, json.dumps(body))
    with pytest.raises(TreeFileError) as excinfo:
        load_tree(source, strict=True)
    assert message in problems_of(excinfo)
    assert excinfo.value.total == 1


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("[1, 3.0]", 'prefix_dict["225_1"][1]: candidate must be an integer, got number 3.0 (not an integer)'),
        ("[true]", 'prefix_dict["225_1"][0]: candidate must be an integer, got boolean true'),
        ('[1, 2, "3"]', 'prefix_dict["225_1"][2]: candidate must be an integer, got string "3"'),
        ("[null]", 'prefix_dict["225_1"][0]: candidate must be an integer, got null'),
        ("[[1], 2, {}]", 'prefix_dict["225_1"][2]: candidate must be an integer, got an object'),
        ("[5, -4]", 'prefix_dict["225_1"][1]: id -4 is negative'),
        ('[[7, [8]], "x", -4]', 'prefix_dict["225_1"][2]: id -4 is negative'),
        ("[1e3]", 'prefix_dict["225_1"][0]: candidate must be an integer'),
        ("[123456789012345678901234567890]", 'prefix_dict["225_1"][0]: id 123456789012345678901234567890 is too large'),
        ("7", 'prefix_dict["225_1"]: candidates must be a list of integers, got number 7'),
        ('{"a": [1]}', 'prefix_dict["225_1"]: candidates must be a list of integers, got an object'),
        ("null", 'prefix_dict["225_1"]: candidates must be a list of integers, got null'),
    ],
)
def test_bad_candidates_in_file(tmp_path, value, message):
    text = '{"start_token_id": 225, "end_token_id": 2, "prefix_dict": {"225": [1], "225_1": %s, "225_9": [2]}}'
    with pytest.raises(TreeFileError) as excinfo:
        load_tree(write(tmp_path, text % value), strict=True)
    assert message in problems_of(excinfo)


def test_bad_candidates_in_dict_use_the_same_messages():
    body = {**SEED_TREE, "prefix_dict": {"225": [1, 3.0, True, "4", -5], "225_1": "x"}}
    with pytest.raises(TreeFileError) as excinfo:
        load_tree(body, strict=True)
    text = problems_of(excinfo)
    assert 'prefix_dict["225"][1]: candidate must be an integer, got number 3.0 (not an integer)' in text
    assert 'prefix_dict["225"][2]: candidate must be an integer, got boolean true' in text
    assert 'prefix_dict["225"][3]: candidate must be an integer, got string "4"' in text
    assert 'prefix_dict["225"][4]: id -5 is negative' in text
    assert 'prefix_dict["225_1"]: candidates must be a list of integers, got string "x"' in text
    assert excinfo.value.total == 5


def test_vocab_size_applies_to_candidates_and_key_parts():
    body = {"start_token_id": 1, "end_token_id": 0, "prefix_dict": {"1": [5, 100], "1_5": [0], "1_100": [0]}}
    assert len(load_tree(body, vocab_size=101)) == 3
    with pytest.raises(TreeFileError) as excinfo:
        load_tree(body, vocab_size=100)
    text = problems_of(excinfo)
    assert 'prefix_dict["1"][1]: id 100 is out of range for vocab_size 100' in text
    assert 'prefix_dict["1_100"]: token id 100 in the key is out of range for vocab_size 100' in text
    with pytest.raises(TreeFileError, match="end_token_id: id 0 is out of range|start_token_id: id 1 is out of range"):
        load_tree(body, vocab_size=1)
    with pytest.raises(ValueError, match="vocab_size must be a positive integer"):
        load_tree(body, vocab_size=0)


def test_duplicate_keys_in_file_are_detected(tmp_path):
    text = '{"start_token_id": 225, "end_token_id": 2, "prefix_dict": {"225": [1], "225_1": [2], "225": [3]}}'
    with pytest.raises(TreeFileError) as excinfo:
        load_tree(write(tmp_path, text))
    assert 'prefix_dict["225"]: duplicate key (appears 2 times)' in problems_of(excinfo)


def test_all_problems_reported_with_a_cap(tmp_path):
    bad = {f"225_x{i}": [1] for i in range(MAX_REPORTED_PROBLEMS + 15)}
    with pytest.raises(TreeFileError) as excinfo:
        load_tree(write(tmp_path, tree_json(prefix_dict={"225": [1], **bad})))
    error = excinfo.value
    assert error.total == MAX_REPORTED_PROBLEMS + 15
    assert len(error.problems) == MAX_REPORTED_PROBLEMS
    assert f"invalid tree file '{tmp_path / 'tree.json'}': {MAX_REPORTED_PROBLEMS + 15} problems:" in str(error)
    assert "... and 15 more" in str(error)
    assert 'prefix_dict["225_x0"]' in str(error)


def test_many_negative_ids_are_counted_past_the_cap():
    body = {**SEED_TREE, "prefix_dict": {"225": [-1] * 50}}
    with pytest.raises(TreeFileError) as excinfo:
        load_tree(body, strict=True)
    assert excinfo.value.total == 50
    assert 'prefix_dict["225"][19]: id -1 is negative' in str(excinfo.value)


def test_error_is_a_value_error_and_pickles():
    assert issubclass(TreeFileError, ValueError)
    error = TreeFileError(["a", "b"], total=5, source="tree file 'x.json'")
    clone = pickle.loads(pickle.dumps(error))
    assert (clone.problems, clone.total, clone.source, str(clone)) == (["a", "b"], 5, error.source, str(error))
    assert "... and 3 more" in str(clone)
    with pytest.raises(TypeError, match="expects a path, a dict or a TreeSpec"):
        load_tree(42)


def test_is_tree_path_follows_the_spec_rules():
    from processors.kinds.tree.treefile.load import is_tree_path

    tree = {"start_token_id": 1, "end_token_id": 2, "sep": "-", "prefix_dict": {"1": [5, 6], "1-5": [2], "1-6": []}}
    assert is_tree_path(tree, [5, 2])
    assert is_tree_path(tree, [6, 2]), "an empty list allows only the end token"
    assert is_tree_path(tree, [5, 2, 9]), "the path ends at the end token"
    assert not is_tree_path(tree, [5]), "no end token: not a complete path"
    assert not is_tree_path(tree, [7, 2]) and not is_tree_path(tree, [6, 3])
