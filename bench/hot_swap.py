"""Hot swap: how long a PUT (and a PATCH) of a new tree version takes until EVERY model replica serves it, what
the replicas' memory does, and whether serving stalls while it happens.

The whole app runs in-process on Ray Serve with TWO model replicas (as in ``tests/serve``; ``--replicas`` changes
it). For synthetic trees of ``--sizes`` keys (the tree file format of docs/design.md, ids below 49,152, end token 2,
root key ``str(start)`` with ``start`` = the chat template's last token), new versions are PUT one after another,
``--pause`` seconds apart (untimed). Up to ``--inline-max`` keys the tree goes inline in the JSON body (serialized
before the clock starts); larger trees are written as tree files into the manager's tree directory and PUT by
``path`` (the manager reads the file once and stores its content). ``PUT`` returns only once every live replica
acknowledged the new version, so its wall time is the PUT-to-every-replica-serving latency; ``/healthz`` is read
after each PUT to check that both replicas report it. After the PUTs of a size, ``--patches`` PATCHes of 1,000 items
(500 removed, 500 added: token-id paths after the root) are timed the same way, and one generation checks that the
answer is a path of the last version. With ``--exact-too`` each timed inline PUT is preceded by a PUT of the same
tree in a body that the manager parses whole (an escaped character in its description keeps it off the split way of
``processors/kinds/tree/store/inline.py``): the two ways of reading a large inline tree compared in one run.

Memory: after the first PUT of a size and after the last one, the resident set (RSS), proportional
(PSS) and unique (USS) memory of every model replica process (``/proc/<pid>/smaps_rollup``), against the same
reading before the size's first PUT. Replicas read the tables through Ray's object store (zero-copy numpy), so
replicas on one node share them: a private copy per replica would show up as USS.

Stall (``--stall-keys``): 8 client threads send small label requests without pause; rounds alternate a
quiet window and a window in which versions of a ``--stall-keys`` tree are PUT back to back. The p95 latency of
the requests that started inside the swap windows is compared with the p95 of those in the quiet windows.

Targets: p95 PUT latency at most 0.5 s for 10^5 keys and 3 s for 10^6; stall p95 at most 1.5x the quiet p95.

    python bench/hot_swap.py [--quick] [--sizes 100000:6,1000000:4] [--stall-keys 1000000] [--exact-too]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import emit, iter_tree, log, ratio, write_tree_json  # noqa: E402
from processors.kinds.tree.treefile.load import is_tree_path  # noqa: E402
from bench._serve import APP_NAME, ServeBench, cpu_delta, percentile, replica_versions, serve_process_cpu  # noqa: E402

VOCAB = 49_152  # SmolLM2's vocabulary: every id stays below it
END = 2
TARGETS_P95_S = {100_000: 0.5, 1_000_000: 3.0}
STALL_TARGET = 1.5
PATCH_ITEMS = 1000
LABELS = ["positive", "negative", "neutral", "mixed", "unknown", "question", "complaint", "praise"]
MIB = 1 << 20


def make_prefix(n_keys: int, start: int, seed: int) -> dict[str, list[int]]:
    prefix = dict(iter_tree(n_keys, VOCAB, start_token_id=start, end_token_id=END, seed=seed))
    assert len(prefix) == n_keys and str(start) in prefix
    return prefix


def make_body(n_keys: int, start: int, seed: int) -> dict:
    tree = {"start_token_id": start, "end_token_id": END, "prefix_dict": make_prefix(n_keys, start, seed)}
    return {"type": "tree", "tree": tree, "max_new_tokens": 16}


def tree_items(prefix: dict[str, list[int]], start: int) -> list[list[int]]:
    """The items of a tree: the token ids after the root of every path the end token may end."""
    lead = f"{start}_"
    out = []
    for key, cands in prefix.items():
        path = [int(p) for p in key[len(lead):].split("_")] if key != str(start) else []
        for c in cands:
            if c == END:
                out.append(path)
            elif f"{key}_{c}" not in prefix:
                out.append(path + [c])
    return [p for p in out if p]


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def in_process_phases(raw: bytes, tokenizer, reps: int) -> dict:
    """Median seconds of each stand-in phase of a PUT, measured here on ``raw`` (the PUT body)."""
    from processors import ScenarioCompiler

    compiler = ScenarioCompiler(tokenizer, grammar_worker=None)

    def phase(key: str, fn):
        gc.collect()  # a collection triggered by earlier garbage should not land in this phase
        out, dt = _timed(fn)
        times[key].append(dt)
        return out

    times: dict[str, list[float]] = {k: [] for k in (
        "manager_json_loads", "parse_and_validate", "compile", "tables_pickle_roundtrip")}
    table_bytes = 0
    for _ in range(reps):
        body = phase("manager_json_loads", lambda: json.loads(raw))
        scenario = phase("parse_and_validate", lambda: compiler.parse(body))
        compiled = phase("compile", lambda: compiler.compile_now(scenario))
        blob = pickle.dumps(compiled, protocol=5)
        table_bytes = len(blob)
        phase("tables_pickle_roundtrip", lambda: pickle.loads(pickle.dumps(compiled, protocol=5)))
    out = {f"{k}_s": round(statistics.median(v), 4) for k, v in times.items()}
    out["compiled_tables_pickled_bytes"] = table_bytes
    return out


# --------------------------------------------------------------------------- memory of the replicas


def _smaps(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as fh:
        for line in fh:
            parts = line.split()
            if len(parts) >= 3 and parts[2] == "kB":
                out[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return out


def process_memory(role: str = "ModelReplica") -> dict[str, dict[str, float]]:
    """RSS, PSS and USS (MiB) of every process of a deployment of the app (Ray's process titles), by pid."""
    import psutil

    prefix = f"ray::ServeReplica:{APP_NAME}:{role}"
    out = {}
    for proc in psutil.Process().children(recursive=True):
        try:
            if not " ".join(proc.cmdline()).startswith(prefix):
                continue
            m = _smaps(proc.pid)
        except (psutil.Error, OSError):
            continue
        uss = m.get("Private_Clean", 0) + m.get("Private_Dirty", 0)
        out[str(proc.pid)] = {"rss_mib": round(m.get("Rss", 0) / MIB, 1), "pss_mib": round(m.get("Pss", 0) / MIB, 1),
                              "uss_mib": round(uss / MIB, 1)}
    return out


def memory_delta(before: dict, after: dict) -> dict[str, dict[str, float]]:
    return {pid: {k: round(v - before.get(pid, {}).get(k, 0.0), 1) for k, v in m.items()} for pid, m in after.items()}


# --------------------------------------------------------------------------- one size


def _healthz_check(bench: ServeBench, name: str, version: int, replicas: int) -> tuple[bool, dict]:
    views = replica_versions(bench.health())
    ok = len(views) == replicas and all(vs.get(name) == version for vs in views.values())
    return ok, {rid: vs.get(name) for rid, vs in views.items()}


def _patch(bench: ServeBench, name: str, delta: dict) -> dict:
    r = bench.session.patch(f"{bench.url}/admin/scenarios/{name}", json=delta, headers=bench.admin, timeout=600)
    if r.status_code != 200:
        raise RuntimeError(f"PATCH {name} -> {r.status_code}: {r.text[:500]}")
    return r.json()


def run_size(bench: ServeBench, tokenizer, start: int, n_keys: int, n_puts: int, args) -> dict:
    name = f"bench-tree-{n_keys}"
    inline = n_keys <= args.inline_max
    t0 = time.perf_counter()
    raws, paths, exact_raws = [], [], []
    last_prefix: dict[str, list[int]] = {}
    tree_dir = os.path.join(bench.data_dir, "trees")
    os.makedirs(tree_dir, exist_ok=True)
    for k in range(n_puts + 1):  # seed k gives version k a new tree; bodies are ready before the clock starts
        seed = 1000 * n_keys + k
        if inline:
            body = make_body(n_keys, start, seed)
            raws.append(json.dumps(body, separators=(",", ":")).encode())
            if args.exact_too and k:
                # the same tree in a body with an escaped character: the manager parses it whole (the exact way)
                exact_raws.append(json.dumps({**body, "description": "exact\tway"}, separators=(",", ":")).encode())
            if k == n_puts:
                last_prefix = body["tree"]["prefix_dict"]
        else:
            path = os.path.join(tree_dir, f"{name}-{k}.json")
            write_tree_json(path, iter_tree(n_keys, VOCAB, start_token_id=start, end_token_id=END, seed=seed),
                            start_token_id=start, end_token_id=END)
            paths.append(path)
            raws.append(json.dumps({"type": "tree", "path": os.path.basename(path), "max_new_tokens": 16}).encode())
    if not inline and args.patches:
        last_prefix = make_prefix(n_keys, start, 1000 * n_keys + n_puts)
    gc.collect()
    sizes = [len(r) if inline else os.path.getsize(p) for r, p in zip(raws, paths or raws)]
    log(f"[{n_keys} keys] {n_puts + 1} trees built in {time.perf_counter() - t0:.1f} s; "
        f"{'inline body' if inline else 'tree file'} {min(sizes) / 1e6:.1f}-{max(sizes) / 1e6:.1f} MB")

    mem_before = process_memory()
    first, first_s = _timed(lambda: bench.put(name, raws[0], timeout=1800))
    mem_first = process_memory()
    log(f"[{n_keys} keys] untimed first PUT: v{first['version']} in {first_s:.3f} s")
    latencies, versions, exact_lat = [], [], []
    all_on_new, health_checks = True, []
    cpu_before, cpu_after = serve_process_cpu(), {}
    for k in range(1, n_puts + 1):
        if exact_raws:  # the exact way first, then the split way on the same tree (in the CPU figures too)
            time.sleep(args.pause)
            result, dt = _timed(lambda: bench.put(name, exact_raws[k - 1], timeout=1800))
            exact_lat.append(dt)
            log(f"[{n_keys} keys] PUT v{result['version']} (exact way): {dt:.3f} s")
        time.sleep(args.pause)  # isolated PUTs: background work set off by the previous one has finished
        result, dt = _timed(lambda: bench.put(name, raws[k], timeout=1800))
        if k == n_puts:
            time.sleep(1.0)  # let work the last PUT set off in the background finish
            cpu_after = serve_process_cpu()
        v = result["version"]
        ok, view = _healthz_check(bench, name, v, args.replicas)
        all_on_new &= ok
        health_checks.append({"version": v, "replicas": view})
        latencies.append(dt)
        versions.append(v)
        log(f"[{n_keys} keys] PUT v{v}: {dt:.3f} s; /healthz: {'all on v%d' % v if ok else 'NOT all on it: %s' % view}")
    if len(set(versions)) != len(versions):
        raise RuntimeError(f"versions repeat: {versions}")
    mem_last = process_memory()
    for path in paths:
        os.unlink(path)

    # PATCHes of PATCH_ITEMS items: half removed from the current version, half new
    patch_lat: list[float] = []
    rng = random.Random(n_keys)
    items = tree_items(last_prefix, start) if args.patches else []
    present = {tuple(i) for i in items}
    for _ in range(args.patches):
        remove = rng.sample(sorted(present), PATCH_ITEMS // 2)
        add = []
        while len(add) < PATCH_ITEMS // 2:
            cand = tuple(rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 6)))
            if cand not in present and cand not in add:
                add.append(cand)
        time.sleep(args.pause)
        result, dt = _timed(lambda: _patch(bench, name, {"add": [list(a) for a in add],
                                                          "remove": [list(r) for r in remove]}))
        present.difference_update(remove)
        present.update(add)
        ok, view = _healthz_check(bench, name, result["version"], args.replicas)
        all_on_new &= ok
        versions.append(result["version"])
        patch_lat.append(dt)
        log(f"[{n_keys} keys] PATCH v{result['version']} (+{result.get('added')} -{result.get('removed')}): {dt:.3f} s"
            f"{'' if ok else '; NOT all replicas on it: %s' % view}")

    # One request on the last version: served by it, and its answer is one of its items.
    r = requests.post(f"{bench.url}/v1/generate", timeout=120, json={
        "scenario": name, "messages": [{"role": "user", "content": "Pick one."}], "temperature": 1.0,
        "max_new_tokens": 16})
    gen = {"status": r.status_code}
    if r.status_code == 200:
        body = r.json()
        out = body["outputs"][0]
        ids = list(out["token_ids"])
        if ids and ids[-1] == END:
            ids = ids[:-1]
        if args.patches:
            valid = tuple(ids) in present
        else:
            valid = is_tree_path({"start_token_id": start, "end_token_id": END, "prefix_dict": last_prefix},
                                 out["token_ids"]) if last_prefix else None
        gen.update(version=body["version"], version_is_last=body["version"] == versions[-1],
                   finish_reason=out["finish_reason"], valid_item=out["finish_reason"] != "stop" or valid)
    log(f"[{n_keys} keys] generation after the last write: {gen}")

    phases = {}
    if inline and args.reps:
        log(f"[{n_keys} keys] timing the manager's work in-process ({args.reps} rep(s))")
        phases = in_process_phases(raws[-1], tokenizer, args.reps)
    p50 = percentile(latencies, 50)
    target = TARGETS_P95_S.get(n_keys)
    p95 = percentile(latencies, 95)
    out = {
        "keys": n_keys,
        "body": "inline JSON" if inline else "tree file by path",
        "puts_timed": n_puts,
        "body_bytes": {"min": min(sizes), "max": max(sizes)},
        "first_put_s": round(first_s, 4),
        "put_latency_s": {"p50": round(p50, 4), "p95": round(p95, 4), "min": round(min(latencies), 4),
                          "max": round(max(latencies), 4), "all": [round(x, 4) for x in latencies]},
        "healthz_all_replicas_on_new_version": all_on_new,
        "healthz_checks": health_checks if not all_on_new else None,
        "generate_after_last_write": gen,
        "replica_memory_before_mib": mem_before,
        "replica_memory_added_by_first_put_mib": memory_delta(mem_before, mem_first),
        "replica_memory_added_after_last_put_mib": memory_delta(mem_before, mem_last),
        # CPU seconds per timed PUT of each Serve process (Ray's process titles), idle time between PUTs included
        # (with --exact-too, the mean over the PUTs of both ways)
        "server_cpu_s_per_put": cpu_delta(cpu_before, cpu_after, n_puts * (2 if exact_lat else 1)),
    }
    if exact_lat:
        out["exact_way_put_latency_s"] = {"p50": round(percentile(exact_lat, 50), 4),
                                          "p95": round(percentile(exact_lat, 95), 4),
                                          "all": [round(x, 4) for x in exact_lat]}
        out["exact_over_split_p50"] = ratio(percentile(exact_lat, 50), p50)
    if patch_lat:
        out["patch_items"] = PATCH_ITEMS
        out["patch_latency_s"] = {"p50": round(percentile(patch_lat, 50), 4), "p95": round(percentile(patch_lat, 95), 4),
                                  "all": [round(x, 4) for x in patch_lat]}
    if phases:
        out["in_process"] = phases
        out["compile_share_of_put_p50"] = ratio(phases["compile_s"], p50)
    if target is not None:
        out["target_p95_s"] = target
        out["target_met"] = p95 <= target
    return out


