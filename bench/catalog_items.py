"""The manager's item list of a catalog: its memory, the parse of an upload and the items step of a PATCH, for this
checkout and another one (``--other DIR``, a checkout of an earlier commit) in one run.

Each (checkout, size) runs in its own process (its RSS its own): a catalog of ``--items`` distinct random
4-token semantic ids (256 codes per level) is written as the NDJSON upload, parsed the way the
manager parses a PUT (``parse_catalog``, then its canonical bytes, ``Catalog.content``), then ``--rounds`` chained
PATCHes of ``--delta`` items (half new items added, half present ones removed) apply the delta to the item list
(``apply_tree_delta``: what the manager's log calls the items step) and hash the new catalog's bytes (the bytes
step). ``catalog_mb`` is the parse's RSS growth with the upload's bytes held (the catalog's arrays, Python objects
and canonical bytes); ``held_mb`` counts what the catalog holds object by object. The tables are not built here (``bench/catalog_scale.py`` and ``bench/catalog_patch.py`` time
them).

    .venv/bin/python bench/catalog_items.py --items 1000000,10000000 --other /tmp/before
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

# a child measures the checkout it was started for (run_child), the parent this one
sys.path.insert(0, os.environ.get("CATALOG_ITEMS_CHECKOUT") or str(Path(__file__).resolve().parents[1]))

from bench._common import emit, log, ratio, rss_bytes  # noqa: E402

VOCAB = 49_152
END = 2
START = 1
CODES = 256
DEPTH = 4


def semantic_ids(n: int, seed: int) -> np.ndarray:
    """``n`` distinct rows of DEPTH ids, level ``d`` taking codes ``1000 + 256 d + [0, 256)``, in random order."""
    rng = np.random.default_rng(seed)
    rows = np.zeros((0, DEPTH), dtype=np.int64)
    while rows.shape[0] < n:
        more = rng.integers(0, CODES, size=(int((n - rows.shape[0]) * 1.01) + 16, DEPTH))
        rows = np.concatenate((rows, more))
        code = (rows * (CODES ** np.arange(DEPTH))).sum(axis=1)
        _, first = np.unique(code, return_index=True)
        rows = rows[np.sort(first)]
    return rows[:n] + 1000 + CODES * np.arange(DEPTH)


def upload_text(rows: np.ndarray) -> bytes:
    """The NDJSON catalog of ``rows`` (a header, then ``[a,b,c,d]`` per line), made by Arrow's string kernels."""
    import pyarrow as pa
    import pyarrow.compute as pc

    text = pa.large_string()
    lists = pa.FixedSizeListArray.from_arrays(pa.array(rows.ravel()), DEPTH).cast(pa.large_list(text))
    lines = pc.binary_join_element_wise(pa.scalar("[", text), pc.binary_join(lists, pa.scalar(",", text)),
                                        pa.scalar("]\n", text), pa.scalar("", text))
    offsets = np.frombuffer(lines.buffers()[1], dtype=np.int64, count=len(lines) + 1)
    head = json.dumps({"start_token_id": START, "end_token_id": END}).encode() + b"\n"
    return head + lines.buffers()[2][int(offsets[0]):int(offsets[-1])].to_pybytes()


def held_bytes(catalog) -> int:
    """What the parsed catalog holds, counted object by object (RSS also counts memory freed but not returned):
    its arrays' bytes, its bytes objects, and a list's slots and elements."""
    total = 0
    for value in vars(catalog).values():
        if isinstance(value, np.ndarray):
            total += value.nbytes
        elif isinstance(value, (bytes, bytearray)):
            total += len(value)
        elif isinstance(value, list):
            total += sys.getsizeof(value) + sum(sys.getsizeof(x) for x in value)
    return total


def measure(n: int, delta: int, rounds: int) -> dict:
    from processors.kinds.tree.catalog.parse import parse_catalog
    from processors.kinds.tree.patch.items import apply_tree_delta

    warm = semantic_ids(1000, seed=0)  # the modules loaded and warmed up before the RSS is read
    apply_tree_delta(parse_catalog(upload_text(warm), vocab_size=VOCAB), [], warm[:1].tolist(), vocab_size=VOCAB)
    rows = semantic_ids(n, seed=n)
    body = upload_text(rows)
    gc.collect()
    before = rss_bytes()
    t0 = time.perf_counter()
    catalog = parse_catalog(body, vocab_size=VOCAB, max_items=None)
    catalog.content()  # (the manager stores the canonical bytes at the PUT)
    out: dict = {"items": n, "parse_s": round(time.perf_counter() - t0, 3)}
    gc.collect()
    out["catalog_mb"] = round((rss_bytes() - before) / 2**20, 1)
    out["held_mb"] = round(held_bytes(catalog) / 2**20, 1)
    rng = np.random.default_rng(7)
    picks = rng.choice(n, size=rounds * (delta - delta // 2), replace=False).reshape(rounds, -1)  # never re-added
    items_s, bytes_s = [], []
    for r in range(rounds):
        remove_list = rows[picks[r]].tolist()
        add_list = (rng.integers(0, CODES, size=(delta // 2, DEPTH)) + 1000 + CODES * np.arange(DEPTH)).tolist()
        t0 = time.perf_counter()
        new, report = apply_tree_delta(catalog, add_list, remove_list, vocab_size=VOCAB)
        t1 = time.perf_counter()
        hashlib.sha256(new.content()).hexdigest()
        t2 = time.perf_counter()
        assert report.removed == len(remove_list) and report.added + len(report.already_present) == len(add_list)
        assert len(new) == len(catalog) + report.added - report.removed
        items_s.append(t1 - t0)
        bytes_s.append(t2 - t1)
        catalog = new
    out["patch_items_first_s"] = round(items_s[0], 3)
    out["patch_items_s"] = round(statistics.median(items_s[1:] or items_s), 3)
    out["patch_bytes_s"] = round(statistics.median(bytes_s), 3)
    out["peak_rss_mb"] = round(int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) / 1024, 1)
    return out


def run_child(checkout: Path, n: int, args) -> dict:
    """:func:`measure` in a process of its own, importing the project from ``checkout``."""
    env = dict(os.environ, PYTHONPATH=str(checkout), CATALOG_ITEMS_CHECKOUT=str(checkout))
    cmd = [sys.executable, __file__, "--measure", str(n), "--delta", str(args.delta), "--rounds", str(args.rounds)]
    done = subprocess.run(cmd, env=env, cwd=checkout, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{checkout} at {n} items failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", default="1000000", help="catalog sizes (comma separated)")
    parser.add_argument("--other", default=None, help="another checkout to measure beside this one")
    parser.add_argument("--delta", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--measure", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure is not None:
        emit(measure(args.measure, args.delta, args.rounds))
        return
    here = Path(__file__).resolve().parents[1]
    sides = {"this": here, **({"other": Path(args.other).resolve()} if args.other else {})}
    rows = []
    for n in (int(x) for x in args.items.split(",")):
        row: dict = {"items": n}
        for side, checkout in sides.items():
            row[side] = run_child(checkout, n, args)
            log(side, json.dumps(row[side]))
        if "other" in row:
            row["other_over_this"] = {k: ratio(row["other"][k], row["this"][k]) for k in
                                      ("parse_s", "catalog_mb", "held_mb", "patch_items_first_s", "patch_items_s", "patch_bytes_s",
                                       "peak_rss_mb")}
        rows.append(row)
    emit({"bench": "catalog_items", "delta": args.delta, "rounds": args.rounds, "sizes": rows})


if __name__ == "__main__":
    main()
