"""Beams under a request's filter find the true top-k of the passing items (the real model): random small catalogs
with random metadata and random filters, a beam request as wide as the items that pass (so nothing is pruned) against
an exhaustive scoring of every passing item written here, apart from the engine: one teacher-forced forward of the
prompt and each item, the item's log-probability summed over its tokens and its end token (the score a beam of that
path has). Both ways (beams ranked from the
tree's tables, and the masked path) must give the same items in the same order."""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch
from item_checks import filter_passes

from deployments.engines import EngineRequest, EventCollector, SamplingParams
from deployments.engines.transformers import DecodeEngine
from processors import build_prompt_ids, compile_scenario
from processors.items import ItemRequest
from processors.kinds.tree.catalog.parse import parse_catalog
from processors.kinds.tree.tables.compile import catalog_tables
from processors.scenarios import load_scenario

pytestmark = pytest.mark.integration

CODES = [1000 + 7 * i for i in range(6)]
ROOT = 2000
REGIONS = ["eu", "us", "asia"]
TAGS = ["new", "sale", "kids", "pro"]


def _metadata(rng: random.Random) -> dict:
    return {"region": rng.choice(REGIONS), "stock": rng.randint(0, 9), "price": round(rng.uniform(1, 100), 2),
            "tags": rng.sample(TAGS, rng.randint(0, 2))}


def _filter(rng: random.Random) -> dict:
    clauses = [
        {"region": {"$in": rng.sample(REGIONS, rng.randint(1, 2))}},
        {"stock": {"$gt": rng.randint(0, 6)}},
        {"price": {"$lte": rng.uniform(20, 90)}},
        {"tags": rng.choice(TAGS)},
        {"region": {"$ne": rng.choice(REGIONS)}},
    ]
    chosen = rng.sample(clauses, rng.randint(1, 3))
    if len(chosen) > 1 and rng.random() < 0.3:
        return {"$or": chosen}
    return {"$and": chosen}


def _compiled(tokenizer, items: dict[tuple[int, ...], dict]):
    eos = tokenizer.eos_token_id
    lines = [json.dumps({"start_token_id": ROOT, "end_token_id": eos})]
    lines += [json.dumps({"ids": list(ids), "metadata": meta}) for ids, meta in items.items()]
    catalog = parse_catalog(("\n".join(lines) + "\n").encode(), vocab_size=len(tokenizer))
    scenario = load_scenario({"type": "tree", "path": "catalog"})
    return compile_scenario(scenario, tokenizer, prebuilt=(catalog_tables(catalog, len(tokenizer)), ROOT, catalog))


@torch.no_grad()
def _exhaustive(model, prompt: list[int], passing: list[tuple[int, ...]], eos: int) -> dict[tuple[int, ...], float]:
    """Each passing item's log-probability under the model, its end token included (the model's own distribution
    over the whole vocabulary at every step: the score HF's beam search gives a path allowed by
    ``prefix_allowed_tokens_fn``, and ours)."""
    depth = len(passing[0])
    ids = torch.tensor([prompt + list(item) for item in passing])
    logits = model(input_ids=ids).logits[:, len(prompt) - 1:].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return {item: sum(float(logprobs[row, t, token]) for t, token in enumerate([*item, eos]))
            for row, item in enumerate(passing) if len(item) == depth}


@pytest.mark.parametrize("seed", range(2))
def test_filtered_beams_equal_the_exhaustive_top_k(model, tokenizer, seed, monkeypatch):
    from deployments.engines.transformers import engine as engine_module
    from deployments.engines.transformers import wide as wide_module

    rng = random.Random(seed)
    eos = tokenizer.eos_token_id
    items = {ids: _metadata(rng) for ids in rng.sample(list(itertools.product(CODES, repeat=3)), 60)}
    compiled = _compiled(tokenizer, items)
    kind = compiled.constraint_kind
    history = " ".join(f"item{rng.randint(0, 99)}" for _ in range(12))
    prompt = build_prompt_ids(None, tokenizer, messages=[{"role": "user", "content": f"History: {history}. Next?"}])
    checked = 0
    for _ in range(5):
        if checked == 3:
            break
        flt = _filter(rng)
        passing = sorted(ids for ids, meta in items.items() if filter_passes(meta, flt))
        if len(passing) < 4:
            continue
        resolved = kind.item_filter(compiled.constraint, flt, None)
        assert resolved.passing(1 << 30) == len(passing), flt
        scores = _exhaustive(model, prompt, passing, eos)
        ranked = sorted(passing, key=lambda item: -scores[item])
        k = min(5, len(passing) - 1)
        results = []
        for tree_ranked in (True, False):
            with monkeypatch.context() as patch:
                if not tree_ranked:  # the masked path: beams ranked over the vocabulary
                    patch.setattr(engine_module, "plan_tree_beams", lambda cursors: None)
                    patch.setattr(wide_module, "plan_tree_beams", lambda cursors: None)
                engine = DecodeEngine(model, tokenizer, prefix_cache_tokens=0).start()
                try:
                    collector = EventCollector()
                    engine.submit(EngineRequest(prompt_ids=prompt, compiled=compiled, max_new_tokens=5, n=k,
                                                num_beams=len(passing), sampling=SamplingParams(temperature=0),
                                                items=ItemRequest(base=resolved.view(1 << 30))), collector)
                    outputs = collector.wait(180)
                finally:
                    engine.stop()
            got = []
            for _, out in sorted(outputs.items()):
                assert out.finish_reason == "stop" and out.token_ids[-1] == eos, out
                got.append(tuple(out.token_ids[:-1]))
            assert all(item in items and filter_passes(items[item], flt) for item in got), (flt, got)
            results.append(got)
        # the true top-k (where two scores are closer than float noise, either order is right)
        for got in results:
            for place, item in enumerate(got):
                assert abs(scores[item] - scores[ranked[place]]) < 1e-3, (flt, place, got, ranked[:k])
        assert results[0] == results[1], flt
        checked += 1
    assert checked >= 2, "too few filters kept enough items"
