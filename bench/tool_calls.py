"""The cost of a tool call against the same request with ``response_format`` (same schema), 16 clients at once.

Both modes ask the same thing of the model, over real HTTP to the whole app on Ray Serve (one model replica, as in
``tests/serve``), with the ``openai`` client's JSON bodies:

* ``tools``: one function tool (``get_weather``, two required parameters), ``tool_choice`` naming it: the answer is
  ``message.tool_calls[0]``, its arguments checked against the parameters;
* ``response_format``: ``json_schema`` with the function's parameters as the schema: the answer is the message's
  content, checked against the same schema.

``--clients`` closed-loop threads send ``--requests`` requests per mode in rounds (tools, response_format,
tools, response_format), so drift on the shared machine falls on both alike. Reported per mode: requests per
second, latency p50/p95, completion tokens per request, and invalid answers (expected: 0); then the ratios
tools / response_format. The tool-call prompt also carries the tool's description (the chat template's tool
block, or our system message), so some extra prompt cost is expected.

    python bench/tool_calls.py [--clients 16] [--requests 64] [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import emit, log  # noqa: E402
from bench._serve import ServeBench, percentile  # noqa: E402

PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "unit": {"enum": ["celsius", "fahrenheit"]}},
              "required": ["city", "unit"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city.",
                                         "parameters": PARAMETERS, "strict": True}}
CITIES = ["Paris", "Oslo", "Lima", "Kyoto", "Cairo", "Perth", "Quito", "Riga"]


def body(mode: str, i: int, max_tokens: int) -> dict:
    ask = {"model": "default", "max_tokens": max_tokens, "temperature": 0.7, "seed": i,
           "messages": [{"role": "user", "content": f"What is the weather in {CITIES[i % len(CITIES)]}?"}]}
    if mode == "tools":
        return {**ask, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    return {**ask, "response_format": {"type": "json_schema",
                                       "json_schema": {"name": "get_weather", "schema": PARAMETERS, "strict": True}}}


def answer_error(mode: str, response: requests.Response) -> str | None:
    """Why the answer is not a valid one for its mode (None: valid)."""
    import jsonschema

    if response.status_code != 200:
        return f"HTTP {response.status_code}: {response.text[:120]}"
    choice = response.json()["choices"][0]
    try:
        if mode == "tools":
            if choice["finish_reason"] != "tool_calls":
                return f"finish_reason {choice['finish_reason']}"
            (call,) = choice["message"]["tool_calls"]
            if call["function"]["name"] != "get_weather":
                return f"name {call['function']['name']}"
            jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMETERS)
        else:
            if choice["finish_reason"] != "stop":
                return f"finish_reason {choice['finish_reason']}"
            jsonschema.validate(json.loads(choice["message"]["content"]), PARAMETERS)
    except (ValueError, KeyError, jsonschema.ValidationError) as exc:
        return f"{type(exc).__name__}: {str(exc)[:120]}"
    return None


def run_round(url: str, mode: str, clients: int, count: int, offset: int, max_tokens: int) -> dict:
    """``count`` requests of ``mode`` from ``clients`` closed-loop threads."""
    latencies: list[float] = []
    tokens: list[int] = []
    prompt_tokens: list[int] = []
    invalid: list[str] = []
    lock = threading.Lock()
    todo = iter(range(offset, offset + count))

    def client() -> None:
        session = requests.Session()
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            t0 = time.perf_counter()
            r = session.post(f"{url}/v1/chat/completions", json=body(mode, i, max_tokens), timeout=600)
            elapsed = time.perf_counter() - t0
            error = answer_error(mode, r)
            with lock:
                latencies.append(elapsed)
                if error:
                    invalid.append(error)
                else:
                    usage = r.json()["usage"]
                    tokens.append(usage["completion_tokens"])
                    prompt_tokens.append(usage["prompt_tokens"])

    threads = [threading.Thread(target=client) for _ in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "latencies": latencies, "tokens": tokens, "prompt_tokens": prompt_tokens,
            "invalid": invalid}


def summary(rounds: list[dict]) -> dict:
    lat = [x for r in rounds for x in r["latencies"]]
    tok = [x for r in rounds for x in r["tokens"]]
    ptok = [x for r in rounds for x in r["prompt_tokens"]]
    wall = sum(r["wall_s"] for r in rounds)
    return {"requests": len(lat), "req_per_s": round(len(lat) / wall, 3), "p50_s": round(percentile(lat, 50), 3),
            "p95_s": round(percentile(lat, 95), 3),
            "completion_tokens_mean": round(sum(tok) / len(tok), 1) if tok else None,
            "prompt_tokens_mean": round(sum(ptok) / len(ptok), 1) if ptok else None,
            "invalid": sum(len(r["invalid"]) for r in rounds),
            "invalid_examples": [e for r in rounds for e in r["invalid"]][:3]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=64, help="requests per mode (split over two rounds)")
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    with ServeBench(num_cpus=4) as bench:
        bench.deploy(bench.settings(num_replicas=1, max_batch_size=16), replicas=1)
        log("warm-up")
        run_round(bench.url, "tools", 4, 8, 10_000, args.max_tokens)
        run_round(bench.url, "response_format", 4, 8, 10_000, args.max_tokens)
        rounds: dict[str, list[dict]] = {"tools": [], "response_format": []}
        half = max(1, args.requests // 2)
        for k in range(2):
            for mode in ("tools", "response_format"):
                r = run_round(bench.url, mode, args.clients, half, k * half, args.max_tokens)
                log(f"round {k + 1} {mode}: {len(r['latencies'])} requests in {r['wall_s']:.1f} s, "
                    f"{len(r['invalid'])} invalid")
                rounds[mode].append(r)
    result = {mode: summary(rs) for mode, rs in rounds.items()}
    tools, rf = result["tools"], result["response_format"]
    emit({"bench": "tool_calls", "clients": args.clients, "max_tokens": args.max_tokens, **result,
          "ratio_tools_vs_response_format": {
              "req_per_s": round(tools["req_per_s"] / rf["req_per_s"], 3),
              "p50": round(tools["p50_s"] / rf["p50_s"], 3), "p95": round(tools["p95_s"] / rf["p95_s"], 3)}})


if __name__ == "__main__":
    main()
