"""Catalog PATCH vs a whole PUT of the same change: how long a delta of ``--delta`` items (half added, half
removed; 2,000 by default) takes until EVERY model replica serves it, for a tree uploaded in each form, in one run.

The whole app runs in-process on Ray Serve with TWO model replicas. For each size, a random catalog is built (items
of 3 to 6 token ids below 49,152 after the chat template's last token, end token 2; the tree it spells has about
2.7 keys per item, reported) and uploaded, untimed, in each ``--forms`` form: ``catalog`` (``Content-Type:
application/x-ndjson``) and ``prefix_dict`` (an inline ``tree`` with its ``prefix_dict``, the way RTP-LLM users
write it), twice each: one scenario is PATCHed, the other gets the same change as a whole PUT in the same form.
Then, alternating in rounds so machine load hits both alike: a PATCH of the delta, and the PUT of the whole new item
set. Both return only once every live replica acknowledged the new version, so their wall time is the
request-to-every-replica-serving latency; ``--pause`` seconds follow the first uploads and each whole PUT (the
manager reads an inline tree's items once no write has come for 2 s, for a first PATCH: that work is not the next
PATCH's). A tree uploaded as ``prefix_dict`` is turned into its items at its first PATCH (``first_patch_s``, one per
``--first-patches``, each after a PUT of the tree, outside the p50/p95 of the later PATCHes but in the target check:
from the items read in the background; a PATCH that comes sooner waits for that read, about 1.9 s at 10^6 items);
the PATCHes after it are deltas of a catalog. After the last round, one generation checks that the
answer is an item of the current version.

For comparison in the same run, the manager's table work of one PATCH is timed in this process: the overlay version
(``processors.kinds.tree.tables.overlay.overlay_tables``, what the manager does since 2026-12-01, its fold checked equal to
the full compile), the delta applied to the base's tables along the changed paths with every array renumbered
(``processors.kinds.tree.tables.delta.patch_tables``, what it did before), and a full compile of the new items
(``catalog_tables``), checked equal.

Targets: a PATCH of 2,000 items with p95 at most 0.3 s at 10^6 items and 0.5 s at 10^7, for both forms.

    python bench/catalog_patch.py [--quick] [--items 270000,1000000] [--rounds 5] [--delta 2000]
        [--forms catalog,prefix_dict] [--replica-table-delta auto|always|never] [--no-put] [--first-patches 1]
"""

from __future__ import annotations

import argparse
import hashlib
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
TARGETS_S = {1_000_000: 0.3, 10_000_000: 0.5}  # items -> PATCH p95 target


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


def prefix_dict_body(items: list[list[int]], start: int) -> bytes:
    """An inline tree scenario whose ``prefix_dict`` spells ``items`` (the tree file text of the catalog)."""
    from processors.kinds.tree.catalog.catalog import Catalog, tree_file_bytes

    tree = tree_file_bytes(Catalog.from_items(start, END, [tuple(i) for i in items]))
    return b'{"type":"tree","max_new_tokens":8,"tree":' + tree + b"}"


