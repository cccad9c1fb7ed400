"""Serving throughput over HTTP: continuous batching on vs off, at 1, 4 and 16 concurrent clients.

The whole app (ingress, config manager with an embedded Redis, ONE model replica) runs in-process
on Ray Serve, as in ``tests/serve``. A labels scenario with six topic labels is PUT, then closed-loop
clients (threads with ``requests``, each sending its next request as soon as the previous one
answered) POST ``/v1/generate`` with varied chat prompts, ``temperature: 1.0`` and
``max_new_tokens: 16`` for ``--duration`` seconds per level, after a warm-up. Every response must be
200 with ``finish_reason == "stop"`` and a text that is one of the labels (with its leading space);
anything else is counted as invalid (expected: zero).

The app is measured twice in the same run: first with ``max_batch_size=16``, then redeployed
(``serve.run`` again under the same app name) with ``max_batch_size=1``. Both use one replica with
the same CPUs and torch threads, so the batch size is the only difference. Throughput is completed
requests over the time from the first request sent to the last answer received (no request is
started after the level's duration; the ones in flight are waited for). The decode engine's
counters (read from the replica through a Serve handle) give the mean rows per forward pass.

Target: batched/unbatched throughput at 16 clients of at least 3x.

    python bench/serve_throughput.py [--quick] [--duration 20] [--levels 1,4,16]
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import emit, log, ratio  # noqa: E402
from bench._serve import ServeBench, percentile  # noqa: E402

SCENARIO = "bench-topics"
LABELS = ["Sports", "Technology", "Politics", "Health", "Finance", "Entertainment"]
TARGET_RATIO = 3.0

_SUBJECTS = (
    "the championship final", "a new smartphone chip", "the parliamentary vote", "a flu vaccine trial",
    "interest rates", "the film festival", "a marathon record", "an open-source database release",
    "a tax reform bill", "sleep and memory", "the stock market rally", "a streaming series finale",
    "the transfer window", "quantum computing", "the election debate", "a hospital strike",
)
_FRAMES = (
    "Which topic is this about: {s}?",
    "Classify the topic of a news story about {s}.",
    "Pick the best category for an article on {s}.",
    "What section of a newspaper would cover {s}?",
)


def prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [rng.choice(_FRAMES).format(s=rng.choice(_SUBJECTS)) for _ in range(n)]


def valid(response: requests.Response) -> bool:
    if response.status_code != 200:
        return False
    outs = response.json().get("outputs") or []
    return len(outs) == 1 and outs[0].get("finish_reason") == "stop" and \
        outs[0].get("text", "").strip() in LABELS and outs[0]["text"] == " " + outs[0]["text"].strip()


def run_level(url: str, clients: int, duration: float, max_new_tokens: int, seed: int) -> dict:
    """``clients`` closed-loop threads for ``duration`` seconds; returns counts, rate and latencies."""
    texts = prompts(256, seed)
    latencies: list[float] = []
    invalid: list[str] = []
    lock = threading.Lock()
    start_barrier = threading.Barrier(clients + 1)
    state = {"t0": 0.0, "last": 0.0}

    def client(i: int) -> None:
        session = requests.Session()
        k = i
        start_barrier.wait()
        while time.perf_counter() - state["t0"] < duration:
            body = {"scenario": SCENARIO, "messages": [{"role": "user", "content": texts[k % len(texts)]}],
                    "temperature": 1.0, "max_new_tokens": max_new_tokens}
            k += clients
            sent = time.perf_counter()
            try:
                r = session.post(f"{url}/v1/generate", json=body, timeout=300)
                ok, why = valid(r), f"{r.status_code}: {r.text[:200]}"
            except requests.RequestException as exc:
                ok, why = False, repr(exc)
            done = time.perf_counter()
            with lock:
                state["last"] = max(state["last"], done)
                if ok:
                    latencies.append(done - sent)
                else:
                    invalid.append(why)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    state["t0"] = time.perf_counter()
    start_barrier.wait()
    for t in threads:
        t.join()
    elapsed = state["last"] - state["t0"]
    if invalid:
        log(f"  {len(invalid)} invalid responses, e.g. {invalid[0]}")
    return {
        "clients": clients,
        "requests_ok": len(latencies),
        "invalid": len(invalid),
        "elapsed_s": round(elapsed, 2),
        "requests_per_s": round(len(latencies) / elapsed, 3) if elapsed > 0 else None,
        "latency_p50_s": _r(percentile(latencies, 50)),
        "latency_p95_s": _r(percentile(latencies, 95)),
        "invalid_examples": invalid[:3],
    }


def _r(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(x, digits)


def measure_mode(bench: ServeBench, args, max_batch_size: int, label: str) -> dict:
    settings = bench.settings(num_replicas=1, max_batch_size=max_batch_size,
                              num_cpus_per_replica=1, torch_threads=args.torch_threads)
    log(f"[{label}] deploying with max_batch_size={max_batch_size}")
    deploy_s = bench.deploy(settings, replicas=1)
    version = bench.put(SCENARIO, {"type": "labels", "labels": LABELS})["version"]
    log(f"[{label}] ready after {deploy_s:.1f} s; scenario {SCENARIO!r} v{version}")
    warm = run_level(bench.url, max(args.levels), args.warmup, args.max_new_tokens, seed=999)
    log(f"[{label}] warm-up: {warm['requests_ok']} ok, {warm['invalid']} invalid")
    levels = {}
    for n in args.levels:
        before = bench.model_stats()
        res = run_level(bench.url, n, args.duration, args.max_new_tokens, seed=n)
        after = bench.model_stats()
        steps = after["steps"] - before["steps"]
        res["mean_rows_per_step"] = round((after["rows_decoded"] - before["rows_decoded"]) / steps, 2) if steps else None
        res["prefills"] = after["prefills"] - before["prefills"]
        levels[str(n)] = res
        log(f"[{label}] {n:>2} clients: {res['requests_per_s']} req/s, p50 {res['latency_p50_s']} s, "
            f"p95 {res['latency_p95_s']} s, {res['invalid']} invalid, {res['mean_rows_per_step']} rows/step")
    return {"max_batch_size": max_batch_size, "deploy_s": round(deploy_s, 1), "scenario_version": version,
            "warmup_invalid": warm["invalid"], "levels": levels}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="short levels (1 and 16 clients, 4 s each)")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of load per level")
    ap.add_argument("--warmup", type=float, default=4.0, help="seconds of warm-up load per mode")
    ap.add_argument("--levels", default="1,4,16", help="comma-separated client counts")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--torch-threads", type=int, default=1, help="torch threads in the model replica")
    args = ap.parse_args()
    if args.quick:
        args.duration, args.warmup, args.levels = 4.0, 2.0, "1,16"
    args.levels = [int(x) for x in str(args.levels).split(",") if x.strip()]

    t_start = time.perf_counter()
    with ServeBench() as bench:
        batched = measure_mode(bench, args, 16, "batched")
        unbatched = measure_mode(bench, args, 1, "unbatched")

    ratios = {str(n): ratio(batched["levels"][str(n)]["requests_per_s"] or 0.0,
                            unbatched["levels"][str(n)]["requests_per_s"] or 0.0) for n in args.levels}
    top = str(max(args.levels))
    invalid_total = sum(m["levels"][k]["invalid"] for m in (batched, unbatched) for k in m["levels"])
    met = ratios.get(top) is not None and ratios[top] >= TARGET_RATIO
    log(f"batched/unbatched throughput at {top} clients: {ratios.get(top)}x "
        f"(target >= {TARGET_RATIO}x: {'met' if met else 'NOT met'}); invalid responses: {invalid_total}")
    emit({
        "benchmark": "serve_throughput",
        "setup": {
            "num_replicas": 1,
            "only_difference": "max_batch_size (16 vs 1); same replica count, CPUs and torch threads",
            "num_cpus_per_replica": 1,
            "torch_threads": args.torch_threads,
            "scenario": {"type": "labels", "labels": LABELS},
            "request": {"messages": "varied chat prompts", "temperature": 1.0, "max_new_tokens": args.max_new_tokens},
            "duration_s_per_level": args.duration,
            "warmup_s_per_mode": args.warmup,
            "quick": args.quick,
        },
        "batched": batched,
        "unbatched": unbatched,
        "throughput_ratio_batched_over_unbatched": ratios,
        "invalid_total": invalid_total,
        "target": {"ratio_at_clients": int(top), "min_ratio": TARGET_RATIO, "ratio": ratios.get(top), "met": met},
        "wall_s": round(time.perf_counter() - t_start, 1),
    })


if __name__ == "__main__":
    main()
