"""Generative retrieval with item controls: 16 clients each asking for 16 items of a semantic-id catalog, with
1,000 excluded items per request, against the same requests without item controls.

The catalog holds ``--items`` items of ``--levels`` codes (256 codes per level; code ``c`` of level ``l`` is token
``BASE_TOKEN + 256 * l + c`` of the vocabulary), written as a tree file and compiled as a stored scenario would be.
Two workloads, each run with and without controls in alternating rounds (the ratio is measured in one run):

* ``beams``: ``num_beams = n = 16`` per request, ``exclude`` = 1,000 random catalog items;
* ``sampled_distinct``: ``n = 16`` sampled rows at temperature 1 with ``distinct: true`` and the same ``exclude``.

Reported per workload and mode: requests per second, items per second, the chain's share of the decode step
(``chain_seconds / step_seconds`` of the engine), the admission cost of the controls (walking 1,000 excluded
items into the request's book), and validity: every returned item is in the catalog, not excluded by its request,
and distinct within its request. Runs on the decode engine directly (no Ray), like ``bench/beams.py``; the last
line is one JSON object.

    .venv/bin/python bench/retrieval.py                    # 10^6 items
    .venv/bin/python bench/retrieval.py --items 100000     # a smaller catalog
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import emit, log  # noqa: E402
from bench.beams import run as run_jobs  # noqa: E402

CODES = 256
BASE_TOKEN = 1000
START_TOKEN = 900


def catalog(items: int, levels: int, seed: int = 0) -> list[tuple[int, ...]]:
    """``items`` distinct semantic ids as token tuples (random codes per level)."""
    rng = random.Random(seed)
    out: set[tuple[int, ...]] = set()
    while len(out) < items:
        out.add(tuple(BASE_TOKEN + level * CODES + rng.randrange(CODES) for level in range(levels)))
    return sorted(out)


def write_tree(items: list[tuple[int, ...]], end_token_id: int, path: Path) -> None:
    children: dict[str, set[int]] = {}
    for item in items:
        key = str(START_TOKEN)
        for tok in item:
            children.setdefault(key, set()).add(tok)
            key += "_" + str(tok)
        children.setdefault(key, set()).add(end_token_id)
    body = {"start_token_id": START_TOKEN, "end_token_id": end_token_id,
            "prefix_dict": {k: sorted(v) for k, v in children.items()}}
    path.write_text(json.dumps(body))


def run(engine, requests, concurrent: bool = True):
    """Submit ``requests`` (all at once, or each after the previous ended); seconds and collectors."""
    return run_jobs(engine, lambda: requests, concurrent)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--items", type=int, default=1_000_000)
    ap.add_argument("--levels", type=int, default=4)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--per-request", type=int, default=16, help="items per request (num_beams = n, or n sampled)")
    ap.add_argument("--exclude", type=int, default=1000, help="excluded items per request")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--workloads", default="beams,sampled_distinct")
    args = ap.parse_args()

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from processors.scenarios import load_scenario
    from deployments.engines import EngineRequest, SamplingParams
    from deployments.engines.transformers import DecodeEngine
    from deployments.model_loader import load_model_and_tokenizer
    from processors import build_prompt_ids, compile_scenario
    from processors.items import resolve_exclude
    from processors.tables import _item_metrics

    model, tokenizer = load_model_and_tokenizer(None)
    model = model.eval()
    end = tokenizer.eos_token_id
    t0 = time.perf_counter()
    items = catalog(args.items, args.levels)
    item_set = set(items)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "catalog.json"
        write_tree(items, end, path)
        t_write = time.perf_counter() - t0
        t0 = time.perf_counter()
        compiled = compile_scenario(load_scenario({"type": "tree", "path": str(path)}), tokenizer)
        t_compile = time.perf_counter() - t0
    tables = compiled.constraint
    t0 = time.perf_counter()
    _item_metrics(tables)  # min_remaining / item_count again, timed alone (the compile above already made them)
    t_metrics = time.perf_counter() - t0
    log(f"catalog of {len(items)} items: written in {t_write:.1f} s, compiled in {t_compile:.1f} s "
        f"({tables.n_states} states, {tables.n_edges} edges), item metrics in {t_metrics:.2f} s")

    k = args.per_request
    engine = DecodeEngine(model, tokenizer, max_batch_size=max(16, args.clients * k), prefix_cache_tokens=0).start()
    rng = random.Random(1)
    prompts = [build_prompt_ids(compiled, tokenizer, prompt=f"User {i} watched items 12, {i * 7}, {i * 13}; next:")
               for i in range(args.clients)]
    excluded = [rng.sample(items, args.exclude) for _ in range(args.clients)]
    max_new = args.levels + 1
    admission: list[float] = []

    def requests(workload: str, controls: bool):
        out = []
        for p, ex in zip(prompts, excluded):
            item_req = None
            if controls:
                t = time.perf_counter()
                item_req = resolve_exclude(tables, [list(i) for i in ex], distinct=workload != "beams")
                admission.append(time.perf_counter() - t)
            if workload == "beams":
                out.append(EngineRequest(prompt_ids=p, compiled=compiled, max_new_tokens=max_new, n=k, num_beams=k,
                                         items=item_req))
            else:
                out.append(EngineRequest(prompt_ids=p, compiled=compiled, max_new_tokens=max_new, n=k,
                                         sampling=SamplingParams(temperature=1.0), items=item_req))
        return out

    def check(waiters, controls: bool) -> dict:
        total = in_catalog = not_excluded = distinct_requests = 0
        for w, ex in zip(waiters, excluded):
            ex_set = set(ex)
            got = []
            for ev in w.finished.values():
                total += 1
                item = tuple(ev.token_ids[:-1]) if ev.token_ids and ev.token_ids[-1] == end else None
                got.append(item)
                in_catalog += item in item_set
                not_excluded += item is not None and item not in ex_set
            distinct_requests += len(set(got)) == len(got) and None not in got
        return {"returned": total, "in_catalog": in_catalog, "not_excluded": not_excluded,
                "requests_all_distinct": distinct_requests}

    results = {}
    for workload in args.workloads.split(","):
        run(engine, requests(workload, True))  # warm-up
        stats = {m: {"seconds": [], "chain": 0.0, "step": 0.0, "valid": None} for m in ("plain", "controls")}
        for _ in range(args.rounds):
            for mode in ("plain", "controls"):
                reqs = requests(workload, mode == "controls")
                before = engine.stats()
                secs, waiters = run(engine, reqs)
                after = engine.stats()
                s = stats[mode]
                s["seconds"].append(secs)
                s["chain"] += after["chain_seconds"] - before["chain_seconds"]
                s["step"] += after["step_seconds"] - before["step_seconds"]
                v = check(waiters, mode == "controls")
                if s["valid"] is None:
                    s["valid"] = v
                else:
                    s["valid"] = {key: s["valid"][key] + v[key] for key in v}
                log(f"{workload} {mode}: {secs:.2f} s, {v}")
        res = {}
        for mode, s in stats.items():
            best = min(s["seconds"])
            res[mode] = {
                "best_s": round(best, 3),
                "req_per_s": round(args.clients / best, 2),
                "items_per_s": round(args.clients * k / best, 1),
                "chain_share_of_step": round(s["chain"] / s["step"], 4) if s["step"] else None,
                **s["valid"],
            }
        res["controls_over_plain_time"] = round(min(stats["controls"]["seconds"]) / min(stats["plain"]["seconds"]), 3)
        results[workload] = res
    engine.stop()
    emit({
        "bench": "retrieval", "device": f"cpu x{torch.get_num_threads()} threads", "items": len(items),
        "levels": args.levels, "states": tables.n_states, "clients": args.clients, "per_request": k,
        "excluded_per_request": args.exclude, "compile_s": round(t_compile, 2), "item_metrics_s": round(t_metrics, 3),
        "admission_ms_median": round(1000 * sorted(admission)[len(admission) // 2], 2) if admission else None,
        **results,
    })


if __name__ == "__main__":
    main()
