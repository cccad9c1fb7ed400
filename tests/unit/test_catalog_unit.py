"""The pure parts of catalogs and PATCH: If-Match parsing, the PATCH body, the admin body parse, label deltas."""

from __future__ import annotations

import pytest

from config import ConstraintError
from config.settings import Limits
from deployments.ingress import _if_match_version
from deployments.json_body import parse_json_body
from processors.kinds.labels.delta import apply_labels_delta
from processors.kinds.patch import parse_delta
from deployments.protocol import ServiceError


@pytest.mark.parametrize("header, version", [(None, None), ("*", None), ('"3"', 3), ("3", 3), ('W/"12"', 12),
                                             (' "7" ', 7)])
def test_if_match_names_a_version(header, version):
    assert _if_match_version(header) == version


@pytest.mark.parametrize("header", ['"0"', '"-1"', '"3', "three", '"3", "4"', "W/", '""'])
def test_a_bad_if_match_is_422_naming_it(header):
    with pytest.raises(ServiceError) as info:
        _if_match_version(header)
    assert info.value.status == 422 and info.value.detail["field"] == "If-Match"


def test_parse_delta():
    assert parse_delta({"add": [[1, 2]], "base_version": 3}) == ([[1, 2]], [], 3)
    assert parse_delta({"remove": ["a"]}) == ([], ["a"], None)
    for body, field in (([1], "body"), ({}, "add"), ({"add": [], "remove": []}, "add"), ({"add": {}}, "add"),
                        ({"remove": "x"}, "remove"), ({"add": [[1]], "base_version": 0}, "base_version"),
                        ({"add": [[1]], "base_version": True}, "base_version"), ({"add": [[1]], "x": 1}, "x")):
        with pytest.raises(ConstraintError) as info:
            parse_delta(body)
        assert info.value.status == 422 and info.value.detail["field"] == field, body


def test_admin_body_parse_is_strict_and_checks_limits():
    limits = Limits(max_labels=2)
    assert parse_json_body(b'{"type": "labels", "labels": ["a"]}', limits, scenario=True) == {
        "type": "labels", "labels": ["a"]}
    cases = [(b"", "body", 422), (b"{nope", "body", 422), (b"[1]", "body", 422), (b'{"a": NaN}', "a", 422),
             (b'{"a": 1, "a": 2}', "body", 422), (b'{"type": "labels", "labels": ["a", "b", "c"]}', "labels", 422)]
    for raw, field, status in cases:
        with pytest.raises(ServiceError) as info:
            parse_json_body(raw, limits, scenario=True)
        assert info.value.status == status and info.value.detail.get("field") == field, (raw, info.value.message)


def test_labels_delta_keeps_order_and_reports_noops():
    body = {"type": "labels", "labels": ["a", "b", "c"], "multi_label": True}
    new, report = apply_labels_delta(body, ["d", "a"], ["b", "x"])
    assert new == {"type": "labels", "labels": ["a", "c", "d"], "multi_label": True}
    assert report.to_json() == {"added": 1, "removed": 1, "already_present": ["a"], "not_present": ["x"]}
    for add, remove, field in ((["a", "a"], [], "add"), ([1], [], "add"), (["q"], ["q"], "add"), ([], [None], "remove")):
        with pytest.raises(ConstraintError) as info:
            apply_labels_delta(body, add, remove)
        assert info.value.status == 422 and info.value.detail["field"] == field


