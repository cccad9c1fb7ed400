"""Beam search inside the continuous batch: 16 concurrent beam requests against the same requests one at a time.

The catalog is a tree of semantic ids (``--items`` distinct items of ``--levels`` codes, 256 codes per level, each
code its own token), the generative-retrieval workload of the seeds. Every request asks for its ``--beams`` best
items (``n = num_beams``); every returned sequence is checked to be a path of the tree ending with the end token.
A second workload, ``free``, decodes unconstrained greedy text, concurrent against one at a time.

Runs on the decode engine directly (no Ray), on the CPU or a GPU (``--device cuda``). Without the default model's
weights (a GPU machine that cannot install the model package), ``--random-weights DIR`` builds the model from the
``config.json`` and tokenizer in DIR with random weights: the timings are the same, and validity is enforced by
the tree, not by the weights. Rounds alternate (one at a time, concurrent, ...); the last line is one JSON object.

    .venv/bin/python bench/beams.py                       # CPU, the default model
    python bench/beams.py --device cuda --random-weights model_dir
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import emit, log  # noqa: E402

CODES = 256
BASE_TOKEN = 1000  # code c of level l is token BASE_TOKEN + l * CODES + c
START_TOKEN = 900


def catalog(items: int, levels: int, seed: int = 0) -> set[tuple[int, ...]]:
    rng = random.Random(seed)
    out: set[tuple[int, ...]] = set()
    while len(out) < items:
        out.add(tuple(rng.randrange(CODES) for _ in range(levels)))
    return out


def tree_body(items: set[tuple[int, ...]], end_token_id: int) -> dict:
    children: dict[str, set[int]] = {}
    for item in items:
        key = str(START_TOKEN)
        for level, code in enumerate(item):
            tok = BASE_TOKEN + level * CODES + code
            children.setdefault(key, set()).add(tok)
            key += "_" + str(tok)
        children.setdefault(key, set()).add(end_token_id)
    prefix = {k: sorted(v) for k, v in children.items()}
    return {"type": "tree", "tree": {"start_token_id": START_TOKEN, "end_token_id": end_token_id, "prefix_dict": prefix}}


def load(args):
    import torch

    if args.random_weights:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        config = AutoConfig.from_pretrained(args.random_weights)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        tokenizer = AutoTokenizer.from_pretrained(args.random_weights)
    else:
        from deployments.model_loader import load_model_and_tokenizer

        model, tokenizer = load_model_and_tokenizer(None)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    model = model.to(device=args.device, dtype=dtype).eval()
    return model, tokenizer


def run(engine, jobs_factory, concurrent: bool) -> tuple[float, list]:
    """Submit the factory's requests (all at once, or each after the previous ended); seconds and collectors."""
    from deployments.engines import EventCollector

    jobs = jobs_factory()
    t0 = time.perf_counter()
    waiters = []
    for request in jobs:
        w = EventCollector()
        engine.submit(request, w)
        waiters.append(w)
        if not concurrent:
            w.wait(3600)
    for w in waiters:
        w.wait(3600)
    return time.perf_counter() - t0, waiters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--items", type=int, default=100_000)
    ap.add_argument("--levels", type=int, default=3)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--beams", type=int, default=8)
    ap.add_argument("--free-tokens", type=int, default=64, help="tokens per request of the free-text workload (0: skip)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--random-weights", metavar="DIR", help="a directory with config.json and the tokenizer files")
    ap.add_argument("--thread-counts", metavar="A,B",
                    help="only the free-text workload, concurrent, at these torch thread counts, alternated round by "
                         "round (a fresh engine per round, so its thread starts with the count); reports tokens/s each")
    args = ap.parse_args()
    if args.thread_counts:
        threads_ab(args)
        return

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from processors.scenarios import load_scenario
    from deployments.engines import EngineRequest, SamplingParams
    from deployments.engines.transformers import DecodeEngine
    from processors import build_prompt_ids, compile_scenario

    model, tokenizer = load(args)
    end = tokenizer.eos_token_id
    items = catalog(args.items, args.levels)
    t0 = time.perf_counter()
    compiled = compile_scenario(load_scenario(tree_body(items, end)), tokenizer)
    log(f"tree of {len(items)} items compiled in {time.perf_counter() - t0:.2f} s")
    batch = max(16, args.clients * args.beams)
    engine = DecodeEngine(model, tokenizer, max_batch_size=batch, prefix_cache_tokens=0).start()
    prompts = [build_prompt_ids(compiled, tokenizer, prompt=f"User {i} watched items 12, {i * 7}, {i * 13}; next:")
               for i in range(args.clients)]
    max_new = args.levels + 1

    def beam_jobs():
        return [EngineRequest(prompt_ids=p, compiled=compiled, max_new_tokens=max_new, n=args.beams, num_beams=args.beams)
                for p in prompts]

    free_prompts = [build_prompt_ids(None, tokenizer, prompt=f"Story number {i}: once upon a time") for i in range(args.clients)]

    def free_jobs():
        return [EngineRequest(prompt_ids=p, compiled=None, max_new_tokens=args.free_tokens, sampling=SamplingParams(temperature=0))
                for p in free_prompts]

    def check(waiters) -> tuple[int, int]:
        valid = total = 0
        for w in waiters:
            seen = set()
            for ev in w.finished.values():
                total += 1
                ids = ev.token_ids
                codes = tuple(t - BASE_TOKEN - level * CODES for level, t in enumerate(ids[:-1]))
                if ids and ids[-1] == end and len(codes) == args.levels and codes in items and codes not in seen:
                    valid += 1
                seen.add(codes)
        return valid, total

    results = {}
    workloads = [("beams", beam_jobs)] + ([("free", free_jobs)] if args.free_tokens else [])
    for name, factory in workloads:
        run(engine, factory, True)  # warm-up
        times = {"one_at_a_time": [], "concurrent": []}
        valid = total = tokens = 0
        chain = steps = 0.0
        for _ in range(args.rounds):
            for mode in ("one_at_a_time", "concurrent"):
                before = engine.stats()
                secs, waiters = run(engine, factory, mode == "concurrent")
                times[mode].append(secs)
                chain += engine.stats()["chain_seconds"] - before["chain_seconds"]
                steps += engine.stats()["step_seconds"] - before["step_seconds"]
                tokens += sum(len(ev.token_ids) for w in waiters for ev in w.finished.values())
                if name == "beams":
                    v, t = check(waiters)
                    valid += v
                    total += t
                log(f"{name} {mode}: {secs:.2f} s for {args.clients} requests")
        seq, conc = min(times["one_at_a_time"]), min(times["concurrent"])
        results[name] = {
            "requests": args.clients,
            "one_at_a_time_s": round(seq, 3),
            "concurrent_s": round(conc, 3),
            "speedup": round(seq / conc, 2),
            "concurrent_req_per_s": round(args.clients / conc, 2),
            "chain_share_of_step": round(chain / steps, 4) if steps else None,
        }
        if name == "beams":
            results[name].update({"returned_sequences": total, "valid_distinct_paths": valid})
        else:
            results[name]["concurrent_tokens_per_s"] = round(args.clients * args.free_tokens / conc, 1)
    engine.stop()
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"cpu x{torch.get_num_threads()} threads"
    emit({"bench": "beams", "device": device, "dtype": args.dtype, "items": len(items), "levels": args.levels,
          "num_beams": args.beams, "random_weights": bool(args.random_weights), **results})


