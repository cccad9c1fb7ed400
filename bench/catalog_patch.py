"""Catalog PATCH vs PUT: how long a delta of 1,000 items takes until EVERY model replica serves it, against a
PUT of the whole catalog, in one run.

The whole app runs in-process on Ray Serve with TWO model replicas. For each size, a random catalog is built (items
of 3 to 6 token ids below 49,152 after the chat template's last token, end token 2; the tree it spells has about
3.7 keys per item, reported) and PUT once (``Content-Type: application/x-ndjson``, untimed). Then, alternating in
rounds so machine load hits both alike: a PUT of the whole catalog with one item changed (a real new version) and a
PATCH of ``--delta`` items (half added, half removed). Both return only once every live replica acknowledged the new
version, so their wall time is the request-to-every-replica-serving latency. After the last round, one generation
checks that the answer is an item of the current version.

For comparison in the same run, the manager's CPU work of a PATCH is timed in this process: applying the delta to
the parsed catalog and building the tables straight from its items (``catalog_tables``, what the manager does), and,
for the ratio, the former path to the same tables: writing the tree it spells (``tree_file_bytes``), loading it
(``config.load_tree``) and building the tables (``processors.tables.build_tree_tables``).

Target (issue 12): a delta of 1,000 items on a 10^6-key tree in at most 0.5 s.

    python bench/catalog_patch.py [--quick] [--items 27000,270000] [--rounds 5] [--delta 1000]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import emit, log, ratio  # noqa: E402
from bench._serve import ServeBench, percentile  # noqa: E402

VOCAB = 49_152
END = 2
REPLICAS = 2
TARGET_KEYS, TARGET_S = 1_000_000, 0.5


def make_items(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, 7, size=n)
    flat = rng.integers(3, VOCAB, size=int(lengths.sum())).tolist()
    out, pos = [], 0
    for length in lengths.tolist():
        out.append(flat[pos:pos + length])
        pos += length
    return list({tuple(i): i for i in out}.values())  # distinct


def catalog_bytes(items: list[list[int]], start: int) -> bytes:
    head = json.dumps({"start_token_id": start, "end_token_id": END, "max_new_tokens": 8})
    return (head + "\n" + "\n".join("[" + ",".join(map(str, i)) + "]" for i in items) + "\n").encode()


def in_process_patch(items: list[list[int]], start: int, delta: int, seed: int) -> dict:
    """The manager's CPU work of one PATCH, step by step, in this process."""
    from config import load_tree
    from deployments.manager.catalog import catalog_tables, parse_catalog, tree_file_bytes
    from deployments.manager.catalog_delta import apply_tree_delta
    from processors.tables import build_tree_tables

    catalog = parse_catalog(catalog_bytes(items, start), vocab_size=VOCAB)
    rng = np.random.default_rng(seed)
    add = [rng.integers(3, VOCAB, size=7).tolist() for _ in range(delta // 2)]  # 7 ids: never an existing item
    remove = [list(i) for i in items[: delta - delta // 2]]
    out = {}
    t0 = time.perf_counter()
    new, _ = apply_tree_delta(catalog, add, remove, vocab_size=VOCAB)
    out["apply_delta_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    direct = catalog_tables(new, VOCAB)
    out["catalog_tables_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    text = tree_file_bytes(new)
    out["tree_file_s"] = time.perf_counter() - t0
    path = Path("/tmp") / f"cs-bench-catalog-{seed}.json"
    path.write_bytes(text)
    try:
        t0 = time.perf_counter()
        tree = load_tree(str(path), vocab_size=VOCAB)
        out["load_tree_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        reference = build_tree_tables(tree, VOCAB)
        out["build_tables_s"] = time.perf_counter() - t0
        out["keys"] = len(tree)
    finally:
        path.unlink()
    assert reference.version == direct.version, "catalog_tables differs from the tree-file path"
    out["total_s"] = out["apply_delta_s"] + out["catalog_tables_s"]
    out["tree_file_path_total_s"] = out["apply_delta_s"] + out["tree_file_s"] + out["load_tree_s"] + out["build_tables_s"]
    out["tables_speedup"] = ratio(out["tree_file_s"] + out["load_tree_s"] + out["build_tables_s"], out["catalog_tables_s"])
    return {k: round(v, 3) if isinstance(v, float) and k.endswith("_s") else v for k, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", default="27000,270000", help="catalog sizes in items (comma separated)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--delta", type=int, default=1000)
    parser.add_argument("--quick", action="store_true", help="one small size, 2 rounds")
    args = parser.parse_args()
    sizes = [4000] if args.quick else [int(x) for x in args.items.split(",")]
    rounds = 2 if args.quick else args.rounds

    from deployments.examples import chat_root_token_id
    from deployments.model_loader import load_tokenizer

    tokenizer = load_tokenizer(None)
    start = chat_root_token_id(tokenizer)
    results = []
    with ServeBench() as bench:
        bench.deploy(bench.settings(num_replicas=REPLICAS, torch_threads=1, seed_examples=False,
                                    limits={"max_body_bytes": 256 << 20, "max_tree_keys": 20_000_000,
                                            "compile_timeout_s": 300}),
                     replicas=REPLICAS)
        session, url = bench.session, bench.url
        ndjson = {**bench.admin, "Content-Type": "application/x-ndjson"}
        for n in sizes:
            name = f"bench-cat-{n}"
            items = make_items(n, seed=n)
            data = catalog_bytes(items, start)
            log(f"{len(items)} items, {len(data) / 1e6:.1f} MB: first PUT (untimed)")
            t0 = time.perf_counter()
            r = session.put(f"{url}/admin/scenarios/{name}", data=data, headers=ndjson, timeout=600)
            assert r.status_code == 200, r.text[:500]
            first_put_s = time.perf_counter() - t0
            current = {tuple(i) for i in items}
            rng = np.random.default_rng(1)
            put_s, patch_s = [], []
            for k in range(rounds):
                variant = list(items)
                variant[0] = [3 + k, 4 + k, 5, 6, 7, 8, 9]  # one item changed: a new version
                body = catalog_bytes(variant, start)
                t0 = time.perf_counter()
                r = session.put(f"{url}/admin/scenarios/{name}", data=body, headers=ndjson, timeout=600)
                put_s.append(time.perf_counter() - t0)
                assert r.status_code == 200, r.text[:500]
                current = {tuple(i) for i in variant}
                pool = sorted(current)
                remove = [list(pool[j]) for j in rng.choice(len(pool), size=args.delta - args.delta // 2, replace=False)]
                add = [rng.integers(3, VOCAB, size=7).tolist() for _ in range(args.delta // 2)]
                t0 = time.perf_counter()
                r = session.patch(f"{url}/admin/scenarios/{name}", json={"add": add, "remove": remove},
                                  headers=bench.admin, timeout=600)
                patch_s.append(time.perf_counter() - t0)
                assert r.status_code == 200, r.text[:500]
                answer = r.json()
                assert answer["added"] == len(add) and answer["removed"] == len(remove), answer
                current = (current - {tuple(i) for i in remove}) | {tuple(i) for i in add}
                log(f"  round {k + 1}: PUT {put_s[-1]:.2f} s, PATCH {patch_s[-1]:.2f} s (version {answer['version']})")
            # the service answers with an item of the version it reports
            out = session.post(f"{url}/v1/generate", json={"scenario": name, "prompt": "Item:", "temperature": 1.5},
                               timeout=120).json()
            ids = list(out["outputs"][0]["token_ids"])
            ids = ids[:-1] if ids and ids[-1] == tokenizer.eos_token_id else ids
            assert tuple(ids) in current, ids
            local = in_process_patch(items, start, args.delta, seed=n)
            results.append({
                "items": len(items), "keys": local["keys"], "body_mb": round(len(data) / 1e6, 1),
                "first_put_s": round(first_put_s, 2),
                "put_p50_s": round(percentile(put_s, 50), 3), "put_p95_s": round(percentile(put_s, 95), 3),
                "patch_p50_s": round(percentile(patch_s, 50), 3), "patch_p95_s": round(percentile(patch_s, 95), 3),
                "patch_over_put_p50": ratio(percentile(patch_s, 50), percentile(put_s, 50)),
                "patch_in_process": local,
            })
            log(json.dumps(results[-1]))
    near = min(results, key=lambda r: abs(r["keys"] - TARGET_KEYS))
    emit({"bench": "catalog_patch", "replicas": REPLICAS, "delta": args.delta, "rounds": rounds, "sizes": results,
          "target": {"keys": TARGET_KEYS, "patch_p95_s": TARGET_S, "measured_keys": near["keys"],
                     "measured_patch_p95_s": near["patch_p95_s"], "met": near["patch_p95_s"] <= TARGET_S
                     and near["keys"] >= TARGET_KEYS * 0.9}})


if __name__ == "__main__":
    main()
