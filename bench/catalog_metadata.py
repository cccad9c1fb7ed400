"""A catalog upload whose items carry metadata, read by the config manager: by columns (``parse._meta_catalog``:
Arrow's JSON reader over the NDJSON object lines; ``parquet_items``: a Parquet file's columns, both through
``columns.arrow_metadata``) against the object read per line it replaces (``json.loads`` per line,
``ItemMetadata.from_objects``, ``canonical_meta``; a Parquet file through the NDJSON it spells), in one run.

For each ``--items`` size a catalog of random distinct 4-token ids with 4 metadata fields (``category``: one of 1,000
strings; ``region``: a list of 0-8 of 8 strings; ``stock``: an int; ``price``: a float of 2 decimals) is written once
as NDJSON (each line as ``json.dumps`` writes it by default, spaces after the separators) and as Parquet; each way
reads it in its own subprocess (its time and peak RSS above the upload's bytes its own): the parse (items, metadata
columns, canonical metadata), the stored bytes and their SHA-256 (``Catalog.content``), the stored body's metadata
summary (``catalog_body``), the metadata digest, then the tables (``catalog_tables``). All must give the same
content hash.

    .venv/bin/python bench/catalog_metadata.py [--items 1000000] [--rounds 1] [--formats ndjson,parquet]

The result is one JSON object (``rows``: one per size and format); progress on stderr.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import emit, log, median, peak_rss_bytes, ratio, run_json_subprocess  # noqa: E402
from bench.catalog_scale import _distinct, make_ids  # noqa: E402

VOCAB = 49_152
HEADER = {"start_token_id": 1, "end_token_id": 2}
REGIONS = ["eu", "us", "apac", "latam", "mena", "uk", "ch", "jp"]
KEYS = ("read_s", "content_s", "summary_s", "tables_s", "total_s", "peak_above_upload_mb")


def _columns(n: int):
    """The items' ids and their 4 metadata fields, as arrays (a null: the field left out)."""
    rng = np.random.default_rng(7)
    ids = _distinct(make_ids(n, 256))
    ids = ids[rng.permutation(ids.shape[0])]
    n = ids.shape[0]
    category = rng.integers(0, 1000, n)
    counts = rng.integers(0, 9, n)
    picks = np.argsort(rng.random((n, 8)), axis=1)
    stock = rng.integers(0, 10_000, n)
    price = np.round(rng.random(n) * 1000, 2)
    missing = rng.random((n, 4)) < 0.05
    return ids, category, counts, picks, stock, price, missing


def write_files(n: int, ndjson: Path, parquet: Path) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    ids, category, counts, picks, stock, price, missing = _columns(n)
    names = [f"category-{i:03d}" for i in range(1000)]
    with open(ndjson, "w") as out:
        out.write(json.dumps(HEADER) + "\n")
        for i, row in enumerate(ids.tolist()):
            meta: dict = {}
            if not missing[i, 0]:
                meta["category"] = names[category[i]]
            if not missing[i, 1]:
                meta["region"] = [REGIONS[j] for j in picks[i, :counts[i]].tolist()]
            if not missing[i, 2]:
                meta["stock"] = int(stock[i])
            if not missing[i, 3]:
                meta["price"] = float(price[i])
            out.write(json.dumps({"ids": row, "metadata": meta}) + "\n")
    offsets = np.concatenate(([0], np.cumsum(counts)))
    regions = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)),
                                       pa.array(np.array(REGIONS)[np.concatenate(
                                           [picks[i, :counts[i]] for i in range(len(counts))])].tolist()),
                                       mask=pa.array(missing[:, 1]))
    table = pa.table({
        "ids": pa.ListArray.from_arrays(pa.array(np.arange(0, ids.size + 1, ids.shape[1], dtype=np.int32)),
                                        pa.array(ids.reshape(-1))),
        "category": pa.array(np.array(names)[category].tolist(), mask=missing[:, 0]),
        "region": regions,
        "stock": pa.array(stock, mask=missing[:, 2]),
        "price": pa.array(price, mask=missing[:, 3]),
    }).replace_schema_metadata({"catalog": json.dumps(HEADER)})
    pq.write_table(table, parquet)
    return int(ids.shape[0])


def child(path: str, fmt: str, way: str) -> dict:
    from processors.kinds.tree.catalog import parse as parse_module
    from processors.kinds.tree.catalog.catalog import catalog_body
    from processors.kinds.tree.catalog.parquet import parquet_catalog, parquet_items
    from processors.kinds.tree.tables.compile import catalog_tables

    if way == "objects":  # the object read alone: what an upload with metadata took before the column read
        parse_module._meta_catalog = lambda *args: None
    data = Path(path).read_bytes()
    before = peak_rss_bytes()
    t0 = time.perf_counter()
    if fmt == "ndjson":
        catalog = parse_module.parse_catalog(data, vocab_size=VOCAB, max_items=1 << 31)
    elif way == "columns":
        catalog = parquet_items(data, vocab_size=VOCAB, max_items=1 << 31)
    else:
        catalog = parse_module.parse_catalog(parquet_catalog(data, max_items=1 << 31), vocab_size=VOCAB)
    t1 = time.perf_counter()
    sha = hashlib.sha256(catalog.content()).hexdigest()
    t2 = time.perf_counter()
    body = catalog_body(catalog, sha)
    digest = catalog.metadata_digest()
    t3 = time.perf_counter()
    catalog_tables(catalog, VOCAB)
    t4 = time.perf_counter()
    return {"read_s": round(t1 - t0, 3), "content_s": round(t2 - t1, 3), "summary_s": round(t3 - t2, 3),
            "tables_s": round(t4 - t3, 3), "total_s": round(t4 - t0, 3),
            "peak_above_upload_mb": round((peak_rss_bytes() - before) / 2**20),
            "content_sha256": sha, "metadata_digest": digest, "fields": sorted(body["metadata"]),
            "items": len(catalog)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", default="1000000")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--formats", default="ndjson,parquet")
    ap.add_argument("--child", nargs=3, metavar=("PATH", "FORMAT", "WAY"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        emit(child(*args.child))
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in [int(x) for x in args.items.split(",")]:
            paths = {"ndjson": Path(tmp) / f"catalog-{n}.ndjson", "parquet": Path(tmp) / f"catalog-{n}.parquet"}
            items = write_files(n, paths["ndjson"], paths["parquet"])
            for fmt in args.formats.split(","):
                path = paths[fmt]
                log(f"{items:,} items, {path.stat().st_size / 2**20:,.0f} MiB of {fmt}")
                runs: dict[str, list[dict]] = {"columns": [], "objects": []}
                for r in range(args.rounds):
                    for way in (("columns", "objects") if r % 2 == 0 else ("objects", "columns")):
                        res = run_json_subprocess([__file__, "--child", str(path), fmt, way], timeout=3600)
                        runs[way].append(res)
                        log(f"  {way}: {res}")
                results = [res for way in runs for res in runs[way]]
                assert len({(res["content_sha256"], res["metadata_digest"]) for res in results}) == 1, \
                    "the two ways gave different catalogs"
                row = {"items": items, "format": fmt, "upload_mb": round(path.stat().st_size / 2**20, 1)}
                for way, got in runs.items():
                    row[way] = {key: median([res[key] for res in got]) for key in KEYS}
                row["columns_vs_objects"] = {key: ratio(row["columns"][key], row["objects"][key]) for key in KEYS}
                rows.append(row)
    emit({"bench": "catalog_metadata", "rows": rows})


if __name__ == "__main__":
    main()
