"""``cs-tree`` with the default model's tokenizer: build from labels, CSV and a taxonomy, lint, and the console script.

The command loads the default tokenizer itself (no ``--tokenizer``); the ``tokenizer`` fixture is the same
tokenizer, used here as the oracle: every answer's ids must be a path of the written tree (``processors.kinds.tree.treefile.load.is_tree_path``),
decode back to the answer, and walk the tables the service compiles from the file.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from cli.tree import main
from processors.kinds.tree.treefile.load import is_tree_path, load_tree
from processors.scenarios import load_scenario
from deployments.examples import EXAMPLE_TOPICS, build_phrase_tree, chat_root_token_id
from processors import DONE, compile_scenario

CS_TREE = str(Path(sys.executable).parent / "cs-tree")

LABELS = [
    "positive", "negative", "neutral", "New York", "New York City", "naïve café", "🎉 party", "e-mail",
    "C++", "don't know", "multi  space", "tab\tseparated", "ÜBER", "42",
]


@pytest.fixture
def run(capsys):
    def run_(*args) -> tuple[int, str, str]:
        code = main([str(a) for a in args])
        out, err = capsys.readouterr()
        assert "Traceback" not in err
        return code, out, err

    return run_


def check_tree(tokenizer, path: str, answers: list[str]) -> dict:
    """Every answer is a path of the tree, decodes back, and is accepted by the compiled tables; nothing else is."""
    eos = tokenizer.eos_token_id
    tree = load_tree(path, vocab_size=len(tokenizer)).to_dict()
    assert tree["start_token_id"] == chat_root_token_id(tokenizer) and tree["end_token_id"] == eos
    tables = compile_scenario(load_scenario({"type": "tree", "path": path}), tokenizer).constraint
    for answer in answers:
        ids = tokenizer.encode(" " + answer, add_special_tokens=False)
        assert is_tree_path(tree, ids + [eos]), answer
        assert tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) == " " + answer
        state = tables.root
        for token in ids + [eos]:
            assert token in tables.allowed(state).tolist(), (answer, token)
            state = tables.step(state, token)
        assert state == DONE
    return tree


def lint(run, path: str, *args) -> tuple[int, dict]:
    code, out, _ = run("lint", path, "--json", *args)
    return code, json.loads(out)


def assert_clean_with_exactly(run, path: str, answers: list[str]) -> None:
    code, report = lint(run, path, "--sample", "1000")
    assert code == 0 and report["ok"] and report["errors"] == [] and report["warnings"] == [], report
    # lint counts each complete path once: as many paths as answers, and every sampled path is an answer
    assert report["stats"]["paths"] == len(answers)
    assert sorted(p["text"] for p in report["sample"]) == sorted(" " + a for a in answers)


def test_build_from_label_file(tmp_path, run, tokenizer):
    src = tmp_path / "labels.txt"
    src.write_text("\n".join(LABELS + ["positive", "", "<|im_end|>"]) + "\n", encoding="utf-8")
    out = str(tmp_path / "labels.json")
    code, stdout, _ = run("build", src, "-o", out, "--json", "--quiet")
    assert code == 0
    report = json.loads(stdout)
    assert report["added"] == len(LABELS) and report["written"] and report["blank"] == 1
    assert report["duplicates"] == [{"where": f"line {len(LABELS) + 1}", "text": "positive", "first": "line 1"}]
    (bad,) = report["unencodable"]
    assert bad["text"] == "<|im_end|>" and "end token 2" in bad["reason"]
    check_tree(tokenizer, out, LABELS)
    assert_clean_with_exactly(run, out, LABELS)


def test_build_from_csv_column(tmp_path, run, tokenizer):
    src = tmp_path / "topics.csv"
    src.write_text('id,topic,weight\n1,weather forecast,2\n2,"sports, results",1\n3,stock market update,1\n'
                   '4,"quoted ""news""",1\n5,,0\n', encoding="utf-8")
    out = str(tmp_path / "topics.json")
    code, stdout, _ = run("build", src, "-o", out, "--column", "topic", "-q")
    assert code == 0 and "added: 4 answers" in stdout
    answers = ["weather forecast", "sports, results", "stock market update", 'quoted "news"']
    check_tree(tokenizer, out, answers)
    assert_clean_with_exactly(run, out, answers)


def test_build_from_taxonomy(tmp_path, run, tokenizer):
    src = tmp_path / "taxonomy.txt"
    src.write_text("Technology > AI > NLP\nTechnology > AI > Vision\nTechnology > Hardware\nSports > Football\n"
                   "Science\n", encoding="utf-8")
    out = str(tmp_path / "taxonomy.json")
    code, stdout, _ = run("build", src, "-o", out, "--format", "taxonomy", "--json", "-q")
    assert code == 0
    report = json.loads(stdout)
    answers = ["Technology", "Technology > AI", "Technology > AI > NLP", "Technology > AI > Vision",
               "Technology > Hardware", "Sports", "Sports > Football", "Science"]
    assert report["added"] == len(answers) and report["implied"] == 3 and report["read"] == 5
    check_tree(tokenizer, out, answers)
    assert_clean_with_exactly(run, out, answers)
    # a coarser level is a token prefix of the finer one here, so the model may stop at either
    tree = json.loads(Path(out).read_text())
    ai = tokenizer.encode(" Technology > AI", add_special_tokens=False)
    key = "_".join(map(str, [tree["start_token_id"]] + ai))
    assert tokenizer.eos_token_id in tree["prefix_dict"][key] and len(tree["prefix_dict"][key]) == 2

    code, _, _ = run("build", src, "-o", out, "--format", "taxonomy", "--full-paths-only", "-q")
    assert code == 0
    check_tree(tokenizer, out, ["Technology > AI > NLP", "Technology > AI > Vision", "Technology > Hardware",
                                "Sports > Football", "Science"])


