"""The installed ``cs-admin`` console script against the shared Ray Serve app, over real HTTP.

Every call runs the real executable in a subprocess and is checked for its exit code, its one-line
message and that the admin token never shows up in what it prints. Scenario names start with
``cli-`` and carry a random suffix, so tests sharing the app are not disturbed; each test deletes
what it stored.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import requests

from config import Limits
from helpers import free_port
from serve_app import ADMIN_TOKEN

pytestmark = pytest.mark.serve

CS_ADMIN = shutil.which("cs-admin", path=str(Path(sys.executable).parent)) or str(Path(sys.executable).parent / "cs-admin")
COLORS = {"type": "labels", "labels": ["red", "green", "blue"]}
ANIMALS = {"type": "labels", "labels": ["cat", "dog"], "description": "second version"}


def _unique(prefix: str = "cli") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def cli(*args: str, url: str | None, token: str | None = ADMIN_TOKEN, stdin: str | None = None,
        timeout: float = 240) -> subprocess.CompletedProcess:
    """Run ``cs-admin ARGS`` with CS_URL / ADMIN_TOKEN in the environment; never let it print a token."""
    env = {k: v for k, v in os.environ.items() if k not in ("CS_URL", "ADMIN_TOKEN", "CS_TIMEOUT")}
    if url is not None:
        env["CS_URL"] = url
    if token is not None:
        env["ADMIN_TOKEN"] = token
    done = subprocess.run([CS_ADMIN, *args], input=stdin, capture_output=True, text=True, env=env, timeout=timeout)
    for secret in {ADMIN_TOKEN, token} - {None}:
        assert secret not in done.stdout and secret not in done.stderr, (args, done.stdout, done.stderr)
    return done


def _ok(done: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert done.returncode == 0, (done.args, done.returncode, done.stdout, done.stderr)
    return done


def _one_line_error(done: subprocess.CompletedProcess, code: int) -> str:
    assert done.returncode == code, (done.args, done.returncode, done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cs-admin: "), done.stderr
    return lines[0]


def _stored(serve_app, name: str) -> bool:
    r = requests.get(f"{serve_app.url}/admin/scenarios/{name}", headers=serve_app.admin, timeout=60)
    assert r.status_code in (200, 404), r.text
    return r.status_code == 200


def _cleanup(serve_app, name: str) -> None:
    if _stored(serve_app, name):
        requests.delete(f"{serve_app.url}/admin/scenarios/{name}", headers=serve_app.admin, timeout=120)


def test_help_lists_the_exit_codes():
    done = _ok(cli("--help", url=None, token=None))
    for code, what in ((3, "token"), (4, "404"), (5, "422"), (6, "413"), (7, "503"), (8, "no service"), (9, "timeout")):
        assert any(line.strip().startswith(f"{code} ") and what in line for line in done.stdout.splitlines()), (code, done.stdout)


def test_every_command_on_one_scenario(serve_app, tmp_path):
    url, name = serve_app.url, _unique()
    first = tmp_path / "colors.json"
    first.write_text(json.dumps(COLORS))
    try:
        assert _ok(cli("put", name, str(first), url=url)).stdout.strip() == f"stored {name} version 1 (every replica serves it)"

        table = _ok(cli("list", url=url)).stdout.splitlines()
        assert table[0].split() == ["NAME", "TYPE", "VERSION"]
        assert [name, "labels", "1"] in [line.split() for line in table[1:]]
        listed = json.loads(_ok(cli("list", "--json", url=url)).stdout)["scenarios"]
        assert {"name": name, "type": "labels", "version": 1} in listed

        shown = _ok(cli("get", name, url=url)).stdout
        assert f"name:    {name}" in shown and "version: 1" in shown and "action:  put" in shown
        assert json.loads(shown.split("scenario:\n", 1)[1]) == COLORS
        assert json.loads(_ok(cli("--json", "get", name, url=url)).stdout)["scenario"] == COLORS

        # The second version comes from stdin.
        assert json.loads(_ok(cli("put", name, "-", "--json", url=url, stdin=json.dumps(ANIMALS))).stdout) == {"name": name, "version": 2}
        history = json.loads(_ok(cli("versions", name, "--json", url=url)).stdout)["versions"]
        assert [(h["version"], h["action"], h["type"]) for h in history] == [(1, "put", "labels"), (2, "put", "labels")]
        rows = [line.split() for line in _ok(cli("versions", name, url=url)).stdout.splitlines()]
        assert rows[0][:4] == ["VERSION", "ACTION", "TYPE", "FROM"]
        assert rows[1][:3] == ["1", "put", "labels"] and rows[2][:4] == ["*", "2", "put", "labels"]

        rolled = json.loads(_ok(cli("rollback", name, "1", "--json", url=url)).stdout)
        assert rolled == {"name": name, "version": 3, "from_version": 1}
        assert _ok(cli("rollback", name, "2", url=url)).stdout.strip() == (
            f"rolled back {name}: version 4 has the body of version 2 (every replica serves it)")
        assert _ok(cli("rollback", name, "1", url=url)).returncode == 0  # version 5 = version 1 again
        record = json.loads(_ok(cli("get", name, "--json", url=url)).stdout)
        assert (record["version"], record["action"], record["from_version"]) == (5, "rollback", 1)
        assert record["scenario"] == COLORS
        assert json.loads(_ok(cli("get", name, "--version", "3", "--json", url=url)).stdout)["scenario"] == COLORS
        assert json.loads(_ok(cli("get", name, "--version", "2", "--json", url=url)).stdout)["scenario"] == ANIMALS

        # try: the answer is one of the current version's labels, plain, as a chat message, and streamed.
        labels = set(COLORS["labels"])
        for extra in ([], ["--messages"], ["--messages", "--stream"], ["--stream", "--temperature", "1.5", "--seed", "7"]):
            done = _ok(cli("try", name, "The color of the sky is", "--max-new-tokens", "8", *extra, url=url))
            # the label form fits the prompt: bare as a chat answer, " label" after raw text that ends in a word
            assert done.stdout.strip() in labels, (extra, done.stdout)
            assert done.stdout.startswith(" ") == ("--messages" not in extra), (extra, done.stdout)
            assert f"[{name} v5: stop;" in done.stderr, done.stderr
        response = json.loads(_ok(cli("try", name, "Pick a color.", "--messages", "--seed", "1", "--json", url=url)).stdout)
        assert response["scenario"] == name and response["version"] == 5
        assert [o["text"].strip() in labels for o in response["outputs"]] == [True]
        events = [json.loads(line) for line in _ok(cli("try", name, "Pick one.", "--stream", "--json", url=url)).stdout.splitlines()]
        assert events[-1]["type"] == "done" and events[-1]["response"]["outputs"][0]["text"].strip() in labels
        assert all(e["type"] == "token" for e in events[:-1])

        assert _ok(cli("delete", name, url=url)).stdout.strip() == f"deleted {name} (delete entry is version 6; history kept)"
        assert not _stored(serve_app, name)
        assert name not in _ok(cli("list", url=url)).stdout
        message = _one_line_error(cli("get", name, url=url), 4)
        assert f"unknown scenario '{name}'" in message
        history = json.loads(_ok(cli("versions", name, "--json", url=url)).stdout)["versions"]
        assert [h["action"] for h in history] == ["put", "put", "rollback", "rollback", "rollback", "delete"]
    finally:
        _cleanup(serve_app, name)


def test_large_upload_shows_progress_and_too_large_is_413(serve_app, tmp_path):
    name = _unique()
    # Valid JSON padded with whitespace: a large body that costs the service nothing to compile.
    padded = tmp_path / "padded.json"
    padded.write_text(json.dumps(COLORS) + " " * (2 << 20))
    try:
        done = _ok(cli("put", name, str(padded), "--progress", url=serve_app.url))
        assert "100%" in done.stderr and f"upload {name}" in done.stderr, done.stderr
        assert json.loads(_ok(cli("get", name, "--json", url=serve_app.url)).stdout)["scenario"] == COLORS
        quiet = _ok(cli("put", name, str(padded), url=serve_app.url))  # stderr is not a terminal: no bar
        assert quiet.stderr == "" and "version 2" in quiet.stdout

        limit = Limits().max_body_bytes
        too_large = tmp_path / "too_large.json"
        too_large.write_text(json.dumps(ANIMALS) + " " * limit)
        message = _one_line_error(cli("put", name, str(too_large), "--no-progress", url=serve_app.url), 6)
        assert "HTTP 413" in message and f"max_body_bytes={limit}" in message
        assert json.loads(_ok(cli("get", name, "--json", url=serve_app.url)).stdout)["version"] == 2
    finally:
        _cleanup(serve_app, name)


def test_wrong_or_missing_token_is_refused_without_printing_it(serve_app, tmp_path):
    name = _unique()
    body = tmp_path / "colors.json"
    body.write_text(json.dumps(COLORS))
    wrong = "wrong-" + uuid.uuid4().hex
    for args, token in ((["--token", wrong, "put", name, str(body)], ADMIN_TOKEN),  # the flag wins over the env
                        (["put", name, str(body)], wrong),
                        (["versions", _unique("cli-missing"), "--json"], wrong)):
        done = cli(*args, url=serve_app.url, token=token)
        message = _one_line_error(done, 3)
        assert "HTTP 401" in message and "token" in message
        assert wrong not in done.stdout + done.stderr
    message = _one_line_error(cli("get", "sentiment", url=serve_app.url, token=None), 3)
    assert "no admin token" in message and "ADMIN_TOKEN" in message
    token_file = tmp_path / "admin_token"
    token_file.write_text(ADMIN_TOKEN + "\n")
    # Accepted: the answer is the 404 of a name never stored, not a 401.
    _one_line_error(cli("--token-file", str(token_file), "versions", _unique("cli-missing"), url=serve_app.url, token=None), 4)
    assert not _stored(serve_app, name)


@pytest.mark.parametrize("command", [["get"], ["get", "--version", "2"], ["versions"], ["delete"], ["rollback", "1"],
                                     ["try", "hello"], ["try", "hello", "--stream"]])
def test_unknown_scenario_is_404_naming_it(serve_app, command):
    name = _unique("cli-missing")
    args = [command[0], name, *command[1:]]
    message = _one_line_error(cli(*args, url=serve_app.url), 4)
    assert "HTTP 404" in message and repr(name) in message, message
    assert "known scenarios: " in message or "no scenarios are stored" in message


def test_unknown_version_names_the_stored_versions(serve_app, tmp_path):
    name = _unique()
    body = tmp_path / "colors.json"
    body.write_text(json.dumps(COLORS))
    try:
        _ok(cli("put", name, str(body), url=serve_app.url))
        message = _one_line_error(cli("get", name, "--version", "7", url=serve_app.url), 4)
        assert f"scenario '{name}' has no version 7 (stored versions: 1)" in message
        assert "no version 7" in _one_line_error(cli("rollback", name, "7", url=serve_app.url), 4)
    finally:
        _cleanup(serve_app, name)


@pytest.mark.parametrize("body, field", [
    ('{"type": "labels"}', "labels: Field required"),
    ('{"type": "labels", "labels": ["a", "b"], "colour": "red"}', "colour: Extra inputs are not permitted"),
    ('{"type": "regex", "pattern": 42}', "pattern: Input should be a valid string"),
    ('{"type": "labelz"}', "type: "),
    ('{"type": "labels", ', "body: not valid JSON"),
    ('[1, 2]', "body: expected a scenario JSON object"),
    ('{"start_token_id": 1, "end_token_id": 2, "prefix_dict": {}}', "cs-admin put --tree"),  # a bare tree file
])
def test_invalid_body_is_422_naming_the_field(serve_app, body, field):
    name = _unique()
    message = _one_line_error(cli("put", name, "-", url=serve_app.url, stdin=body), 5)
    assert "HTTP 422" in message and field in message, message
    assert not _stored(serve_app, name)


def test_invalid_arguments_are_named(serve_app, tmp_path):
    message = _one_line_error(cli("put", _unique(), str(tmp_path / "absent.json"), url=serve_app.url), 2)
    assert "cannot read" in message and "absent.json" in message
    assert "invalid scenario name 'a/b'" in _one_line_error(cli("get", "a/b", url=serve_app.url), 5)
    message = _one_line_error(cli("try", "cli-any", "hi", "--max-new-tokens", "100000", url=serve_app.url), 5)
    assert "max_new_tokens: 100000 exceeds the limit" in message
    assert "version: " in _one_line_error(cli("rollback", "cli-any", "0", url=serve_app.url), 5)


def test_unreachable_service_is_named():
    url = f"http://127.0.0.1:{free_port()}"
    for args in (["list"], ["get", "cli-x"], ["put", "cli-x", "-"], ["try", "cli-x", "hi", "--stream"]):
        message = _one_line_error(cli(*args, url=url, stdin="{}"), 8)
        assert message == f"cs-admin: no service at {url} (Connection refused)", message
    message = _one_line_error(cli("--url", "ftp://example.invalid", "list", url=None), 2)
    assert "invalid --url" in message


def test_timeout_is_named(serve_app):
    name = _unique()
    try:
        _ok(cli("put", name, "-", url=serve_app.url, stdin=json.dumps(COLORS)))
        # A generation takes far longer than 10 ms, so this client gives up first.
        message = _one_line_error(cli("try", name, "hi", "--timeout", "0.01", url=serve_app.url), 9)
        assert message == f"cs-admin: no answer from {serve_app.url} within 0.01 s (--timeout or CS_TIMEOUT)"
        # CS_TIMEOUT is read when --timeout is not given.
        env_timeout = subprocess.run([CS_ADMIN, "try", name, "hi"], capture_output=True, text=True, timeout=120,
                                     env={**os.environ, "CS_URL": serve_app.url, "CS_TIMEOUT": "0.01"})
        assert env_timeout.returncode == 9 and "within 0.01 s" in env_timeout.stderr
    finally:
        _cleanup(serve_app, name)


def test_put_tree_stores_a_bare_tree_file_as_a_tree_scenario(serve_app, tokenizer, tmp_path):
    from processors.kinds.tree.treefile.load import is_tree_path
    from deployments.examples import build_phrase_tree, chat_root_token_id

    tree = build_phrase_tree(tokenizer, ["red apple", "green pear"], root=chat_root_token_id(tokenizer),
                             end=tokenizer.eos_token_id)
    path = tmp_path / "tree.json"
    path.write_text(json.dumps(tree))  # what cs-tree build writes: no "type", no wrapper
    name = _unique()
    try:
        assert _ok(cli("put", name, str(path), "--tree", url=serve_app.url)).stdout.startswith(f"stored {name} version 1")
        stored = json.loads(_ok(cli("--json", "get", name, url=serve_app.url)).stdout)["scenario"]
        assert stored["type"] == "tree" and stored["tree"]["prefix_dict"] == tree["prefix_dict"]
        answer = _ok(cli("--json", "try", name, "Pick a fruit.", url=serve_app.url)).stdout
        assert is_tree_path(tree, json.loads(answer)["outputs"][0]["token_ids"])
    finally:
        _cleanup(serve_app, name)


def test_put_items_sends_a_parquet_file_as_parquet(serve_app, tokenizer, tmp_path):
    """``put --items`` reads a Parquet file's magic bytes and sends it as Parquet: the same catalog as its NDJSON."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from deployments.examples import chat_root_token_id

    header = {"start_token_id": chat_root_token_id(tokenizer), "end_token_id": tokenizer.eos_token_id}
    items = [[1000, 2000], [1000, 2001], [1001, 2000]]
    path = tmp_path / "catalog.parquet"
    pq.write_table(pa.table({"ids": pa.array(items, pa.list_(pa.int32())), "region": ["eu", "us", "eu"]})
                   .replace_schema_metadata({"catalog": json.dumps(header)}), path)
    ndjson = tmp_path / "catalog.ndjson"
    ndjson.write_text("\n".join([json.dumps(header)] + [json.dumps({"ids": ids, "metadata": {"region": region}})
                                                        for ids, region in zip(items, ["eu", "us", "eu"])]) + "\n")
    names = _unique(), _unique()
    try:
        for name, source in zip(names, (path, ndjson)):
            assert _ok(cli("put", name, "--items", str(source), url=serve_app.url)).stdout.startswith(f"stored {name}")
        stored = [json.loads(_ok(cli("--json", "get", name, url=serve_app.url)).stdout)["scenario"] for name in names]
        assert stored[0]["content_sha256"] == stored[1]["content_sha256"] and stored[0]["items"] == 3
    finally:
        for name in names:
            _cleanup(serve_app, name)