def test_item_tokens_are_bounded_where_items_are_parsed():
    """``max_item_tokens``: a catalog line (fast and per-line parse) or a PATCH add longer than the limit is a 422
    naming it and the limit; at the limit it parses; a stored catalog (no limit given) is read as it is."""
    from processors.kinds.tree.catalog.parse import parse_catalog
    from processors.kinds.tree.patch.items import apply_tree_delta

    header = b'{"start_token_id": 100, "end_token_id": 2}\n'
    assert len(parse_catalog(header + b"[5,6,7]\n[5]\n", vocab_size=1000, max_item_tokens=3)) == 2
    for body, where in ((header + b"\n[5]\n[5,6,7,8]\n", "items: line 4:"),
                        (header + b"[5]\n[5,6,7,8]\n[1.5]\n", "items: line 3:")):
        with pytest.raises(ConstraintError) as info:
            parse_catalog(body, vocab_size=1000, max_item_tokens=3)
        assert info.value.status == 422 and info.value.message.startswith(where), info.value.message
        assert "an item of 4 tokens exceeds the limit max_item_tokens=3" in info.value.message
        assert info.value.detail == {"field": "items", "limit_name": "max_item_tokens", "limit": 3}
        assert len(parse_catalog(body.replace(b"[1.5]\n", b""), vocab_size=1000)) == 2  # no limit: read
    catalog = parse_catalog(header + b"[5]\n", vocab_size=1000)
    new, report = apply_tree_delta(catalog, [[5, 6, 7]], [[5, 6, 7, 8, 9]], vocab_size=1000, max_item_tokens=3)
    assert report.added == 1 and report.not_present == [[5, 6, 7, 8, 9]]  # removes are not bounded
    with pytest.raises(ConstraintError) as info:
        apply_tree_delta(catalog, [[5, 6], [5, 6, 7, 8]], [], vocab_size=1000, max_item_tokens=3)
    assert info.value.status == 422 and info.value.message.startswith("add: add[1]: an item of 4 tokens")
    assert info.value.detail == {"field": "add", "limit_name": "max_item_tokens", "limit": 3}


def test_a_patched_catalogs_bytes_are_spliced_from_its_bases_exactly():
    """A PATCH makes the new catalog's bytes from its base's (cut lines, appended lines) when the base's are made:
    the same bytes, and line ends, as writing the new catalog out from its lines, through chains of deltas (removes
    at the start, the end, everywhere; the empty item; a catalog emptied and refilled)."""
    import random

    import numpy as np

    from processors.kinds.tree.catalog.catalog import Catalog
    from processors.kinds.tree.patch.items import apply_tree_delta

    rnd = random.Random(0)
    for trial in range(300):
        items = list({tuple(rnd.randint(3, 60) for _ in range(rnd.randint(0 if trial % 7 == 0 else 1, 4)))
                      for _ in range(rnd.randint(1, 40))})
        catalog = Catalog.from_items(5, 2, items)
        catalog.content()
        for step in range(3):
            current = [list(x) for x in catalog.items]
            remove = [x for x in rnd.sample(current, rnd.randint(0, len(current))) if x]
            add = [list(x) for x in {tuple(rnd.randint(3, 70) for _ in range(rnd.randint(1, 4)))
                                     for _ in range(rnd.randint(0 if remove else 1, 5))}]
            add = [a for a in add if a not in remove]
            if not add and not remove:
                continue
            new, _ = apply_tree_delta(catalog, add, remove, vocab_size=100)
            new.settle()  # (a PATCH's result is pending on its base until read)
            spliced, ends = new._content, new._ends
            assert spliced is not None
            written = Catalog(new.start_token_id, new.end_token_id, new.flat, new.lengths)
            assert spliced == written.content(), (trial, step)
            assert np.array_equal(ends, written.line_ends()), (trial, step)
            catalog = new


