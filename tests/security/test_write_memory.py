"""A write that would not fit in the manager's memory is refused before its work (``write_memory_mb``): a catalog
upload, a PUT body and a PATCH whose estimated peak, beside what the manager holds, is over the setting get a 507
naming the setting and the estimate; nothing is stored (no version, no content file) and the manager goes on
serving and accepting writes that fit. Real config manager (embedded Redis, real tokenizer)."""

from __future__ import annotations

import json
import os

import pytest

from deployments.manager.memory_guard import PATCH_BYTES_PER_ITEM, PEAK_PER_BODY_BYTE, SETTING, held_bytes
from deployments.protocol import ServiceError

ROOT, END = 1000, 2
MIB = 2**20
HEADROOM_MB = 64  # what the limit leaves above the manager's memory at the start


def catalog(n: int) -> bytes:
    """``n`` distinct 3-token items under a header."""
    lines = [b'{"start_token_id": 1000, "end_token_id": 2}']
    lines += [b"[%d,%d,%d]" % (10 + i // 10_000, 10 + (i // 100) % 100, 10 + i % 100) for i in range(n)]
    return b"\n".join(lines) + b"\n"


@pytest.fixture(scope="module")
def manager(start_manager):
    """The manager, started and warm (one small write made), its ``write_memory_mb`` then set to what it holds plus
    ``HEADROOM_MB`` (the tests run in its process: what the manager holds is this process's memory)."""
    with start_manager("write-memory", write_memory_mb=64 * 1024) as manager:
        manager.run(manager.put_items("warm", catalog(100)))
        manager.settings.write_memory_mb = held_bytes() // MIB + HEADROOM_MB
        yield manager


def _content_files(manager) -> set[str]:
    content_dir = os.path.join(manager.settings.data_dir, "tree-content")
    return set(os.listdir(content_dir)) if os.path.isdir(content_dir) else set()


def _refused(call, manager) -> ServiceError:
    with pytest.raises(ServiceError) as info:
        manager.run(call)
    error = info.value
    assert error.status == 507, error.message
    assert SETTING in error.message and error.detail["setting"] == SETTING, error.message
    assert error.detail["estimate_mb"] > 0 and error.detail["limit_mb"] == manager.settings.write_memory_mb
    return error


def test_writes_over_the_memory_setting_are_refused_and_nothing_is_stored(manager):
    small = manager.run(manager.put_items("fits", catalog(100)))
    assert small["items"] == 100
    files = _content_files(manager)
    big = catalog(200_000)  # 32 bytes per body byte: about 80 MiB more than the headroom
    assert PEAK_PER_BODY_BYTE * len(big) > HEADROOM_MB * MIB
    error = _refused(manager.put_items("too-big", big), manager)
    assert error.detail["name"] == "too-big"
    # a PUT body (an inline tree) of the same size
    prefix = {str(i): [10 + i % 50] for i in range(150_000)}
    raw = json.dumps({"type": "tree", "tree": {"start_token_id": ROOT, "end_token_id": END,
                                               "prefix_dict": {"1000": list(range(10, 60)), **prefix}}}).encode()
    _refused(manager.put("too-big", raw), manager)
    # nothing stored: no version, no content file, the served scenario as it was
    with pytest.raises(ServiceError) as missing:
        manager.run(manager.get("too-big"))
    assert missing.value.status == 404
    assert _content_files(manager) == files
    assert [v["version"] for v in manager.run(manager.versions("fits"))] == [1]
    # the manager serves on and takes the writes that fit
    assert manager.run(manager.patch("fits", {"add": [[11, 12, 13, 14]]}))["version"] == 2
    assert "fits" in manager.scenarios.served


def test_a_patch_of_a_version_too_large_for_the_setting_is_refused(manager):
    """A PATCH's estimate counts the version it patches (one copy of its tables; its items built anew when they are
    not held): with less room left than that it is refused and nothing is stored."""
    items = 60_000
    answer = manager.run(manager.put_items("patched", catalog(items)))  # 1.1 MB body: fits
    assert answer["items"] == items
    assert PATCH_BYTES_PER_ITEM * items < HEADROOM_MB * MIB  # the PATCH fits the headroom ...
    try:  # ... until the limit leaves less room than this PATCH's estimate
        manager.settings.write_memory_mb = max(64, held_bytes() // MIB)  # (no room at all: the MiB rounded down)
        error = _refused(manager.patch("patched", {"add": [[11, 12, 13, 14]]}), manager)
        assert f"{items:,} items" in error.message, error.message
        assert [v["version"] for v in manager.run(manager.versions("patched"))] == [1]
    finally:
        manager.settings.write_memory_mb = held_bytes() // MIB + HEADROOM_MB
    assert manager.run(manager.patch("patched", {"add": [[11, 12, 13, 14]]}))["version"] == 2


def test_a_parquet_catalog_is_estimated_by_its_items_not_its_compressed_bytes(manager):
    """A Parquet file compresses its ids many times over (here ~0.5 byte per id): its estimate comes from the footer's
    rows and ids, so a file of a few MB that spells ~100 MiB of work is refused, and a small one is served."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    from deployments.manager.memory_guard import catalog_need
    from processors.kinds.tree.catalog.parquet import parquet_shape

    def parquet(n: int) -> bytes:
        ids = [[10 + i // 10_000, 10 + (i // 100) % 100, 10 + i % 100] for i in range(n)]
        table = pa.table({"ids": pa.array(ids, pa.list_(pa.int32()))}).replace_schema_metadata(
            {"catalog": json.dumps({"start_token_id": ROOT, "end_token_id": END})})
        out = io.BytesIO()
        pq.write_table(table, out)
        return out.getvalue()

    big = parquet(600_000)
    assert parquet_shape(big)[:2] == (600_000, 1_800_000)
    assert PEAK_PER_BODY_BYTE * len(big) < HEADROOM_MB * MIB < catalog_need(600_000, 1_800_000)  # bytes would pass
    files = _content_files(manager)
    error = _refused(manager.put_items("parquet-big", big, None, "parquet"), manager)
    assert "600,000 items" in error.message and "1,800,000 ids" in error.message, error.message
    assert _content_files(manager) == files
    with pytest.raises(ServiceError) as missing:
        manager.run(manager.get("parquet-big"))
    assert missing.value.status == 404
    manager.settings.write_memory_mb = held_bytes() // MIB + HEADROOM_MB  # (what the manager holds grew meanwhile)
    small = manager.run(manager.put_items("parquet-small", parquet(1_000), None, "parquet"))
    assert small["items"] == 1_000 and "parquet-small" in manager.scenarios.served


def _parquet_notes(rows: int, note: str, odd: tuple[int, str] | None = None) -> bytes:
    """A Parquet catalog of ``rows`` distinct 3-token items whose ``note`` is ``note`` (``odd``: one row's another)."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    from helpers import repeated_strings

    ids = [[10 + i // 10_000, 10 + (i // 100) % 100, 10 + i % 100] for i in range(rows)]
    table = pa.table({"ids": pa.array(ids, pa.list_(pa.int32())), "note": repeated_strings(rows, note, odd)})
    out = io.BytesIO()
    pq.write_table(table.replace_schema_metadata(
        {"catalog": json.dumps({"start_token_id": ROOT, "end_token_id": END})}), out)
    return out.getvalue()


def test_a_parquet_catalog_is_estimated_by_its_strings_as_they_decode(manager):
    """200,000 rows whose ``note`` is the same 4,000 bytes: a file of about 0.6 MB (one dictionary page) that decodes
    to 800 MB of strings, read through 800 MB of NDJSON (it took the manager 4.7 GB). Its estimate counts each row's
    string: with room for what its rows and ids alone would need, it is a 507 naming its metadata bytes, refused
    before its columns are decoded (the manager's memory grows by far less than their 800 MB), nothing stored; as a
    file named by path too. A row over the per-item metadata bound is a 422 naming it, before the read, the same."""
    from deployments.manager.memory_guard import catalog_need
    from helpers import resident_growth
    from processors.kinds.tree.filters.metadata import MetadataLimits

    rows, note = 200_000, "x" * 4_000
    data = _parquet_notes(rows, note)
    assert len(data) < 2**20
    trees = os.path.join(manager.settings.data_dir, "trees")
    os.makedirs(trees, exist_ok=True)
    with open(os.path.join(trees, "notes.parquet"), "wb") as handle:
        handle.write(data)
    files = _content_files(manager)
    try:
        manager.settings.write_memory_mb = held_bytes() // MIB + 1024
        assert catalog_need(rows, 3 * rows) + len(data) < 1024 * MIB  # the rows and ids alone would pass
        for call in (lambda: manager.put_items("notes", data, None, "parquet"),
                     lambda: manager.put("notes", json.dumps({"type": "tree", "path": "notes.parquet"}).encode())):
            error, grown = resident_growth(lambda: _refused(call(), manager))
            assert f"{rows:,} items" in error.message and "bytes of metadata" in error.message, error.message
            assert error.detail["estimate_mb"] > rows * len(note) / MIB, error.detail
            assert grown < rows * len(note) // 4, grown  # (the column read as a dictionary: a few MB)
        limit = MetadataLimits().max_item_bytes
        over = _parquet_notes(rows, "s" * 100, (150_001, "y" * limit))
        with pytest.raises(ServiceError) as refused:
            manager.run(manager.put_items("notes", over, None, "parquet"))
        assert refused.value.status == 422 and refused.value.detail["row"] == 150_001, refused.value.message
        assert refused.value.detail["limit_name"] == "max_item_bytes", refused.value.message
        assert f"max_item_bytes={limit}" in refused.value.message, refused.value.message
        with pytest.raises(ServiceError) as missing:
            manager.run(manager.get("notes"))
        assert missing.value.status == 404
        assert _content_files(manager) == files
        small = manager.run(manager.put_items("notes", _parquet_notes(1_000, note), None, "parquet"))
        assert small["items"] == 1_000
        assert manager.run(manager.get("notes"))["scenario"]["metadata"]["note"]["values"] == {note: 1_000}
    finally:
        manager.settings.write_memory_mb = held_bytes() // MIB + HEADROOM_MB


def test_a_patch_of_a_held_catalog_is_estimated_by_what_it_copies(manager):
    """A PATCH of a catalog whose items and tables the manager holds leaves its result pending on those items and
    makes an overlay of its tables: its estimate is their bytes, not 256 per item, so it fits where the per-item
    estimate would not; with less room than those bytes it is refused."""
    items = 400_000
    try:
        manager.settings.write_memory_mb = held_bytes() // MIB + 1024  # (the upload's own estimate is larger)
        assert manager.run(manager.put_items("held", catalog(items)))["items"] == items
        manager.settings.write_memory_mb = held_bytes() // MIB + HEADROOM_MB
        assert PATCH_BYTES_PER_ITEM * items > HEADROOM_MB * MIB  # the per-item estimate would refuse it
        answer = manager.run(manager.patch("held", {"add": [[11, 12, 13, 14]]}))
        assert answer["version"] == 2 and answer["added"] == 1
        manager.settings.write_memory_mb = max(64, held_bytes() // MIB + 1)  # less room than the copies
        error = _refused(manager.patch("held", {"add": [[11, 12, 13, 15]]}), manager)
        assert f"{items + 1:,} items" in error.message and error.detail["estimate_mb"] < PATCH_BYTES_PER_ITEM * items / MIB
        assert [v["version"] for v in manager.run(manager.versions("held"))] == [1, 2]
    finally:
        manager.settings.write_memory_mb = held_bytes() // MIB + HEADROOM_MB


def test_a_write_within_the_setting_but_over_the_nodes_free_memory_is_refused(manager, monkeypatch):
    """The setting bounds the manager; the node's other processes (replicas, Redis, the object store) use the rest.
    A write within the setting whose estimate is over what the node has free now is refused too (507 naming both),
    nothing stored. FAKE: the node's free memory is patched down (a node really that full would be one this test
    run could not survive)."""
    from deployments.manager import memory_guard

    manager.settings.write_memory_mb = held_bytes() // MIB + 1024
    try:
        monkeypatch.setattr(memory_guard, "node_free_bytes", lambda: 5 * MIB)
        body = catalog(50_000)  # ~0.6 MB: ~20 MiB estimated, within the setting
        error = _refused(manager.put_items("node-full", body), manager)
        assert error.detail["node_free_mb"] == 5 and "free" in error.message, error.message
        with pytest.raises(ServiceError) as missing:
            manager.run(manager.get("node-full"))
        assert missing.value.status == 404
        monkeypatch.undo()
        assert manager.run(manager.put_items("node-full", body))["items"] == 50_000
    finally:
        manager.settings.write_memory_mb = held_bytes() // MIB + HEADROOM_MB


def test_a_catalog_file_named_by_path_is_estimated_before_it_is_read(manager):
    """A PUT naming a catalog file by path (``{"type": "tree", "path": "<file>.ndjson"}``) gets the estimate of an
    upload of that file, from its size (the file is mapped, not read, until the estimate allows it): over the
    setting a 507, nothing stored; with room, stored as that upload would be."""
    trees = os.path.join(manager.settings.data_dir, "trees")
    os.makedirs(trees, exist_ok=True)
    with open(os.path.join(trees, "big.ndjson"), "wb") as handle:
        handle.write(catalog(200_000))  # 32 bytes per body byte: about 80 MiB more than the headroom
    with open(os.path.join(trees, "small.ndjson"), "wb") as handle:
        handle.write(catalog(1_000))
    files = _content_files(manager)
    error = _refused(manager.put("by-path", json.dumps({"type": "tree", "path": "big.ndjson"}).encode()), manager)
    assert "catalog upload" in error.message and error.detail["name"] == "by-path", error.message
    with pytest.raises(ServiceError) as missing:
        manager.run(manager.get("by-path"))
    assert missing.value.status == 404
    assert _content_files(manager) == files
    answer = manager.run(manager.put("by-path", json.dumps({"type": "tree", "path": "small.ndjson"}).encode()))
    assert answer["items"] == 1_000