def test_build_matches_the_example_tree_of_the_service(tmp_path, run, tokenizer):
    src = tmp_path / "topics.txt"
    src.write_text("\n".join(EXAMPLE_TOPICS) + "\n", encoding="utf-8")
    out = tmp_path / "topics.json"
    assert run("build", src, "-o", out, "-q")[0] == 0
    root = chat_root_token_id(tokenizer)
    assert json.loads(out.read_text()) == build_phrase_tree(tokenizer, EXAMPLE_TOPICS, root=root,
                                                            end=tokenizer.eos_token_id)


@pytest.fixture
def built(tmp_path, run, tokenizer) -> dict:
    src = tmp_path / "labels.txt"
    src.write_text("positive\nnegative\nNew York\nNew York City\n", encoding="utf-8")
    out = tmp_path / "built.json"
    assert run("build", src, "-o", out, "-q")[0] == 0
    return json.loads(out.read_text())


def _broken(tree: dict, defect: str, vocab: int) -> str | dict:
    pd, root, end = dict(tree["prefix_dict"]), str(tree["start_token_id"]), tree["end_token_id"]
    first = pd[root][0]
    if defect == "missing-root":
        del pd[root]
    elif defect == "out-of-vocab":
        pd[root] = pd[root] + [vocab + 5]
    elif defect == "unreachable":
        pd[f"{root}_{first}_{first}"] = [end]  # the state after `first` lists only the end token
    elif defect == "end-unreachable":
        pd[f"{root}_{first}"] = [vocab]  # the only way on cannot be emitted
    elif defect == "bad-key":
        pd[f"{root}__{first}"] = [end]
    elif defect == "duplicate-key":
        body = json.dumps({**tree, "prefix_dict": pd})
        return body[:-2] + f', "{root}": [{end}]}}}}'
    return {**tree, "prefix_dict": pd}


@pytest.mark.parametrize("defect", ["missing-root", "out-of-vocab", "unreachable", "end-unreachable", "bad-key",
                                    "duplicate-key"])
def test_lint_detects_each_defect_in_a_built_tree(tmp_path, run, tokenizer, built, defect):
    body = _broken(built, defect, len(tokenizer))
    path = tmp_path / f"{defect}.json"
    path.write_text(body if isinstance(body, str) else json.dumps(body), encoding="utf-8")
    code, report = lint(run, str(path))
    assert code == 1 and not report["ok"] and defect in report["counts"]["errors"], report
    code, out, _ = run("lint", path, "-q")
    assert code == 1 and f"[{defect}]" in out


def test_console_script(tmp_path):
    """The installed entry point: help, a real build and lint, and a user error without a traceback."""
    helped = subprocess.run([CS_TREE, "--help"], capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0 and "usage: cs-tree" in helped.stdout and "{build,lint}" in helped.stdout
    src = tmp_path / "labels.txt"
    src.write_text("positive\nnegative\nneutral\n", encoding="utf-8")
    out = tmp_path / "tree.json"
    built = subprocess.run([CS_TREE, "build", str(src), "-o", str(out)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    assert "added: 3 answers" in built.stdout and f"wrote {out}" in built.stdout
    assert len(load_tree(str(out))) == 4
    linted = subprocess.run([CS_TREE, "lint", str(out), "--sample", "3"], capture_output=True, text=True, timeout=300)
    assert linted.returncode == 0 and linted.stdout.rstrip().endswith("clean")
    assert "' positive'" in linted.stdout
    failed = subprocess.run([CS_TREE, "build", str(tmp_path / "missing.txt"), "-o", str(out)],
                            capture_output=True, text=True, timeout=120)
    assert failed.returncode == 2 and "cs-tree: error: input file" in failed.stderr
    assert "Traceback" not in failed.stderr


def _stderr_on_a_tty(args: list[str], cwd: str) -> tuple[int, str]:
    """Run ``args`` with stderr on a pseudo-terminal (stdout captured apart); return (exit code, terminal text)."""
    leader, follower = pty.openpty()
    # a new pty is 0 columns wide and tqdm would draw an empty bar: give it a real size
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=follower, stdin=subprocess.DEVNULL, cwd=cwd)
    os.close(follower)
    chunks = []
    while True:
        ready, _, _ = select.select([leader], [], [], 300)
        if not ready:
            proc.kill()
            break
        try:
            data = os.read(leader, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(leader)
    return proc.wait(timeout=60), b"".join(chunks).decode("utf-8", "replace")


def test_progress_bars_on_a_terminal_only_without_quiet(tmp_path):
    src = tmp_path / "labels.txt"
    src.write_text("".join(f"label number {i}\n" for i in range(300)), encoding="utf-8")
    out = str(tmp_path / "tree.json")
    code, shown = _stderr_on_a_tty([CS_TREE, "build", str(src), "-o", out], str(tmp_path))
    assert code == 0 and "tokenizing" in shown and "label" in shown
    code, shown = _stderr_on_a_tty([CS_TREE, "lint", out], str(tmp_path))
    assert code == 0 and "walking" in shown
    code, shown = _stderr_on_a_tty([CS_TREE, "build", str(src), "-o", out, "--quiet"], str(tmp_path))
    assert code == 0 and "tokenizing" not in shown and "walking" not in shown
