"""Large inline trees at the config manager (real Redis, real tokenizer, replicas speaking the real protocol): a PUT
body of over 1 MiB is split at its tree's braces (processors/kinds/tree/store/inline.py) and the tree read by the tree
loader's scan. What a client sees must not change: the served tables are those the exact way (the whole body
parsed, pydantic, the loader) compiles, the warnings and every refusal are the same, a GET gives back the tree as
sent, a retry with an Idempotency-Key replays, and a restart compiles the stored body to the same tables."""

from __future__ import annotations

import json

import pytest
from test_catalog_manager import run
from test_manager import make_manager

from deployments.manager.compiler import compile_warnings
from deployments.protocol import ServiceError
from deployments.storage.redis_server import connect_redis
from processors.kinds.tree.store.inline import INLINE_TREE_MIN_BYTES

pytestmark = pytest.mark.integration

START, END = 1000, 2
CODES = range(3000, 3260)


def big_tree(**extra_fields) -> dict:
    """A 3-level tree of 260 x 260 items (67,861 keys, about 1.6 MB of JSON)."""
    prefix_dict = {str(START): list(CODES)}
    for a in CODES:
        prefix_dict[f"{START}_{a}"] = list(CODES)
        for b in CODES:
            prefix_dict[f"{START}_{a}_{b}"] = [END]
    return {"start_token_id": START, "end_token_id": END, "prefix_dict": prefix_dict, **extra_fields}


def encode(body: dict, **kw) -> bytes:
    raw = json.dumps(body, ensure_ascii=False, **kw).encode()
    assert len(raw) >= INLINE_TREE_MIN_BYTES
    return raw


def test_large_inline_tree_is_served_as_the_exact_way_compiles_it(tokenizer, data_dir):
    tree = big_tree(note="kept by RTP-LLM, ignored here")  # lenient: an unknown field gives a warning
    tree["prefix_dict"][f"{START}_{CODES[0]}_{CODES[0]}"] = [END, -5]  # and a negative id, skipped
    body = {"type": "tree", "tree": tree, "temperature": 0.0, "description": "catalog", "max_items": 1}
    raw = encode(body, indent=1)
    manager = make_manager(tokenizer, data_dir, client=connect_redis(None, data_dir))
    assert manager.compiler.split_body(raw) is not None  # this body takes the split way

    async def scenario(r0, r1):
        answer = await manager.put("big", raw, "key-1")
        assert answer["version"] == 1
        exact = await manager.compiler.compile("big", json.loads(raw))  # the whole body, the exact way
        assert answer["warnings"] == compile_warnings(exact) and len(answer["warnings"]) == 2
        for replica in (r0, r1):
            version, compiled = replica.tables["big"]
            assert version == 1 and compiled.version == exact.version
            assert compiled.settings == exact.settings and compiled.start_token_id == exact.start_token_id
        assert (await manager.get("big"))["scenario"] == body  # the tree as it was sent
        again = await manager.put("big", raw, "key-1")  # a retry of the same request
        assert again == {"name": "big", "version": 1, "replayed": True}
        with pytest.raises(ServiceError) as err:  # the key with another body
            await manager.put("big", encode({**body, "max_items": 2, "separator_token_id": 7}), "key-1")
        assert err.value.status == 422
        return exact.version

    served = run(manager, scenario)

    # a restart compiles the stored body (the exact way) to the same tables
    restarted = make_manager(tokenizer, data_dir, client=connect_redis(None, data_dir))

    async def after_restart(r0):
        assert r0.tables["big"][0] == 1 and r0.tables["big"][1].version == served

    run(restarted, after_restart, n_replicas=1)


def _refusals():
    tree = big_tree()
    beyond = big_tree()
    beyond["prefix_dict"][str(START)].append(60000)  # at or above the served vocabulary
    dup_sep = big_tree(sep="-")
    return {
        "id beyond the vocabulary": {"type": "tree", "tree": beyond},
        "strict refuses what a lenient load warns about": {"type": "tree", "strict": True, "tree": dup_sep},
        "an invalid field beside the tree": {"type": "tree", "tree": tree, "max_items": 0},
        "an unknown field beside the tree": {"type": "tree", "tree": tree, "colour": "red"},
        "tree and path": {"type": "tree", "tree": tree, "path": "x.json"},
        "a separator that is not in the vocabulary": {"type": "tree", "tree": tree, "max_items": 2,
                                                      "separator_token_id": 10 ** 6},
        "over max_tree_keys": {"type": "tree", "tree": tree, "limit": 1000},
    }


@pytest.mark.parametrize("case", list(_refusals()))
def test_refusals_are_those_of_the_exact_way(tokenizer, data_dir, monkeypatch, case):
    body = _refusals()[case]
    limit = body.pop("limit", None)
    settings = {"limits": {"max_tree_keys": limit}} if limit else {}
    raw = encode(body)
    manager = make_manager(tokenizer, data_dir, client=connect_redis(None, data_dir), settings=settings)

    async def attempt():
        with pytest.raises(ServiceError) as err:
            await manager.put("t", raw)
        return err.value.status, err.value.message

    async def scenario(r0):
        split = await attempt()
        monkeypatch.setattr(manager.compiler, "split_body", lambda *args, **kw: None)  # the whole body, parsed
        exact = await attempt()
        assert split == exact and split[0] in (400, 422), (split, exact)
        with pytest.raises(ServiceError) as err:  # nothing stored
            await manager.get("t")
        assert err.value.status == 404
        assert "t" not in r0.tables

    run(manager, scenario, n_replicas=1)
