"""Catalog uploads (``Content-Type: application/x-ndjson``), PATCH and bounded history over real HTTP against the
shared Ray Serve app (2 model replicas, the real model), and ``cs-admin put --items`` / ``cs-admin patch``.

Every generated output is checked against the items of the version its response reports. Names start with
``cat-`` plus a random suffix, so tests sharing the app are not disturbed."""

from __future__ import annotations

import json
import uuid

import pytest
import requests
from helpers import http_answer, user_messages
from serve_app import swap_under_load
from test_admin_cli import _ok, cli

from deployments.examples import chat_root_token_id

pytestmark = pytest.mark.serve

PHRASES = ["red apple", "green pear", "blue sky at night", "yellow sun", "white snow", "black cat", "grey mouse",
           "orange juice", "purple rain", "pink panther", "brown bear", "silver moon"]


def _name() -> str:
    return f"cat-{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def phrase_items(tokenizer):
    out = {}
    for phrase in PHRASES:
        ids = tokenizer.encode(" " + phrase, add_special_tokens=False)
        assert tokenizer.decode(ids) == " " + phrase
        out[phrase] = tuple(ids)
    return out


def catalog(tokenizer, items) -> bytes:
    head = {"start_token_id": chat_root_token_id(tokenizer), "end_token_id": tokenizer.eos_token_id,
            "max_new_tokens": 16}
    return (json.dumps(head) + "\n" + "".join(json.dumps(list(i)) + "\n" for i in items)).encode()


def put_catalog(app, name, data) -> requests.Response:
    return requests.put(f"{app.url}/admin/scenarios/{name}", data=data, timeout=240,
                        headers={**app.admin, "Content-Type": "application/x-ndjson"})


def patch(app, name, body, headers=None) -> requests.Response:
    return requests.patch(f"{app.url}/admin/scenarios/{name}", json=body, timeout=240,
                          headers={**app.admin, **(headers or {})})


def check_item(out, items, eos) -> None:
    """``out`` is exactly one item of ``items``, then the end token."""
    ids = list(out["token_ids"])
    assert out["finish_reason"] == "stop", out
    if ids and ids[-1] == eos:
        ids = ids[:-1]
    assert tuple(ids) in items, (out, sorted(items))


def test_catalog_put_get_and_generate(serve_app, tokenizer, phrase_items):
    name = _name()
    items = set(list(phrase_items.values())[:4])
    r = put_catalog(serve_app, name, catalog(tokenizer, items))
    assert r.status_code == 200, r.text
    assert r.json() == {"name": name, "version": 1, "items": 4}
    got = requests.get(f"{serve_app.url}/admin/scenarios/{name}", headers=serve_app.admin, timeout=30)
    assert got.headers["etag"] == '"1"'
    assert got.json()["scenario"]["content_format"] == "items"
    r = serve_app.generate({"scenario": name, "messages": user_messages("Name a thing."), "n": 4, "temperature": 1.5})
    assert r.status_code == 200, r.text
    for out in r.json()["outputs"]:
        check_item(out, items, tokenizer.eos_token_id)
    # a bad line is a 422 naming it; nothing stored
    bad = catalog(tokenizer, items) + b"[1, 2.5]\n"
    r = put_catalog(serve_app, name, bad)
    assert r.status_code == 422 and "line 6" in r.json()["error"]["message"], r.text
    versions = requests.get(f"{serve_app.url}/admin/scenarios/{name}/versions", headers=serve_app.admin, timeout=30)
    assert [v["version"] for v in versions.json()["versions"]] == [1]


def test_patch_under_load_every_output_matches_its_version(serve_app, tokenizer, phrase_items):
    """One PATCH (one item in, one out) after another while 8 clients send requests: every answer is an item of
    the version it reports."""
    name = _name()
    phrases = list(phrase_items.values())
    current = set(phrases[:3])
    r = put_catalog(serve_app, name, catalog(tokenizer, current))
    assert r.status_code == 200, r.text

    def swap(k):
        nonlocal current
        drop = sorted(current)[0]
        r = patch(serve_app, name, {"add": [list(phrases[k + 2])], "remove": [list(drop)]})
        assert r.status_code == 200, r.text
        answer = r.json()
        assert (answer["added"], answer["removed"], answer["changed"]) == (1, 1, True)
        current = (current - {drop}) | {phrases[k + 2]}
        return answer["version"], set(current)

    seen = swap_under_load(
        serve_app, name, (r.json()["version"], set(current)), swap,
        lambda i: {"scenario": name, "messages": user_messages(f"Name a thing ({i})."), "temperature": 1.5},
        lambda body, items: check_item(body["outputs"][0], items, tokenizer.eos_token_id),
        swaps=len(phrases) - 3, clients=8, min_answers=16)
    assert len(seen) >= 3, f"the load should span several versions, saw {sorted(seen)}"