def threads_ab(args) -> None:
    """Free text, ``--clients`` concurrent greedy requests, at each thread count in turn; one JSON line."""
    import statistics

    import torch

    from deployments.engines import EngineRequest, SamplingParams
    from deployments.engines.transformers import DecodeEngine
    from processors import build_prompt_ids

    counts = [int(c) for c in args.thread_counts.split(",")]
    model, tokenizer = load(args)
    prompts = [build_prompt_ids(None, tokenizer, prompt=f"Story number {i}: once upon a time") for i in range(args.clients)]

    def jobs():
        return [EngineRequest(prompt_ids=p, compiled=None, max_new_tokens=args.free_tokens, sampling=SamplingParams(temperature=0))
                for p in prompts]

    per: dict[int, dict[str, list[float]]] = {c: {"tok_s": [], "forward_share": [], "engine_threads": []} for c in counts}
    for rnd in range(args.rounds + 1):  # round 0 warms up and is not counted
        for c in counts if rnd % 2 == 0 else counts[::-1]:
            torch.set_num_threads(c)
            engine = DecodeEngine(model, tokenizer, max_batch_size=max(16, args.clients), prefix_cache_tokens=0).start()
            try:
                secs, waiters = run(engine, jobs, True)
                st = engine.stats()
            finally:
                engine.stop()
            tokens = sum(len(ev.token_ids) for w in waiters for ev in w.finished.values())
            log(f"threads {c}: {tokens / secs:.1f} tok/s, forward {st['forward_seconds'] / max(st['step_seconds'], 1e-9):.0%} "
                f"of step time, engine thread saw {st['torch_threads']} torch threads")
            if rnd:
                per[c]["tok_s"].append(tokens / secs)
                per[c]["forward_share"].append(st["forward_seconds"] / max(st["step_seconds"], 1e-9))
                per[c]["engine_threads"].append(st["torch_threads"])
    out = {c: {"tokens_per_s": round(statistics.median(v["tok_s"]), 1),
               "forward_share_of_step": round(statistics.median(v["forward_share"]), 3),
               "engine_thread_torch_threads": int(v["engine_threads"][0])} for c, v in per.items()}
    base = out[counts[0]]["tokens_per_s"]
    emit({"bench": "beams_threads", "workload": f"free text, {args.clients} concurrent, {args.free_tokens} tokens, greedy",
          "rounds": args.rounds, "dtype": args.dtype, "per_thread_count": out,
          "ratio_to_first": {c: round(v["tokens_per_s"] / base, 3) for c, v in out.items()}})


if __name__ == "__main__":
    main()
