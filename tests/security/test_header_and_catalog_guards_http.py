"""Guards over real HTTP against the shared Serve app: requests that used to slip past a guard or answer 500.

* a guard header sent twice (``x-request-timeout-seconds: 300`` then ``0``): the ingress read the first copy and
  Serve's proxy the last, so the timeout was lifted; now a 400 naming the header;
* 500s: a catalog header with a lone surrogate (``"\\ud800"``) in ``description``, an ``If-Match`` of 5,000 digits
  (past Python's int limit) or of a non-ASCII digit; each is a 422 now, nothing stored;
* a catalog header that gives a key twice was taken (the last copy won): admin bodies are strict JSON, a 422;
* an ``exclude`` item of 2,000,000 ids went to a model replica to be walked; now each item is bounded by
  ``max_new_tokens`` (a longer item can never be produced), a 422 naming ``exclude[i]`` at the ingress.
"""

from __future__ import annotations

import json
import socket

import pytest
import requests

pytestmark = pytest.mark.serve

TIMEOUT = 60


def _raw(app, method: str, path: str, headers: list[tuple[str, str]], body: bytes = b"") -> tuple[int, bytes]:
    """One HTTP/1.1 request written byte by byte (a header may repeat); ``(status, body)``."""
    head = f"{method} {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Length: {len(body)}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers)
    with socket.create_connection(("127.0.0.1", app.port), timeout=TIMEOUT) as sock:
        sock.sendall(head.encode("latin-1") + b"\r\n" + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, data.split(b"\r\n\r\n", 1)[1]


@pytest.mark.parametrize("header, values", [
    ("x-request-timeout-seconds", ["300", "0"]),
    ("x-request-timeout-seconds", ["5", "5"]),
    ("x-request-disconnect-disabled", ["?0", "?1"]),
])
def test_a_repeated_guard_header_is_a_400_naming_it(serve_app, header, values):
    body = json.dumps({"prompt": "x", "max_new_tokens": 1}).encode()
    for path in ("/v1/generate", "/admin/scenarios"):
        status, answer = _raw(serve_app, "POST" if path == "/v1/generate" else "GET", path,
                              [("Content-Type", "application/json"), ("Authorization", serve_app.admin["Authorization"])]
                              + [(header, v) for v in values], body if path == "/v1/generate" else b"")
        assert status == 400, (status, answer[:300])
        error = json.loads(answer)["error"]
        assert error["message"].startswith(f"{header}:") and error.get("field") == header, error
    # sent once, the same header is judged as before: a value in (0, request_timeout_s] passes
    if header == "x-request-timeout-seconds":
        status, answer = _raw(serve_app, "POST", "/v1/generate", [("Content-Type", "application/json"),
                                                                  (header, "30")], body)
        assert status == 200, answer[:300]


NDJSON = {"Content-Type": "application/x-ndjson"}


def _put_catalog(app, name: str, header: bytes) -> requests.Response:
    return requests.put(f"{app.url}/admin/scenarios/{name}", data=header + b"\n[5]\n[6, 7]\n",
                        headers={**NDJSON, **app.admin}, timeout=TIMEOUT)


def _not_stored(app, name: str) -> None:
    r = requests.get(f"{app.url}/admin/scenarios/{name}", headers=app.admin, timeout=TIMEOUT)
    assert r.status_code == 404, r.text


def test_lone_surrogate_in_a_catalog_header_is_a_422(serve_app):
    for header in (b'{"start_token_id": 1000, "end_token_id": 2, "description": "\\ud800"}',
                   b'{"start_token_id": 1000, "end_token_id": 2, "description": "a\xed\xa0\x80"}'):
        r = _put_catalog(serve_app, "i23-surrogate", header)
        assert r.status_code == 422, (r.status_code, r.text[:300])
        error = r.json()["error"]
        assert "surrogate" in error["message"] and error.get("field") == "header.description", error
    _not_stored(serve_app, "i23-surrogate")


def test_a_catalog_header_with_a_repeated_key_is_a_422(serve_app):
    r = _put_catalog(serve_app, "i23-dup", b'{"start_token_id": 1000, "end_token_id": 2, "start_token_id": 1001}')
    assert r.status_code == 422, (r.status_code, r.text[:300])
    assert "duplicate key" in r.json()["error"]["message"] and "start_token_id" in r.json()["error"]["message"]
    _not_stored(serve_app, "i23-dup")


def test_an_if_match_out_of_range_is_a_422(serve_app):
    name = "i23-ifmatch"
    serve_app.put(name, {"type": "labels", "labels": ["a", "b"]})
    url = f"{serve_app.url}/admin/scenarios/{name}"
    for tag in ("9" * 5000, '"' + "1" * 5000 + '"', "\xb2", "1" * 19):
        r = requests.patch(url, json={"add": ["c"]}, headers={**serve_app.admin, "If-Match": tag.encode("latin-1")},
                           timeout=TIMEOUT)
        assert r.status_code == 422, (r.status_code, r.text[:300])
        assert r.json()["error"].get("field") == "If-Match", r.text[:300]
    history = requests.get(f"{url}/versions", headers=serve_app.admin, timeout=TIMEOUT).json()["versions"]
    assert [v["version"] for v in history] == [1]
    r = requests.patch(url, json={"add": ["c"]}, headers={**serve_app.admin, "If-Match": '"1"'}, timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["version"] == 2, r.text


def test_an_exclude_item_longer_than_max_new_tokens_is_refused_at_the_ingress(serve_app):
    from config import Limits

    longest = Limits().max_new_tokens
    serve_app.put("i23-exclude", {"type": "tree", "tree": {"start_token_id": 1000, "end_token_id": 2,
                                                          "prefix_dict": {"1000": [5, 6], "1000_5": [2, 5]}}})
    base = {"scenario": "i23-exclude", "prompt": "x", "max_new_tokens": 4}
    for path, body in (("/v1/generate", base),
                       ("/v1/chat/completions", {"scenario": "i23-exclude", "max_tokens": 4,
                                                 "messages": [{"role": "user", "content": "x"}]})):
        huge = {**body, "exclude": [[5], [5] * 2_000_000]}
        r = requests.post(f"{serve_app.url}{path}", json=huge, timeout=TIMEOUT)
        assert r.status_code == 422, (r.status_code, r.text[:300])
        error = r.json()["error"]
        assert error["message"].startswith("exclude[1]:") and f"max_new_tokens={longest}" in error["message"], error
        assert error.get("field") == "exclude[1]" and error.get("limit_name") == "max_new_tokens", error
    # at the bound the item is judged as before: not an item of this tree (a 422 naming it, from the replica)
    r = requests.post(f"{serve_app.url}/v1/generate", json={**base, "exclude": [[5] * longest]}, timeout=TIMEOUT)
    assert r.status_code == 422 and r.json()["error"]["message"].startswith("exclude[0]:"), r.text[:300]
    assert "not an item" in r.json()["error"]["message"], r.text[:300]
    r = requests.post(f"{serve_app.url}/v1/generate", json={**base, "exclude": [[5, 5]]}, timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["outputs"][0]["token_ids"] in ([5], [6], [5, 2], [6, 2]), r.text[:300]


PARQUET = {"Content-Type": "application/vnd.apache.parquet"}


def _parquet(columns: dict, header: str = '{"start_token_id": 1000, "end_token_id": 2}') -> bytes:
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    out = io.BytesIO()
    pq.write_table(pa.table(columns).replace_schema_metadata({"catalog": header}), out)
    return out.getvalue()


def _put_parquet(app, name: str, data: bytes) -> requests.Response:
    return requests.put(f"{app.url}/admin/scenarios/{name}", data=data, headers={**PARQUET, **app.admin},
                        timeout=TIMEOUT)


def test_parquet_ids_and_headers_the_ndjson_form_refuses_are_422s(serve_app):
    """A null id inside an ``ids`` list (it became -2^31 and failed the compile: a 500), a ``catalog`` header nested
    200,000 deep or holding NaN or 1e999 (500s) or giving a key twice (stored with the last value): each a 422
    naming ``parquet.ids`` with the row or ``parquet.catalog``, nothing stored."""
    import pyarrow as pa

    ids = pa.array([[1000, 2000], [1001, 2001]], pa.list_(pa.int64()))
    cases = [
        (_parquet({"ids": pa.array([[1000, 2000], [1001, None, 2001]], pa.list_(pa.int64()))}), "parquet.ids",
         "row 1: a null token id"),
        (_parquet({"ids": ids}, '{"start_token_id": 1000, "end_token_id": 2, "x": ' + "[" * 200_000 + "]" * 200_000
                  + "}"), "parquet.catalog", "not JSON"),
        (_parquet({"ids": ids}, '{"start_token_id": 1000, "end_token_id": 2, "x": NaN}'), "parquet.catalog.x",
         "NaN is not a finite number"),
        (_parquet({"ids": ids}, '{"start_token_id": 1000, "end_token_id": 2, "x": 1e999}'), "parquet.catalog.x",
         "overflows to infinity"),
        (_parquet({"ids": ids}, '{"start_token_id": 1000, "end_token_id": 2, "end_token_id": 3}'), "parquet.catalog",
         'duplicate key "end_token_id"'),
    ]
    for data, field, says in cases:
        r = _put_parquet(serve_app, "pq-strict", data)
        assert r.status_code == 422, (field, r.status_code, r.text[:300])
        error = r.json()["error"]
        assert error.get("field") == field and error["message"].startswith(f"{field}: "), error
        assert says in error["message"], error
        if field == "parquet.ids":
            assert error.get("row") == 1, error
    _not_stored(serve_app, "pq-strict")
    r = _put_parquet(serve_app, "pq-strict", _parquet({"ids": ids}))  # the same file, well formed: stored
    assert r.status_code == 200 and r.json()["items"] == 2, r.text[:300]


def test_a_parquet_catalog_whose_strings_decode_past_the_memory_guard_is_a_507(serve_app):
    """2,000,000 rows whose ``note`` is the same 4,000 bytes: under 1 MB of Parquet (one dictionary page) that
    decodes to 8 GB of strings. Its estimate counts each row's string (about 77 GiB: more than the manager's
    default ``write_memory_mb``, half of the machine's memory, or than the node has free): a 507 over HTTP,
    answered before the strings are decoded, nothing stored. A row whose metadata is over the per-item bound
    (``max_item_bytes``, as in NDJSON) is a 422 naming the row and the limit."""
    import psutil
    import pyarrow as pa

    from deployments.manager.memory_guard import parquet_need
    from helpers import repeated_strings
    from processors.kinds.tree.filters.metadata import MetadataLimits
    from processors.kinds.tree.catalog.parquet import parquet_shape, parquet_strings

    rows, note = 2_000_000, "x" * 4_000
    data = _parquet({"ids": pa.array([[1000]] * rows, pa.list_(pa.int32())), "note": repeated_strings(rows, note)})
    assert len(data) < 2**20
    need = parquet_need(parquet_strings(data, parquet_shape(data)))
    if need <= psutil.virtual_memory().total // 2:  # (a machine that large would rightly take it)
        pytest.skip(f"this machine's memory would fit the estimate ({need / 2**30:.0f} GiB)")
    r = _put_parquet(serve_app, "pq-decoded", data)
    assert r.status_code == 507, (r.status_code, r.text[:300])
    error = r.json()["error"]
    assert f"{rows:,} items" in error["message"] and "bytes of metadata" in error["message"], error
    assert error.get("setting") == "write_memory_mb" and error["estimate_mb"] > rows * len(note) / 2**20, error
    limit = MetadataLimits().max_item_bytes
    r = _put_parquet(serve_app, "pq-decoded", _parquet({"ids": pa.array([[1000], [1001], [1002]], pa.list_(pa.int32())),
                                                        "note": ["a", "b", "y" * limit]}))
    assert r.status_code == 422, (r.status_code, r.text[:300])
    error = r.json()["error"]
    assert error.get("row") == 2 and error.get("limit_name") == "max_item_bytes", error
    assert "row 2:" in error["message"] and f"max_item_bytes={limit}" in error["message"], error
    _not_stored(serve_app, "pq-decoded")
