"""Rerun the requests of the three robustness reports against the app and measure what others feel.

A probe client sends small labels requests (the seeded ``sentiment`` scenario) one after another for the whole
run. First alone (the baseline), then while each attack request of the report is sent. For each attack it
reports the attack's own HTTP status and time, the probe's latency during it as a ratio to the baseline
(p50, p95, max), any probe error, and the model replicas' RSS before, at peak and after.

Run: ``.venv/bin/python bench/attack_rerun.py`` (the first report's requests, about 6 minutes here), ``--only
PREFIX[,PREFIX]`` for the attacks whose names start so, ``--report 2``
(the second's: guards, admin PATCH, catalogs; about 8 minutes; the manager's RSS too, and each row says what the
report saw before the fixes) or ``--report 3`` (the third's: tools, grammar and prompt bounds; one replica with
``limits.max_num_beams: 1024`` as in that report; each row also counts /healthz checks that failed while it ran);
``--report 4`` (the fourth's: wide beams on every
generating route and many moderate beam requests, a Parquet file of one repeated 4,000-byte metadata value, four
stalled chunked uploads and a fifth, a 400-digit integer in a filter; the third's setting);
``--engine vllm`` runs the model replica on vLLM (with ``.venv-vllm/bin/python``).
The last line is one JSON object.
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
    """Polls the RSS (MiB) of a deployment's replicas (the largest) every 0.2 s."""

    def __init__(self, deployment: str = "ModelReplica"):
        import psutil

        self.procs = [psutil.Process(a["Pid"]) for a in serve_actors(APP_NAME, deployment)]
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


# -- report 2 ------------------------------------------------------------------------------------------------------

def _raw(url: str, method: str, path: str, headers: list[tuple[str, str]], body: bytes = b"") -> tuple[int, str]:
    """One HTTP/1.1 request written as is (a header may repeat)."""
    import socket

    host, port = url.split("//")[1].split(":")
    head = f"{method} {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\nContent-Length: {len(body)}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers)
    with socket.create_connection((host, int(port)), timeout=600) as sock:
        sock.sendall(head.encode("latin-1") + b"\r\n" + body)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return int(data.split(b" ", 2)[1]), data.split(b"\r\n\r\n", 1)[1][:200].decode("utf-8", "replace")


def _items_lines(items) -> bytes:
    return b"".join(b"[" + ",".join(map(str, item)).encode() + b"]\n" for item in items)


