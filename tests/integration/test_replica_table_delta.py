"""A model replica applies a catalog PATCH to the tables it serves: the real
``ModelReplica`` (the real model) polls a real config manager (real Redis, the real tokenizer) in this process; with
``replica_table_delta: always`` every PATCH of the version it serves is applied there (not fetched), and the tables
it then serves equal a full compile of the new items, byte for byte; its answers are items of that version. A replica
whose tables for the base version are not the manager's (a fault made here by hand: it cannot happen by itself)
finds the result's hash differs and fetches the whole tables; a PUT (no delta) is always fetched."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest
from test_catalog_manager import END, START, catalog_text
from test_catalog_patch_tables import assert_full_compile

from config import ServerSettings
from processors.kinds.tree.catalog.catalog import Catalog
from deployments.storage.redis_server import connect_redis
from deployments.replica.table_delta import delta_wanted
from processors.kinds.tree.tables.compile import catalog_tables
from tests.manager_helpers import make_manager

pytestmark = pytest.mark.integration

CODES = [1000 + 7 * i for i in range(8)]  # ordinary word pieces of SmolLM2's vocabulary


def first_items(rnd: random.Random, n: int) -> set[tuple[int, ...]]:
    return {tuple(rnd.choice(CODES) for _ in range(rnd.randint(1, 3))) for _ in range(n)}


async def poll(manager, replica) -> None:
    """The replica's long poll (ScenarioSubscriber._poll), on this event loop: the manager is an object here."""
    subscriber = replica.subscriber
    await subscriber._apply(await manager.register(replica.replica_id))
    while True:
        snapshot = await manager.wait_for_update(replica.replica_id, subscriber.epoch, 10.0)
        if snapshot:
            await subscriber._apply(snapshot)


async def answer_items(replica, name: str, eos: int, k: int) -> list[tuple[int, tuple[int, ...]]]:
    """``k`` answers of ``replica`` for scenario ``name``: ``(version reported, item)``, end tokens dropped."""
    out = []
    for i in range(k):
        answer = await replica.generate({"scenario": name, "prompt": f"Item {i}:", "temperature": 1.5})
        ids = list(answer["outputs"][0]["token_ids"])
        while ids and ids[-1] in (END, eos):
            ids.pop()
        out.append((answer["version"], tuple(ids)))
    return out


def test_a_replica_applies_patches_to_its_tables_and_serves_them(model, tokenizer, data_dir):
    from deployments.replica import ModelReplica

    rnd = random.Random(3)
    items = first_items(rnd, 40)
    manager = make_manager(tokenizer, data_dir, client=connect_redis(None, data_dir))
    manager.compiler.contents["tree"].patch_states_per_item = 0  # small catalog: update its tables for any delta size
    replica = ModelReplica(ServerSettings(replica_table_delta="always"), None, model=model, tokenizer=tokenizer)
    replica.subscriber._manager = manager
    vocab = manager.compiler.vocab_size
    eos = tokenizer.eos_token_id

    async def main():
        nonlocal items
        task = asyncio.get_running_loop().create_task(poll(manager, replica))
        try:
            await manager.put_items("cat", catalog_text(sorted(items), max_new_tokens=6))
            assert replica.subscriber.table_deltas == 0  # a PUT: fetched
            for k in range(3):
                remove = rnd.sample(sorted(items), 4)
                add = sorted({(CODES[k], CODES[k], CODES[k], c) for c in CODES[:3]} - items)
                result = await manager.patch("cat", {"add": [list(a) for a in add],
                                                     "remove": [list(r) for r in remove]})
                items = (items - set(remove)) | set(add)
                version, compiled = replica.subscriber._scenarios["cat"]
                assert version == result["version"]
                assert replica.subscriber.table_deltas == k + 1  # applied here, not fetched
                assert (await manager.replica_versions())[replica.replica_id]["table_deltas"] == k + 1  # /healthz
                assert_full_compile(compiled.constraint, items, vocab)
                for got_version, item in await answer_items(replica, "cat", eos, 3):
                    assert got_version == result["version"] and item in items, item
            # a replica whose base tables are not the manager's: its delta result differs, it fetches instead
            version, compiled = replica.subscriber._scenarios["cat"]
            other = catalog_tables(Catalog.from_items(START, END, sorted(items - {sorted(items)[0]})), vocab)
            replica.subscriber._scenarios["cat"] = (version, dataclasses.replace(compiled, constraint=other))
            remove = [sorted(items)[-1]]
            await manager.patch("cat", {"add": [[CODES[5], CODES[6], CODES[7], CODES[0]]],
                                        "remove": [list(remove[0])]})
            items = (items - set(remove)) | {(CODES[5], CODES[6], CODES[7], CODES[0])}
            assert replica.subscriber.table_deltas == 3  # not applied: fetched
            assert_full_compile(replica.subscriber._scenarios["cat"][1].constraint, items, vocab)
        finally:
            task.cancel()
            await manager.close()

    try:
        asyncio.run(main())
    finally:
        replica.shutdown()


def test_auto_fetches_what_is_not_an_object_ref_and_never_means_never():
    assert delta_wanted("auto", object()) is False  # a manager without Ray hands over the object
    assert delta_wanted("never", object()) is False
    assert delta_wanted("always", object()) is True
