"""Our service on the vLLM backend against the peers that serve the same vLLM: vLLM's own OpenAI server and Ray Serve
LLM (``ray.serve.llm.build_openai_app``); same machine, model (the float32 checkpoint), threads, KV cache and
prompts.

Three workloads, each ``--requests`` requests sent ``--concurrency`` (16) at a time, greedy (so every system
generates the same tokens where the constraint allows the same outputs):

* ``free``: free text, ``--free-tokens`` new tokens at most, a different chat prompt per request;
* ``labels``: one of 10 labels (ours: a stored ``labels`` scenario; peers: ``structured_outputs.choice``);
* ``json``: a JSON schema (ours: a stored ``json_schema`` scenario; peers: ``response_format`` json_schema with
  vLLM's ``guidance`` backend and ``disable_any_whitespace``: the same compact grammar as ours).

Systems, each a column of the result: our service on both of its routes, ``<backend>/generate`` (the native
``POST /v1/generate``) and ``<backend>/chat`` (``POST /v1/chat/completions`` naming the scenario), and the two
peers on their chat route (``bench/_peers.py``): ``vllm-server`` (``python -m vllm.entrypoints.openai.api_server``,
a child process) and ``ray-serve-llm`` (deployed as a second Serve application in the same Ray cluster as ours, at
``/rsl``). Our backends (``--backends``): ``vllm-backend`` (``engine: vllm``, grammar rows masked by our chain,
the default), ``vllm-backend-guidance`` (``vllm_grammar: guidance``) and ``transformers``; one phase each,
redeployed between phases. In a phase, every round runs every workload on every system, the order of the
systems rotated from one workload and round to the next, so drifting load hits them alike. Every output is
checked (labels: exactly one label; json: parses and validates; free: some text); tokens/s counts the completion
tokens the server reports, req/s the requests, both over the wall time of a workload's batch. Ratios: ours / each
peer in req/s, per round then the median (the same requests in the same round). Targets: at least
0.95x vLLM's server and at least 1.0x Ray Serve LLM on every workload and both routes.

``--profile N`` (default 20) then sends N sequential short label requests through each layer: our whole HTTP path
on both routes, our model replica alone (a Serve handle call: no proxy, no ingress) and each peer's HTTP path,
median ms, interleaved: where a short request's time goes.

Threads: every vLLM engine gets the same ``--threads`` (default: all cores). Ray starts its workers at nice 15
unless told otherwise, while vLLM's server and this client run at 0: the bench starts Ray with
``RAY_worker_niceness=0`` (``--ray-niceness``).

``--grammar-ab`` measures only grammar rows inside one vLLM engine: our chain against vLLM's guidance structured
outputs (same grammar), alternated, with the outputs compared token for token.

Run (in .venv-vllm, which has vLLM, its server and Ray Serve LLM: ``scripts/setup_vllm.sh``)::

    .venv-vllm/bin/python bench/engines.py                 # ~25 min here (three vLLM starts with torch.compile)
    .venv-vllm/bin/python bench/engines.py --enforce-eager --rounds 1 --requests 16   # a quick look
    .venv-vllm/bin/python bench/engines.py --grammar-ab     # chain or guidance for grammar rows

Last line of stdout: the result as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import emit, log, median, ratio  # noqa: E402
from bench._peers import RayServeLLM, VLLMServer, chat_body  # noqa: E402
from bench._serve import ServeBench  # noqa: E402

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
SCENARIOS = {"labels": "bench-labels", "json": "bench-json"}
SYSTEMS = {"transformers": "transformers", "vllm": "vllm-backend", "vllm-guidance": "vllm-backend-guidance"}
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


def _post(url: str, body: dict) -> requests.Response:
    return requests.post(url, json=body, timeout=600)


def ours_generate(url: str, workload: str, prompt: str, max_tokens: int) -> dict:
    """Our native route, ``POST /v1/generate``, with the workload's stored scenario."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_new_tokens": max_tokens, "temperature": 0}
    if workload in SCENARIOS:
        body["scenario"] = SCENARIOS[workload]
    r = _post(f"{url}/v1/generate", body)
    if r.status_code != 200:
        return {"ok": False, "text": r.text[:200], "tokens": 0, "finish": "http"}
    out = r.json()["outputs"][0]
    return {"ok": True, "text": out["text"], "tokens": len(out["token_ids"]), "finish": out["finish_reason"]}


