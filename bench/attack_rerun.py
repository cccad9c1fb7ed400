"""Rerun the requests of the robustness report (issue 13) against the running app and measure what others feel.

A probe client sends small labels requests (the seeded ``sentiment`` scenario) one after another for the whole
run. First alone (the baseline), then while each attack request of the report is sent. For each attack it
reports the attack's own HTTP status and time, the probe's latency during it as a ratio to the baseline
(p50, p95, max), any probe error, and the model replicas' RSS before, at peak and after.

Run: ``.venv/bin/python bench/attack_rerun.py`` (about 6 minutes here). The last line is one JSON object.
"""

from __future__ import annotations

import http.client
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import emit, log  # noqa: E402
from bench._serve import APP_NAME, ServeBench, percentile, serve_actors  # noqa: E402

PROBE = {"scenario": "sentiment", "prompt": "The food was great and the staff friendly.", "max_new_tokens": 8,
         "temperature": 0}
LABELS_24 = {"type": "string", "allOf": [{"pattern": f"a{{{i},}}"} for i in range(1, 25)]}


class Probe:
    """Sequential small requests in a thread; latencies are tagged with the phase they ran in."""

    def __init__(self, url: str):
        self.url = url
        self.phase = "idle"
        self.samples: list[tuple[str, float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        # another client than the attacks: its own source address (any 127.x address reaches the proxy)
        host, port = self.url.split("//")[1].split(":")
        body = json.dumps(PROBE)
        while not self._stop.is_set():
            phase = self.phase
            t0 = time.perf_counter()
            conn = http.client.HTTPConnection(host, int(port), timeout=600, source_address=("127.0.0.2", 0))
            try:
                conn.request("POST", "/v1/generate", body=body, headers={"Content-Type": "application/json"})
                status = conn.getresponse().status
            except OSError:
                status = -1
            finally:
                conn.close()
            self.samples.append((phase, time.perf_counter() - t0, status))

    def start(self) -> "Probe":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(700)

    def stats(self, phase: str) -> dict:
        lat = [d for p, d, _ in self.samples if p == phase]
        errors = [st for p, _, st in self.samples if p == phase and st != 200]
        return {"n": len(lat), "p50_s": round(percentile(lat, 50) or 0, 3), "p95_s": round(percentile(lat, 95) or 0, 3),
                "max_s": round(max(lat) if lat else 0, 3), "non_200": errors}


class Rss:
    """Polls the model replicas' RSS (MiB) every 0.2 s."""

    def __init__(self):
        import psutil

        self.procs = [psutil.Process(a["Pid"]) for a in serve_actors(APP_NAME, "ModelReplica")]
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def now(self) -> float:
        total = 0.0
        for p in self.procs:
            try:
                total = max(total, p.memory_info().rss / 2**20)
            except Exception:
                pass
        return round(total, 1)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            time.sleep(0.2)

    def __enter__(self):
        self.before = self.now()
        self.peak = self.before
        self._thread.start()
        return self

    def __exit__(self, *exc):
        time.sleep(2.0)
        self._stop.set()
        self._thread.join()
        self.after = self.now()


def _post(url: str, path: str, body, timeout: float = 600, **kw) -> tuple[int, float, str]:
    t0 = time.perf_counter()
    try:
        if isinstance(body, (bytes, str)):
            r = requests.post(url + path, data=body, headers={"Content-Type": "application/json", **kw.get("headers", {})},
                              timeout=timeout)
        else:
            r = requests.post(url + path, json=body, timeout=timeout, headers=kw.get("headers"))
        return r.status_code, time.perf_counter() - t0, r.text[:200]
    except requests.RequestException as exc:
        return -1, time.perf_counter() - t0, type(exc).__name__


def attacks(bench: ServeBench):
    url = bench.url
    from deployments.model_loader import load_tokenizer

    ids = load_tokenizer()(" ".join(["alpha beta gamma delta epsilon zeta eta theta"] * 520))["input_ids"]
    long_prompt = load_tokenizer().decode(ids[:4090])  # just under max_prompt_tokens (4096)

    def beams_then_disconnect():
        # the client goes away after 3 s, as in the report
        return _post(url, "/v1/generate", {"prompt": "Count from 1 to 10000: 1, 2, 3,", "n": 8, "num_beams": 8,
                                           "max_new_tokens": 1024}, timeout=3)

    def tiny_temperature():
        with ThreadPoolExecutor(5) as pool:
            others = [pool.submit(_post, url, "/v1/generate", {**PROBE, "temperature": 0.7, "seed": i}) for i in range(4)]
            bad = pool.submit(_post, url, "/v1/generate", {"prompt": "x", "temperature": 1e-39, "max_new_tokens": 3})
            codes = [f.result()[0] for f in others]
            status, secs, text = bad.result()
        return status, secs, f"4 concurrent requests: {codes}"

    def infinity_in_scenario():
        t0 = time.perf_counter()
        r = requests.put(f"{url}/admin/scenarios/inf-temp", headers={**bench.admin, "Content-Type": "application/json"},
                         data='{"type": "labels", "labels": ["a", "b"], "temperature": Infinity}', timeout=60)
        return r.status_code, time.perf_counter() - t0, r.text[:200]

    def schema_24_patterns():
        return _post(url, "/v1/chat/completions", {
            "model": "default", "messages": [{"role": "user", "content": "a"}], "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": LABELS_24}}})

    def schema_24_patterns_put():
        t0 = time.perf_counter()
        r = requests.put(f"{url}/admin/scenarios/explode", headers=bench.admin,
                         json={"type": "json_schema", "schema": LABELS_24}, timeout=600)
        return r.status_code, time.perf_counter() - t0, r.text[:200]

    def long_prompt_n8():
        return _post(url, "/v1/generate", {"prompt": long_prompt, "n": 8, "max_new_tokens": 4, "temperature": 0})

    def slow_regex_n8():
        return _post(url, "/v1/completions", {"model": "default", "prompt": "a", "n": 8, "max_tokens": 3,
                                              "structured_outputs": {"regex": "(a{10000})" * 400}})

    def huge_integer():
        return _post(url, "/v1/chat/completions", '{"model": "default", "messages": [{"role": "user", "content": "x"}],'
                     ' "structured_outputs": {"json": {"type": "integer", "maximum": ' + "9" * 5000 + "}}}")

    def lone_surrogate():
        return _post(url, "/v1/generate", '{"prompt": "hi \\ud800 there", "max_new_tokens": 2}')

    def flood_400():
        with ThreadPoolExecutor(64) as pool:
            futs = [pool.submit(_post, url, "/v1/generate", {"prompt": f"Story {i}:", "max_new_tokens": 16}) for i in range(400)]
            codes = [f.result()[0] for f in futs]
        counts = {str(c): codes.count(c) for c in sorted(set(codes))}
        return 200 if all(c in (200, 429) for c in codes) else 500, 0.0, f"status counts {counts}"

    return [
        ("1 beams n=8 x 1024 tokens, client gone after 3 s", beams_then_disconnect),
        ("2 temperature 1e-39 beside 4 requests", tiny_temperature),
        ("2 stored scenario with temperature Infinity", infinity_in_scenario),
        ("3 json_schema of 24 patterns (OpenAI one-off)", schema_24_patterns),
        ("3 json_schema of 24 patterns (admin PUT)", schema_24_patterns_put),
        ("4 a 4090-token prompt, n=8", long_prompt_n8),
        ("5 regex (a{10000})*400, n=8", slow_regex_n8),
        ("9 integer of 5000 digits", huge_integer),
        ("9 lone surrogate in prompt", lone_surrogate),
        ("10 400 concurrent requests from one client", flood_400),
    ]


