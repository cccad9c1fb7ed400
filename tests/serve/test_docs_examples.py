"""The filter example of docs/scenarios.md ("Item metadata and filters"), run from the page's own text against the
shared app (2 model replicas, the real model): its build script writes the catalog files, its console session runs
in one ``bash`` (``cs-admin`` and ``curl`` as printed, ``CS_URL`` and ``ADMIN_TOKEN`` set to the app's) and each
command's output must be what the page prints (``...`` stands for any text; a printed line that goes on in the next,
indented by one space, is one line), then the openai client's block prints what the page says. Every output item
is also checked against the catalog it was served from: an item of that version whose metadata passes the request's
filter and the catalog's default filter (``item_checks.filter_passes``, written apart from the code under test)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from item_checks import filter_passes
from serve_app import ADMIN_TOKEN

pytestmark = pytest.mark.serve

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "scenarios.md"
SECTION = "### Item metadata and filters"
MARK = "<<<docs-example-command-done>>>"


def _section() -> str:
    text = PAGE.read_text(encoding="utf-8")
    start = text.index(SECTION)
    end = text.find("\n### ", start + len(SECTION))
    return text[start:] if end < 0 else text[start:end]


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```$", text, re.DOTALL | re.MULTILINE)


def _session(block: str) -> list[tuple[str, str]]:
    """``(command, printed output)`` of each command of a console block: a line starting with ``$ `` starts a
    command, which goes on while a single quote is open; the lines up to the next command are its output."""
    out: list[tuple[str, list[str]]] = []
    for line in block.splitlines():
        if out and out[-1][0].count("'") % 2:  # a quoted argument goes on
            out[-1] = (out[-1][0] + "\n" + line, out[-1][1])
        elif line.startswith("$ "):
            out.append((line[2:], []))
        else:
            assert out, f"output before any command: {line!r}"
            out[-1][1].append(line)
    return [(command, "\n".join(lines)) for command, lines in out]


def _pattern(printed: str) -> re.Pattern:
    """What an output must be: ``printed`` with each ``...`` any text and each wrap (a newline, then one space) an
    optional space."""
    parts = re.split(r"(\.\.\.|\n )", printed)
    return re.compile("".join(".*?" if p == "..." else " ?" if p == "\n " else re.escape(p) for p in parts),
                      re.DOTALL)


def _run_session(commands: list[str], cwd: Path, env: dict) -> list[str]:
    script = "".join(f"{command}\nprintf '\\n{MARK}\\n'\n" for command in commands)
    done = subprocess.run(["bash", "-c", script], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    outputs = done.stdout.split(f"\n{MARK}\n")
    assert len(outputs) == len(commands) + 1, (done.stdout[-2000:], done.stderr[-2000:])
    return [o.removesuffix("\n") for o in outputs[:-1]]


def _lines(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_the_filter_example_runs_as_printed(serve_app, tokenizer, tmp_path):
    section = _section()
    build, openai_block = _blocks(section, "python")
    (session,) = _blocks(section, "console")
    env = {**os.environ, "CS_URL": serve_app.url, "ADMIN_TOKEN": ADMIN_TOKEN, "PYTHONPATH": str(ROOT)}
    env.pop("CS_TOKEN", None)
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")  # the session sources .venv/bin/activate (the repository's)
    done = subprocess.run([sys.executable, "-c", build], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]

    steps = _session(session)
    assert len(steps) >= 10, steps
    outputs = _run_session([command for command, _ in steps], tmp_path, env)
    wrong = [f"$ {command}\n--- printed:\n{printed}\n--- got:\n{got}"
             for (command, printed), got in zip(steps, outputs) if not _pattern(printed).fullmatch(got)]

    # every output item: an item of the version that served it, passing the request's filter and the default
    lines = _lines(tmp_path / "shop.jsonl")
    default = lines[0]["filter"]
    first = {tuple(item["ids"]): item["metadata"] for item in lines[1:]}
    added = {tuple(item["ids"]): item["metadata"] for item in _lines(tmp_path / "shop-add.jsonl")}
    removed = {tuple(ids) for ids in _lines(tmp_path / "shop-remove.jsonl")}
    versions = {1: first, 2: {k: v for k, v in first.items() if k not in removed} | added}
    served = 0
    for (command, _), got in zip(steps, outputs):
        body = re.search(r"-d '(.*)'", command, re.DOTALL)
        if body is None or "/v1/generate" not in command or '"outputs"' not in got:
            continue
        request, answer = json.loads(body.group(1)), json.loads(got)
        items = versions[answer["version"]]
        for out in answer["outputs"]:
            ids = tuple(out["token_ids"][:-1]) if out["token_ids"][-1] == tokenizer.eos_token_id else tuple(
                out["token_ids"])
            assert ids in items, (command, out)
            assert filter_passes(items[ids], request["filter"]) and filter_passes(items[ids], default), (command, out)
            served += 1
    assert served >= 9, served

    printed = re.search(r"^# prints: (.*)$", openai_block, re.MULTILINE)
    assert printed is not None, openai_block
    done = subprocess.run([sys.executable, "-c", openai_block], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    if not _pattern(printed.group(1)).fullmatch(done.stdout.strip()):
        wrong.append(f"(the openai client)\n--- printed:\n{printed.group(1)}\n--- got:\n{done.stdout}")
    assert not wrong, "\n\n".join(wrong)
