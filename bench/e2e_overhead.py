"""End-to-end cost of the processor chain in a real decode loop.

SmolLM2-135M-Instruct, batch 16, 32 new tokens, sampled: the same ``generate`` call with the chain
(labels, tree, JSON schema scenarios) and without it, interleaved A/B/A/B so that machine noise
hits both sides. Every run decodes exactly ``--new-tokens`` steps: rows that finish stay pinned to
their end token (generate is given no EOS to stop on), so both sides do the same number of
forward passes. The time inside the chain is measured separately with a wrapper.

Prints one JSON object as its last line. Target: the chain makes a decode step at most 5% slower.

    python bench/e2e_overhead.py [--batch 16] [--new-tokens 32] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from transformers import LogitsProcessorList  # noqa: E402

from processors.scenarios import load_scenario  # noqa: E402
from deployments.examples import build_phrase_tree, chat_root_token_id  # noqa: E402
from deployments.model_loader import load_model_and_tokenizer  # noqa: E402
from processors import ConstrainedLogitsProcessor, build_prompt_ids, compile_scenario  # noqa: E402


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


class Timed:
    """Wraps a logits processor and accumulates the time spent in it."""

    def __init__(self, inner):
        self.inner = inner
        self.seconds = 0.0
        self.calls = 0

    def __call__(self, input_ids, scores):
        t0 = time.perf_counter()
        out = self.inner(input_ids, scores)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return out


def scenarios(tokenizer):
    tree = build_phrase_tree(
        tokenizer, ["red apple", "green pear", "blue sky at night", "yellow sun", "purple rain", "grey stone wall"],
        root=chat_root_token_id(tokenizer), end=tokenizer.eos_token_id,
    )
    return {
        "labels": {"type": "labels", "labels": ["Sports", "Technology", "Politics", "Health", "New York City"]},
        "tree": {"type": "tree", "tree": tree},
        "json_schema": {
            "type": "json_schema",
            "schema": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
                "required": ["name", "age", "tags"],
            },
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))

    model, tok = load_model_and_tokenizer()
    msgs = [{"role": "user", "content": "Describe the weather in one word, then give details."}]
    results = {}
    for name, body in scenarios(tok).items():
        compiled = compile_scenario(load_scenario(body), tok)
        ids = build_prompt_ids(compiled, tok, messages=msgs)
        input_ids = torch.tensor([ids] * args.batch)
        attention = torch.ones_like(input_ids)

        def run(constrained: bool, seed: int) -> tuple[float, float]:
            procs = LogitsProcessorList()
            timed = None
            if constrained:
                timed = Timed(ConstrainedLogitsProcessor(compiled, tokenizer=tok))
                procs.append(timed)
            torch.manual_seed(seed)
            t0 = time.perf_counter()
            out = model.generate(
                input_ids, attention_mask=attention, logits_processor=procs, do_sample=True, temperature=1.0,
                max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, eos_token_id=None,
                pad_token_id=tok.eos_token_id,
            )
            wall = time.perf_counter() - t0
            steps = out.shape[1] - input_ids.shape[1]
            assert steps == args.new_tokens, f"decoded {steps} steps, expected {args.new_tokens}"
            return wall / steps, (timed.seconds / steps if timed else 0.0)

        run(True, 0)  # warm-up (first matcher, first kernels)
        run(False, 0)
        base, cons, inside = [], [], []
        for r in range(args.repeats):
            b, _ = run(False, r)
            c, i = run(True, r)
            base.append(b)
            cons.append(c)
            inside.append(i)
        mb, mc, mi = statistics.median(base), statistics.median(cons), statistics.median(inside)
        results[name] = {
            "step_ms_unconstrained": round(mb * 1e3, 3),
            "step_ms_constrained": round(mc * 1e3, 3),
            "chain_ms_per_step": round(mi * 1e3, 3),
            "slowdown_pct": round((mc / mb - 1) * 100, 2),
            "chain_share_of_step_pct": round(mi / mc * 100, 2),
        }
        log(name, results[name])
    worst = max(r["slowdown_pct"] for r in results.values())
    worst_share = max(r["chain_share_of_step_pct"] for r in results.values())
    print(json.dumps({
        "bench": "e2e_overhead",
        "model": "SmolLM2-135M-Instruct",
        "batch": args.batch,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "results": results,
        "worst_slowdown_pct": worst,
        "worst_chain_share_pct": worst_share,
        "target_max_slowdown_pct": 5.0,
        "target_met": worst <= 5.0,
    }))


if __name__ == "__main__":
    main()