def _chat_result(r: requests.Response) -> dict:
    if r.status_code != 200:
        return {"ok": False, "text": r.text[:200], "tokens": 0, "finish": "http"}
    body = r.json()
    choice = body["choices"][0]
    return {"ok": True, "text": choice["message"]["content"] or "", "tokens": body["usage"]["completion_tokens"],
            "finish": choice["finish_reason"]}


def ours_chat(url: str, workload: str, prompt: str, max_tokens: int) -> dict:
    """Our OpenAI route, ``POST /v1/chat/completions``, naming the workload's stored scenario."""
    body = chat_body("default", prompt, max_tokens)
    if workload in SCENARIOS:
        body["scenario"] = SCENARIOS[workload]
    return _chat_result(_post(f"{url}/v1/chat/completions", body))


def peer_chat(url: str, workload: str, prompt: str, max_tokens: int) -> dict:
    """A peer's OpenAI route with vLLM's own constraint fields (the same constraints as our scenarios)."""
    body = chat_body("m", prompt, max_tokens)
    if workload == "labels":
        body["structured_outputs"] = {"choice": [" " + label for label in LABELS]}  # ours are continuations too
    elif workload == "json":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    return _chat_result(_post(f"{url}/v1/chat/completions", body))


def valid(workload: str, res: dict) -> bool:
    if not res["ok"]:
        return False
    text = res["text"]
    if workload == "free":
        return bool(text) and res["finish"] in ("stop", "length")
    if workload == "labels":  # one label, as a continuation (" sports") or bare on a chat route, then the end
        return res["finish"] == "stop" and text.lstrip(" ") in LABELS and text.lstrip(" ") == text.strip()
    import jsonschema

    if res["finish"] != "stop":
        return False
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def run_batch(system: str, call, url: str, workload: str, n: int, concurrency: int, max_tokens: int) -> dict:
    batch = prompts(workload, n)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: call(url, workload, p, max_tokens), batch))
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    ok = sum(valid(workload, r) for r in results)
    bad = [r for r in results if not valid(workload, r)]
    if bad:
        log(f"  {system}/{workload}: {len(bad)} invalid, e.g. {bad[0]}")
    return {"seconds": round(wall, 2), "requests": n, "tokens": tokens, "tokens_per_s": round(tokens / wall, 1),
            "req_per_s": round(n / wall, 2), "valid": ok}


# --------------------------------------------------------------------------- grammar rows: chain or guidance


def grammar_ab(args) -> dict:
    """One VLLMEngine (no Ray, no HTTP): the JSON-schema and regex workloads with grammar rows masked by our
    chain, then by vLLM's guidance structured outputs (the engine's ``grammar_backend`` switched between
    batches), alternating for ``--rounds`` rounds. Both must give the same tokens (same grammar, greedy)."""
    import threading as _threading

    from processors.scenarios import load_scenario
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


