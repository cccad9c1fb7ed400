"""What the scenario store keeps, as values: scenario names and idempotency keys checked, request fingerprints,
bodies and content packed (compressed, hashed) and cut into chunks, and read back (``deployments/storage/store.py`` writes
them; docs/design.md section 4.1 has the keys).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from redis.client import NEVER_DECODE

from deployments.storage.errors import InvalidRequest, StoreCorrupt

__all__ = ["BODY_INLINE_BYTES", "CHUNK_BYTES", "ContentDelta", "IDEMPOTENCY_KEY_PATTERN", "NAME_PATTERN",
           "PackedBody", "apply_line_delta", "content_sha256", "line_delta", "pack_body", "put_chunks", "read_content",
           "request_fingerprint", "validate_idempotency_key", "validate_name"]

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
_NAME_RE = re.compile(NAME_PATTERN)
_NAME_RULE = (
    f"names must match {NAME_PATTERN}: 1 to 64 characters, letters, digits, '_', '.' or '-', "
    "starting with a letter or digit"
)

# Stored content (tree files, catalogs, large bodies) is compressed and cut into values of at most this many bytes.
CHUNK_BYTES = 1 << 20
# A scenario body whose JSON is larger than this is stored as chunked content, not in the version's hash.
BODY_INLINE_BYTES = 256 * 1024
IDEMPOTENCY_KEY_PATTERN = r"^[\x21-\x7e]{1,200}$"  # printable ASCII without spaces, as a header value
_IDEMPOTENCY_KEY_RE = re.compile(IDEMPOTENCY_KEY_PATTERN)
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


def validate_name(name: Any) -> str:
    """Return ``name`` if it is a valid scenario name, else raise :class:`InvalidRequest`."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise InvalidRequest(f"invalid scenario name {name!r}: {_NAME_RULE}", {"field": "name"})
    return name


def validate_idempotency_key(key: Any) -> str:
    """Return ``key`` if it can be an idempotency key (1 to 200 printable ASCII characters, no spaces),
    else raise :class:`InvalidRequest`."""
    if not isinstance(key, str) or not _IDEMPOTENCY_KEY_RE.fullmatch(key):
        raise InvalidRequest("invalid Idempotency-Key: 1 to 200 printable ASCII characters without spaces "
                             "(e.g. a UUID)", {"field": "Idempotency-Key"})
    return key


#: content of at least this many bytes is compressed in parts, one zlib stream each, on threads (zlib releases the
#: GIL): encoding ``zlib-parts``, the streams one after the other (readers before 2026-12-06 know only ``zlib``)
PARALLEL_BYTES = 8 << 20
_PART_BYTES = 4 << 20
_pool: Any = None
_pool_lock = threading.Lock()


