"""One-row requests beside one wide beam request: the probe's latency quiet and while it runs.

In-process, the real engine and the default model. A probe is a small labels request (the seeded ``sentiment``
scenario, 8 new tokens, greedy), sent one after another. First ``--quiet`` probes with the engine otherwise idle;
then one beam request of ``--beams`` beams after a prompt of ``--history`` tokens (free text unless ``--tree``,
``--max-new-tokens`` new tokens), with probes sent one after another until it completes; then ``--quiet`` probes
again. Reported: the probe's p50/p95/max quiet (before and after) and during, the ratios of during to both quiet runs
together, the wide request's time (and its time alone with ``--alone``), and the engine's steps. Progress on stderr; the last line of stdout is one JSON object.

    .venv/bin/python bench/wide_fairness.py                                   # 1,024 beams after 730 tokens
    .venv/bin/python bench/wide_fairness.py --wide-step-rows 0 --narrow-reserve 0   # every wide row in each forward
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import emit, log, ratio  # noqa: E402

PROBE_TEXT = "The food was great and the staff friendly."
SENTIMENT = {"type": "labels", "labels": ["positive", "negative", "neutral"],
             "system_prompt": "Classify the sentiment of the user's text as positive, negative or neutral."}


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return round(s[min(len(s) - 1, int(round(q * (len(s) - 1))))], 4)


def summary(values: list[float]) -> dict:
    return {"count": len(values), "p50_s": pct(values, 0.5), "p95_s": pct(values, 0.95),
            "max_s": round(max(values), 4) if values else None,
            "mean_s": round(statistics.fmean(values), 4) if values else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--beams", type=int, default=1024)
    ap.add_argument("--history", type=int, default=730, help="prompt tokens of the wide request")
    ap.add_argument("--max-new-tokens", type=int, default=8, help="new tokens of the wide request")
    ap.add_argument("--tree", action="store_true", help="the wide request on a 3-level tree instead of free text")
    ap.add_argument("--quiet", type=int, default=20, help="probes with the engine otherwise idle")
    ap.add_argument("--alone", action="store_true", help="also time the wide request with no probe beside it")
    ap.add_argument("--wide-step-rows", type=int, default=None, help="engine setting (default: the engine's)")
    ap.add_argument("--wide-step-rows-shared", type=int, default=None,
                    help="engine setting: wide rows per forward beside one-row rows (default: the engine's)")
    ap.add_argument("--narrow-reserve", type=float, default=None, help="engine setting (default: the engine's)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()

    import torch

    from processors.scenarios import load_scenario
    from deployments.engines import EngineRequest, EventCollector, SamplingParams
    from deployments.engines.transformers import DecodeEngine
    from deployments.model_loader import load_model, load_tokenizer
    from processors import build_prompt_ids, compile_scenario

    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer()
    model = load_model()
    settings = {}
    if args.wide_step_rows is not None:
        settings["wide_step_rows"] = args.wide_step_rows
    if args.wide_step_rows_shared is not None:
        settings["wide_step_rows_shared"] = args.wide_step_rows_shared
    if args.narrow_reserve is not None:
        settings["narrow_reserve"] = args.narrow_reserve
    engine = DecodeEngine(model, tokenizer, **settings).start()
    sentiment = compile_scenario(load_scenario(SENTIMENT), tokenizer)
    probe_ids = build_prompt_ids(sentiment, tokenizer, messages=[{"role": "user", "content": PROBE_TEXT}])

    def probe() -> float:
        c = EventCollector()
        t0 = time.perf_counter()
        engine.submit(EngineRequest(prompt_ids=probe_ids, compiled=sentiment, max_new_tokens=8,
                                    sampling=SamplingParams(temperature=0)), c)
        c.wait(600)
        return time.perf_counter() - t0

    wide_compiled = None
    if args.tree:
        codes = [1000 + 7 * i for i in range(16)]
        eos = tokenizer.eos_token_id
        tree = {str(a): {str(b): {str(c): {str(eos): {}} for c in codes} for b in codes} for a in codes}
        wide_compiled = compile_scenario(load_scenario({"type": "tree", "tree": {"2000": tree}}), tokenizer)
    words = " ".join(f"item{i % 97}" for i in range(args.history))
    wide_ids = tokenizer(f"History: {words}")["input_ids"][: args.history]
    if wide_compiled is not None:
        wide_ids = wide_ids + [2000]

    def wide_request() -> EngineRequest:
        return EngineRequest(prompt_ids=wide_ids, compiled=wide_compiled, max_new_tokens=args.max_new_tokens,
                             n=min(args.beams, 8), num_beams=args.beams, sampling=SamplingParams(temperature=0))

    for _ in range(3):
        probe()  # warm-up
    quiet = [probe() for _ in range(args.quiet)]
    log(f"quiet probe: {summary(quiet)}")

    result = {"settings": {"beams": args.beams, "history": len(wide_ids), "max_new_tokens": args.max_new_tokens,
                           "tree": args.tree, "wide_step_rows": getattr(engine, "wide_step_rows", None),
                           "wide_step_rows_shared": getattr(engine.batch, "wide_step_rows_shared", None),
                           "narrow_reserve": getattr(engine, "narrow_reserve", None),
                           "torch_threads": torch.get_num_threads()}}
    if args.alone:
        c = EventCollector()
        t0 = time.perf_counter()
        engine.submit(wide_request(), c)
        c.wait(3600)
        result["wide_alone_s"] = round(time.perf_counter() - t0, 2)
        log(f"wide alone: {result['wide_alone_s']} s")

    steps0 = engine.stats()["steps"]
    c = EventCollector()
    t0 = time.perf_counter()
    engine.submit(wide_request(), c)
    during: list[float] = []
    while not c.done.is_set():
        during.append(probe())
    c.wait(0)
    wide_s = time.perf_counter() - t0
    steps = engine.stats()["steps"] - steps0
    # quiet again: on a shared machine the load may have changed; the ratios use both quiet runs together
    quiet_after = [probe() for _ in range(args.quiet)]
    engine.stop()
    both = quiet + quiet_after
    result.update({
        "probe_quiet": summary(quiet), "probe_quiet_after": summary(quiet_after), "probe_during_wide": summary(during),
        "p50_ratio": ratio(pct(during, 0.5), pct(both, 0.5)), "p95_ratio": ratio(pct(during, 0.95), pct(both, 0.95)),
        "wide_s": round(wide_s, 2), "wide_outputs": len(c.finished), "engine_steps_during": steps,
    })
    log(f"during: {result['probe_during_wide']}; p95 ratio {result['p95_ratio']}; wide {result['wide_s']} s")
    emit(result)


if __name__ == "__main__":
    main()