def test_a_patch_finds_its_items_by_row_key_and_the_result_keeps_the_keys_exact(monkeypatch):
    """A PATCH looks its items up by a hash of each row (catalog_rows.row_keys): through chains of deltas the result's
    keys (its base's cut and appended) equal its own keys made afresh, and the report names exactly the items present
    and absent, found by the pass over every key or in the sorted key index, also when every row falls into one
    bucket (a collision on every key: the lines decide)."""
    import random

    import numpy as np

    from processors.kinds.tree.catalog import catalog as catalog_module
    from processors.kinds.tree.catalog.catalog import Catalog
    from processors.kinds.tree.patch import rows as catalog_rows
    from processors.kinds.tree.patch.items import apply_tree_delta
    from processors.kinds.tree.patch.rows import catalog_row_keys, row_keys

    for colliding, indexed in ((False, False), (False, True), (True, False), (True, True)):
        if colliding:  # every key the same: the flags and the key compare pass every row, the lines tell them apart
            for module in (catalog_module, catalog_rows):  # (the catalog's rows' keys, and the wanted items')
                monkeypatch.setattr(module, "row_keys", lambda flat, lengths: np.zeros(lengths.size, np.uint64))
        # every catalog found through its sorted key index (index_row_keys), or by the pass over every row's key
        monkeypatch.setattr(catalog_rows, "INDEX_ROWS", 1 if indexed else 1 << 40)
        rnd = random.Random(1)
        for trial in range(150):
            items = list({tuple(rnd.randint(3, 40) for _ in range(rnd.randint(0 if trial % 9 == 0 else 1, 4)))
                          for _ in range(rnd.randint(1, 40))})
            catalog = Catalog.from_items(5, 2, items)
            catalog_row_keys(catalog)
            for step in range(3):
                current = {tuple(x) for x in catalog.items}
                remove = [list(x) for x in rnd.sample(sorted(current), rnd.randint(0, len(current))) if x]
                remove += [[x] for x in rnd.sample(range(41, 50), rnd.randint(0, 2))]  # not present
                add = [list(x) for x in {tuple(rnd.randint(3, 40) for _ in range(rnd.randint(1, 4)))
                                         for _ in range(rnd.randint(0, 6))}]
                add = [a for a in add if a not in remove]
                if not add and not remove:
                    continue
                new, report = apply_tree_delta(catalog, add, remove, vocab_size=100)
                assert sorted(map(tuple, report.not_present)) == sorted(tuple(r) for r in remove
                                                                        if tuple(r) not in current), (trial, step)
                assert sorted(map(tuple, report.already_present)) == sorted(tuple(a) for a in add
                                                                            if tuple(a) in current), (trial, step)
                expect = (current - {tuple(r) for r in remove}) | {tuple(a) for a in add}
                assert set(new.items) == expect and len(new.items) == len(expect)
                if report.changed:
                    new.settle()
                    assert new._row_keys is not None
                    assert np.array_equal(new._row_keys, catalog_rows.row_keys(new.flat, new.lengths)), (trial, step)
                catalog = new
    # unequal rows, equal keys, would be rare: none among 200,000 random rows of 1-6 ids
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 7, size=200_000)
    flat = rng.integers(0, 300, size=int(lengths.sum()))
    unique_rows = len({tuple(r) for r in Catalog.from_flat(0, 0, flat, lengths).items})
    assert np.unique(row_keys(flat, lengths)).size == unique_rows


def test_a_parsed_catalog_is_arrays_and_its_canonical_bytes(monkeypatch):
    """A catalog parsed from an upload keeps no Python object per item: its ids as arrays, a key per item and the
    canonical bytes made from the upload's text (spaces, carriage returns and blank lines dropped), equal to the
    lines written out here by hand; a repeated item is found by its ids also when every key collides (a 422 naming
    both lines)."""
    import random

    import numpy as np

    from processors.kinds.tree.catalog import lines as item_lines
    from processors.kinds.tree.catalog.catalog import row_keys
    from processors.kinds.tree.catalog.parse import parse_catalog

    rnd = random.Random(3)
    for trial in range(200):
        items = list({tuple(rnd.randint(3, 99) for _ in range(rnd.randint(1, 5))) for _ in range(rnd.randint(1, 30))})
        text = []
        for item in items:
            text += ["", " \r"] * (rnd.random() < 0.2)  # blank lines, some with spaces
            sep = rnd.choice([",", ", ", " ,"])
            text.append(rnd.choice(["", " "]) + "[" + sep.join(map(str, item)) + "]" + rnd.choice(["", "\r", " "]))
        body = ('{"start_token_id": 5, "end_token_id": 2}\n' + "\n".join(text) + rnd.choice(["", "\n", "\n\n"])).encode()
        catalog = parse_catalog(body, vocab_size=100)
        expect = (b'{"format":"cs-items","start_token_id":5,"end_token_id":2}\n'
                  + b"".join(("[" + ",".join(map(str, i)) + "]\n").encode() for i in items))
        assert catalog.content() == expect, trial
        assert catalog.items == items and len(catalog) == len(items)
        assert np.array_equal(catalog._row_keys, row_keys(catalog.flat, catalog.lengths))
        assert catalog.line_ends().tolist() == (np.flatnonzero(np.frombuffer(expect, dtype=np.uint8) == 10)[1:]
                                                + 1).tolist()
        assert not any(isinstance(value, list) for value in vars(catalog).values())  # nothing per item in Python
        assert catalog.rows([len(items) - 1]) == [items[-1]]
    monkeypatch.setattr(item_lines, "row_keys", lambda flat, lengths: np.zeros(lengths.size, np.uint64))
    distinct = parse_catalog(b'{"start_token_id": 5, "end_token_id": 2}\n[3,4]\n[4,3]\n[3]\n', vocab_size=100)
    assert distinct.items == [(3, 4), (4, 3), (3,)]
    with pytest.raises(ConstraintError) as info:
        parse_catalog(b'{"start_token_id": 5, "end_token_id": 2}\n[3,4]\n[4,3]\n[3, 4]\n', vocab_size=100)
    assert info.value.status == 422 and "line 4" in str(info.value) and "line 2" in str(info.value)