def _compress(data: Any, parallel: bool = True) -> tuple[Any, str]:
    if len(data) < PARALLEL_BYTES or not parallel:
        packed = zlib.compress(data, 1)
        return (data, "raw") if len(packed) >= len(data) else (packed, "zlib")
    workers = max(1, min(4, os.cpu_count() or 1))
    step = max(_PART_BYTES, -(-len(data) // workers))
    view = memoryview(data)  # (slices of it copy nothing: a catalog's bytes may be a mapped file)
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="content-zlib")
    parts = list(_pool.map(lambda lo: zlib.compress(view[lo:lo + step], 1), range(0, len(data), step)))
    packed = b"".join(parts)
    return (data, "raw") if len(packed) >= len(data) else (packed, "zlib-parts")


def _decompress(packed: bytes, encoding: str) -> bytes:
    """The bytes of ``packed`` in ``encoding``: ``raw``, ``zlib`` (one stream) or ``zlib-parts`` (streams one after
    the other, :func:`_compress`)."""
    if encoding == "zlib":
        return zlib.decompress(packed)
    if encoding != "zlib-parts":
        return packed
    out, rest = [], packed
    while rest:
        stream = zlib.decompressobj()
        out.append(stream.decompress(rest))
        if not stream.eof:
            raise zlib.error("a zlib-parts stream is cut short")
        rest = stream.unused_data
    return b"".join(out)


@dataclass(frozen=True)
class PackedBody:
    """A large body's text as the store keeps it (see :func:`pack_body`)."""

    sha256: str
    data: bytes
    encoding: str


def pack_body(raw: bytes) -> PackedBody | None:
    """Hash and compress a body's JSON (UTF-8 bytes) as :meth:`ScenarioStore.put` would store it, ahead of the write
    (the config manager does it on another thread while the body compiles); ``None`` for a body small enough to be
    kept in the version's hash."""
    if len(raw) <= BODY_INLINE_BYTES:
        return None
    data, encoding = _compress(raw)
    return PackedBody(hashlib.sha256(raw).hexdigest(), data, encoding)


@dataclass(frozen=True)
class ContentDelta:
    """Content stored as a line delta of other stored content (a catalog PATCH): the result's first line is the
    base's; its other lines are the base's without ``removed`` lines, then the ``added`` ones (see
    :func:`apply_line_delta`). ``data``: :func:`line_delta` of them. ``whole``: makes the result's bytes, stored
    instead when the base is gone or its delta chain is at the store's limit (``DeltaChains.delta_chain``)."""

    base: str  # SHA-256 of the base content
    data: bytes
    whole: Callable[[], bytes]


def line_delta(removed: list[bytes], added: list[bytes]) -> bytes:
    """A line delta's bytes: ``-<line>`` for each line removed, then ``+<line>`` for each appended, one a line
    (lines hold no newline)."""
    return b"".join([*(b"-" + line + b"\n" for line in removed), *(b"+" + line + b"\n" for line in added)])


def apply_line_delta(base: bytes, delta: bytes) -> bytes:
    """The content ``delta`` (:func:`line_delta`) makes of ``base``: base's first line, its other lines without the
    removed ones (every copy), the added lines appended; lines end with a newline."""
    head, _, rest = base.partition(b"\n")
    lines = rest.split(b"\n")
    if lines and not lines[-1]:
        lines.pop()
    changes = delta.split(b"\n")
    removed = {line[1:] for line in changes if line[:1] == b"-"}
    added = [line[1:] for line in changes if line[:1] == b"+"]
    if removed:
        lines = [line for line in lines if line not in removed]
    lines += added
    return head + b"\n" + b"".join(line + b"\n" for line in lines)


def request_fingerprint(action: str, name: str, body: Any = None, from_version: int | None = None) -> str:
    """SHA-256 (hex) of an admin write request as the client sent it: the action, the name, the body (keys
    sorted, so their order does not matter) and the rolled-back version. An idempotency key may only be
    reused for a request with the same fingerprint."""
    text = json.dumps([action, name, body, from_version], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def content_sha256(body: Any) -> str | None:
    """The ``content_sha256`` of a body stored with content of its own (a tree file's, a catalog's), else None. Only
    bodies the manager has validated are stored, and validation refuses the field where the kind has no content."""
    if isinstance(body, dict) and isinstance(body.get("content_sha256"), str):
        return body["content_sha256"]
    return None


def put_chunks(client: Any, base: str, data: bytes, packed: PackedBody | None = None, part: str = "",
               expire_s: int | None = None, parallel: bool = True) -> list[str]:
    """Write ``data`` (compressed) as chunks of at most :data:`CHUNK_BYTES` under ``<base>:<part><i>`` (``base``: the
    content key ``P c:<sha>``; ``part`` ``"w"``: the whole bytes of content stored as a delta, see
    :data:`WHOLE_PART`) and return its manifest ``[size, chunks, encoding]``; the manifest key itself is
    written by a script, with the version that refers to it, so no reader ever sees content whose chunks are not all there.
    One SET per chunk in a pipeline without a transaction: Redis serves other clients between chunks.
    ``packed``: ``data`` already compressed by :func:`pack_body` (used when it is of these very bytes); ``expire_s``:
    the chunks expire unless a script persists them (chunks a process that died before naming them leaves behind);
    ``parallel`` False: compressed on the calling thread only (a compaction at the lowest priority: the shared
    compression threads keep the priority of the writes that started them)."""
    if packed is not None and base.endswith(":" + packed.sha256):
        packed_data, encoding = packed.data, packed.encoding
    else:
        packed_data, encoding = _compress(data, parallel)
    pipe = client.pipeline(transaction=False)
    count = 0
    for count, start in enumerate(range(0, len(packed_data), CHUNK_BYTES), start=1):
        pipe.set(f"{base}:{part}{count - 1}", packed_data[start:start + CHUNK_BYTES], ex=expire_s)
    if count == 0:  # empty content: one empty chunk
        pipe.set(f"{base}:{part}0", b"", ex=expire_s)
        count = 1
    pipe.execute()
    return [str(len(data)), str(count), encoding]


#: the infix of the chunks of a delta's whole bytes, stored later beside its delta (``ScenarioStore``'s compaction
#: behind the writes): ``<base>:w<i>``, named in its manifest by ``wsize``, ``wchunks`` and ``wencoding``
WHOLE_PART = "w"
#: the infix of the chunks of content staged ahead of the write that names it (``ScenarioStore.stage_content``):
#: ``<base>:s<i>``, with an expiry; the write script renames them to ``<base>:<i>`` as it writes their manifest, so a
#: staging never touches the chunks of content stored meanwhile by another write
STAGED_PART = "s"


def _read_chunks(client: Any, base: str, part: str, manifest: dict[str, str], fields: tuple[str, str, str]) -> bytes:
    """The bytes of the chunks ``<base>:<part><i>`` whose size, count and encoding the manifest's ``fields`` give."""
    try:
        size, chunks, encoding = int(manifest[fields[0]]), int(manifest[fields[1]]), manifest[fields[2]]
    except (KeyError, ValueError):
        raise StoreCorrupt(f"stored content manifest {base}:m is corrupt") from None
    pipe = client.pipeline(transaction=False)
    for i in range(chunks):
        pipe.execute_command("GET", f"{base}:{part}{i}", **{NEVER_DECODE: []})
    parts = pipe.execute()
    if any(one is None for one in parts):
        raise StoreCorrupt(f"stored content {base} is missing chunks")
    packed = b"".join(parts)
    try:
        data = _decompress(packed, encoding)
    except zlib.error:
        raise StoreCorrupt(f"stored content {base} does not decompress ({encoding})") from None
    if len(data) != size:
        raise StoreCorrupt(f"stored content {base} has {len(data)} bytes, its manifest says {size}")
    return data


def read_content(client: Any, base: str, _depth: int = 0) -> bytes | None:
    """The bytes stored under the content key ``base`` (``P c:<sha>``): chunked (manifest ``<base>:m``) or, as
    written before chunking, one string ``<base>``; None when neither exists. Content stored as a delta (its
    manifest names a ``base``) is read from its whole bytes when they were stored beside it (:data:`WHOLE_PART`),
    else rebuilt from its base chain and checked against its hash."""
    manifest = client.hgetall(base + ":m")
    if not manifest:
        return client.execute_command("GET", base, **{NEVER_DECODE: []})
    if manifest.get("wchunks"):
        return _read_chunks(client, base, WHOLE_PART, manifest, ("wsize", "wchunks", "wencoding"))
    data = _read_chunks(client, base, "", manifest, ("size", "chunks", "encoding"))
    parent = manifest.get("base")
    if parent:  # a line delta of other content (ContentDelta): that content, read the same way, with it applied
        prefix = base[:-64]
        if _depth > 64 or not _SHA256_RE.fullmatch(parent):
            raise StoreCorrupt(f"stored content {base} has a bad base {parent[:80]!r}")
        whole = read_content(client, prefix + parent, _depth + 1)
        if whole is None:
            raise StoreCorrupt(f"stored content {base} is a delta of {parent[:12]}, which is not stored")
        data = apply_line_delta(whole, data)
        if hashlib.sha256(data).hexdigest() != base[-64:]:
            raise StoreCorrupt(f"stored content {base}: its delta applied to {parent[:12]} does not give its hash")
    return data