def test_patch_semantics_over_http(serve_app, tokenizer, phrase_items):
    name = _name()
    a, b, c = list(phrase_items.values())[:3]
    assert put_catalog(serve_app, name, catalog(tokenizer, [a, b])).status_code == 200
    # no-ops are reported; a retry that changes nothing makes no version
    r = patch(serve_app, name, {"add": [list(c), list(a)], "remove": [[7, 8, 9]]})
    assert r.status_code == 200, r.text
    assert r.json() == {"name": name, "version": 2, "base_version": 1, "changed": True, "added": 1, "removed": 0,
                        "already_present": [list(a)], "not_present": [[7, 8, 9]]}
    r = patch(serve_app, name, {"add": [list(c)]})
    assert r.status_code == 200 and r.json()["changed"] is False and r.json()["version"] == 2
    # If-Match with a stale version: 409, nothing stored; with the current one (GET's ETag): applied
    r = patch(serve_app, name, {"remove": [list(a)]}, headers={"If-Match": '"1"'})
    assert r.status_code == 409, r.text
    error = r.json()["error"]
    assert error["current_version"] == 2 and error["base_version"] == 1
    etag = requests.get(f"{serve_app.url}/admin/scenarios/{name}", headers=serve_app.admin, timeout=30).headers["etag"]
    r = patch(serve_app, name, {"remove": [list(a)]}, headers={"If-Match": etag})
    assert r.status_code == 200 and r.json()["version"] == 3, r.text
    r = patch(serve_app, name, {"remove": [list(b)], "base_version": 2})
    assert r.status_code == 409
    r = patch(serve_app, name, {"remove": [list(b)]}, headers={"If-Match": "three"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "If-Match"
    r = patch(serve_app, name, {"add": [[1, 2]], "remove": [[1, 2]]})
    assert r.status_code == 422 and r.json()["error"]["field"] == "add"
    # an Idempotency-Key retry answers the first result
    key = {"Idempotency-Key": f"k-{uuid.uuid4().hex}"}
    first = patch(serve_app, name, {"add": [list(a)]}, headers=key)
    again = patch(serve_app, name, {"add": [list(a)]}, headers=key)
    assert first.status_code == again.status_code == 200
    assert again.headers.get("idempotent-replayed") == "true" and again.json()["version"] == first.json()["version"] == 4
    history = requests.get(f"{serve_app.url}/admin/scenarios/{name}/versions", headers=serve_app.admin, timeout=30)
    assert [(v["version"], v["action"]) for v in history.json()["versions"]] == [
        (1, "put"), (2, "patch"), (3, "patch"), (4, "patch")]
    # rollback works across patches
    r = requests.post(f"{serve_app.url}/admin/scenarios/{name}/rollback", json={"version": 1},
                      headers=serve_app.admin, timeout=240)
    assert r.status_code == 200 and r.json()["version"] == 5
    out = serve_app.generate({"scenario": name, "messages": user_messages("Name a thing."), "n": 4, "temperature": 1.5})
    for o in out.json()["outputs"]:
        check_item(o, {a, b}, tokenizer.eos_token_id)
    # labels
    lname = _name()
    serve_app.put(lname, {"type": "labels", "labels": ["red", "green"]})
    r = patch(serve_app, lname, {"add": ["blue"], "remove": ["red", "mauve"]})
    assert r.status_code == 200 and r.json()["not_present"] == ["mauve"], r.text
    got = requests.get(f"{serve_app.url}/admin/scenarios/{lname}", headers=serve_app.admin, timeout=30).json()
    assert got["scenario"]["labels"] == ["green", "blue"]


def test_cs_admin_put_items_and_patch(serve_app, tokenizer, phrase_items, tmp_path):
    name = _name()
    a, b, c = list(phrase_items.values())[3:6]
    items = tmp_path / "catalog.jsonl"
    items.write_bytes(catalog(tokenizer, [a, b]))
    done = _ok(cli("put", name, "--items", str(items), url=serve_app.url))
    assert done.stdout.strip() == f"stored {name} version 1 (2 items) (every replica serves it)"
    add, remove = tmp_path / "add.jsonl", tmp_path / "remove.jsonl"
    add.write_text(json.dumps(list(c)) + "\n" + json.dumps(list(a)) + "\n")
    remove.write_text(json.dumps(list(b)) + "\n")
    done = _ok(cli("patch", name, "--add", str(add), "--remove", str(remove), url=serve_app.url))
    lines = done.stdout.strip().splitlines()
    assert lines[0] == f"patched {name}: version 2 (from 1): 1 added, 1 removed (every replica serves it)"
    assert lines[1] == f"  1 already present (not added again): {json.dumps(list(a))}"
    done = cli("patch", name, "--add", str(add), "--base-version", "1", url=serve_app.url)
    assert done.returncode == 5 and "changed underneath" in done.stderr, done.stderr
    out = serve_app.generate({"scenario": name, "messages": user_messages("Name a thing."), "n": 4, "temperature": 1.5})
    for o in out.json()["outputs"]:
        check_item(o, {a, c}, tokenizer.eos_token_id)


def test_auto_replica_table_delta_fetches_tables_on_this_node(serve_app):
    """``replica_table_delta: auto`` (the default) applies a PATCH on a replica only where the tables would come
    over the network: tables in this node's object store (the manager's node, as here) are fetched."""
    import numpy as np
    import ray

    from deployments.replica.table_delta import delta_wanted

    big = ray.put(np.zeros(1 << 20, dtype=np.int64))  # 8 MB: in the shared-memory store of this node
    small = ray.put(b"x")  # inline with its reference, on no node
    assert delta_wanted("auto", big) is False
    assert delta_wanted("auto", small) is False
    assert delta_wanted("always", big) is True


def test_a_catalog_file_named_by_path_is_read_by_the_manager(serve_app, tokenizer, phrase_items):
    """``PUT`` of ``{"type": "tree", "path": "<file>.parquet"}`` (or ``.ndjson`` / ``.jsonl``), a file under the tree
    directory: the manager reads the catalog file itself (the body over HTTP is a few bytes) and stores the same
    catalog as an upload of that file (same content hash, items), answering like one; generation gives its items and
    a PATCH of it works as of an uploaded one. Fields besides type and path are a 422, a missing file a 400, a path
    outside the tree directory a 422: nothing stored by any of them."""
    import os

    import pyarrow as pa
    import pyarrow.parquet as pq

    trees = os.path.join(serve_app.data_dir, "trees")
    os.makedirs(trees, exist_ok=True)
    items = sorted(set(list(phrase_items.values())[:5]))
    head = {"start_token_id": chat_root_token_id(tokenizer), "end_token_id": tokenizer.eos_token_id,
            "max_new_tokens": 16}
    stem = _name()
    pq.write_table(pa.table({"ids": pa.array([list(i) for i in items], pa.list_(pa.int32()))})
                   .replace_schema_metadata({"catalog": json.dumps(head)}), os.path.join(trees, stem + ".parquet"))
    with open(os.path.join(trees, stem + ".jsonl"), "wb") as handle:
        handle.write(catalog(tokenizer, items))
    uploaded, by_parquet, by_ndjson = _name(), _name(), _name()
    assert put_catalog(serve_app, uploaded, catalog(tokenizer, items)).status_code == 200
    for name, suffix in ((by_parquet, ".parquet"), (by_ndjson, ".jsonl")):
        r = requests.put(f"{serve_app.url}/admin/scenarios/{name}", json={"type": "tree", "path": stem + suffix},
                         headers=serve_app.admin, timeout=240)
        assert r.status_code == 200, r.text
        assert r.json() == {"name": name, "version": 1, "items": len(items)}
    stored = [requests.get(f"{serve_app.url}/admin/scenarios/{n}", headers=serve_app.admin, timeout=30).json()
              ["scenario"] for n in (uploaded, by_parquet, by_ndjson)]
    assert len({s["content_sha256"] for s in stored}) == 1 and {s["content_format"] for s in stored} == {"items"}
    r = serve_app.generate({"scenario": by_parquet, "messages": user_messages("Name a thing."), "n": 4,
                            "temperature": 1.5})
    assert r.status_code == 200, r.text
    for out in r.json()["outputs"]:
        check_item(out, set(items), tokenizer.eos_token_id)
    extra = list(phrase_items.values())[6]
    r = patch(serve_app, by_parquet, {"add": [list(extra)], "remove": [list(items[0])]})
    assert r.status_code == 200 and r.json()["version"] == 2, r.text
    r = serve_app.generate({"scenario": by_parquet, "messages": user_messages("Name a thing."), "n": 4,
                            "temperature": 1.5})
    assert r.status_code == 200, r.text
    for out in r.json()["outputs"]:
        check_item(out, set(items[1:]) | {extra}, tokenizer.eos_token_id)
    # refused, nothing stored
    refused = _name()
    for body, status, field in (({"type": "tree", "path": stem + ".parquet", "description": "x"}, 422, "description"),
                                ({"type": "tree", "path": stem + "-missing.parquet"}, 400, "path"),
                                ({"type": "tree", "path": "/etc/passwd.ndjson"}, 422, "path")):
        r = requests.put(f"{serve_app.url}/admin/scenarios/{refused}", json=body, headers=serve_app.admin, timeout=60)
        assert r.status_code == status, (body, r.text)
        assert field in r.text, r.text
    assert requests.get(f"{serve_app.url}/admin/scenarios/{refused}", headers=serve_app.admin,
                        timeout=30).status_code == 404
    for name in (uploaded, by_parquet, by_ndjson):
        requests.delete(f"{serve_app.url}/admin/scenarios/{name}", headers=serve_app.admin, timeout=60)


def test_a_catalog_larger_than_a_part_is_streamed_and_nothing_is_left_behind(serve_app, tokenizer):
    """A catalog upload of more than one part (16 MiB) is streamed by the ingress to the manager as it arrives and
    spooled there: chunked or with Content-Length, the version serves exactly the uploaded items, the spool directory
    is empty after it, and another client's requests are answered all along. A client that goes away mid-upload
    leaves nothing: its spool file is removed and the current version stays."""
    import os
    import socket
    import threading
    import time

    import numpy as np

    from deployments.manager.uploads import UPLOAD_PART_BYTES

    rng = np.random.default_rng(3)  # 8-token items that share their first 7 (about one tree key an item)
    rows = np.unique(np.column_stack([rng.integers(10_000, 10_002, size=(420_000, 7)),
                                      rng.integers(10_000, 40_000, size=420_000)]), axis=0)
    head = {"start_token_id": chat_root_token_id(tokenizer), "end_token_id": tokenizer.eos_token_id,
            "max_new_tokens": 16}
    body = (json.dumps(head) + "\n" + "\n".join(json.dumps(r) for r in rows.tolist()) + "\n").encode()
    assert len(body) > UPLOAD_PART_BYTES
    items = {tuple(r) for r in rows.tolist()}
    spool = os.path.join(serve_app.data_dir, "uploads")
    name = _name()

    def chunks(data: bytes, size: int = 1 << 20):
        for i in range(0, len(data), size):
            yield data[i:i + size]

    probes: list[tuple[int, float]] = []
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            started = time.monotonic()
            r = requests.get(f"{serve_app.url}/v1/scenarios", timeout=120)
            probes.append((r.status_code, time.monotonic() - started))
            stop.wait(0.1)

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    try:
        r = put_catalog(serve_app, name, chunks(body))  # chunked: no Content-Length
        assert r.status_code == 200, r.text[:500]
        assert r.json() == {"name": name, "version": 1, "items": len(items)}
        r = put_catalog(serve_app, name, body)  # with Content-Length: the same catalog, a new version
        assert r.status_code == 200 and r.json()["version"] == 2, r.text[:500]
    finally:
        stop.set()
        prober.join(130)
    assert probes and all(status == 200 for status, _ in probes), probes
    print(f"other client during the uploads: {len(probes)} answers, slowest {max(t for _, t in probes):.3f} s")
    assert os.listdir(spool) == []
    r = serve_app.generate({"scenario": name, "prompt": "Item:", "n": 4, "temperature": 1.5})
    assert r.status_code == 200, r.text
    for out in r.json()["outputs"]:
        check_item(out, items, tokenizer.eos_token_id)

    # a client that goes away after two parts: its spool file goes, version 2 stays
    sock = socket.create_connection(("127.0.0.1", serve_app.port), timeout=60)
    request = (f"PUT /admin/scenarios/{name} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
               f"Authorization: {serve_app.admin['Authorization']}\r\nContent-Type: application/x-ndjson\r\n"
               "Transfer-Encoding: chunked\r\n\r\n").encode()
    sock.sendall(request)
    sent = 0
    for chunk in chunks(body):
        sock.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
        sent += len(chunk)
        if sent > 2 * UPLOAD_PART_BYTES:
            break
    deadline = time.monotonic() + 60
    while not os.listdir(spool) and time.monotonic() < deadline:  # (the parts reached the manager)
        time.sleep(0.05)
    assert os.listdir(spool), "no part of the upload reached the manager"
    sock.close()
    deadline = time.monotonic() + 60
    while os.listdir(spool) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert os.listdir(spool) == []
    r = requests.get(f"{serve_app.url}/admin/scenarios/{name}", headers=serve_app.admin, timeout=30)
    assert r.json()["version"] == 2 and r.json()["scenario"]["items"] == len(items)


def test_stalled_catalog_uploads_are_a_408_and_free_their_places(serve_app, tokenizer):
    """Four clients that stall mid-upload (a chunk header that claims 32 MiB, more than one part of it sent, then
    nothing) hold the 4 uploads under way, each with its spool file, until the next part is past
    upload_part_timeout_s (short in the shared app): then each is answered 408 naming it, and its file is removed. A
    client that stalls within its first part (no spool file: the body is sent whole) gets the same answer. A fifth
    upload of more than one part then succeeds and serves exactly its items."""
    import os
    import socket
    import time

    import numpy as np
    from serve_app import UPLOAD_PART_TIMEOUT_S

    from deployments.manager.uploads import MAX_OPEN_UPLOADS, UPLOAD_PART_BYTES

    rng = np.random.default_rng(5)
    rows = np.unique(np.column_stack([rng.integers(10_000, 10_002, size=(420_000, 7)),
                                      rng.integers(10_000, 40_000, size=420_000)]), axis=0)
    head = {"start_token_id": chat_root_token_id(tokenizer), "end_token_id": tokenizer.eos_token_id,
            "max_new_tokens": 16}
    body = (json.dumps(head) + "\n" + "\n".join(json.dumps(r) for r in rows.tolist()) + "\n").encode()
    stall_at = UPLOAD_PART_BYTES + (1 << 20)
    assert len(body) > stall_at
    spool = os.path.join(serve_app.data_dir, "uploads")
    name = _name()

    def stalled(size: int) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", serve_app.port), timeout=UPLOAD_PART_TIMEOUT_S + 120)
        sock.sendall((f"PUT /admin/scenarios/{name} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                      f"Authorization: {serve_app.admin['Authorization']}\r\nContent-Type: application/x-ndjson\r\n"
                      "Transfer-Encoding: chunked\r\n\r\n").encode() + b"%x\r\n" % (32 << 20))
        sock.sendall(body[:size])
        return sock

    clients = [stalled(stall_at) for _ in range(MAX_OPEN_UPLOADS)]
    clients.append(stalled(1 << 20))
    try:
        deadline = time.monotonic() + 60
        while len(os.listdir(spool)) < MAX_OPEN_UPLOADS and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(os.listdir(spool)) == MAX_OPEN_UPLOADS, os.listdir(spool)  # every place taken
        for sock in clients:
            status, text = http_answer(sock)
            assert status.split(b"\r\n")[0].split(b" ")[1:2] == [b"408"], (status, text[:300])
            error = json.loads(text)["error"]
            assert error["limit_name"] == "upload_part_timeout_s" and error["limit"] == UPLOAD_PART_TIMEOUT_S, error
            assert f"upload_part_timeout_s={UPLOAD_PART_TIMEOUT_S:g}" in error["message"], error
    finally:
        for sock in clients:
            sock.close()
    deadline = time.monotonic() + 60
    while os.listdir(spool) and time.monotonic() < deadline:  # (drop_upload runs beside the answer)
        time.sleep(0.1)
    assert os.listdir(spool) == []
    assert requests.get(f"{serve_app.url}/admin/scenarios/{name}", headers=serve_app.admin,
                        timeout=30).status_code == 404

    def chunks(size: int = 1 << 20):
        for i in range(0, len(body), size):
            yield body[i:i + size]

    r = put_catalog(serve_app, name, chunks())  # chunked, more than one part: it needs a place in the spool
    assert r.status_code == 200, r.text[:500]
    assert r.json() == {"name": name, "version": 1, "items": len(rows)}
    assert os.listdir(spool) == []
    items = {tuple(r) for r in rows.tolist()}
    r = serve_app.generate({"scenario": name, "prompt": "Item:", "n": 4, "temperature": 1.5})
    assert r.status_code == 200, r.text
    for out in r.json()["outputs"]:
        check_item(out, items, tokenizer.eos_token_id)
    requests.delete(f"{serve_app.url}/admin/scenarios/{name}", headers=serve_app.admin, timeout=60)