@pytest.mark.parametrize("block", [1, 7, 64, 1 << 23])
def test_the_catalog_fast_path_agrees_with_json_in_blocks_of_any_size(monkeypatch, block):
    """The array-pass reading of item lines (item_lines.fast_items, blocks cut at newlines and read two at a time)
    against json.loads per line on random text over its alphabet: whatever it accepts is exactly what JSON reads
    (lists of ids, blank lines skipped), and it accepts every body of well-formed lines; any block size gives the
    same answer."""
    import json as json_module
    import random

    import numpy as np

    from processors.kinds.tree.catalog import lines as item_lines

    monkeypatch.setattr(item_lines, "_BLOCK", block)
    rnd = random.Random(block)

    def reference(body: bytes):
        items = []
        for line in body.split(b"\n"):
            if not line.strip(b" \t\r"):
                continue
            try:
                value = json_module.loads(line)
            except ValueError:
                return None
            if not (isinstance(value, list) and value and all(type(v) is int and 0 <= v < 10**9 for v in value)):
                return None
            items.append(value)
        return items

    accepted = 0
    for trial in range(1500):
        if trial % 3 == 0:  # well formed, random spacing and blank lines
            lines = ["[" + rnd.choice([",", ", ", " , "]).join(str(rnd.randint(0, 10**rnd.randint(1, 9) - 1))
                                                              for _ in range(rnd.randint(1, 4))) + "]"
                     for _ in range(rnd.randint(0, 12))]
            lines = [line + rnd.choice(["", " ", "\r"]) for line in lines] + [""] * rnd.randint(0, 2)
            rnd.shuffle(lines)
            body = "\n".join(lines).encode()
        else:  # anything over the alphabet
            body = "".join(rnd.choice("[[]],,0123456789 \n") for _ in range(rnd.randint(0, 40))).encode()
        fast, expect = item_lines.fast_items(body), reference(body)
        if trial % 3 == 0:
            assert fast is not None, body
        if fast is None:
            continue
        accepted += 1
        texts, flat, lengths, keys, ends = fast
        text = b"".join(texts)
        assert ends.tolist() == (np.flatnonzero(np.frombuffer(text, dtype=np.uint8) == 10) + 1).tolist()
        assert expect is not None, body
        assert np.array_equal(keys, item_lines.row_keys(flat, lengths))
        assert flat.tolist() == [v for item in expect for v in item] and lengths.tolist() == list(map(len, expect))
        assert text == b"".join(json_module.dumps(item, separators=(",", ":")).encode() + b"\n" for item in expect)
        assert flat.dtype == np.int32 and lengths.dtype == np.int32
    assert accepted > 500


def test_a_large_catalogs_key_index_finds_the_rows_the_pass_over_every_key_finds(monkeypatch):
    """A catalog of INDEX_ROWS rows gets its sorted key index when first looked up: the rows it finds for items
    present, absent and of keys sharing their high bits are exactly those the pass over every row's key finds."""
    import numpy as np

    from processors.kinds.tree.patch import rows as catalog_rows
    from processors.kinds.tree.catalog.catalog import Catalog

    rng = np.random.default_rng(7)
    rows = catalog_rows.INDEX_ROWS
    lengths = rng.integers(3, 6, size=rows).astype(np.int32)  # (distinct: 49k^3 ids to draw from)
    flat = rng.integers(3, 49_152, size=int(lengths.sum())).astype(np.int32)
    catalog = Catalog.from_flat(5, 2, flat, lengths)
    picked = rng.choice(rows, size=3000, replace=False).tolist()
    items = catalog.rows(picked) + [(1, 2, 3, 4, 5, 6, 7), (49_151,) * 6]  # (ids no row has: 6+ of them, or > 48k)
    found = catalog_rows.rows_of(catalog, items)
    assert catalog._key_index is not None and catalog._key_index.size == rows
    assert np.all(np.diff(catalog._key_index.view(np.int64) ^ np.int64(-2 ** 63)) >= 0)  # (sorted as unsigned)
    monkeypatch.setattr(catalog_rows, "INDEX_ROWS", rows + 1)
    assert catalog_rows.index_row_keys(Catalog.from_flat(5, 2, flat, lengths)) is None  # (one row short: none)
    scanned = catalog_rows.rows_of(Catalog.from_flat(5, 2, flat, lengths), items)
    assert found == scanned and len(found) == 3000
    assert all(catalog.rows([row])[0] == item for item, row in found.items())
    # a key's rows are all the entries under its high bits: rows made to share them are all found
    keys = catalog_rows.catalog_row_keys(catalog)
    low = np.uint64((1 << catalog_rows._index_bits(rows)) - 1)
    same = np.flatnonzero((keys & ~low) == (keys[picked[0]] & ~low))
    assert picked[0] in catalog_rows._indexed_rows(catalog._key_index, rows, keys[same]).tolist()
    assert set(same.tolist()) <= set(catalog_rows._indexed_rows(catalog._key_index, rows, keys[same]).tolist())


