"""A Parquet catalog upload read by the config manager: the array path (``parquet.py:parquet_items``, the ``ids``
column straight into the catalog's arrays) against the text path it replaces for files without metadata
(``parquet_catalog``: the NDJSON the file spells, then ``parse_catalog``), in one run.

For each ``--items`` size a Parquet file of random distinct 4-token semantic ids (a ``list<int32>`` column, the
header in the file's metadata) is written once; each path reads it in its own subprocess (its time and its peak
RSS above the file's bytes are its own), then makes the canonical bytes the manager stores (``Catalog.content``).
Both must give the same content hash.

    .venv/bin/python bench/catalog_parquet.py [--items 1000000,10000000] [--rounds 2]

The result is one JSON object (``rows``: one per size); progress on stderr.
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


def write_file(n: int, path: Path) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    ids = _distinct(make_ids(n, 256))
    ids = ids[np.random.default_rng(1).permutation(ids.shape[0])]  # upload order is not sorted
    column = pa.ListArray.from_arrays(pa.array(np.arange(0, ids.size + 1, ids.shape[1], dtype=np.int32)),
                                      pa.array(ids.reshape(-1)))
    table = pa.table({"ids": column}).replace_schema_metadata(
        {"catalog": json.dumps({"start_token_id": 1, "end_token_id": 2})})
    pq.write_table(table, path)
    return int(ids.shape[0])


def child(path: str, way: str) -> dict:
    from processors.kinds.tree.catalog.parse import parse_catalog
    from processors.kinds.tree.catalog.parquet import parquet_catalog, parquet_items

    data = Path(path).read_bytes()
    before = peak_rss_bytes()
    t0 = time.perf_counter()
    if way == "arrays":
        catalog = parquet_items(data, vocab_size=VOCAB, max_items=1 << 31)
    else:
        catalog = parse_catalog(parquet_catalog(data, max_items=1 << 31), vocab_size=VOCAB)
    read_s = time.perf_counter() - t0
    content = catalog.content()
    total_s = time.perf_counter() - t0
    return {"read_s": round(read_s, 3), "with_content_s": round(total_s, 3),
            "peak_above_file_mb": round((peak_rss_bytes() - before) / 2**20),
            "content_sha256": hashlib.sha256(content).hexdigest(), "items": len(catalog)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--items", default="1000000,10000000")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", nargs=2, metavar=("PATH", "WAY"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        emit(child(*args.child))
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in [int(x) for x in args.items.split(",")]:
            path = Path(tmp) / f"catalog-{n}.parquet"
            items = write_file(n, path)
            log(f"{items:,} items, {path.stat().st_size / 2**20:,.0f} MiB of Parquet")
            runs: dict[str, list[dict]] = {"arrays": [], "text": []}
            for r in range(args.rounds):
                for way in (("arrays", "text") if r % 2 == 0 else ("text", "arrays")):  # (order alternated)
                    res = run_json_subprocess([__file__, "--child", str(path), way], timeout=3600)
                    runs[way].append(res)
                    log(f"  {way}: {res}")
            shas = {res["content_sha256"] for way in runs for res in runs[way]}
            assert len(shas) == 1, "the two paths gave different catalogs"
            row = {"items": items, "file_mb": round(path.stat().st_size / 2**20, 1)}
            for way, results in runs.items():
                row[way] = {key: median([res[key] for res in results])
                            for key in ("read_s", "with_content_s", "peak_above_file_mb")}
            row["arrays_vs_text"] = {key: ratio(row["arrays"][key], row["text"][key])
                                     for key in ("read_s", "with_content_s", "peak_above_file_mb")}
            rows.append(row)
    emit({"bench": "catalog_parquet", "rows": rows})


if __name__ == "__main__":
    main()
