"""Soak: many concurrent clients mix scenarios while an admin swaps scenario versions every few seconds.

Every answer is checked against the exact scenario version the response names (labels: one of that
version's labels; tree: a path of that version's tree; JSON schema: a document valid under the schema, or
cut by ``length``). Reported: requests served, failed and invalid requests, swaps done, latency p50/p95,
and each model replica's resident memory at the start, during a warm-up of the same load (the baseline is
its peak there: by then the prefix cache and the allocator's pools have grown to their working size) and at
the end.

    python bench/soak.py                       # 120 s, 32 clients, a swap every 3 s (the full soak)
    python bench/soak.py --duration 30         # shorter

``tests/faults/test_soak.py`` runs :func:`run_soak` against the shared test app for a shorter time (set
``SOAK_SECONDS`` for the full length there). Progress goes to stderr, the JSON result is the last stdout line.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import emit, log  # noqa: E402
from bench._serve import APP_NAME, ServeBench, percentile, serve_actors  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
LABEL_SETS = [["Sports", "Technology", "Politics", "New York City"], ["red", "green", "blue"]]
PHRASE_SETS = [["red apple", "green pear", "blue sky at night"], ["north", "south wind", "east coast"]]


def soak_bodies(tokenizer) -> dict[str, list[dict[str, Any]]]:
    """The scenarios of the soak; the admin thread alternates between each one's bodies."""
    from deployments.examples import build_phrase_tree, chat_root_token_id

    root = chat_root_token_id(tokenizer)
    return {
        "soak-labels": [{"type": "labels", "labels": labels} for labels in LABEL_SETS],
        "soak-tree": [{"type": "tree", "tree": build_phrase_tree(tokenizer, phrases, root=root, end=tokenizer.eos_token_id)}
                      for phrases in PHRASE_SETS],
        "soak-schema": [{"type": "json_schema", "schema": SCHEMA}],
    }


def check_output(body: dict[str, Any], out: dict[str, Any]) -> str | None:
    """Why ``out`` does not satisfy scenario ``body``, or None when it does."""
    import jsonschema

    from processors.kinds.tree.treefile.load import is_tree_path

    kind = body["type"]
    if kind == "labels":
        if out["finish_reason"] != "stop" or out["text"].strip() not in body["labels"]:
            return f"not one of {body['labels']}: {out['text']!r} ({out['finish_reason']})"
    elif kind == "tree":
        if not is_tree_path(body["tree"], out["token_ids"]):
            return f"not a path of the tree: {out['token_ids']}"
    elif kind == "json_schema" and out["finish_reason"] == "stop":
        try:
            jsonschema.validate(json.loads(out["text"]), body["schema"])
        except (ValueError, jsonschema.ValidationError) as exc:
            return f"not valid under the schema: {out['text']!r}: {exc}"
    return None


def model_replica_pids(app_name: str) -> list[int]:
    """Pids of the live model replicas of ``app_name`` in this process's Ray cluster."""
    return sorted(int(a["Pid"]) for a in serve_actors(app_name, "ModelReplica"))


def rss_mib(pids: list[int]) -> dict[int, float]:
    import psutil

    out = {}
    for pid in pids:
        try:
            out[pid] = round(psutil.Process(pid).memory_info().rss / 2**20, 1)
        except psutil.Error:
            out[pid] = None
    return out


class _Versions:
    """Scenario bodies by (name, version): recorded from the admin's PUTs, fetched for any other version."""

    def __init__(self, url: str, admin: dict[str, str]):
        self.url, self.admin = url, admin
        self._known: dict[tuple[str, int], dict] = {}
        self._lock = threading.Lock()

    def record(self, name: str, version: int, body: dict) -> None:
        with self._lock:
            self._known[(name, version)] = body

    def get(self, name: str, version: int) -> dict:
        with self._lock:
            body = self._known.get((name, version))
        if body is None:  # served before its PUT answered (replicas ack before the PUT returns)
            r = requests.get(f"{self.url}/admin/scenarios/{name}", params={"version": version}, headers=self.admin, timeout=60)
            r.raise_for_status()
            body = r.json()["scenario"]
            self.record(name, version, body)
        return body