def test_a_patch_result_pending_on_its_base_equals_the_catalog_written_out(monkeypatch):
    """A PATCH of a catalog without metadata leaves its result pending on its base (the base's rows cut, the new
    items appended, nothing copied): through chains of PATCHes of pending results, written out now and then (a small
    fold limit, and the real one), each result's items in order, SHA-256 without writing it out, line delta and row
    keys equal those of the same catalog built afresh from its items; the base's arrays and bytes never change."""
    import hashlib
    import random

    import numpy as np

    from deployments.storage.content import apply_line_delta, line_delta
    from processors.kinds.tree.patch import items as catalog_delta
    from processors.kinds.tree.patch import rows as catalog_rows
    from processors.kinds.tree.catalog.catalog import Catalog
    from processors.kinds.tree.patch.items import apply_tree_delta

    for fold_rows, fold_share in ((3, 2), (catalog_delta.FOLD_ROWS, catalog_delta.FOLD_SHARE)):
        monkeypatch.setattr(catalog_delta, "FOLD_ROWS", fold_rows)
        monkeypatch.setattr(catalog_delta, "FOLD_SHARE", fold_share)
        # bases found through their key index when small ones are folded often, by the pass over every key else
        monkeypatch.setattr(catalog_rows, "INDEX_ROWS", 1 if fold_rows == 3 else 1 << 40)
        rnd = random.Random(fold_rows)
        pending_seen = chained_seen = folded_seen = 0
        for trial in range(120):
            size = rnd.randint(1, 40) if fold_rows == 3 else rnd.randint(200, 400)  # (the real limit: larger ones)
            items = list({tuple(rnd.randint(3, 60) for _ in range(rnd.randint(0 if trial % 7 == 0 else 1, 4)))
                          for _ in range(size)})
            catalog = first = Catalog.from_items(5, 2, items)
            base_bytes = catalog.content()
            base_flat = catalog.flat.copy()
            order = list(items)
            for step in range(6):
                remove = [list(x) for x in rnd.sample(order, rnd.randint(0, min(len(order), 6))) if x]
                remove += [[x] for x in rnd.sample(range(71, 80), rnd.randint(0, 1))]  # not present
                add = [list(x) for x in {tuple(rnd.randint(3, 70) for _ in range(rnd.randint(1, 4)))
                                         for _ in range(rnd.randint(0, 5))}]
                add = [a for a in add if a not in remove]
                if not add and not remove:
                    continue
                was_pending = catalog._pending is not None
                before = catalog.content_sha256(), len(catalog)
                new, report = apply_tree_delta(catalog, add, remove, vocab_size=100)
                assert (catalog.content_sha256(), len(catalog)) == before  # the PATCHed catalog is unchanged
                gone = {tuple(r) for r in remove}
                fresh = [x for x in order if x not in gone]
                fresh += [tuple(a) for a in add if tuple(a) not in set(order)]
                assert report.removed == len(order) - len([x for x in order if x not in gone])
                assert report.added == len(fresh) - (len(order) - report.removed)
                written = Catalog.from_items(5, 2, fresh)
                pending = new._pending is not None
                pending_seen += pending
                chained_seen += pending and was_pending
                folded_seen += not pending
                assert len(new) == len(fresh), (trial, step)
                assert new.content_sha256() == hashlib.sha256(written.content()).hexdigest(), (trial, step)
                assert apply_line_delta(catalog.content(), line_delta(*new.line_delta)) == written.content()
                # its bytes whole (what the store keeps when it compacts a delta chain), its arrays not written out
                assert catalog_delta.whole_content(new) == written.content()
                assert (new._pending is not None) == pending  # (reading its hash, len, delta, bytes wrote nothing out)
                if rnd.random() < 0.3:  # read (written out) now and then; else the next PATCH is of a pending one
                    assert new.items == fresh, (trial, step)
                    assert new.content() == written.content()
                    assert np.array_equal(new.line_ends(), written.line_ends())
                    assert np.array_equal(catalog_rows.catalog_row_keys(new),
                                          catalog_rows.row_keys(written.flat, written.lengths))
                catalog, order = new, fresh
            assert first.content() == base_bytes and np.array_equal(first.flat, base_flat)  # the first base as it was
        if fold_rows == 3:  # results written out at the fold limit, and others pending
            assert pending_seen > 50 and folded_seen > 50, (pending_seen, folded_seen)
        else:  # PATCHes of pending results, chained
            assert chained_seen > 300, chained_seen


