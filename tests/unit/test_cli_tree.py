"""``cs-tree build`` and ``cs-tree lint`` with the tiny hand-built tokenizer, saved to disk and loaded by path.

Every test runs the real command (``cli.tree.main``) on real files and checks the files it writes with the
service's own loader (``processors.kinds.tree.treefile.load.load_tree``) and the spec-level path oracle (``processors.kinds.tree.treefile.load.is_tree_path``).
"""

from __future__ import annotations

import json
import os

import pytest

from cli.tree import main
from processors.kinds.tree.treefile.load import is_tree_path, load_tree
from processors.testing import decode, tid

EOS_ID = 2
ROOT = tid("\n")


@pytest.fixture(scope="module")
def tok_dir(tok, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_tokenizer")
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture
def run(tok_dir, capsys):
    """Run ``cs-tree`` with the tiny tokenizer; returns ``(exit_code, stdout, stderr)``."""

    def run_(*args: str, tokenizer: bool = True, start: bool = True):
        argv = [str(a) for a in args]
        if tokenizer:
            argv += ["--tokenizer", tok_dir]
        if start and argv[0] == "build":
            argv += ["--start-token", str(ROOT)]
        code = main(argv)
        out, err = capsys.readouterr()
        assert "Traceback" not in err
        return code, out, err

    return run_


def write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def paths_of(tree: dict) -> list[list[int]]:
    """Every complete path of a tree dict by the spec rules (a missing or empty state allows only the end)."""
    sep, end, pd = tree["sep"], tree["end_token_id"], tree["prefix_dict"]
    out, stack = [], [(str(tree["start_token_id"]), [])]
    while stack:
        key, ids = stack.pop()
        for token in pd.get(key) or [end]:
            if token == end:
                out.append(ids + [end])
            else:
                stack.append((f"{key}{sep}{token}", ids + [token]))
    return out


def assert_answers(tok, tree_file: str, answers: list[str]) -> dict:
    """The tree holds exactly ``answers``: each one's path is in it and decodes back, and nothing else is."""
    tree = load_tree(tree_file, vocab_size=len(tok)).to_dict()
    assert (tree["start_token_id"], tree["end_token_id"]) == (ROOT, EOS_ID)
    for answer in answers:
        ids = tok.encode(" " + answer, add_special_tokens=False)
        assert is_tree_path(tree, ids + [EOS_ID]), answer
        assert decode(tok, ids) == " " + answer
    decoded = sorted(decode(tok, path[:-1]) for path in paths_of(tree))
    assert decoded == sorted(" " + a for a in answers)
    return tree


# -- build: label files ---------------------------------------------------------------------------------------


def test_build_labels_adds_every_encodable_label_and_reports_the_rest(tmp_path, run, tok):
    src = write(tmp_path, "labels.txt", "yes\nno\n\nNew York\nNew York City\n  yes  \nFoo\n")
    out = tmp_path / "tree.json"
    code, stdout, _ = run("build", src, "-o", out)
    assert code == 0
    assert_answers(tok, str(out), ["yes", "no", "New York", "New York City"])
    assert "added: 4 answers" in stdout
    assert "line 6: 'yes' (first at line 1)" in stdout  # stripped, then a duplicate
    assert "line 7: 'Foo'" in stdout and "does not survive a tokenizer round trip" in stdout
    assert "(1 blank skipped)" in stdout


def test_build_json_report_and_layout_match_the_service_builder(tmp_path, run, tok):
    from deployments.examples import build_phrase_tree

    labels = ["New York City", "New York", "yes", "no", "Sports"]
    src = write(tmp_path, "labels.txt", "\n".join(labels) + "\n")
    out = tmp_path / "tree.json"
    code, stdout, _ = run("build", src, "-o", out, "--json")
    assert code == 0
    report = json.loads(stdout)
    assert report["added"] == 5 and report["written"] and report["unencodable"] == [] and report["duplicates"] == []
    assert report["keys"] == len(json.loads(out.read_text())["prefix_dict"])
    assert json.loads(out.read_text()) == build_phrase_tree(tok, labels, root=ROOT, end=EOS_ID)


def test_label_containing_the_end_token_is_unencodable(tmp_path, run):
    src = write(tmp_path, "labels.txt", "yes\n<eos>\n")
    code, stdout, _ = run("build", src, "-o", tmp_path / "t.json", "--json")
    assert code == 0
    (bad,) = json.loads(stdout)["unencodable"]
    assert bad["text"] == "<eos>" and "contain the end token 2" in bad["reason"]


def test_start_and_end_tokens_by_text_and_custom_sep(tmp_path, run, tok):
    src = write(tmp_path, "labels.txt", "yes\nno\n")
    out = tmp_path / "t.json"
    code, _, _ = run("build", src, "-o", out, "--start-token", "Ċ", "--end-token", "!", "--sep", ":", start=False)
    assert code == 0
    tree = json.loads(out.read_text())
    assert (tree["start_token_id"], tree["end_token_id"], tree["sep"]) == (ROOT, tid("!"), ":")
    assert is_tree_path(tree, [tid(" yes"), tid("!")]) and f"{ROOT}:{tid(' no')}" in tree["prefix_dict"]


def test_nothing_encodable_fails_without_writing(tmp_path, run):
    src = write(tmp_path, "labels.txt", "Foo\nBar\n")
    out = tmp_path / "t.json"
    code, stdout, err = run("build", src, "-o", out)
    assert code == 1 and not out.exists()
    assert "could not encode: 2" in stdout and "nothing could be encoded" in err
    assert os.listdir(tmp_path) == ["labels.txt"]  # no temporary file left behind


def test_strict_refuses_any_unencodable_label_and_keeps_the_old_file(tmp_path, run):
    src = write(tmp_path, "labels.txt", "yes\nFoo\n")
    out = tmp_path / "t.json"
    out.write_text("old")
    code, _, err = run("build", src, "-o", out, "--strict")
    assert code == 1 and out.read_text() == "old" and "--strict" in err
    code, _, _ = run("build", src, "-o", out)
    assert code == 0 and load_tree(str(out)).keys == [str(ROOT), f"{ROOT}_{tid(' yes')}"]
    assert sorted(os.listdir(tmp_path)) == ["labels.txt", "t.json"]


# -- build: CSV -----------------------------------------------------------------------------------------------


def test_csv_column_by_name_and_index(tmp_path, run, tok):
    src = write(tmp_path, "data.csv", 'id,label,note\n1,yes,a\n2,"New York",b\n3,,c\n4\n5,no,"x, y"\n')
    for column in ("label", "1"):
        out = tmp_path / f"t{column}.json"
        code, stdout, _ = run("build", src, "-o", out, "--column", column)
        assert code == 0, stdout
        assert_answers(tok, str(out), ["yes", "New York", "no"])
        assert "line 5: no column" in stdout  # the short row is reported, not silently dropped


def test_csv_without_header_and_tsv(tmp_path, run, tok):
    src = write(tmp_path, "data.csv", "yes,1\nno,2\n")
    out = tmp_path / "t.json"
    assert run("build", src, "-o", out, "--column", "0", "--no-header")[0] == 0
    assert_answers(tok, str(out), ["yes", "no"])
    tsv = write(tmp_path, "data.tsv", "label\tn\nNew York\t1\nyes\t2\n")
    assert run("build", tsv, "-o", out, "--column", "label")[0] == 0
    assert_answers(tok, str(out), ["New York", "yes"])


@pytest.mark.parametrize(
    "text, args, message",
    [
        ("a,b\n1,2\n", [], "has several columns ('a', 'b'); choose one with --column"),
        ("a,b\n1,2\n", ["--column", "c"], "no such column in the header"),
        ("a,b\n1,2\n", ["--column", "5"], "has only 2 columns"),
        ("a,b\n1,2\n", ["--column", "a", "--no-header"], "names a column, but --no-header"),
        ("a,b\nx\ny\n", ["--column", "b"], "column 'b' of"),
        ("a\n" + "x" * 200_000 + "\n", ["--column", "a"], "unreadable CSV: field larger than field limit"),
        ("a,b\n1,2\n", ["--column", "a", "--delimiter", ";;"], "--delimiter must be one character"),
    ],
)
def test_csv_errors_are_one_line_messages(tmp_path, run, text, args, message):
    src = write(tmp_path, "data.csv", text)
    code, _, err = run("build", src, "-o", tmp_path / "t.json", *args)
    assert code == 2 and message in err and err.startswith("cs-tree: error:")


# -- build: taxonomy ------------------------------------------------------------------------------------------


def test_taxonomy_adds_each_path_and_the_levels_it_implies(tmp_path, run, tok):
    src = write(tmp_path, "tax.txt", "Technology > AI > NLP\nTechnology>AI\nSports\nTechnology > > AI\nSports\n")
    out = tmp_path / "t.json"
    code, stdout, _ = run("build", src, "-o", out, "--format", "taxonomy", "--json")
    assert code == 0
    report = json.loads(stdout)
    tree = assert_answers(tok, str(out), ["Technology", "Technology > AI", "Technology > AI > NLP", "Sports"])
    # every prefix of a path's text is a prefix of its ids: the coarser answers are on the way to the finer ones
    nlp = tok.encode(" Technology > AI > NLP", add_special_tokens=False)
    assert nlp[:4] == tok.encode(" Technology > AI", add_special_tokens=False)
    assert tree["prefix_dict"]["_".join(map(str, [ROOT] + nlp[:4]))] == [EOS_ID, tid(" >")]
    assert report["implied"] == 1  # "Technology" (line 2 writes "Technology > AI" itself)
    assert [d["where"] for d in report["duplicates"]] == ["line 5"]
    assert report["rejected"] == [{"where": "line 4", "reason": "empty level in 'Technology > > AI'"}]


def test_taxonomy_full_paths_only_and_custom_separators(tmp_path, run, tok):
    src = write(tmp_path, "tax.txt", "Technology/AI/NLP\nSports\n")
    out = tmp_path / "t.json"
    args = ["--format", "taxonomy", "--level-sep", "/", "--join", " > "]
    assert run("build", src, "-o", out, *args, "--full-paths-only")[0] == 0
    assert_answers(tok, str(out), ["Technology > AI > NLP", "Sports"])
    assert run("build", src, "-o", out, *args)[0] == 0
    assert_answers(tok, str(out), ["Technology", "Technology > AI", "Technology > AI > NLP", "Sports"])


# -- build: user errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing-input", "input file"),
        ("empty-input", "the file is empty"),
        ("blank-input", "no non-blank entries"),
        ("missing-tokenizer", "tokenizer path"),
        ("no-chat-template", "--start-token: no default for this tokenizer (the tokenizer has no chat template)"),
        ("bad-sep", "--sep:"),
        ("missing-out-dir", "output directory"),
        ("csv-flag-on-labels", "apply to CSV input only"),
        ("unknown-token", "neither a token id nor a token"),
        ("id-out-of-vocab", "outside the vocabulary (size 35)"),
        ("not-utf8", "is not utf-8-sig text"),
    ],
)
def test_build_user_errors(tmp_path, run, case, message):
    labels = write(tmp_path, "labels.txt", "yes\n")
    out = str(tmp_path / "t.json")
    argv, kw = ["build", labels, "-o", out], {}
    if case == "missing-input":
        argv[1] = str(tmp_path / "nope.txt")
    elif case == "empty-input":
        argv[1] = write(tmp_path, "empty.txt", "")
    elif case == "blank-input":
        argv[1] = write(tmp_path, "blank.txt", "\n  \n")
    elif case == "missing-tokenizer":
        argv += ["--tokenizer", str(tmp_path / "no-such-dir")]
        kw["tokenizer"] = False
    elif case == "no-chat-template":
        kw["start"] = False
    elif case == "bad-sep":
        argv += ["--sep", "-"]
    elif case == "missing-out-dir":
        argv[3] = str(tmp_path / "no" / "t.json")
    elif case == "csv-flag-on-labels":
        argv += ["--column", "0"]
    elif case == "unknown-token":
        argv += ["--end-token", "<nope>"]
    elif case == "id-out-of-vocab":
        argv += ["--end-token", "35"]
    elif case == "not-utf8":
        (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
        argv[1] = str(tmp_path / "latin1.txt")
    code, stdout, err = run(*argv, **kw)
    assert code == 2 and message in err and stdout == ""
    assert not os.path.exists(out)


def test_help_and_usage_errors(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0 and "{build,lint}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["build", "labels.txt"])  # -o is required
    assert exc.value.code == 2 and "-o/--output" in capsys.readouterr().err


# -- lint -----------------------------------------------------------------------------------------------------


def tree_file(tmp_path, prefix_dict: dict, name: str = "tree.json", **fields) -> str:
    body = {"start_token_id": ROOT, "end_token_id": EOS_ID, "sep": "_", "prefix_dict": prefix_dict, **fields}
    return write(tmp_path, name, json.dumps(body))


def lint_json(run, path: str, *args: str) -> tuple[int, dict]:
    code, stdout, _ = run("lint", path, "--json", *args)
    return code, json.loads(stdout)


def test_lint_clean_built_tree_with_a_decoded_sample(tmp_path, run):
    src = write(tmp_path, "labels.txt", "yes\nno\nNew York\nNew York City\nSports\n")
    out = str(tmp_path / "t.json")
    assert run("build", src, "-o", out)[0] == 0
    code, stdout, _ = run("lint", out, "--sample", "3")
    assert code == 0 and stdout.rstrip().endswith("clean") and "sample: 3 of 5 paths (seed 0)" in stdout
    code, report = lint_json(run, out, "--sample", "10")
    assert code == 0 and report["ok"] and report["errors"] == [] and report["warnings"] == []
    assert report["stats"]["paths"] == 5 and report["stats"]["reachable"] == report["stats"]["keys"] == 7
    assert sorted(p["text"] for p in report["sample"]) == sorted([" yes", " no", " New York", " New York City", " Sports"])
    assert all(p["ids"][-1] == EOS_ID for p in report["sample"])


def test_missing_and_empty_states_are_valid_path_ends_not_dead_ends(tmp_path, run):
    y, n, ny = tid(" yes"), tid(" no"), tid(" New")
    # " yes" leads to a missing state, " no" to an empty list, " New" to " York" then a missing state
    path = tree_file(tmp_path, {str(ROOT): [y, n, ny], f"{ROOT}_{n}": [], f"{ROOT}_{ny}": [tid(" York")]})
    code, report = lint_json(run, path)
    assert code == 0 and report["ok"] and report["errors"] == []
    assert sorted(p["ids"] for p in report["sample"]) == sorted([[y, EOS_ID], [n, EOS_ID], [ny, tid(" York"), EOS_ID]])


def test_lint_sample_is_seeded(tmp_path, run):
    src = write(tmp_path, "labels.txt", "New\nNew York\nyes\nno\nSports\nPolitics\nNew York City\n")
    out = str(tmp_path / "t.json")
    assert run("build", src, "-o", out)[0] == 0

    def sample(seed: int) -> list[str]:
        return [p["text"] for p in lint_json(run, out, "--sample", "3", "--seed", str(seed))[1]["sample"]]

    first = sample(1)
    assert len(first) == 3 and len(set(first)) == 3 and sample(1) == first
    assert len({tuple(sample(seed)) for seed in range(8)}) > 1  # the seed does choose the sample
    assert lint_json(run, out, "--sample", "0")[1]["sample"] == []


BROKEN = {
    # code: (prefix_dict, extra top-level fields, a fragment of the message)
    "missing-root": ({f"{ROOT}_18": [EOS_ID]}, {}, "no entry for the root key"),
    "out-of-vocab": ({str(ROOT): [18, 35]}, {}, "id 35 is out of range for vocab_size 35"),
    "unreachable": ({str(ROOT): [18], f"{ROOT}_19": [EOS_ID]}, {}, 'does not list token 19'),
    "end-unreachable": ({str(ROOT): [18], f"{ROOT}_18": [99]}, {}, "the end token cannot be reached"),
    "bad-key": ({str(ROOT): [18], f"{ROOT}_x": [EOS_ID]}, {}, "malformed key"),
    "invalid-tree": ({str(ROOT): ["18"]}, {}, "candidate must be an integer"),
}


@pytest.mark.parametrize("code_name", sorted(BROKEN))
def test_lint_detects_each_error_class(tmp_path, run, code_name):
    prefix_dict, extra, fragment = BROKEN[code_name]
    path = tree_file(tmp_path, prefix_dict, **extra)
    code, report = lint_json(run, path)
    assert code == 1 and not report["ok"]
    assert code_name in report["counts"]["errors"]
    assert any(e["code"] == code_name and fragment in e["message"] for e in report["errors"]), report["errors"]
    code, stdout, _ = run("lint", path)
    assert code == 1 and f"[{code_name}]" in stdout


def test_lint_unreachable_reasons_and_text_layout(tmp_path, run):
    y = tid(" yes")
    pd = {str(ROOT): [y], f"{ROOT}_{y}": [EOS_ID], f"{ROOT}_{y}_{EOS_ID}": [5], f"{ROOT}_7_8": [EOS_ID]}
    code, stdout, _ = run("lint", tree_file(tmp_path, pd))
    assert code == 1
    assert f'prefix_dict["{ROOT}_{y}_{EOS_ID}"]: no path from the root reaches it: its path continues after the end' in stdout
    assert f'there is no key "{ROOT}_7"' in stdout
    errors = stdout[stdout.index("errors:"):stdout.index("warnings:")]
    assert "[unreachable]" in errors and stdout.rstrip().endswith("2 errors, 0 warnings")


def test_lint_duplicate_keys_and_bad_json(tmp_path, run):
    dup = write(tmp_path, "dup.json", '{"start_token_id": 15, "end_token_id": 2, "prefix_dict": {"15": [18], "15": [19]}}')
    code, report = lint_json(run, dup)
    assert code == 1 and report["counts"]["errors"] == {"duplicate-key": 1}
    for name, text in (("bad.json", '{"start_token_id": 15,'), ("empty.json", "")):
        code, report = lint_json(run, write(tmp_path, name, text))
        assert code == 1 and "invalid-tree" in report["counts"]["errors"]


def test_lint_reports_key_problems_hidden_behind_a_bad_start_id(tmp_path, run):
    # the loader skips key checks when the start id is invalid; lint loads again without the vocabulary
    path = tree_file(tmp_path, {"99": [18], "99_x": [EOS_ID]}, start_token_id=99)
    code, report = lint_json(run, path)
    assert code == 1 and report["counts"]["errors"] == {"out-of-vocab": 1, "bad-key": 1}
    assert report["stats"] == {"vocab_size": 35}


def test_lint_warnings_do_not_fail(tmp_path, run):
    y = tid(" yes")
    pd = {str(ROOT): [y, y, 0], f"{ROOT}_{y}": [tid(" no"), EOS_ID]}
    code, report = lint_json(run, tree_file(tmp_path, pd), "--max-new-tokens", "2")
    assert code == 0 and report["ok"]
    assert set(report["counts"]["warnings"]) == {"duplicate-candidate", "special-token", "long-path"}
    assert report["counts"]["warnings"]["long-path"] == 1  # [" yes", " no", end] is 3 tokens


def test_lint_user_errors(tmp_path, run):
    code, _, err = run("lint", str(tmp_path / "nope.json"))
    assert code == 2 and "tree file" in err and "does not exist" in err
    code, _, err = run("lint", str(tmp_path))
    assert code == 2 and "is a directory" in err


def test_progress_is_off_when_stderr_is_not_a_terminal(tmp_path, run):
    src = write(tmp_path, "labels.txt", "yes\n" * 50 + "no\n")
    code, _, err = run("build", src, "-o", tmp_path / "t.json")
    assert code == 0 and err == ""  # pytest's captured stderr is not a TTY: no bar, nothing else either