# --------------------------------------------------------------------------- stall


def stall(bench: ServeBench, start: int, n_keys: int, rounds: int, quiet_s: float, clients: int) -> dict:
    """Latency of small label requests from ``clients`` threads, in quiet windows and in windows of back-to-back
    PUTs of ``n_keys``-key trees, alternated ``rounds`` times."""
    labels_name, tree_name = "bench-stall-labels", f"bench-stall-tree-{n_keys}"
    bench.put(labels_name, {"type": "labels", "labels": LABELS, "max_new_tokens": 8})
    bodies = [json.dumps(make_body(n_keys, start, 7_000 + k), separators=(",", ":")).encode() for k in range(3)]
    bench.put(tree_name, bodies[0], timeout=1800)
    request = {"scenario": labels_name, "prompt": "Review: the food was great. Sentiment:", "temperature": 0.0}
    stop = threading.Event()
    samples: list[tuple[float, float, bool]] = []  # (start, latency, ok)
    lock = threading.Lock()

    def client():
        session = requests.Session()
        while not stop.is_set():
            t0 = time.perf_counter()
            r = session.post(f"{bench.url}/v1/generate", json=request, timeout=120)
            ok = r.status_code == 200 and r.json()["outputs"][0]["text"].strip() in LABELS
            with lock:
                samples.append((t0, time.perf_counter() - t0, ok))

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    time.sleep(3.0)  # warm up
    windows: list[tuple[str, float, float]] = []
    swap_times: list[float] = []
    for r in range(rounds):
        t0 = time.perf_counter()
        time.sleep(quiet_s)
        windows.append(("quiet", t0, time.perf_counter()))
        t0 = time.perf_counter()
        for k in range(2):
            _, dt = _timed(lambda: bench.put(tree_name, bodies[1 + (2 * r + k) % 2], timeout=1800))
            swap_times.append(dt)
        windows.append(("swap", t0, time.perf_counter()))
        log(f"[stall] round {r + 1}: quiet {quiet_s:.0f} s, then 2 PUTs of {n_keys} keys ({swap_times[-2]:.1f} s, "
            f"{swap_times[-1]:.1f} s)")
    stop.set()
    for t in threads:
        t.join(timeout=120)

    def inside(kind):
        return [lat for (t, lat, _) in samples if any(k == kind and a <= t < b for k, a, b in windows)]

    quiet, swap = inside("quiet"), inside("swap")
    q95, s95 = percentile(quiet, 95), percentile(swap, 95)
    return {
        "keys": n_keys, "clients": clients, "rounds": rounds, "quiet_window_s": quiet_s,
        "requests_quiet": len(quiet), "requests_during_swaps": len(swap),
        "all_answers_valid_labels": all(ok for _, _, ok in samples),
        "quiet_p50_s": round(percentile(quiet, 50), 4), "quiet_p95_s": round(q95, 4),
        "swap_p50_s": round(percentile(swap, 50), 4), "swap_p95_s": round(s95, 4),
        "swap_p95_over_quiet_p95": ratio(s95, q95),
        "put_s_during_stall": [round(x, 3) for x in swap_times],
        "target_ratio": STALL_TARGET, "target_met": s95 <= STALL_TARGET * q95,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 PUTs of 10^5 keys, 1 PATCH, a short stall run at 10^5")
    ap.add_argument("--sizes", default="100000:6,1000000:4", help="comma-separated KEYS:PUTS")
    ap.add_argument("--patches", type=int, default=3, help="PATCHes of 1,000 items per size (0: none)")
    ap.add_argument("--inline-max", type=int, default=2_000_000, help="largest tree sent inline; larger go by path")
    ap.add_argument("--exact-too", action="store_true",
                    help="before each timed inline PUT, PUT the same tree in a body the manager parses whole (an "
                         "escaped character in its description keeps it off the split way): both ways in one run")
    ap.add_argument("--reps", type=int, default=1, help="repetitions of the in-process phase timing (0: none)")
    ap.add_argument("--pause", type=float, default=1.0, help="seconds between two timed writes (not timed)")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--stall-keys", type=int, default=1_000_000, help="tree size of the stall run (0: none)")
    ap.add_argument("--stall-rounds", type=int, default=3)
    ap.add_argument("--stall-quiet", type=float, default=10.0, help="seconds of each quiet window")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--torch-threads", type=int, default=1, help="torch threads per model replica")
    ap.add_argument("--compile-nice", type=int, default=None, help="the manager's compile_nice (default: the setting's)")
    args = ap.parse_args()
    if args.quick:
        args.sizes, args.patches, args.reps, args.pause = "100000:2", 1, 0, 0.5
        args.stall_keys, args.stall_rounds, args.stall_quiet = min(args.stall_keys, 100_000), 1, 5.0
    sizes = [tuple(int(x) for x in part.split(":")) for part in args.sizes.split(",") if part.strip()]

    from deployments.examples import chat_root_token_id
    from deployments.model_loader import load_tokenizer

    t_start = time.perf_counter()
    load_before = os.getloadavg()
    tokenizer = load_tokenizer()
    start = chat_root_token_id(tokenizer)
    results, stall_result = {}, None
    biggest = max([n for n, _ in sizes] + [args.stall_keys])
    with ServeBench() as bench:
        limits = {"max_body_bytes": 1 << 30, "max_tree_keys": max(2_000_000, 2 * biggest),
                  "compile_timeout_s": 1800}
        settings = bench.settings(num_replicas=args.replicas, max_batch_size=16, num_cpus_per_replica=1,
                                  torch_threads=args.torch_threads, limits=limits,
                                  **({} if args.compile_nice is None else {"compile_nice": args.compile_nice}))
        log(f"deploying with {args.replicas} model replica(s)")
        deploy_s = bench.deploy(settings, replicas=args.replicas)
        log(f"ready after {deploy_s:.1f} s")
        for n_keys, n_puts in sizes:
            results[str(n_keys)] = run_size(bench, tokenizer, start, n_keys, n_puts, args)
        if args.stall_keys:
            stall_result = stall(bench, start, args.stall_keys, args.stall_rounds, args.stall_quiet, args.clients)
            log(f"[stall] quiet p95 {stall_result['quiet_p95_s']:.3f} s, during swaps {stall_result['swap_p95_s']:.3f} s"
                f" (x{stall_result['swap_p95_over_quiet_p95']}; target x{STALL_TARGET}: "
                f"{'met' if stall_result['target_met'] else 'NOT met'})")

    for n, res in results.items():
        lat = res["put_latency_s"]
        log(f"{n:>8} keys: PUT p50 {lat['p50']:.3f} s, p95 {lat['p95']:.3f} s"
            + (f" (target {res['target_p95_s']} s: {'met' if res['target_met'] else 'NOT met'})" if "target_met" in res else "")
            + (f"; PATCH p50 {res['patch_latency_s']['p50']:.3f} s" if "patch_latency_s" in res else "")
            + f"; all replicas on each new version: {res['healthz_all_replicas_on_new_version']}")
    emit({
        "benchmark": "hot_swap",
        "setup": {"num_replicas": args.replicas, "torch_threads": args.torch_threads, "start_token_id": start,
                  "end_token_id": END, "vocab": VOCAB, "pause_between_writes_s": args.pause, "quick": args.quick,
                  "cpus": os.cpu_count()},
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "deploy_s": round(deploy_s, 1),
        "sizes": results,
        "stall": stall_result,
        "healthz_always_on_new_version": all(r["healthz_all_replicas_on_new_version"] for r in results.values()),
        "wall_s": round(time.perf_counter() - t_start, 1),
    })


if __name__ == "__main__":
    main()