def test_a_catalog_whose_bytes_are_its_mapped_local_copy_patches_the_same(tmp_path):
    """A large upload's canonical bytes are read from its local copy, memory-mapped (``stored._mapped``), not held
    in the heap: PATCHes of it (pending and written out, with and without metadata) give the same bytes, hash and
    line ends as of the same catalog held as bytes."""
    import hashlib
    import random

    import numpy as np

    from processors.kinds.tree.patch import rows as catalog_rows
    from processors.kinds.tree.catalog.catalog import Catalog
    from processors.kinds.tree.patch.items import apply_tree_delta
    from processors.kinds.tree.store.content import _mapped

    rnd = random.Random(5)
    items = list({tuple(rnd.randint(3, 90) for _ in range(rnd.randint(1, 4))) for _ in range(3000)})
    held = Catalog.from_items(5, 2, items)
    path = tmp_path / "content"
    path.write_bytes(held.content())
    mapped = Catalog.from_items(5, 2, items)
    mapped._content = _mapped(str(path))
    assert not isinstance(mapped.content(), bytes)
    for step in range(8):
        current = held.items
        remove = [list(x) for x in rnd.sample(current, 20)]
        add = [[rnd.randint(91, 99), rnd.randint(3, 99)] for _ in range(20)]
        add = [list(x) for x in {tuple(a) for a in add} - set(current)]
        if step == 5:  # one with metadata: the copying way
            add = [{"ids": add[0], "metadata": {"k": "v"}}, *add[1:]]
        held, _ = apply_tree_delta(held, add, remove, vocab_size=100)
        mapped, _ = apply_tree_delta(mapped, add, remove, vocab_size=100)
        assert mapped.content_sha256() == held.content_sha256() == hashlib.sha256(held.content()).hexdigest()
        if step % 3 == 2:
            mapped.settle()
            held.settle()
            assert bytes(mapped.content()) == held.content()
            assert np.array_equal(mapped.line_ends(), held.line_ends())
            assert np.array_equal(catalog_rows.catalog_row_keys(mapped), catalog_rows.catalog_row_keys(held))


