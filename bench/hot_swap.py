"""Hot swap: how long a PUT of a new tree version takes until EVERY model replica serves it.

The whole app runs in-process on Ray Serve with TWO model replicas (as in ``tests/serve``). For
synthetic trees of 10^3 and 10^5 ``prefix_dict`` keys (the tree file format of docs/design.md, ids below
49,152, end token 2, root key ``str(start)`` with ``start`` = the chat template's last token), new
versions are PUT inline (JSON body, serialized before the clock starts) one after another, ``--pause``
seconds apart (untimed, so background work set off by one PUT does not land in the next); each
version is a different random tree, so each PUT is a real new version. ``PUT`` returns only once
every live replica acknowledged the new version (read-your-writes), so its wall time is the
PUT-to-every-replica-serving latency. Right after each PUT, ``/healthz`` is read to check that
both replicas report the new version. One untimed PUT per size comes first (reported separately).

For comparison in the same run, the manager's CPU work is timed in this process on the same
bodies: ``json.loads`` of the body (the ingress), a pickle round trip of the dict (the Serve handle
call to the manager), validation (``json.dumps`` + ``config.load_scenario``, as the manager does),
``processors.compile_scenario`` with ``deployments.model_loader.load_tokenizer()``, the
``json.dumps`` the store writes to Redis, and a pickle round trip of the compiled tables (the
``ray.put``/``ray.get`` to the replicas). The JSON shows which share of the PUT each part is, and
the CPU seconds per PUT that each Serve process (proxy, ingress, manager, model replicas) used over
the timed PUTs, read from ``/proc`` (Ray's process titles) for the Ray node this process started.
After the last PUT of each size, one generation checks that the answer is a path of that version.

Target: p95 PUT latency at most 1 s for 10^5 keys.

    python bench/hot_swap.py [--quick] [--sizes 1000:10,100000:6]
"""

from __future__ import annotations

import argparse
import gc
import json
import pickle
import statistics
import sys
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import emit, iter_tree, log, ratio  # noqa: E402
from config import is_tree_path  # noqa: E402
from bench._serve import ServeBench, cpu_delta, percentile, replica_versions, serve_process_cpu  # noqa: E402

VOCAB = 49_152  # SmolLM2's vocabulary: every id stays below it
END = 2
REPLICAS = 2
TARGET_KEYS, TARGET_P95_S = 100_000, 1.0


def make_body(n_keys: int, start: int, seed: int) -> dict:
    prefix = dict(iter_tree(n_keys, VOCAB, start_token_id=start, end_token_id=END, seed=seed))
    assert len(prefix) == n_keys and str(start) in prefix
    return {"type": "tree", "tree": {"start_token_id": start, "end_token_id": END, "prefix_dict": prefix}}


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def in_process_phases(raw: bytes, tokenizer, reps: int) -> dict:
    """Median seconds of each stand-in phase of a PUT, measured here on ``raw`` (the PUT body)."""
    from config import load_scenario
    from processors import compile_scenario

    def phase(key: str, fn):
        gc.collect()  # a collection triggered by earlier garbage should not land in this phase
        out, dt = _timed(fn)
        times[key].append(dt)
        return out

    times: dict[str, list[float]] = {k: [] for k in (
        "ingress_json_loads", "handle_pickle_roundtrip", "validate_json_dumps", "validate_load_scenario",
        "compile", "store_json_dumps", "tables_pickle_roundtrip")}
    table_bytes = 0
    for _ in range(reps):
        body = phase("ingress_json_loads", lambda: json.loads(raw))
        phase("handle_pickle_roundtrip", lambda: pickle.loads(pickle.dumps(body, protocol=5)))
        phase("validate_json_dumps", lambda: json.dumps(body))
        scenario = phase("validate_load_scenario", lambda: load_scenario(body))
        compiled = phase("compile", lambda: compile_scenario(scenario, tokenizer))
        phase("store_json_dumps", lambda: json.dumps(body, separators=(",", ":"), ensure_ascii=False))
        blob = pickle.dumps(compiled, protocol=5)
        table_bytes = len(blob)
        phase("tables_pickle_roundtrip", lambda: pickle.loads(pickle.dumps(compiled, protocol=5)))
    out = {f"{k}_s": round(statistics.median(v), 4) for k, v in times.items()}
    out["compiled_tables_pickled_bytes"] = table_bytes
    return out