def main() -> None:
    with ServeBench(num_cpus=4) as bench:
        bench.deploy(bench.settings(num_replicas=2, num_cpus_per_replica=1, torch_threads=1), replicas=2)
        probe = Probe(bench.url).start()
        time.sleep(20)  # warm-up
        probe.phase = "baseline"
        time.sleep(30)
        results = []
        for name, fn in attacks(bench):
            probe.phase = name
            with Rss() as rss:
                status, secs, text = fn()
                time.sleep(5)  # the probe keeps measuring while the attack's after-effects last
            probe.phase = "idle"
            row = {"attack": name, "status": status, "attack_s": round(secs, 2), "detail": text,
                   "probe": probe.stats(name), "rss_mib": {"before": rss.before, "peak": rss.peak, "after": rss.after}}
            log(json.dumps(row))
            results.append(row)
            time.sleep(3)
        probe.stop()
        base = probe.stats("baseline")
        for row in results:
            p = row["probe"]
            row["probe_p95_vs_baseline"] = round(p["p95_s"] / base["p95_s"], 2) if base["p95_s"] else None
            row["probe_max_vs_baseline"] = round(p["max_s"] / base["max_s"], 2) if base["max_s"] else None
        health = bench.health()
    emit({"bench": "attack_rerun", "baseline": base, "attacks": results, "health": health.get("status"),
          "probe_non_200": sum(len(r["probe"]["non_200"]) for r in results)})


if __name__ == "__main__":
    main()
