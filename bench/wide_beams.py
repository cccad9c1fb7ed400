"""Generative retrieval at wide beams: one request of ``B`` beams after ``H`` history tokens, ours against the layout
that copies the prompt into every beam row, HF ``generate(num_beams, prefix_allowed_tokens_fn)``, and the floor.

The catalog holds ``--items`` semantic ids of ``--levels`` codes (256 codes per level, code ``c`` of level ``l`` is
token ``1000 + 256 l + c``), compiled from a tree file as a stored scenario would be. For every ``B`` in ``--beams``
and ``H`` in ``--history``, in the same run:

* ``ours``: the decode engine (prompt held once per request, ``shared_kv``), ``num_beams = n = B``;
* ``padded``: the same engine with ``shared_prompt=False``, the layout without ``shared_kv`` (prompt copied into each
  row), where its estimate fits ``--padded-max-gb``;
* ``hf``: HF ``generate`` with ``prefix_allowed_tokens_fn`` over the same tree, where ``B x H <= --hf-max-cost``;
* ``floor``: the model's own work with no constraint: the history's prefill (in the engine's 256-token chunks), then
  ``levels + 1`` forwards of ``B`` one-token rows attending to the prompt held once (the same attention as ``ours``,
  no masks, no ranking, no cursors).

Reported: seconds and peak resident memory above the idle process (sampled every 5 ms), ratios to the floor, and
validity (every returned item in the catalog, the ``n`` items of a request distinct). Then ``--concurrent`` requests
of ``--concurrent-beams`` beams at once against the same requests one at a time. Progress on stderr; the last line
of stdout is one JSON object.

    .venv/bin/python bench/wide_beams.py                                   # the full grid (long: ~1 h on 2 cores)
    .venv/bin/python bench/wide_beams.py --beams 8,256 --history 64,1024   # a part of it
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import emit, log, ratio, rss_bytes  # noqa: E402

CODES = 256
BASE_TOKEN = 1000
START_TOKEN = 900
GIB = 2**30


class PeakRss:
    """Peak resident memory of this process while the block runs, sampled every 5 ms, above ``base``."""

    def __init__(self, base: int):
        self.base, self.peak = base, base
        self._stop = threading.Event()

    def __enter__(self):
        self.peak = rss_bytes()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())

    @property
    def above_gib(self) -> float:
        return round((self.peak - self.base) / GIB, 3)


def catalog(items: int, levels: int, seed: int = 0) -> set[tuple[int, ...]]:
    rng = random.Random(seed)
    out: set[tuple[int, ...]] = set()
    while len(out) < items:
        out.add(tuple(BASE_TOKEN + level * CODES + rng.randrange(CODES) for level in range(levels)))
    return out


def tree_file(items: set[tuple[int, ...]], end: int, path: Path) -> dict[tuple[int, ...], list[int]]:
    """Writes the tree file; returns ``prefix -> allowed next tokens`` (for HF's ``prefix_allowed_tokens_fn``)."""
    import json

    children: dict[tuple[int, ...], set[int]] = {}
    for item in items:
        for i in range(len(item)):
            children.setdefault(item[:i], set()).add(item[i])
        children.setdefault(item, set()).add(end)
    sep = "_"
    body = {"start_token_id": START_TOKEN, "end_token_id": end,
            "prefix_dict": {sep.join(map(str, (START_TOKEN,) + k)): sorted(v) for k, v in children.items()}}
    path.write_text(json.dumps(body))
    return {k: sorted(v) for k, v in children.items()}


def history_prompt(tokenizer, tokens: int, seed: int) -> list[int]:
    """A chat prompt of about ``tokens`` tokens: a user's history of item ids, then the question."""
    rng = random.Random(seed)
    words = []
    ids: list[int] = []
    while True:
        words.append(f"item{rng.randrange(100000)}")
        if len(words) % 16 == 0:
            ids = tokenizer.encode(" ".join(words))
            if len(ids) >= tokens - 24:
                break
    from processors import build_prompt_ids

    messages = [{"role": "user", "content": "History: " + " ".join(words) + ". Next?"}]
    return build_prompt_ids(None, tokenizer, messages=messages)[-tokens:]


def check(outputs, n: int, item_set, end: int) -> dict:
    items = []
    for out in outputs.values():
        ids = out.token_ids[:-1] if out.token_ids and out.token_ids[-1] == end else out.token_ids
        items.append(tuple(ids))
    return {"returned": len(items), "in_catalog": sum(i in item_set for i in items),
            "distinct": len(set(items)) == len(items), "complete": len(items) == n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--items", type=int, default=1_000_000)
    ap.add_argument("--levels", type=int, default=4)
    ap.add_argument("--beams", default="8,64,256,512,1024")
    ap.add_argument("--history", default="64,1024,2048")
    ap.add_argument("--concurrent", type=int, default=8)
    ap.add_argument("--concurrent-beams", type=int, default=64)
    ap.add_argument("--concurrent-history", type=int, default=64)
    ap.add_argument("--hf-max-cost", type=int, default=16384, help="run HF generate where beams x history <= this")
    ap.add_argument("--padded-max-gb", type=float, default=8.0, help="run the padded layout where it fits this")
    ap.add_argument("--kv-memory-mb", type=int, default=4096)
    ap.add_argument("--wide-step-rows", type=int, default=None,
                    help="the engine's wide_step_rows (default: the engine's; 0 reads a wide step in one forward)")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()

    import tempfile

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    from processors.scenarios import load_scenario
    from deployments.engines import EngineRequest, EventCollector, SamplingParams
    from deployments.engines.transformers import DecodeEngine
    from deployments.engines.transformers.kv_cache import release_memory
    from deployments.engines.transformers.shared_kv import SharedGroup, StepContext
    from deployments.model_loader import load_model_and_tokenizer
    from processors import compile_scenario
    from transformers import DynamicCache

    model, tokenizer = load_model_and_tokenizer(None)
    model = model.eval()
    end = tokenizer.eos_token_id
    t0 = time.perf_counter()
    items = catalog(args.items, args.levels)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "catalog.json"
        allowed = tree_file(items, end, path)
        compiled = compile_scenario(load_scenario({"type": "tree", "path": str(path)}), tokenizer)
    log(f"catalog of {len(items)} items of {args.levels} codes compiled in {time.perf_counter() - t0:.1f} s")
    max_new = args.levels + 1
    step_rows = {} if args.wide_step_rows is None else {"wide_step_rows": args.wide_step_rows}
    ours = DecodeEngine(model, tokenizer, prefix_cache_tokens=0, kv_memory_mb=args.kv_memory_mb, **step_rows).start()
    padded = DecodeEngine(model, tokenizer, prefix_cache_tokens=0, shared_prompt=False,
                          kv_memory_mb=int(args.padded_max_gb * 1024)).start()

    def request(prompt, beams):
        return EngineRequest(prompt_ids=prompt, compiled=compiled, max_new_tokens=max_new, n=beams, num_beams=beams,
                             sampling=SamplingParams(temperature=0))

    def engine_run(engine, prompt, beams):
        c = EventCollector()
        t = time.perf_counter()
        engine.submit(request(prompt, beams), c)
        outputs = c.wait(7200)
        return time.perf_counter() - t, check(outputs, beams, items, end)

    def floor_run(prompt, beams):
        t = time.perf_counter()
        cache = DynamicCache()
        for start in range(0, len(prompt), 256):  # the prefill in the engine's chunks (faster than one pass here)
            ids = torch.tensor([prompt[start : start + 256]])
            cache = model(input_ids=ids, position_ids=torch.arange(start, start + ids.shape[1])[None],
                          past_key_values=cache, use_cache=True, logits_to_keep=1).past_key_values
        shared = [[(layer.keys, layer.values)] for layer in cache.layers]
        group = SharedGroup(None, shared, beams)
        token = torch.full((beams, 1), BASE_TOKEN, dtype=torch.long)
        for step in range(max_new):
            pos = torch.full((beams, 1), len(prompt) + step, dtype=torch.long)
            model(input_ids=token, position_ids=pos, use_cache=False, cs_step=StepContext(None, None, [group]))
        return time.perf_counter() - t

    def hf_run(prompt, beams):
        start = len(prompt)

        def allowed_fn(_batch, ids):
            return allowed.get(tuple(ids[start:].tolist()), [end])
        t = time.perf_counter()
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones((1, len(prompt)), dtype=torch.long),
                             num_beams=beams, num_return_sequences=beams, max_new_tokens=max_new, do_sample=False,
                             prefix_allowed_tokens_fn=allowed_fn, pad_token_id=end, eos_token_id=end)
        seconds = time.perf_counter() - t
        rows = [tuple(t for t in r[start:].tolist() if t != end) for r in out]
        return seconds, {"returned": len(rows), "in_catalog": sum(r in items for r in rows),
                         "distinct": len(set(rows)) == len(rows)}

    results = []
    for history in [int(x) for x in args.history.split(",")]:
        prompt = history_prompt(tokenizer, history, seed=history)
        engine_run(ours, prompt, 8)  # warm up this prompt length
        for beams in [int(x) for x in args.beams.split(",")]:
            row: dict = {"beams": beams, "history": len(prompt)}
            release_memory()
            base = rss_bytes()
            with PeakRss(base) as mem:
                row["floor_s"] = round(floor_run(prompt, beams), 3)
            row["floor_gib"] = mem.above_gib
            release_memory()
            with PeakRss(rss_bytes()) as mem:
                seconds, valid = engine_run(ours, prompt, beams)
            row.update(ours_s=round(seconds, 3), ours_gib=mem.above_gib, ours_valid=valid,
                       ours_vs_floor=ratio(seconds, row["floor_s"]))
            if padded.admission_error(request(prompt, beams)) is None:
                release_memory()
                with PeakRss(rss_bytes()) as mem:
                    seconds, valid = engine_run(padded, prompt, beams)
                row.update(padded_s=round(seconds, 3), padded_gib=mem.above_gib, padded_valid=valid,
                           padded_vs_ours=ratio(seconds, row["ours_s"]))
            if beams * len(prompt) <= args.hf_max_cost:
                release_memory()
                with PeakRss(rss_bytes()) as mem:
                    seconds, valid = hf_run(prompt, beams)
                row.update(hf_s=round(seconds, 3), hf_gib=mem.above_gib, hf_valid=valid,
                           hf_vs_ours=ratio(seconds, row["ours_s"]))
            log(row)
            results.append(row)

    # concurrency: k requests of B beams at once against one at a time
    k, beams = args.concurrent, args.concurrent_beams
    prompts = [history_prompt(tokenizer, args.concurrent_history, seed=100 + i) for i in range(k)]
    t = time.perf_counter()
    serial_valid = [engine_run(ours, p, beams)[1] for p in prompts]
    serial = time.perf_counter() - t
    t = time.perf_counter()
    waiters = []
    for p in prompts:
        c = EventCollector()
        ours.submit(request(p, beams), c)
        waiters.append(c)
    concurrent_valid = [check(c.wait(7200), beams, items, end) for c in waiters]
    concurrent = time.perf_counter() - t
    conc = {"requests": k, "beams": beams, "history": args.concurrent_history, "one_at_a_time_s": round(serial, 3),
            "concurrent_s": round(concurrent, 3), "speedup": ratio(serial, concurrent),
            "valid": all(v["complete"] and v["distinct"] and v["in_catalog"] == beams
                         for v in serial_valid + concurrent_valid)}
    log(conc)
    ours.stop()
    padded.stop()
    emit({"bench": "wide_beams", "items": len(items), "levels": args.levels, "threads": torch.get_num_threads(),
          "single": results, "concurrent": conc})


if __name__ == "__main__":
    main()