def test_a_patch_of_a_catalog_with_metadata_stays_pending_and_equals_the_catalog_written_out(monkeypatch):
    """A PATCH of a catalog whose items carry metadata (adds with metadata, removes, metadata updates: an updated
    item cut and appended again) leaves its result pending on its base too: through chains of PATCHes, written out
    now and then (a small fold limit, and the real one), each result's SHA-256, line delta, whole bytes and metadata
    columns equal those of the same catalog parsed afresh from NDJSON the test writes from its own model of the items
    (an ordered dict: a removed item goes, an added or updated one goes last); the base's bytes and metadata never
    change, and reading the hash, the delta or the columns writes nothing out."""
    import hashlib
    import json
    import random

    import numpy as np

    from deployments.storage.content import apply_line_delta, line_delta
    from processors.kinds.tree.catalog.parse import parse_catalog
    from processors.kinds.tree.patch import items as catalog_delta
    from processors.kinds.tree.patch import rows as catalog_rows
    from processors.kinds.tree.patch.items import apply_tree_delta

    def ndjson(model):
        head = json.dumps({"start_token_id": 5, "end_token_id": 2})
        lines = [json.dumps({"ids": list(k), "metadata": m}) if m else json.dumps(list(k)) for k, m in model.items()]
        return ("\n".join([head, *lines]) + "\n").encode()

    def meta(rnd):
        pick = rnd.random()
        if pick < 0.15:
            return None
        out = {"stock": rnd.randint(0, 9), "region": rnd.choice(["eu", "us", "apac"])}
        if pick > 0.8:
            out["tags"] = rnd.sample(["a", "b", "c", "d"], rnd.randint(1, 3))
        return out

    for fold_rows, fold_share in ((3, 2), (catalog_delta.FOLD_ROWS, catalog_delta.FOLD_SHARE)):
        monkeypatch.setattr(catalog_delta, "FOLD_ROWS", fold_rows)
        monkeypatch.setattr(catalog_delta, "FOLD_SHARE", fold_share)
        monkeypatch.setattr(catalog_rows, "INDEX_ROWS", 1 if fold_rows == 3 else 1 << 40)
        rnd = random.Random(11 + fold_rows)
        chained = folded = updated = 0
        for trial in range(60):
            size = rnd.randint(2, 40) if fold_rows == 3 else rnd.randint(200, 400)
            keys = list({tuple(rnd.randint(3, 60) for _ in range(rnd.randint(1, 4))) for _ in range(size)})
            model = {k: meta(rnd) for k in keys}
            if not any(model.values()):
                model[keys[0]] = {"stock": 1}
            catalog = first = parse_catalog(ndjson(model), vocab_size=100)
            base_bytes, base_meta = first.content(), first.meta.text
            for step in range(6):
                order = list(model)
                remove = [list(x) for x in rnd.sample(order, rnd.randint(0, min(len(order) - 1, 3)))]
                gone = {tuple(r) for r in remove}
                rest = [x for x in order if x not in gone]
                update = [{"ids": list(x), "metadata": meta(rnd)} for x in rnd.sample(rest, rnd.randint(0, min(len(rest), 5)))]
                fresh = {tuple(rnd.randint(61, 70) for _ in range(rnd.randint(1, 3))) for _ in range(rnd.randint(0, 3))}
                fresh -= set(model)
                add = [{"ids": list(x), "metadata": m} if (m := meta(rnd)) else list(x) for x in sorted(fresh)]
                if not (add or remove or update):
                    continue
                was_pending = catalog._pending is not None
                before = catalog.content_sha256()
                new, report = apply_tree_delta(catalog, add, remove, vocab_size=100, update=update)
                assert catalog.content_sha256() == before  # the PATCHed catalog is unchanged
                # the model: removes go; adds go last; then each item whose metadata changed, in catalog order
                for r in gone:
                    del model[r]
                for a in add:
                    ids = tuple(a["ids"]) if isinstance(a, dict) else tuple(a)
                    model[ids] = a["metadata"] if isinstance(a, dict) else None
                changed = [tuple(u["ids"]) for u in update if (model[tuple(u["ids"])] or None) != (u["metadata"] or None)]
                wanted = {tuple(u["ids"]): u["metadata"] for u in update}
                for k in [k for k in list(model) if k in set(changed)]:
                    del model[k]
                    model[k] = wanted[k]
                updated += len(changed)
                assert (report.added, report.removed, report.updated) == (len(add), len(remove), len(changed))
                written = parse_catalog(ndjson(model), vocab_size=100)
                pending = new._pending is not None
                chained += pending and was_pending
                folded += not pending
                assert new.content_sha256() == hashlib.sha256(written.content()).hexdigest(), (trial, step)
                assert apply_line_delta(catalog.content(), line_delta(*new.line_delta)) == written.content()
                assert catalog_delta.whole_content(new) == written.content()
                got, want = new.metadata(), written.metadata()
                # (a catalog whose items all lost their metadata keeps empty columns; parsed afresh, it has none)
                assert ((got.summary() if got else None) or None) == (want.summary() if want else None)
                assert (new._pending is not None) == pending  # (nothing above wrote it out)
                if rnd.random() < 0.3:  # written out now and then
                    assert new.items == list(model)
                    assert new.content() == written.content() and new.meta == written.meta
                    assert np.array_equal(new.line_ends(), written.line_ends())
                catalog = new
            assert first.content() == base_bytes and first.meta.text == base_meta  # the first base as it was
        assert updated > 100 and folded > 10, (updated, folded)  # (results written out at the fold limit)
        if fold_rows != 3:  # PATCHes of pending results, chained
            assert chained > 100, chained
