"""Schema compliance with and without the constraint (valid JSON documents out of the same prompts, measured).

At least 50 prompts ask SmolLM2-135M-Instruct for a JSON document matching a given schema (the
schema is in the prompt). Each prompt is answered twice with the same sampling settings and seed:
unconstrained, and constrained by the scenario's JSON schema. An answer is compliant when it
parses as JSON and validates against the schema. Unconstrained answers are also scored leniently
(the first ``{...}`` block, code fences stripped), as a post-processing repair would.

Prints one JSON object as its last line.

    python bench/compliance.py [--prompts 50] [--max-new-tokens 96] [--batch 10]

``--suite``: the official JSON-Schema-Test-Suite (draft 2020-12 and draft 7, the required tests, not
``optional/``) instead. The suite is read from ``--suite-dir`` (its ``tests`` folder), or from the copy the
``jsonschema`` source distribution vendors (``json/tests``), fetched once with ``pip download`` into
``~/.cache/constrained-serve/``. For each schema of the suite: does it compile with the grammar library alone (the
previous behaviour: llguidance refuses a keyword -> 400), does it compile now (as its closest enforceable
relaxation), and is it enforced as written (no keyword relaxed; what ``strict: true`` accepts). For each accepted
schema, each of the suite's instances is run through the grammar (does the grammar accept it?) and, when the grammar
accepts one the suite calls invalid, through the replica's validator (which must refuse it). Then ``--sample``
accepted schemas are generated for with the real model through a real ``ModelReplica`` (validation and regeneration
included), and every output returned with ``finish_reason: stop`` is validated here, independently (``jsonschema``
with its format checker, repeated keys refused).

    python bench/compliance.py --suite [--suite-dir DIR] [--sample 40] [--n 2] [--temperature 1.0]
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

from processors.scenarios import load_scenario  # noqa: E402
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


# ------------------------------------------------------------------------------------------------ --suite

DRAFTS = ("draft2020-12", "draft7")


def suite_dir(given: str | None) -> Path:
    """The suite's ``tests`` folder: ``given``, or the copy vendored by the installed jsonschema's sdist."""
    if given:
        return Path(given)
    from importlib.metadata import version

    ver = version("jsonschema")
    root = Path.home() / ".cache" / "constrained-serve" / f"jsonschema-{ver}-suite"
    tests = root / f"jsonschema-{ver}" / "json" / "tests"
    if not tests.is_dir():
        import subprocess
        import tarfile

        root.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", f"jsonschema=={ver}", "--no-binary", ":all:",
                        "--no-deps", "-q", "-d", str(root)], check=True)
        with tarfile.open(root / f"jsonschema-{ver}.tar.gz") as tar:
            members = [m for m in tar.getmembers() if "/json/tests/" in m.name and m.isfile()]
            tar.extractall(root, members=members, filter="data")
    return tests


def _pairs(pairs):
    keys = [k for k, _ in pairs]
    if len(keys) != len(set(keys)):
        raise ValueError(f"repeated key in {keys}")
    return dict(pairs)


def independent_error(text: str, schema) -> str | None:
    """This benchmark's own check of an output (not the replica's code): strict JSON, then the schema."""
    from jsonschema.validators import validator_for

    try:
        value = json.loads(text, object_pairs_hook=_pairs, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    except ValueError as exc:
        return f"not JSON: {exc}"
    cls = validator_for(schema)
    errors = list(cls(schema, format_checker=cls.FORMAT_CHECKER).iter_errors(value))
    return errors[0].message if errors else None


def grammar_accepts(grammar: str, lltok, tok, text: str) -> bool:
    import llguidance

    matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
    return all(matcher.consume_token(t) for t in tok.encode(text, add_special_tokens=False)) and matcher.is_accepting()


def run_suite(args) -> dict:
    import asyncio

    import llguidance

    from config import ServerSettings
    from deployments.replica import ModelReplica
    from processors.compile_worker import build_grammar
    from processors.schema_check import OutputValidator
    from processors.tokenizer_info import TokenizerInfo

    tests_dir = suite_dir(args.suite_dir)
    model, tok = load_model_and_tokenizer()
    lltok = TokenizerInfo.of(tok).lltokenizer
    options = {"whitespace_flexible": False}
    groups = []
    for draft in DRAFTS:
        for f in sorted((tests_dir / draft).glob("*.json")):
            for group in json.loads(f.read_text()):
                if draft == "draft7" and isinstance(group["schema"], dict):  # as a draft-7 client declares it
                    group["schema"] = {"$schema": "http://json-schema.org/draft-07/schema#", **group["schema"]}
                groups.append((draft, f.stem, group))
    tally = {"schemas": len(groups), "before": 0, "now": 0, "exact": 0, "unsatisfiable_refused": 0,
             "instances": 0, "grammar_accepts_invalid": 0, "validator_misses": 0, "grammar_refuses_valid": 0}
    refused: dict[str, int] = {}
    notes_by_keyword: dict[str, int] = {}
    accepted = []
    t0 = time.perf_counter()
    for draft, name, group in groups:
        schema = group["schema"]
        source = json.dumps(schema)
        try:  # the previous behaviour: the schema as written, or a 400
            grammar = llguidance.LLMatcher.grammar_from_json_schema(source, defaults=options)
            tally["before"] += not llguidance.LLMatcher.validate_grammar_with_warnings(grammar, lltok)[0]
        except (ValueError, RuntimeError):
            pass
        if not isinstance(schema, dict):  # a scenario's schema is an object (true: use type json)
            refused["a boolean schema (true/false) at the top"] = refused.get("a boolean schema (true/false) at the top", 0) + 1
            continue
        try:
            load_scenario({"type": "json_schema", "schema": schema})  # the scenario's own validation first
            grammar, notes = build_grammar("json_schema", source, lltok, options)
        except ValueError as exc:
            reason = str(exc).splitlines()[0]
            if "Unsatisfiable" in reason and not any(t["valid"] for t in group["tests"]):
                tally["unsatisfiable_refused"] += 1
            key = re.sub(r"'[^']*'", "'...'", reason)[:90]
            refused[key] = refused.get(key, 0) + 1
            continue
        tally["now"] += 1
        tally["exact"] += not notes
        for note in notes:
            keyword = note.split(" at ")[0].split(" (")[0].split(" '")[0]
            notes_by_keyword[keyword] = notes_by_keyword.get(keyword, 0) + 1
        validator = OutputValidator(schema)
        if tally["now"] % 50 == 0:
            log(f"{tally['now']} schemas compiled, {time.perf_counter() - t0:.1f} s")
        for test in group["tests"]:
            text = json.dumps(test["data"], separators=(",", ":"), ensure_ascii=False)
            tally["instances"] += 1
            ok = grammar_accepts(grammar, lltok, tok, text)
            if ok and not test["valid"]:
                tally["grammar_accepts_invalid"] += 1
                tally["validator_misses"] += validator.error(text) is None
            tally["grammar_refuses_valid"] += (not ok) and test["valid"]
        accepted.append((draft, name, group["description"], schema, notes))
    compile_s = time.perf_counter() - t0
    log(f"suite: {tally} in {compile_s:.1f} s")

    # generation: relaxed schemas first (where regeneration matters), then exact ones, spread over the files
    relaxed = [a for a in accepted if a[4]]
    exact = [a for a in accepted if not a[4]]
    sample = (relaxed[:: max(1, len(relaxed) // max(1, (args.sample * 3) // 4))][: (args.sample * 3) // 4]
              + exact[:: max(1, len(exact) // max(1, args.sample // 4))][: args.sample - (args.sample * 3) // 4])
    replica = ModelReplica(ServerSettings(json_regenerate_attempts=args.attempts), None, model=model, tokenizer=tok)
    gen = {"requests": len(sample), "outputs": 0, "stop": 0, "length": 0, "error_invalid": 0, "error_other": 0,
           "stop_failing_independent_check": 0, "regenerated_stop": 0, "attempts_total": 0}
    failures = []
    t1 = time.perf_counter()
    bodies = [{"inline_scenario": {"type": "json_schema", "schema": schema},
               "messages": [{"role": "user", "content": f"Write a JSON value valid under this JSON schema: {json.dumps(schema)}"}],
               "n": args.n, "temperature": args.temperature, "seed": 1000 + i, "max_new_tokens": args.max_new_tokens}
              for i, (_, _, _, schema, _) in enumerate(sample)]

    async def run_all():  # all at once: the engine batches them (and their regenerations) as a server would
        return await asyncio.gather(*(replica.generate(b) for b in bodies))

    try:
        results = asyncio.run(run_all())
    finally:
        replica.shutdown()
    for (draft, name, description, schema, _), result in zip(sample, results):
        for out in result["outputs"]:
            gen["outputs"] += 1
            gen["attempts_total"] += out["attempts"]
            reason = out["finish_reason"]
            if reason == "stop":
                gen["stop"] += 1
                gen["regenerated_stop"] += out["attempts"] > 1
                problem = independent_error(out["text"], schema)
                if problem is not None:
                    gen["stop_failing_independent_check"] += 1
                    failures.append({"schema": f"{draft}/{name}: {description}", "text": out["text"][:120], "problem": problem[:160]})
            elif reason == "length":
                gen["length"] += 1
            elif (out["error"] or "").startswith("invalid output"):
                gen["error_invalid"] += 1
            else:
                gen["error_other"] += 1
        log(f"{draft}/{name}: {[(o['finish_reason'], o['attempts']) for o in result['outputs']]}")
    return {
        "bench": "compliance-suite",
        "suite": f"JSON-Schema-Test-Suite as vendored by jsonschema's sdist ({tests_dir}), {', '.join(DRAFTS)}, required tests",
        "schemas": tally["schemas"],
        "accepted_before_pct": round(100 * tally["before"] / tally["schemas"], 1),
        "accepted_now_pct": round(100 * tally["now"] / tally["schemas"], 1),
        "accepted_strict_pct": round(100 * tally["exact"] / tally["schemas"], 1),
        "refused_unsatisfiable": tally["unsatisfiable_refused"],
        "refused": dict(sorted(refused.items(), key=lambda kv: -kv[1])),
        "relaxed_keywords": dict(sorted(notes_by_keyword.items(), key=lambda kv: -kv[1])),
        "suite_instances_checked": tally["instances"],
        "grammar_accepts_invalid_instance": tally["grammar_accepts_invalid"],
        "validator_misses_of_those": tally["validator_misses"],
        "grammar_refuses_valid_instance": tally["grammar_refuses_valid"],
        "compile_and_check_s": round(compile_s, 1),
        "generation": {**gen, "n": args.n, "temperature": args.temperature, "max_new_tokens": args.max_new_tokens,
                       "json_regenerate_attempts": args.attempts, "seconds": round(time.perf_counter() - t1, 1)},
        "stop_outputs_failing_validation": gen["stop_failing_independent_check"],
        "failures": failures[:5],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--batch", type=int, default=10)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--suite", action="store_true", help="the JSON-Schema-Test-Suite figures instead")
    ap.add_argument("--suite-dir", default=None, help="the suite's tests folder (default: jsonschema's sdist copy)")
    ap.add_argument("--sample", type=int, default=40, help="--suite: schemas generated for with the model")
    ap.add_argument("--n", type=int, default=2, help="--suite: outputs per schema")
    ap.add_argument("--attempts", type=int, default=3, help="--suite: json_regenerate_attempts")
    args = ap.parse_args()
    if args.suite:
        print(json.dumps(run_suite(args)))
        return

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