def run_soak(url: str, admin: dict[str, str], tokenizer, *, duration_s: float, clients: int, swap_every_s: float,
             app_name: str, warmup_s: float = 20.0, replica_pids: Callable[[str], list[int]] = model_replica_pids) -> dict[str, Any]:
    """Run the soak against the app at ``url``; return the report (see the module docstring)."""
    bodies = soak_bodies(tokenizer)
    versions = _Versions(url, admin)

    def put(name: str, body: dict) -> tuple[int, float]:
        t0 = time.perf_counter()
        r = requests.put(f"{url}/admin/scenarios/{name}", json=body, headers=admin, timeout=120)
        if r.status_code != 200:
            raise RuntimeError(f"PUT {name}: {r.status_code} {r.text[:300]}")
        version = r.json()["version"]
        versions.record(name, version, body)
        return version, time.perf_counter() - t0

    for name, options in bodies.items():
        put(name, options[0])
    names = sorted(bodies)
    limits = {"soak-labels": 8, "soak-tree": 12, "soak-schema": 40}
    prompts = ["Pick one.", "What is your answer?", "Describe a person.", "Choose wisely.", "Go on."]

    def one(i: int, rng: random.Random) -> dict[str, Any]:
        name = names[i % len(names)]
        request = {"scenario": name, "messages": [{"role": "user", "content": rng.choice(prompts)}],
                   "max_new_tokens": limits[name], "temperature": rng.choice([0.0, 0.7, 1.0]), "seed": rng.randrange(2**31)}
        t0 = time.perf_counter()
        try:
            r = requests.post(f"{url}/v1/generate", json=request, timeout=300)
        except requests.RequestException as exc:
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "latency": time.perf_counter() - t0}
        latency = time.perf_counter() - t0
        if r.status_code != 200:
            return {"ok": False, "error": f"HTTP {r.status_code}: {r.text[:300]}", "latency": latency}
        result = r.json()
        body = versions.get(name, result["version"])
        problems = [p for p in (check_output(body, out) for out in result["outputs"]) if p]
        return {"ok": not problems, "invalid": problems, "latency": latency, "version": (name, result["version"])}

    pids = replica_pids(app_name)
    rss_start = rss_mib(pids)
    log(f"soak: replicas {pids}, RSS {rss_start} MiB; {warmup_s:g} s warm-up, then {duration_s:g} s measured")

    stop = threading.Event()
    results: list[dict[str, Any]] = []
    swaps: list[float] = []
    swap_errors: list[str] = []
    lock = threading.Lock()
    timeline: list[dict[str, Any]] = []
    started = time.monotonic()
    measured_from = started + warmup_s
    deadline = measured_from + duration_s

    def client(index: int) -> None:
        rng = random.Random(1000 + index)
        i = index
        while time.monotonic() < deadline:
            outcome = one(i, rng)
            outcome["warmup"] = time.monotonic() < measured_from
            with lock:
                results.append(outcome)
            i += 1

    def admin_loop() -> None:
        turn = 0
        swappable = [n for n in names if len(bodies[n]) > 1]
        while not stop.wait(swap_every_s):
            name = swappable[turn % len(swappable)]
            body = bodies[name][(turn // len(swappable) + 1) % len(bodies[name])]
            try:
                _, took = put(name, body)
                swaps.append(took)
            except Exception as exc:  # counted and reported, never silent
                swap_errors.append(str(exc))
            turn += 1

    admin_thread = threading.Thread(target=admin_loop, name="soak-admin", daemon=True)
    admin_thread.start()
    peak: dict[int, float] = {}
    last_sample = 0.0
    with ThreadPoolExecutor(clients) as pool:
        futures = [pool.submit(client, k) for k in range(clients)]
        last_report = started
        while not all(f.done() for f in futures):
            time.sleep(0.5)
            now = time.monotonic()
            if now < measured_from and now - last_sample >= 1.0:
                # The baseline is the largest RSS seen during the warm-up: by its end the prefix cache and
                # the allocator's pools have reached their working size, and a single sample could land in
                # the dip between two batches.
                last_sample = now
                for pid, value in rss_mib(pids).items():
                    if value is not None:
                        peak[pid] = max(peak.get(pid, 0.0), value)
            if now - last_report >= 10:
                last_report = now
                with lock:
                    done, bad = len(results), sum(1 for r in results if not r["ok"])
                rss = rss_mib(pids)
                timeline.append({"t_s": round(now - started), **{str(p): v for p, v in rss.items()}})
                log(f"soak: {now - started:5.0f} s  requests {done}  failed/invalid {bad}  "
                    f"swaps {len(swaps)}  RSS MiB {list(rss.values())}")
        for f in futures:
            f.result()
    elapsed = time.monotonic() - measured_from
    stop.set()
    admin_thread.join(timeout=150)
    rss_after = rss_mib(replica_pids(app_name))
    rss_before = peak or rss_start
    measured = [r for r in results if not r["warmup"]]

    latencies = [r["latency"] for r in measured if r["ok"]]

    def growth(base: dict[int, float]) -> dict[int, float]:
        return {pid: round(100.0 * (rss_after[pid] - base[pid]) / base[pid], 2)
                for pid in base if base.get(pid) and rss_after.get(pid)}

    return {
        "warmup_s": warmup_s,
        "duration_s": round(elapsed, 1),
        "clients": clients,
        "swap_every_s": swap_every_s,
        "requests": len(measured),
        "requests_per_s": round(len(measured) / elapsed, 2),
        "warmup_requests": len(results) - len(measured),
        "failed": sum(1 for r in results if not r["ok"] and not r.get("invalid")),
        "invalid": sum(1 for r in results if r.get("invalid")),
        "errors": [r.get("error") or r.get("invalid") for r in results if not r["ok"]][:10],
        "versions_seen": len({r["version"] for r in results if "version" in r}),
        "swaps": len(swaps),
        "swap_errors": swap_errors[:10],
        "swap_p50_s": round(percentile(swaps, 50), 3) if swaps else None,
        "latency_p50_s": round(percentile(latencies, 50), 3) if latencies else None,
        "latency_p95_s": round(percentile(latencies, 95), 3) if latencies else None,
        "replica_rss_mib_start": rss_start,
        "replica_rss_mib_before": rss_before,
        "replica_rss_mib_after": rss_after,
        "replica_rss_growth_pct": growth(rss_before),
        "replica_rss_growth_from_start_pct": growth(rss_start),
        "replicas_replaced": sorted(set(rss_start) ^ set(rss_after)),
        "replica_rss_mib_timeline": timeline,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=120.0, help="seconds of load after the warm-up (default 120)")
    parser.add_argument("--clients", type=int, default=32, help="concurrent HTTP clients (default 32)")
    parser.add_argument("--warmup", type=float, default=20.0,
                        help="seconds of the same load before the memory baseline is taken (default 20)")
    parser.add_argument("--swap-every", type=float, default=3.0, help="seconds between scenario swaps (default 3)")
    parser.add_argument("--replicas", type=int, default=2, help="model replicas (default 2)")
    args = parser.parse_args()

    from deployments.model_loader import load_tokenizer

    tokenizer = load_tokenizer()
    with ServeBench() as bench:
        bench.deploy(bench.settings(num_replicas=args.replicas, max_batch_size=16, num_cpus_per_replica=1,
                                    torch_threads=1), replicas=args.replicas)
        report = run_soak(bench.url, bench.admin, tokenizer, duration_s=args.duration, clients=args.clients,
                          swap_every_s=args.swap_every, app_name=APP_NAME, warmup_s=args.warmup)
    log(json.dumps(report, indent=1))
    emit({"benchmark": "soak", **report})


if __name__ == "__main__":
    main()