def run_size(bench: ServeBench, tokenizer, start: int, n_keys: int, n_puts: int, reps: int, pause: float) -> dict:
    name = f"bench-tree-{n_keys}"
    # Bodies are built and serialized before the clock starts; seed k gives version k a new tree.
    t0 = time.perf_counter()
    bodies = [make_body(n_keys, start, seed=1000 * n_keys + k) for k in range(n_puts + 1)]
    raws = [json.dumps(b, separators=(",", ":")).encode() for b in bodies]
    last_tree = bodies[-1]["tree"]
    del bodies  # keep this process's heap (and its GC pauses) small during the timings
    gc.collect()
    sizes = [len(r) for r in raws]
    log(f"[{n_keys} keys] {n_puts + 1} trees built in {time.perf_counter() - t0:.1f} s; "
        f"body {min(sizes) / 1e6:.2f}-{max(sizes) / 1e6:.2f} MB")

    first, first_s = _timed(lambda: bench.put(name, raws[0]))
    log(f"[{n_keys} keys] untimed first PUT: v{first['version']} in {first_s:.3f} s")
    latencies, versions = [], []
    all_on_new, health_checks = True, []
    cpu_before, cpu_after = serve_process_cpu(), {}
    for k in range(1, n_puts + 1):
        time.sleep(pause)  # isolated PUTs: background work set off by the previous one has finished
        result, dt = _timed(lambda: bench.put(name, raws[k]))
        if k == n_puts:
            time.sleep(1.0)  # let work the last PUT set off in the background finish
            cpu_after = serve_process_cpu()
        v = result["version"]
        views = replica_versions(bench.health())
        ok = len(views) == REPLICAS and all(vs.get(name) == v for vs in views.values())
        all_on_new &= ok
        health_checks.append({"version": v, "replicas": {rid: vs.get(name) for rid, vs in views.items()}})
        latencies.append(dt)
        versions.append(v)
        log(f"[{n_keys} keys] PUT v{v}: {dt:.3f} s; /healthz: {len(views)} replicas, "
            f"{'all on v%d' % v if ok else 'NOT all on the new version: %s' % health_checks[-1]['replicas']}")
    if len(set(versions)) != len(versions):
        raise RuntimeError(f"versions repeat: {versions}")

    # One request on the last version: served by it, and its answer is a path of that tree.
    r = requests.post(f"{bench.url}/v1/generate", timeout=120, json={
        "scenario": name, "messages": [{"role": "user", "content": "Pick one."}], "temperature": 1.0,
        "max_new_tokens": 16})
    gen = {"status": r.status_code}
    if r.status_code == 200:
        body = r.json()
        out = body["outputs"][0]
        gen.update(version=body["version"], version_is_last=body["version"] == versions[-1],
                   finish_reason=out["finish_reason"],
                   valid_path=out["finish_reason"] != "stop" or is_tree_path(last_tree, out["token_ids"]))
    log(f"[{n_keys} keys] generation after the last PUT: {gen}")

    log(f"[{n_keys} keys] timing the manager's work in-process ({reps} rep(s))")
    phases = in_process_phases(raws[-1], tokenizer, reps)
    p50 = percentile(latencies, 50)
    cpu = phases["validate_json_dumps_s"] + phases["validate_load_scenario_s"] + phases["compile_s"]
    stand_in = sum(v for k, v in phases.items() if k.endswith("_s"))
    return {
        "keys": n_keys,
        "puts_timed": n_puts,
        "body_bytes": {"min": min(sizes), "max": max(sizes)},
        "first_put_s": round(first_s, 4),
        "put_latency_s": {"p50": round(p50, 4), "p95": round(percentile(latencies, 95), 4),
                          "min": round(min(latencies), 4), "max": round(max(latencies), 4),
                          "all": [round(x, 4) for x in latencies]},
        "healthz_all_replicas_on_new_version": all_on_new,
        "healthz_checks": health_checks if not all_on_new else None,
        "generate_after_last_put": gen,
        "in_process": phases,
        # CPU seconds per timed PUT of each Serve process (Ray's process titles), idle time between PUTs included
        "server_cpu_s_per_put": cpu_delta(cpu_before, cpu_after, n_puts),
        "compile_share_of_put_p50": ratio(phases["compile_s"], p50),
        "validate_plus_compile_share_of_put_p50": ratio(cpu, p50),
        "all_in_process_stand_ins_share_of_put_p50": ratio(stand_in, p50),
        # what the stand-ins do not cover: HTTP and proxy, Serve handle hops, the Redis write (AOF fsync),
        # ray.put/ray.get of the tables, the replicas' long-poll wake-up and acks
        "rest_of_put_p50_s": round(p50 - stand_in, 4),
        "put_p50_over_compile": ratio(p50, phases["compile_s"]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 PUTs of 10^3 keys and 2 of 10^5 keys, 1 rep in-process")
    ap.add_argument("--sizes", default="1000:10,100000:6", help="comma-separated KEYS:PUTS")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of the in-process phase timing")
    ap.add_argument("--pause", type=float, default=1.0, help="seconds between two timed PUTs (not timed)")
    ap.add_argument("--torch-threads", type=int, default=1, help="torch threads per model replica")
    args = ap.parse_args()
    if args.quick:
        args.sizes, args.reps, args.pause = "1000:3,100000:2", 1, 0.5
    sizes = [tuple(int(x) for x in part.split(":")) for part in args.sizes.split(",") if part.strip()]

    from deployments.examples import chat_root_token_id
    from deployments.model_loader import load_tokenizer

    t_start = time.perf_counter()
    tokenizer = load_tokenizer()
    start = chat_root_token_id(tokenizer)
    results = {}
    with ServeBench() as bench:
        settings = bench.settings(num_replicas=REPLICAS, max_batch_size=16, num_cpus_per_replica=1,
                                  torch_threads=args.torch_threads)
        log(f"deploying with {REPLICAS} model replicas")
        deploy_s = bench.deploy(settings, replicas=REPLICAS)
        log(f"ready after {deploy_s:.1f} s")
        for n_keys, n_puts in sizes:
            results[str(n_keys)] = run_size(bench, tokenizer, start, n_keys, n_puts, args.reps, args.pause)

    target = results.get(str(TARGET_KEYS))
    p95 = target["put_latency_s"]["p95"] if target else None
    met = p95 is not None and p95 <= TARGET_P95_S
    for n, res in results.items():
        lat, ph = res["put_latency_s"], res["in_process"]
        log(f"{n:>7} keys: PUT p50 {lat['p50']:.3f} s, p95 {lat['p95']:.3f} s; compile alone {ph['compile_s']:.3f} s "
            f"(validate {ph['validate_json_dumps_s'] + ph['validate_load_scenario_s']:.3f} s); healthz all on new version: {res['healthz_all_replicas_on_new_version']}")
    log(f"target p95 <= {TARGET_P95_S} s at {TARGET_KEYS} keys: {p95} s -> {'met' if met else 'NOT met'}")
    emit({
        "benchmark": "hot_swap",
        "setup": {"num_replicas": REPLICAS, "torch_threads": args.torch_threads, "start_token_id": start,
                  "end_token_id": END, "vocab": VOCAB, "body": "tree inline in the PUT JSON body",
                  "pause_between_puts_s": args.pause,
                  "quick": args.quick},
        "deploy_s": round(deploy_s, 1),
        "sizes": results,
        "healthz_always_on_new_version": all(r["healthz_all_replicas_on_new_version"] for r in results.values()),
        "target": {"keys": TARGET_KEYS, "max_p95_s": TARGET_P95_S, "p95_s": p95, "met": met},
        "wall_s": round(time.perf_counter() - t_start, 1),
    })


if __name__ == "__main__":
    main()
