"""Wide requests with the real model: the prompt held once per request (``shared_kv``) decodes the same
beams as the padded layout that copies it into every row; a request too large for the memory budget is refused
while another is served; a cancelled wide request frees its memory. Every output is checked against the catalog.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import time
import weakref

import pytest

from config import ServerSettings
from processors.scenarios import load_scenario
from item_checks import product_tree
from deployments.engines import EngineRequest, EventCollector, SamplingParams
from deployments.engines.transformers import DecodeEngine
from deployments.protocol import ServiceError
from processors import build_prompt_ids, compile_scenario

pytestmark = pytest.mark.integration

CODES = [1000 + 7 * i for i in range(8)]
ROOT = 2000
CATALOG = set(itertools.product(CODES, repeat=3))  # 512 items of 3 codes


def _tree(eos: int) -> dict:
    return {"type": "tree", "tree": product_tree(ROOT, CODES, 3, eos)}


@pytest.fixture(scope="module")
def tree(tokenizer):
    return compile_scenario(load_scenario(_tree(tokenizer.eos_token_id)), tokenizer)


def _prompt(tokenizer, words: int) -> list[int]:
    history = " ".join(f"item{i % 97}" for i in range(words))
    return build_prompt_ids(None, tokenizer, messages=[{"role": "user", "content": f"History: {history}. Next?"}])


def _items(outputs, eos) -> list[tuple[int, ...]]:
    items = []
    for out in outputs.values():
        assert out.finish_reason == "stop" and out.token_ids[-1] == eos, out
        item = tuple(out.token_ids[:-1])
        assert item in CATALOG, item
        items.append(item)
    return items


def _beams(engine, prompt, tree, width, n=None) -> EventCollector:
    c = EventCollector()
    engine.submit(EngineRequest(prompt_ids=prompt, compiled=tree, max_new_tokens=4, n=n or width, num_beams=width,
                                sampling=SamplingParams(temperature=0)), c)
    return c


def test_shared_prompt_beams_equal_the_padded_layout(model, tokenizer, tree):
    eos = tokenizer.eos_token_id
    prompts = [_prompt(tokenizer, 40), _prompt(tokenizer, 7)]
    results = {}
    for shared in (False, True):
        engine = DecodeEngine(model, tokenizer, max_batch_size=64, prefix_cache_tokens=0, shared_prompt=shared).start()
        try:
            # two wide requests and a sampled one together: groups of different prompts share forward passes
            runs = [_beams(engine, p, tree, 16) for p in prompts]
            sampled = EventCollector()
            engine.submit(EngineRequest(prompt_ids=prompts[0], compiled=tree, max_new_tokens=4, n=4,
                                        sampling=SamplingParams(temperature=1.0, seed=7)), sampled)
            results[shared] = [_items(c.wait(120), eos) for c in runs] + [_items(sampled.wait(120), eos)]
        finally:
            engine.stop()
    for items in results[True][:2]:
        assert len(items) == 16 and len(set(items)) == 16  # beams end on distinct items of the catalog
    assert results[True] == results[False]


def test_too_large_a_request_is_refused_while_another_is_served(model, tokenizer, tree):
    from deployments.replica import ModelReplica

    replica = ModelReplica(ServerSettings(kv_memory_mb=64, limits={"max_num_beams": 1024}), None,
                           model=model, tokenizer=tokenizer)
    try:
        eos = tokenizer.eos_token_id
        async def both():
            wide = replica.generate({"inline_scenario": _tree(eos), "prompt": "History: a b c. Next?",
                                     "num_beams": 512, "n": 512, "max_new_tokens": 4})
            small = replica.generate({"inline_scenario": _tree(eos), "prompt": "History: a b c. Next?",
                                      "num_beams": 4, "n": 4, "max_new_tokens": 4})
            return await asyncio.gather(wide, small, return_exceptions=True)
        wide, small = asyncio.run(both())
        assert isinstance(wide, ServiceError) and wide.status == 422, wide
        assert "kv_memory_mb=64" in wide.message and wide.detail["field"] == "num_beams"
        assert len(small["outputs"]) == 4
        for out in small["outputs"]:
            assert tuple(out["token_ids"][:-1]) in CATALOG and out["finish_reason"] == "stop"
    finally:
        replica.shutdown()


def test_a_cancelled_wide_request_frees_its_memory(model, tokenizer, tree):
    engine = DecodeEngine(model, tokenizer, prefix_cache_tokens=0, prefill_chunk_tokens=256).start()
    try:
        c = EventCollector()
        ticket = engine.submit(EngineRequest(prompt_ids=_prompt(tokenizer, 400), compiled=tree, max_new_tokens=4,
                                             n=8, num_beams=256, sampling=SamplingParams(temperature=0)), c)
        deadline = time.monotonic() + 120
        while not engine._groups and time.monotonic() < deadline:  # decoding: its group holds the prompt
            time.sleep(0.005)
        assert engine._groups, "the wide request never started decoding"
        prompt_keys = weakref.ref(engine._groups[0].shared[0][0][0])
        ticket.cancel()
        assert c.done.wait(60) and c.error == "cancelled"
        time.sleep(0.2)
        gc.collect()
        assert engine.active_rows == 0 and not engine._groups
        assert prompt_keys() is None, "the cancelled request's prompt cache is still referenced"
    finally:
        engine.stop()


def test_more_beam_outputs_than_items_is_a_422_like_distinct(model, tokenizer):
    """Beams return different sequences; with fewer items than ``n`` the answer is a 422 naming ``n`` and what is
    available, as for sampled ``distinct`` rows, not fewer outputs with a 200."""
    from deployments.replica import ModelReplica

    eos = tokenizer.eos_token_id
    small = {"type": "tree", "tree": {"start_token_id": ROOT, "end_token_id": eos,
                                      "prefix_dict": {str(ROOT): CODES[:3], **{f"{ROOT}_{c}": [eos] for c in CODES[:3]}}}}
    replica = ModelReplica(ServerSettings(), None, model=model, tokenizer=tokenizer)
    try:
        base = {"inline_scenario": small, "prompt": "Next:", "max_new_tokens": 3}
        for extra in ({"num_beams": 4, "n": 4}, {"n": 4, "distinct": True, "temperature": 1.0},
                      {"num_beams": 4, "n": 3, "exclude": [[CODES[0]]]}):
            with pytest.raises(ServiceError) as info:
                asyncio.run(replica.generate({**base, **extra}))
            assert info.value.status == 422 and info.value.detail["field"] == "n", (extra, info.value.message)
            assert info.value.detail["available"] == (2 if "exclude" in extra else 3)
        out = asyncio.run(replica.generate({**base, "num_beams": 4, "n": 3}))
        assert sorted(tuple(o["token_ids"]) for o in out["outputs"]) == sorted((c, eos) for c in CODES[:3])
    finally:
        replica.shutdown()


def test_tree_ranked_beams_equal_the_masked_path(model, tokenizer, tree, monkeypatch):
    """Beams ranked from the tree's tables (``tree_beams``) against the same requests through the full-vocabulary
    mask and log-softmax (the path every other constraint takes), forced by turning the tree plan off."""
    from deployments.engines.transformers import engine as engine_module
    from deployments.engines.transformers import wide as wide_module

    eos = tokenizer.eos_token_id
    prompts = [_prompt(tokenizer, 30), _prompt(tokenizer, 5)]
    results = []
    for tree_ranked in (True, False):
        if not tree_ranked:
            monkeypatch.setattr(engine_module, "plan_tree_beams", lambda cursors: None)
            monkeypatch.setattr(wide_module, "plan_tree_beams", lambda cursors: None)  # a wide step read in chunks
        engine = DecodeEngine(model, tokenizer, prefix_cache_tokens=0).start()
        try:
            runs = [_beams(engine, p, tree, w) for p, w in zip(prompts, (32, 8))]
            results.append([_items(c.wait(120), eos) for c in runs])
            ranked = engine.stats()["tree_ranked_steps"]
        finally:
            engine.stop()
        assert (ranked > 0) == tree_ranked, ranked
    assert results[0] == results[1]
    assert all(len(set(items)) == len(items) for items in results[0])


def test_filtered_beams_ranked_from_the_tables_equal_the_masked_path(model, tokenizer, tree, monkeypatch):
    """Beams under a request's filter (the items left out as an ``ItemRequest.base``, as a ``filter`` on a catalog
    with metadata resolves to): ranked from the tables with the filter's edge mask against the masked path; every
    item passes the filter."""
    import numpy as np

    from deployments.engines.transformers import engine as engine_module
    from deployments.engines.transformers import wide as wide_module
    from processors.items import ItemRequest
    from processors.kinds.tree.catalog.catalog import Catalog
    from processors.kinds.tree.filters.edges import filter_book, item_terminals

    eos = tokenizer.eos_token_id
    items = sorted(CATALOG)
    allowed = {item for item in items if item[0] in CODES[:3] and item[2] not in CODES[2:5]}
    catalog = Catalog.from_items(ROOT, eos, items)
    tables = tree.constraint
    book = filter_book(tables, item_terminals(tables, catalog.flat, catalog.lengths),
                       np.array([item in allowed for item in items]))
    prompt = _prompt(tokenizer, 20)
    results = []
    for tree_ranked in (True, False):
        if not tree_ranked:
            monkeypatch.setattr(engine_module, "plan_tree_beams", lambda cursors: None)
            monkeypatch.setattr(wide_module, "plan_tree_beams", lambda cursors: None)
        engine = DecodeEngine(model, tokenizer, prefix_cache_tokens=0).start()
        try:
            c = EventCollector()
            engine.submit(EngineRequest(prompt_ids=prompt, compiled=tree, max_new_tokens=8, n=16, num_beams=16,
                                        sampling=SamplingParams(temperature=0), items=ItemRequest(base=book)), c)
            got = _items(c.wait(120), eos)
            ranked = engine.stats()["tree_ranked_steps"]
        finally:
            engine.stop()
        assert (ranked > 0) == tree_ranked, ranked
        assert set(got) <= allowed and len(set(got)) == 16, got
        results.append(got)
    assert results[0] == results[1]