def profile_short(bench, peers: dict, n: int) -> dict:
    """Where a short request's time goes: ``n`` sequential greedy label requests (a few tokens each, the shortest
    constrained request) through each layer of our service and each peer, median milliseconds.

    Ours: the whole HTTP path (Serve's proxy, our ingress, the model replica, the engine) on both routes, and the
    model replica alone (a Serve handle call from this process: Ray's actor call, the replica, the engine; no proxy,
    no ingress). The difference is what the proxy and the ingress add. Peers: their whole HTTP path."""
    from ray import serve

    from bench._serve import APP_NAME

    prompt = prompts("labels", 1)[0]
    handle = serve.get_deployment_handle("ModelReplica", app_name=APP_NAME)
    native = {"messages": [{"role": "user", "content": prompt}], "max_new_tokens": 16, "temperature": 0,
              "scenario": SCENARIOS["labels"]}
    layers = {
        "ours: HTTP /v1/generate (proxy + ingress + replica + engine)":
            lambda: ours_generate(bench.url, "labels", prompt, 16),
        "ours: HTTP /v1/chat/completions": lambda: ours_chat(bench.url, "labels", prompt, 16),
        "ours: model replica handle (replica + engine)": lambda: handle.generate.remote(dict(native)).result(),
        **{f"{name}: HTTP /v1/chat/completions": (lambda url=peer.url: peer_chat(url, "labels", prompt, 16))
           for name, peer in peers.items()},
    }
    times: dict[str, list[float]] = {name: [] for name in layers}
    for call in layers.values():
        call()  # warm
    for _ in range(n):
        for name, call in layers.items():  # interleaved, so drifting load hits every layer alike
            t0 = time.perf_counter()
            call()
            times[name].append((time.perf_counter() - t0) * 1000)
    out = {name: round(median(v), 1) for name, v in times.items()}
    replica = out["ours: model replica handle (replica + engine)"]
    out["ours: proxy + ingress (HTTP /v1/generate - replica handle)"] = round(
        out["ours: HTTP /v1/generate (proxy + ingress + replica + engine)"] - replica, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="rounds (each system once per workload, order rotated)")
    ap.add_argument("--requests", type=int, default=32, help="requests per workload and round")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--free-tokens", type=int, default=64)
    ap.add_argument("--json-tokens", type=int, default=64)
    ap.add_argument("--label-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="model threads of every system")
    ap.add_argument("--kv-cache-gb", type=float, default=2.0)
    ap.add_argument("--enforce-eager", action="store_true", help="vLLM without torch.compile (every vLLM system)")
    ap.add_argument("--backends", default="vllm",
                    help="our backends, one phase each, in this order: vllm (vllm_grammar: chain), vllm-guidance "
                         "(vllm_grammar: guidance), transformers")
    ap.add_argument("--routes", default="generate,chat", help="our routes: generate (/v1/generate), chat "
                                                              "(/v1/chat/completions)")
    ap.add_argument("--peers", default="vllm-server,ray-serve-llm", help="peers: vllm-server, ray-serve-llm")
    ap.add_argument("--profile", type=int, default=20, help="sequential short requests per layer for the path "
                                                            "profile (0: none)")
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
    routes = {"generate": ours_generate, "chat": ours_chat}
    model_dir = model_directory(None)
    max_model_len = 2048
    sizes = {"max_num_seqs": args.concurrency, "kv_cache_gb": args.kv_cache_gb, "max_model_len": max_model_len,
             "enforce_eager": args.enforce_eager}
    peer_names = [p for p in args.peers.split(",") if p]
    results: dict = {"config": dict(vars(args)), "phases": {}, "start_seconds": {}}
    # Ray runs its workers (our replicas, Ray Serve LLM's, the vLLM processes they start) at nice 15 by default;
    # vLLM's server and this client run at 0. The same priority for all (--ray-niceness 15 keeps Ray's default).
    os.environ["RAY_worker_niceness"] = str(args.ray_niceness)
    peers: dict = {}
    server = None
    try:
        with ServeBench(num_cpus=8) as bench:
            if "vllm-server" in peer_names:  # starts beside the first deploy
                server = VLLMServer(model_dir, **sizes, env={"VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}"})
            if "ray-serve-llm" in peer_names:
                rsl = RayServeLLM(bench.url, model_dir, **sizes, threads=args.threads)
                results["start_seconds"]["ray-serve-llm"] = round(rsl.deploy(), 1)
                peers["ray-serve-llm"] = rsl
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
                bench.put(SCENARIOS["labels"], {"type": "labels", "labels": LABELS})
                bench.put(SCENARIOS["json"], {"type": "json_schema", "schema": SCHEMA})
                if server is not None and "vllm-server" not in peers:
                    results["start_seconds"]["vllm-server"] = round(server.wait_ready(), 1)
                    peers["vllm-server"] = server
                results["phases"][system] = run_phase(args, bench, system, routes, peers, workloads, deploy_s)
                if backend != "transformers":
                    results["phases"][system]["engine_stats"] = bench.model_stats()
                if args.profile:
                    results["phases"][system]["profile_ms"] = profile_short(bench, peers, args.profile)
                    log(f"profile (median ms): {json.dumps(results['phases'][system]['profile_ms'], indent=1)}")
            for peer in peers.values():
                if isinstance(peer, RayServeLLM):
                    peer.stop()
    finally:
        if server is not None:
            server.stop()
    results["verdict"] = verdict(results["phases"], list(peers))
    emit(results)


def run_phase(args, bench, system: str, routes: dict, peers: dict, workloads: list, deploy_s: float) -> dict:
    """Every system (our routes, the peers) on every workload, ``--rounds`` times, the order of the systems rotated
    from one workload and round to the next so that load drifting over the run hits them alike."""
    systems = [(f"{system}/{route}", routes[route], bench.url) for route in args.routes.split(",")]
    systems += [(name, peer_chat, peer.url) for name, peer in peers.items()]
    phase: dict = {"deploy_seconds": round(deploy_s, 1), "rounds": [], "load_average_at_start": os.getloadavg()[0]}
    for name, call, url in systems:  # warm-up (not counted): compiled shapes, grammars, prefix caches
        for workload, max_tokens in workloads:
            run_batch(name, call, url, workload, args.concurrency, args.concurrency, max_tokens)
    for r in range(args.rounds):
        rnd = {}
        for w, (workload, max_tokens) in enumerate(workloads):
            shift = (r * len(workloads) + w) % len(systems)
            for name, call, url in systems[shift:] + systems[:shift]:
                res = run_batch(name, call, url, workload, args.requests, args.concurrency, max_tokens)
                rnd[f"{name}/{workload}"] = res
                log(f"round {r} {name:28s} {workload:6s} {res['tokens_per_s']:7.1f} tok/s "
                    f"{res['req_per_s']:6.2f} req/s  valid {res['valid']}/{res['requests']}")
        phase["rounds"].append(rnd)
    summary = {}
    for name, _, _ in systems:
        for workload, _ in workloads:
            runs = [rnd[f"{name}/{workload}"] for rnd in phase["rounds"]]
            summary[f"{name}/{workload}"] = {
                "tokens_per_s": round(median([x["tokens_per_s"] for x in runs]), 1),
                "req_per_s": round(median([x["req_per_s"] for x in runs]), 2),
                "valid_pct": round(100 * sum(x["valid"] for x in runs) / sum(x["requests"] for x in runs), 1),
            }
    phase["summary"] = summary
    phase["load_average_at_end"] = os.getloadavg()[0]
    # ours / each peer, per round then the median (the same requests in the same round: less exposed to drift)
    phase["ratios"] = {
        f"{ours}/{workload} vs {peer}": ratio(median([rnd[f"{ours}/{workload}"]["req_per_s"]
                                                      / rnd[f"{peer}/{workload}"]["req_per_s"]
                                                      for rnd in phase["rounds"]]), 1.0)
        for ours, _, _ in systems if ours.startswith(system + "/") for peer in peers for workload, _ in workloads
    }
    log(f"{system}: req/s ratios {json.dumps(phase['ratios'], indent=1)}")
    return phase


def verdict(phases: dict, peers: list[str]) -> dict:
    """Targets: each of our routes at least 0.95x vLLM's server and at least Ray Serve LLM (1.0x) in
    requests/s on every workload, every output valid."""
    targets = {"vllm-server": 0.95, "ray-serve-llm": 1.0}
    out = {}
    for system, phase in phases.items():
        for key, value in phase["ratios"].items():
            peer = key.split(" vs ")[1]
            out[key] = {"ratio": value, "target": targets[peer], "meets_target": (value or 0) >= targets[peer]}
        out[f"{system}: all outputs valid"] = all(v["valid_pct"] == 100.0 for v in phase["summary"].values())
    return out


if __name__ == "__main__":
    main()