def in_process_patch(items: list[list[int]], start: int, add: list, remove: list) -> dict:
    """The manager's work of one PATCH in this process: the delta applied to the item list, the new catalog's bytes
    and hash, and its tables along the changed paths against a full compile of the new items (checked equal)."""
    from processors.kinds.tree.catalog.parse import parse_catalog
    from processors.kinds.tree.patch.items import apply_tree_delta
    from processors.kinds.tree.tables.compile import catalog_tables
    from processors.kinds.tree.tables.delta import patch_tables
    from processors.kinds.tree.tables.overlay import fold, overlay_tables

    catalog = parse_catalog(catalog_bytes(items, start), vocab_size=VOCAB)
    base = catalog_tables(catalog, VOCAB)
    out: dict = {"states": base.n_states, "edges": base.n_edges}
    t0 = time.perf_counter()
    new, _ = apply_tree_delta(catalog, add, remove, vocab_size=VOCAB)
    out["apply_delta_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    hashlib.sha256(new.content()).hexdigest()  # the new version's bytes and hash (stored as a delta of the base's)
    out["bytes_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    full = catalog_tables(new, VOCAB)
    out["full_compile_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    patched = patch_tables(base, add, remove)
    out["delta_tables_s"] = time.perf_counter() - t0
    assert patched is not None and patched.version == full.version, "patched tables differ from a full compile"
    out["full_over_delta"] = ratio(out["full_compile_s"], out["delta_tables_s"])
    t0 = time.perf_counter()
    over = overlay_tables(base, add, remove)  # what the manager does since 2026-12-01 (a catalog without metadata)
    out["overlay_tables_s"] = time.perf_counter() - t0
    assert fold(over).version == full.version, "the overlay's fold differs from a full compile"
    out["delta_over_overlay"] = ratio(out["delta_tables_s"], out["overlay_tables_s"])
    out["overlay_appended_edges"] = int(over.tokens.size - base.tokens.size)
    return {k: round(v, 3) if isinstance(v, float) and k.endswith("_s") else v for k, v in out.items()}


def delta_of(items: list[list[int]], delta: int) -> tuple[list, list]:
    """``(add, remove)``: half of ``delta`` new 7-id items, half existing items."""
    rng = np.random.default_rng(2)
    remove = [list(items[j]) for j in rng.choice(len(items), size=delta - delta // 2, replace=False)]
    return [rng.integers(3, VOCAB, size=7).tolist() for _ in range(delta // 2)], remove


def upload(bench, name: str, form: str, items: list[list[int]], start: int) -> float:
    if form == "catalog":
        data, kind = catalog_bytes(items, start), "application/x-ndjson"
    else:
        data, kind = prefix_dict_body(items, start), "application/json"
    t0 = time.perf_counter()
    r = bench.session.put(f"{bench.url}/admin/scenarios/{name}", data=data,
                          headers={**bench.admin, "Content-Type": kind}, timeout=900)
    assert r.status_code == 200, r.text[:500]
    return time.perf_counter() - t0


def run_form(bench, form: str, items: list[list[int]], start: int, args, tokenizer) -> dict:
    n = len(items)
    patched, whole = f"bench-{form.replace('_', '-')}-{n}-patch", f"bench-{form.replace('_', '-')}-{n}-put"
    first_put_s = upload(bench, patched, form, items, start)
    if not args.no_put:
        upload(bench, whole, form, items, start)
    log(f"{form}: {n} items uploaded {'once' if args.no_put else 'twice'} (first PUT {first_put_s:.2f} s, untimed)")
    time.sleep(args.pause)  # (the first PATCH too comes --pause s after the last write, as each round's PATCH does)
    current = {tuple(i) for i in items}
    rng = np.random.default_rng(1)
    first_patch_s, put_s, patch_s = [], [], []

    def patch_once() -> tuple[float, dict]:
        nonlocal current
        pool = sorted(current)
        remove = [list(pool[j]) for j in rng.choice(len(pool), size=args.delta - args.delta // 2, replace=False)]
        add = [rng.integers(3, VOCAB, size=7).tolist() for _ in range(args.delta // 2)]  # 7 ids: never present
        t0 = time.perf_counter()
        r = bench.session.patch(f"{bench.url}/admin/scenarios/{patched}", json={"add": add, "remove": remove},
                                headers=bench.admin, timeout=900)
        took = time.perf_counter() - t0
        assert r.status_code == 200, r.text[:500]
        answer = r.json()
        assert answer["added"] == len(add) and answer["removed"] == len(remove), answer
        current = (current - {tuple(i) for i in remove}) | {tuple(i) for i in add}
        return took, answer

    for k in range(args.rounds + (form == "prefix_dict")):
        took, answer = patch_once()
        put_took = (float("nan") if args.no_put  # the same change, whole
                    else upload(bench, whole, form, [list(i) for i in sorted(current)], start))
        time.sleep(args.pause)  # (an inline tree's items are read in the background after its PUT: not in the PATCH)
        if form == "prefix_dict" and k == 0:
            first_patch_s.append(took)
        else:
            patch_s.append(took)
            put_s.append(put_took)
        log(f"  {form} round {k + 1}: PATCH {took:.3f} s, whole PUT {put_took:.2f} s (version {answer['version']})")
    for k in range(1, args.first_patches if form == "prefix_dict" else 0):  # again: a PUT of the tree, its PATCH
        upload(bench, patched, form, [list(i) for i in sorted(current)], start)
        time.sleep(args.pause)
        took, answer = patch_once()
        first_patch_s.append(took)
        log(f"  {form} first PATCH {k + 1} after a PUT: {took:.3f} s (version {answer['version']})")
    for name in (patched,) if args.no_put else (patched, whole):  # the service answers with an item of the version it reports
        out = bench.session.post(f"{bench.url}/v1/generate", json={"scenario": name, "prompt": "Item:",
                                                                  "temperature": 1.5}, timeout=120).json()
        ids = list(out["outputs"][0]["token_ids"])
        ids = ids[:-1] if ids and ids[-1] == tokenizer.eos_token_id else ids
        assert tuple(ids) in current, ids
    return {"form": form, "first_put_s": round(first_put_s, 2),
            **({"first_patch_s": [round(t, 3) for t in first_patch_s],
                "first_patch_p95_s": round(percentile(first_patch_s, 95), 3)} if first_patch_s else {}),
            "patch_p50_s": round(percentile(patch_s, 50), 3), "patch_p95_s": round(percentile(patch_s, 95), 3),
            **({} if args.no_put else {
                "put_p50_s": round(percentile(put_s, 50), 3), "put_p95_s": round(percentile(put_s, 95), 3),
                "put_over_patch_p50": ratio(percentile(put_s, 50), percentile(patch_s, 50))})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", default="270000,1000000", help="catalog sizes in items (comma separated)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--delta", type=int, default=2000)
    parser.add_argument("--forms", default="catalog,prefix_dict")
    parser.add_argument("--pause", type=float, default=5.0, help="seconds after each whole PUT")
    parser.add_argument("--replica-table-delta", default="auto", choices=("auto", "always", "never"),
                        help="the replicas' setting: apply a PATCH to their tables or fetch the new ones (one node: "
                             "auto fetches)")
    parser.add_argument("--compile-nice", type=int, default=None,
                        help="the manager's compile_nice setting (default: the service's, 10)")
    parser.add_argument("--no-in-process", action="store_true",
                        help="skip the in-process comparison in a service run (at 10^7 items its full compile alone "
                             "peaks at 13 GiB)")
    parser.add_argument("--first-patches", type=int, default=1,
                        help="prefix_dict: first PATCHes timed, each after a PUT of the tree (--pause s before it)")
    parser.add_argument("--quick", action="store_true", help="one small size, 2 rounds")
    parser.add_argument("--no-put", action="store_true",
                        help="PATCH rounds only: no second scenario for the whole PUTs (sizes where the manager's "
                             "write_memory_mb refuses two catalogs, 10^7 items on a 24 GiB machine)")
    parser.add_argument("--in-process-only", action="store_true",
                        help="only the in-process table work of one PATCH per size (no service)")
    args = parser.parse_args()
    sizes = [4000] if args.quick else [int(x) for x in args.items.split(",")]
    if args.quick:
        args.rounds = 2
    forms = args.forms.split(",")

    from deployments.examples import chat_root_token_id
    from deployments.model_loader import load_tokenizer

    tokenizer = load_tokenizer(None)
    start = chat_root_token_id(tokenizer)
    results = []
    if args.in_process_only:
        for n in sizes:
            items = make_items(n, seed=n)
            add, remove = delta_of(items, args.delta)
            results.append({"items": len(items), "in_process": in_process_patch(items, start, add, remove)})
            log(json.dumps(results[-1]))
        emit({"bench": "catalog_patch", "delta": args.delta, "sizes": results})
        return
    with ServeBench() as bench:
        bench.deploy(bench.settings(num_replicas=REPLICAS, torch_threads=1, seed_examples=False,
                                    replica_table_delta=args.replica_table_delta,
                                    **({} if args.compile_nice is None else {"compile_nice": args.compile_nice}),
                                    limits={"max_body_bytes": 1 << 30, "max_tree_keys": 50_000_000,
                                            "compile_timeout_s": 600}),
                     replicas=REPLICAS)
        for n in sizes:
            items = make_items(n, seed=n)
            add, remove = delta_of(items, args.delta)
            local = None if args.no_in_process else in_process_patch(items, start, add, remove)
            log(f"{len(items)} items: in process {json.dumps(local)}")
            per_form = [run_form(bench, form, items, start, args, tokenizer) for form in forms]
            results.append({"items": len(items), "in_process": local, "forms": per_form})
            log(json.dumps(results[-1]))
    targets = []
    for size, limit in TARGETS_S.items():
        near = [r for r in results if abs(r["items"] - size) <= size * 0.1]
        for r in near:
            for f in r["forms"]:
                worst = max(f["patch_p95_s"], f.get("first_patch_p95_s", 0.0))  # (first PATCHes after a PUT too)
                targets.append({"items": r["items"], "form": f["form"], "target_patch_p95_s": limit,
                                "patch_p95_s": f["patch_p95_s"], "first_patch_p95_s": f.get("first_patch_p95_s"),
                                "met": worst <= limit})
    emit({"bench": "catalog_patch", "replicas": REPLICAS, "replica_table_delta": args.replica_table_delta,
          "delta": args.delta, "rounds": args.rounds,
          "sizes": results, "targets": targets})


if __name__ == "__main__":
    main()