def attacks_second(bench: ServeBench):
    """The second report's requests; each entry: (name, what the report saw before the fixes, the request)."""
    url, admin = bench.url, bench.admin
    ndjson = {**admin, "Content-Type": "application/x-ndjson"}
    header = b'{"start_token_id": 1000, "end_token_id": 2}\n'

    def timed(fn):
        t0 = time.perf_counter()
        status, text = fn()
        return status, time.perf_counter() - t0, text

    def duplicate_guard_header():
        body = json.dumps({"prompt": "Count from 1 to 10000: 1, 2, 3,", "n": 8, "num_beams": 8,
                           "max_new_tokens": 1024}).encode()
        return timed(lambda: _raw(url, "POST", "/v1/generate", [("Content-Type", "application/json"),
                                                                ("x-request-timeout-seconds", "300"),
                                                                ("x-request-timeout-seconds", "0")], body))

    def patch_unreachable_key():
        bench.put("a23-patch", {"type": "tree", "tree": {"start_token_id": 1000, "end_token_id": 2, "prefix_dict": {
            "1000": [5, 6], "1000_5": [2], "1000_6": [2], "1000_7": [8], "1000_7_8": [2]}}})
        r = requests.patch(f"{url}/admin/scenarios/a23-patch", json={"add": [[6, 7]]}, headers=admin, timeout=60)
        return r.status_code, r.elapsed.total_seconds(), r.text[:200]

    def catalog_one_long_item():
        items = [(1000 + i // 90, 1000 + i % 90) for i in range(8000)] + [tuple(range(1000, 9000))]
        return timed(lambda: (lambda r: (r.status_code, r.text[:200]))(requests.put(
            f"{url}/admin/scenarios/a23-long", data=header + _items_lines(items), headers=ndjson, timeout=600)))

    def catalog_2m_item_then_small_put():
        status, secs, text = timed(lambda: (lambda r: (r.status_code, r.text[:120]))(requests.put(
            f"{url}/admin/scenarios/a23-huge", data=header + _items_lines([range(5, 2_000_005)]), headers=ndjson,
            timeout=600)))
        t0 = time.perf_counter()
        r = requests.put(f"{url}/admin/scenarios/a23-after", json={"type": "labels", "labels": ["a", "b"]},
                         headers=admin, timeout=600)
        return status, secs, f"{text} | next admin write: {r.status_code} in {time.perf_counter() - t0:.2f} s"

    def patch_past_max_tree_keys():
        bench.put("a23-grow", {"type": "tree", "tree": {"start_token_id": 1000, "end_token_id": 2,
                                                       "prefix_dict": {"1000": [5], "1000_5": [2]}}})
        add = [[5 + i // 40000, 5 + i % 40000] for i in range(2_100_000)]
        return timed(lambda: (lambda r: (r.status_code, r.text[:200]))(requests.patch(
            f"{url}/admin/scenarios/a23-grow", json={"add": add}, headers=admin, timeout=600)))

    def rows_from_one_client():
        with ThreadPoolExecutor(32) as pool:
            futs = [pool.submit(_post, url, "/v1/generate", {**PROBE, "n": 8, "temperature": 0.8, "seed": i})
                    for i in range(32)]
            codes = [f.result()[0] for f in futs]
        counts = {str(c): codes.count(c) for c in sorted(set(codes))}
        return 200 if all(c == 200 for c in codes) else codes[0], 0.0, f"status counts {counts}"

    def regeneration_n8():
        schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[a-z]{3}$",
                                                            "not": {"const": "abc"}}},
                  "required": ["code"], "not": {"required": ["code"]}}
        t0 = time.perf_counter()
        r = requests.post(f"{url}/v1/chat/completions", json={
            "model": "default", "messages": [{"role": "user", "content": "Give a code."}], "n": 8, "max_tokens": 1024,
            "temperature": 1.0, "seed": 1,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}, timeout=900)
        usage = r.json().get("usage") if r.status_code == 200 else None
        return r.status_code, time.perf_counter() - t0, f"usage {usage}"

    def exclude_2m_ids_x16():
        bench.put("a23-exclude", {"type": "tree", "tree": {"start_token_id": 1000, "end_token_id": 2,
                                                          "prefix_dict": {"1000": [5, 6], "1000_5": [2]}}})
        body = json.dumps({"scenario": "a23-exclude", "prompt": "x", "max_new_tokens": 4,
                           "exclude": [[5] * 2_000_000]})
        with ThreadPoolExecutor(16) as pool:
            futs = [pool.submit(_post, url, "/v1/generate", body) for _ in range(16)]
            codes = [f.result()[0] for f in futs]
        return codes[0], 0.0, f"status counts {{{', '.join(f'{c}: {codes.count(c)}' for c in sorted(set(codes)))}}}"

    def choice_100k_labels():
        return _post(url, "/v1/chat/completions", {
            "model": "default", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
            "structured_outputs": {"choice": [f"label {i}" for i in range(100_000)]}})

    def catalog_header_surrogate():
        return timed(lambda: (lambda r: (r.status_code, r.text[:200]))(requests.put(
            f"{url}/admin/scenarios/a23-sur", data=b'{"start_token_id": 1000, "end_token_id": 2, '
                                                  b'"description": "\\ud800"}\n[5]\n', headers=ndjson, timeout=60)))

    def if_match_5000_digits():
        bench.put("a23-ifm", {"type": "labels", "labels": ["a", "b"]})
        return timed(lambda: (lambda r: (r.status_code, r.text[:200]))(requests.patch(
            f"{url}/admin/scenarios/a23-ifm", json={"add": ["c"]}, headers={**admin, "If-Match": "9" * 5000},
            timeout=60)))

    def catalog_header_duplicate_key():
        return timed(lambda: (lambda r: (r.status_code, r.text[:200]))(requests.put(
            f"{url}/admin/scenarios/a23-dup", data=b'{"start_token_id": 1000, "end_token_id": 2, '
                                                  b'"start_token_id": 1001}\n[5]\n', headers=ndjson, timeout=60)))

    def replayed_patch():
        bench.put("a23-replay", {"type": "labels", "labels": ["a", "b"]})
        key = {**admin, "Idempotency-Key": "a23-replay-1"}
        first = requests.patch(f"{url}/admin/scenarios/a23-replay", json={"add": ["c"]}, headers=key, timeout=60)
        again = requests.patch(f"{url}/admin/scenarios/a23-replay", json={"add": ["c"]}, headers=key, timeout=60)
        same = first.json() == again.json()
        return again.status_code, again.elapsed.total_seconds(), f"replay answers the first answer: {same}"

    return [
        ("1 duplicate x-request-timeout-seconds (300, 0) on 8 beams x 1024", "accepted: the timeout lifted",
         duplicate_guard_header),
        ("2 PATCH add [6,7] next to an unreachable key", "200 'added 1', items became (5),(6),(6,7),(7,8)",
         patch_unreachable_key),
        ("3 catalog: 8,000 two-token items + one of 8,000 tokens", "accepted, manager 1.4 -> 2.7 GB",
         catalog_one_long_item),
        ("4 catalog item of 2M ids, then a small admin PUT", "compile past 60 s; admin writes 400 for ~2.5 min",
         catalog_2m_item_then_small_put),
        ("5 PATCH adding 2.1M items", "accepted (a PUT of the same catalog: 422)", patch_past_max_tree_keys),
        ("6 32 concurrent n=8 label requests from one client", "another client waited 39 s", rows_from_one_client),
        ("7 unenforceable schema, n=8, max_tokens 1024", "3 attempts per output, 138 s, probe p95 13.5x, usage 1 attempt",
         regeneration_n8),
        ("8 exclude item of 2M ids, 16 at once", "ingress stalled (probe p95 85x), 1.2 GB after 48", exclude_2m_ids_x16),
        ("9 structured_outputs.choice of 100,000 labels", "17-20 s of compile, probe 4.5x", choice_100k_labels),
        ("10 catalog header with \\ud800 in description", "500", catalog_header_surrogate),
        ("10 If-Match of 5,000 digits", "500", if_match_5000_digits),
        ("11 catalog header with a repeated key", "accepted (last wins)", catalog_header_duplicate_key),
        ("12 replayed PATCH (same Idempotency-Key)", "answered {name, version} only", replayed_patch),
    ]


# -- report 3 ------------------------------------------------------------------------------------------------------

AMBIGUOUS = 'start: x+ "\u2603"\nx: "a" | "ab" | "abc" | "b" | "bc" | "c" | x x | x x x'


def attacks_third(bench: ServeBench):
    """The third report's requests (one replica, ``limits.max_num_beams: 1024``); each entry: (name, what the report saw
    before the fixes, the request). Each row also gives /healthz during the attack (``healthz``)."""
    url, admin = bench.url, bench.admin
    chat = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}

    def tools(count: int) -> list[dict]:
        return [{"type": "function", "function": {"name": f"f{i}"}} for i in range(count)]

    def tools_chat():
        return _post(url, "/v1/chat/completions", {**chat, "tools": tools(6000)})

    def tools_responses():
        return _post(url, "/v1/responses", {"model": "default", "input": "hi", "tools": [
            {"type": "function", "name": f"f{i}"} for i in range(3000)]})

    def tools_put():
        t0 = time.perf_counter()
        r = requests.put(f"{url}/admin/scenarios/a29-tools", json={"type": "tools", "tools": tools(6000)},
                         headers=admin, timeout=600)
        return r.status_code, time.perf_counter() - t0, r.text[:200]

    def ambiguous_grammar():
        return _post(url, "/v1/chat/completions", {**chat, "max_tokens": 1024, "temperature": 0,
                                                   "structured_outputs": {"grammar": AMBIGUOUS}})

    def huge_function_output():
        return _post(url, "/v1/responses", {"model": "default", "input": [
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "x " * 10_000_000}]})

    def huge_tool_description():
        return _post(url, "/v1/chat/completions", {**chat, "tool_choice": "none", "tools": [
            {"type": "function", "function": {"name": "f", "description": "x " * 10_000_000}}]})

    def responses_flood():
        with ThreadPoolExecutor(48) as pool:
            futs = [pool.submit(_post, url, "/v1/responses", {"model": "default", "input": "Tell a story.",
                                                              "max_output_tokens": 64}) for _ in range(48)]
            codes = [f.result()[0] for f in futs]
        counts = {str(c): codes.count(c) for c in sorted(set(codes))}
        return 200 if all(c in (200, 429) for c in codes) else codes[0], 0.0, f"status counts {counts}"

    def n8_from_three_addresses():
        def one(i: int):
            host, port = url.split("//")[1].split(":")
            conn = http.client.HTTPConnection(host, int(port), timeout=600, source_address=(f"127.0.1.{i % 3 + 1}", 0))
            conn.request("POST", "/v1/generate", body=json.dumps({**PROBE, "n": 8, "max_new_tokens": 256,
                                                                   "temperature": 0.8, "seed": i}),
                         headers={"Content-Type": "application/json"})
            return conn.getresponse().status

        with ThreadPoolExecutor(12) as pool:
            codes = list(pool.map(one, range(12)))
        return codes[0], 0.0, f"status counts {{{', '.join(f'{c}: {codes.count(c)}' for c in sorted(set(codes)))}}}"

    def beams_1024():
        return _post(url, "/v1/generate", {"prompt": "Count: " + "1 2 3 4 5 6 7 8 9 10 " * 36, "num_beams": 1024,
                                           "max_new_tokens": 16})

    def deep_arguments():
        deep = "[" * 3000 + "]" * 3000
        return _post(url, "/v1/chat/completions", {**chat, "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                  "function": {"name": "f", "arguments": deep}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}]})

    def deep_parameters_none():
        params: dict = {"type": "object"}
        for _ in range(200):
            params = {"type": "object", "properties": {"a": params}}
        return _post(url, "/v1/chat/completions", {**chat, "tool_choice": "none", "tools": [
            {"type": "function", "function": {"name": "f", "parameters": params}}]})

    def forwarded_twice():
        return _raw(url, "POST", "/v1/generate", [("Content-Type", "application/json"),
                                                  ("X-Forwarded-For", "198.51.100.1"), ("X-Forwarded-For", "10.0.0.7")],
                    json.dumps(PROBE).encode()) + (0.0,)

    def stop_with_json_object():
        return _post(url, "/v1/chat/completions", {**chat, "max_tokens": 32, "stop": ["\n"],
                                                   "response_format": {"type": "json_object"}})

    def empty_language_grammar():
        return _post(url, "/v1/chat/completions", {**chat, "structured_outputs": {"grammar": 'start: x\nx: x "a"'}})

    def empty_idempotency_key():
        r = requests.put(f"{url}/admin/scenarios/a29-idem", json={"type": "labels", "labels": ["a"]},
                         headers={**admin, "Idempotency-Key": ""}, timeout=60)
        return r.status_code, r.elapsed.total_seconds(), r.text[:200]

    return [
        ("1 6,000 parameterless tools (chat)", "422 after 75.7 s, probe 296x, /healthz 15/16 failed", tools_chat),
        ("1 3,000 tools (/v1/responses)", "19.7 s", tools_responses),
        ("1 stored tools PUT of 6,000 tools", "25.5 s on the manager", tools_put),
        ("2 ambiguous grammar, greedy, 1,024 tokens", "token gaps 1.2-2.4 s, probe 13.5x", ambiguous_grammar),
        ("3 20 MB function_call_output", "plain-text 500 after ~7 s, 503s for 15 s", huge_function_output),
        ("3 20 MB tool description, tool_choice none", "plain-text 500", huge_tool_description),
        ("4 48 concurrent Responses requests, one address", "0 x 429", responses_flood),
        ("5a 12 n=8 requests from 3 addresses", "probe waited 52.2 s", n8_from_three_addresses),
        ("5b 1,024 beams after a 730-token prompt", "85 s, probe p50 20 s (108x)", beams_1024),
        ("6 tool-call arguments nested 3,000 deep", "500", deep_arguments),
        ("6 parameters 200 deep with tool_choice none", "accepted", deep_parameters_none),
        ("7 two X-Forwarded-For lines (no proxy header trusted here)", "the client's own line counted",
         forwarded_twice),
        ("8 stop with response_format json_object", "400", stop_with_json_object),
        ("9 grammar with an empty language", "200 with llguidance's parser state in error", empty_language_grammar),
        ("9 empty Idempotency-Key", "taken as no key", empty_idempotency_key),
    ]


WORDS = ("cat", "dog", "sun", "red", "blue", "tree", "fish")


def attacks_fourth(bench: ServeBench):
    """The fourth report's requests (one replica, ``limits.max_num_beams: 1024``): wide beams on every generating
    route and many moderate beam requests, a Parquet catalog whose repeated metadata value decodes to gigabytes,
    stalled chunked uploads, a 400-digit integer in a filter; each entry (name, what the report saw before the
    fixes, the request)."""
    url, admin = bench.url, bench.admin
    long_text = " ".join(WORDS[i % len(WORDS)] for i in range(700))

    def beams_chat():
        return _post(url, "/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": long_text}],
                                                   "num_beams": 1024, "n": 1, "max_tokens": 8})

    def beams_completions():
        return _post(url, "/v1/completions", {"model": "default", "prompt": long_text, "num_beams": 1024, "n": 1,
                                              "max_tokens": 8})

    def beams_generate_messages():
        return _post(url, "/v1/generate", {"messages": [{"role": "user", "content": long_text}], "num_beams": 1024,
                                           "max_new_tokens": 8})

    def beams_moderate(filtered: bool):
        catalog = b"".join([json.dumps({"start_token_id": 2000, "end_token_id": 2}).encode() + b"\n"] + [
            json.dumps({"ids": [1000 + i // 1000, 3000 + (i // 10) % 100, 5000 + i % 10],
                        "metadata": {"stock": i % 50}}).encode() + b"\n" for i in range(100_000)])
        r = requests.put(f"{url}/admin/scenarios/a44-beams", data=catalog,
                         headers={**admin, "Content-Type": "application/x-ndjson"}, timeout=600)
        if r.status_code != 200:
            return r.status_code, 0.0, r.text[:200]
        stop = time.monotonic() + 40
        counter = iter(range(10**9))

        def client(c: int) -> list[int]:
            codes = []
            while time.monotonic() < stop:
                body = {"scenario": "a44-beams", "prompt": "Pick an item:", "num_beams": 16, "n": 4,
                        "max_new_tokens": 4}
                if filtered:
                    body["filter"] = {"stock": {"$gte": next(counter) % 40}}
                codes.append(_post(url, "/v1/generate", body)[0])
            return codes

        with ThreadPoolExecutor(8) as pool:
            codes = [c for cs in pool.map(client, range(8)) for c in cs]
        counts = {str(c): codes.count(c) for c in sorted(set(codes))}
        return 200 if set(codes) <= {200} else codes[0], 40.0, f"8 clients x num_beams 16 for 40 s: {counts}"

    def parquet_repeated_value():
        import io

        import pyarrow as pa
        import pyarrow.parquet as pq

        rows = 200_000
        table = pa.table({"ids": pa.array([[1000 + i // 1000, 2000 + i % 1000] for i in range(rows)],
                                          pa.list_(pa.int32())),
                          "note": pa.array(["x" * 4000] * rows)})  # Parquet writes it as one dictionary page
        table = table.replace_schema_metadata({"catalog": json.dumps({"start_token_id": 3000, "end_token_id": 2})})
        buf = io.BytesIO()
        pq.write_table(table, buf)
        pq_bytes = buf.getvalue()
        t0 = time.perf_counter()
        r = requests.put(f"{url}/admin/scenarios/a44-parquet", data=pq_bytes,
                         headers={**admin, "Content-Type": "application/vnd.apache.parquet"}, timeout=600)
        return r.status_code, time.perf_counter() - t0, f"{len(pq_bytes) / 1e3:.0f} KB file: {r.text[:160]}"

    def stalled_uploads():
        import socket

        host, port = url.split("//")[1].split(":")
        socks = []
        for _ in range(4):
            s = socket.create_connection((host, int(port)))
            s.sendall((f"PUT /admin/scenarios/a44-stalled HTTP/1.1\r\nHost: {host}\r\n"
                       f"Authorization: {admin['Authorization']}\r\nContent-Type: application/x-ndjson\r\n"
                       "Transfer-Encoding: chunked\r\n\r\n").encode())
            s.sendall(f"{32 * 2**20:x}\r\n".encode())
            header = json.dumps({"start_token_id": 2000, "end_token_id": 2}).encode() + b"\n"
            line = b"[1000,1001]\n"
            s.sendall(header + line * ((20 * 10**6 - len(header)) // len(line)))
            socks.append(s)
        time.sleep(35)  # past limits.upload_part_timeout_s (30 s): the stalled parts are answered and dropped
        lines = [json.dumps({"start_token_id": 2000, "end_token_id": 2})] + [
            f"[{1000 + i // 1000},{1000 + i % 1000}]" for i in range(1_600_000)]
        body = ("\n".join(lines) + "\n").encode()  # about 19 MB: more than one 16 MiB part, so it needs the spool
        t0 = time.perf_counter()
        r = requests.put(f"{url}/admin/scenarios/a44-fifth", data=iter([body[i:i + 2**20] for i in
                                                                        range(0, len(body), 2**20)]),
                         headers={**admin, "Content-Type": "application/x-ndjson"}, timeout=600)
        took = time.perf_counter() - t0
        answered = 0
        for s in socks:
            s.settimeout(1.0)
            try:
                answered += 1 if s.recv(64) else 0
            except OSError:
                pass
            s.close()
        return r.status_code, took, f"fifth upload {r.text[:80]}; stalled clients answered or closed: {answered}/4"

    def huge_integer_filter():
        big = int("1" + "0" * 400)
        body = {"scenario": "a44-beams", "prompt": "Pick an item:", "max_new_tokens": 4,
                "filter": {"stock": {"$gt": big}}}
        return _post(url, "/v1/generate", json.dumps(body))

    return [
        ("1a 1,024 beams, 700-word chat message (/v1/chat/completions)", "200 after 55 s, probe waited 55.0 s (275x)",
         beams_chat),
        ("1b 1,024 beams, 700-word prompt (/v1/completions)", None, beams_completions),
        ("1c 1,024 beams, 700-word message (/v1/generate messages)", None, beams_generate_messages),
        ("1d 8 clients of num_beams 16, no filter", "probe 15.7x", lambda: beams_moderate(False)),
        ("1e 8 clients of num_beams 16, a new filter each time", "probe 18.7x", lambda: beams_moderate(True)),
        ("3 Parquet 200,000 rows, one 4,000-byte metadata value", "200 after 76.7 s, manager +4.7 GB, probe 3.3x",
         parquet_repeated_value),
        ("5 four stalled chunked uploads, then a fifth", "no answer in 60 s, a 17 MB spool file each",
         stalled_uploads),
        ("6 a 400-digit integer in a filter", "500 (OverflowError)", huge_integer_filter),
    ]


class Health:
    """Polls /healthz every 0.5 s from its own address while an attack runs: (checks, failed)."""

    def __init__(self, url: str):
        self.url = url
        self.checks = self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                ok = requests.get(f"{self.url}/healthz", timeout=2).status_code == 200
            except requests.RequestException:
                ok = False
            self.checks += 1
            self.failed += 0 if ok else 1
            time.sleep(0.5)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def main() -> None:
    report = int(sys.argv[sys.argv.index("--report") + 1]) if "--report" in sys.argv else 1
    # --engine vllm: the model replica on vLLM (run with .venv-vllm's python; beam requests are then a 400)
    engine = ({"engine": "vllm", "vllm_enforce_eager": True, "vllm_kv_cache_gb": 0.5, "num_cpus_per_replica": 1}
              if "--engine" in sys.argv and sys.argv[sys.argv.index("--engine") + 1] == "vllm" else {})
    with ServeBench(num_cpus=4) as bench:
        if report in (3, 4):  # the report's setting: one replica, wide beams allowed
            bench.deploy(bench.settings(num_replicas=1, torch_threads=2, limits={"max_num_beams": 1024}, **engine),
                         replicas=1, timeout=900)
        else:
            bench.deploy(bench.settings(num_replicas=2, num_cpus_per_replica=1, torch_threads=1), replicas=2)
        probe = Probe(bench.url).start()
        time.sleep(20)  # warm-up
        probe.phase = "baseline"
        time.sleep(30)
        results = []
        runs = ([(name, None, fn) for name, fn in attacks(bench)] if report == 1 else
                attacks_second(bench) if report == 2 else attacks_third(bench) if report == 3 else
                attacks_fourth(bench))
        only = sys.argv[sys.argv.index("--only") + 1].split(",") if "--only" in sys.argv else None
        runs = [r for r in runs if only is None or any(r[0].startswith(prefix) for prefix in only)]
        for name, before, fn in runs:
            probe.phase = name
            with Rss() as rss, Rss("ConfigManager") as manager_rss, Health(bench.url) as health:
                status, secs, text = fn()
                time.sleep(5)  # the probe keeps measuring while the attack's after-effects last
            probe.phase = "idle"
            row = {"attack": name, "status": status, "attack_s": round(secs, 2), "detail": text,
                   "probe": probe.stats(name), "rss_mib": {"before": rss.before, "peak": rss.peak, "after": rss.after},
                   "manager_rss_mib": {"before": manager_rss.before, "peak": manager_rss.peak,
                                       "after": manager_rss.after},
                   "healthz": {"checks": health.checks, "failed": health.failed}}
            if before is not None:
                row["before_the_fixes"] = before
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
    emit({"bench": "attack_rerun", "report": report, "baseline": base, "attacks": results, "health": health.get("status"),
          "probe_non_200": sum(len(r["probe"]["non_200"]) for r in results)})


if __name__ == "__main__":
    main()
