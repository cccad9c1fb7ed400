"""Schema compliance with and without the constraint (seed 004's table, measured for real).

At least 50 prompts ask SmolLM2-135M-Instruct for a JSON document matching a given schema (the
schema is in the prompt). Each prompt is answered twice with the same sampling settings and seed:
unconstrained, and constrained by the scenario's JSON schema. An answer is compliant when it
parses as JSON and validates against the schema. Unconstrained answers are also scored leniently
(the first ``{...}`` block, code fences stripped), as a post-processing repair would.

Prints one JSON object as its last line.

    python bench/compliance.py [--prompts 50] [--max-new-tokens 96] [--batch 10]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jsonschema  # noqa: E402
import torch  # noqa: E402
from transformers import LogitsProcessorList  # noqa: E402

from config import load_scenario  # noqa: E402
from deployments.model_loader import load_model_and_tokenizer  # noqa: E402
from processors import ConstrainedLogitsProcessor, build_prompt_ids, compile_scenario  # noqa: E402

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}, "email": {"type": "string"}},
        "required": ["name", "age", "email"],
        "additionalProperties": False,
    },
    "product": {
        "type": "object",
        "properties": {
            "title": {"type": "string"},
            "price": {"type": "number", "minimum": 0},
            "in_stock": {"type": "boolean"},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        },
        "required": ["title", "price", "in_stock"],
        "additionalProperties": False,
    },
    "event": {
        "type": "object",
        "properties": {
            "event": {"type": "string"},
            "city": {"type": "string"},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
            "kind": {"enum": ["concert", "match", "conference"]},
        },
        "required": ["event", "city", "year", "kind"],
        "additionalProperties": False,
    },
}
SUBJECTS = {
    "person": ["a nurse from Lyon", "a retired pilot", "a young chess player", "a baker", "a software engineer",
               "a farmer in Kenya", "a violin teacher", "a marathon runner", "a librarian", "a firefighter",
               "a student of physics", "a painter", "a taxi driver", "a chef in Osaka", "a journalist",
               "a beekeeper", "a surgeon"],
    "product": ["a red umbrella", "noise-cancelling headphones", "a cast-iron pan", "a children's book",
                "running shoes", "a desk lamp", "a bag of coffee beans", "a mountain bike", "a wool scarf",
                "a phone charger", "a garden hose", "a board game", "an electric kettle", "a yoga mat",
                "a pack of pencils", "a smart watch", "a camping tent"],
    "event": ["a jazz night in New Orleans", "a football final", "a tech conference in Berlin", "a rock concert",
              "a chess tournament", "a medical conference", "a derby match in Milan", "an opera premiere",
              "a startup conference", "a tennis match", "a folk music festival", "a robotics conference",
              "a basketball game", "a piano recital", "a cricket match", "a developer conference"],
}


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def prompts(n: int):
    items = []
    while len(items) < n:
        for kind, subjects in SUBJECTS.items():
            for s in subjects:
                items.append((kind, s))
    items = items[:n]
    out = []
    for kind, subject in items:
        schema = SCHEMAS[kind]
        text = (
            f"Describe {subject} as a JSON object that matches this JSON schema:\n{json.dumps(schema)}\n"
            "Answer with the JSON object only."
        )
        out.append((kind, text))
    return out


def valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def lenient(text: str) -> str:
    text = re.sub(r"```(?:json)?", "", text)
    start = text.find("{")
    end = text.rfind("}")
    return text[start : end + 1] if 0 <= start < end else text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--batch", type=int, default=10)
    ap.add_argument("--temperature", type=float, default=0.7)
    args = ap.parse_args()

    model, tok = load_model_and_tokenizer()
    compiled = {k: compile_scenario(load_scenario({"type": "json_schema", "schema": s}), tok) for k, s in SCHEMAS.items()}
    items = prompts(args.prompts)
    tally = {m: {"valid": 0, "truncated": 0} for m in ("unconstrained", "constrained")}
    tally["unconstrained"]["valid_lenient"] = 0
    samples = {}
    t_start = time.perf_counter()
    for i in range(0, len(items), args.batch):
        chunk = items[i : i + args.batch]
        rows = [compiled[k] for k, _ in chunk]
        ids = [build_prompt_ids(rows[j], tok, messages=[{"role": "user", "content": text}]) for j, (_, text) in enumerate(chunk)]
        width = max(map(len, ids))
        input_ids = torch.tensor([[tok.eos_token_id] * (width - len(x)) + x for x in ids])
        attention = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        for mode in ("unconstrained", "constrained"):
            procs = LogitsProcessorList()
            if mode == "constrained":
                procs.append(ConstrainedLogitsProcessor(rows, tokenizer=tok))
            torch.manual_seed(1000 + i)
            out = model.generate(
                input_ids, attention_mask=attention, logits_processor=procs, do_sample=True,
                temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id,
            )
            for (kind, _), gen in zip(chunk, out[:, width:].tolist()):
                ended = tok.eos_token_id in gen
                text = tok.decode(gen, skip_special_tokens=True).strip()
                ok = valid(text, SCHEMAS[kind])
                tally[mode]["valid"] += ok
                tally[mode]["truncated"] += not ended
                if mode == "unconstrained":
                    tally[mode]["valid_lenient"] += valid(lenient(text), SCHEMAS[kind])
                samples.setdefault(mode, text[:200])
        log(f"{min(i + args.batch, len(items))}/{len(items)} prompts: {tally}")
    n = len(items)
    result = {
        "bench": "compliance",
        "model": "SmolLM2-135M-Instruct",
        "prompts": n,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "unconstrained_valid_pct": round(100 * tally["unconstrained"]["valid"] / n, 1),
        "unconstrained_valid_lenient_pct": round(100 * tally["unconstrained"]["valid_lenient"] / n, 1),
        "constrained_valid_pct": round(100 * tally["constrained"]["valid"] / n, 1),
        "unconstrained_truncated": tally["unconstrained"]["truncated"],
        "constrained_truncated": tally["constrained"]["truncated"],
        "seconds": round(time.perf_counter() - t_start, 1),
        "sample_unconstrained": samples.get("unconstrained"),
        "sample_constrained": samples.get("constrained"),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
