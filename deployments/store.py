"""Scenario storage in Redis: every version of every scenario, immutable, with its history.

Redis is the source of truth; the config manager compiles what is stored here. Key layout
(``P`` is the prefix, ``cs:`` by default; ``N`` a scenario name, ``n`` a version number)::

    P names              SET     names that currently exist (live)
    P all                SET     every name that was ever written (history survives a delete)
    P s:N:seq            STRING  last version number handed out for N (INCR)
    P s:N:current        STRING  version currently in force; absent while N is deleted
    P s:N:history        LIST    every version number of N, oldest first
    P s:N:bodies         LIST    the versions of N that still hold a body, oldest first (bounded history)
    P s:N:v:n            HASH    one version, written once; only pruning changes it later:
                                   version, action (put | patch | rollback | delete), created_at (ISO 8601 UTC),
                                   type and scenario (the body as JSON; not on a delete entry) or, for a body
                                   over BODY_INLINE_BYTES, body_sha256 (the body is stored content),
                                   from_version (rollback only), refs (the content SHA-256s it refers to),
                                   pruned (when its body was dropped: the instant; scenario/body_sha256/refs gone)
    P w:<id>             STRING  version made by the write call <id> (kept 1 hour): a retried call is applied once
    P i:<key>            HASH    an admin write made with the idempotency key <key> (kept ``idempotency_ttl_s``,
                                   24 h by default): fingerprint (of the request), action, name, version,
                                   from_version; a retry with the key is answered with this version
    P c:<sha256>:m       HASH    stored content (a tree file as read at the PUT, a catalog, a large body) under
                                   the SHA-256 (hex) of its bytes: size, chunks, encoding (zlib | raw)
    P c:<sha256>:<i>     STRING  chunk i of that content (compressed), at most CHUNK_BYTES (1 MiB) each
    P c:<sha256>:refs    SET     the versions ("N:n") whose bodies refer to it; when pruning empties it, the
                                   content is removed
    P c:<sha256>         STRING  content written before chunking (one value; read, never written now)
    P changes            pub/sub channel: {"name", "version", "action"} after every write

A tree scenario given as a ``path`` is stored with the content of the file: its body keeps ``path``
(where the content was read from, for display) and adds ``content_sha256``, the key of the bytes in
``P c:<sha256>``. A version therefore means the same tokens forever, whatever happens to the file.

Large values never block Redis for other clients: content is compressed and cut into chunks of at most 1 MiB,
written one SET each in a pipeline (no transaction) BEFORE the write script runs; the script then writes the
manifest ``P c:<sha>:m`` together with the version that refers to it. A reader finds the manifest only once every
chunk is there, so it never sees content half-written; chunks of a write that failed are overwritten by its retry
(their keys name the content's hash). History is bounded: with ``history_bodies`` N > 0 the script drops, in the
same write, the body of every version older than the newest N that have one (``P s:N:bodies``); such a version
keeps its metadata and is listed with ``pruned: true``; :meth:`ScenarioStore.get` returns it with ``scenario:
None, pruned: True``, and a rollback to it is a 410. Content no version refers to any more is removed with it.

A write (put, patch, rollback, delete) is one Lua script: it takes the next number with INCR (skipping any
version key that already exists, so a record is never overwritten), writes the record, moves the
``current`` pointer and the live-name set, appends to the history, records the idempotency key and
publishes the change, all atomically; a put that refers to tree content stores the bytes in the same
script (or checks that they are stored). A write that reaches the server after its deadline (its
caller has given up and answered 503) is dropped, and a retry of one that was applied returns the
same version. A write with an idempotency key that was already used for the same request is not
applied again: it returns the first write's version (``WriteResult.replayed``); the key used for a
different request is a ``ServiceError(422)``. A write with ``expect_current`` (a PATCH) is applied only while
that version is current, else it raises :class:`BaseChanged` (409) and writes nothing. Two concurrent writers therefore get distinct versions,
both land in the history, and ``current`` always names the newest write. Names are checked against
:data:`NAME_PATTERN` because they become parts of keys and URLs.

Redis being unreachable surfaces as ``ServiceError(503)``; a record that is not what this module
writes (another tool wrote garbage) as ``ServiceError(500)`` naming the key.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import re
import uuid
import zlib
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import redis
from redis.client import NEVER_DECODE

from deployments.protocol import ServiceError

__all__ = ["BaseChanged", "HISTORY_BODIES", "IDEMPOTENCY_TTL_S", "NAME_PATTERN", "PackedBody", "ScenarioStore", "WriteResult",
           "content_sha256", "pack_body", "pruned_error", "request_fingerprint", "validate_idempotency_key",
           "validate_name"]

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
_NAME_RE = re.compile(NAME_PATTERN)
_NAME_RULE = (
    f"names must match {NAME_PATTERN}: 1 to 64 characters, letters, digits, '_', '.' or '-', "
    "starting with a letter or digit"
)

# Seconds a write may wait on the server before it runs (plus the upload time of its body at
# UPLOAD_BYTES_PER_S); later, it is dropped. Below the client's socket timeout, so a write either runs
# while the client still waits for the answer or never.
WRITE_DEADLINE_S = 3.0
UPLOAD_BYTES_PER_S = 10e6

# Stored content (tree files, catalogs, large bodies) is compressed and cut into values of at most this many bytes.
CHUNK_BYTES = 1 << 20
# A scenario body whose JSON is larger than this is stored as chunked content, not in the version's hash.
BODY_INLINE_BYTES = 256 * 1024
# Default number of newest bodies kept per scenario (older versions keep their metadata; 0 keeps all).
HISTORY_BODIES = 20

# Seconds an idempotency key is remembered after the write it made.
IDEMPOTENCY_TTL_S = 24 * 3600
IDEMPOTENCY_KEY_PATTERN = r"^[\x21-\x7e]{1,200}$"  # printable ASCII without spaces, as a header value
_IDEMPOTENCY_KEY_RE = re.compile(IDEMPOTENCY_KEY_PATTERN)
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")

# Script answers: {status, version}
WRITTEN, REPLAYED, NOT_LIVE, TOO_LATE, NO_CONTENT, KEY_REUSED, BASE_CHANGED = 1, 2, -1, -2, -3, -4, -5

_WRITE_SCRIPT = """
-- KEYS: seq, current, history, names, all, write id, idempotency key, bodies
-- ARGV: version key prefix, name, action, created_at, type, body ('' when stored as content), from_version,
--       channel, deadline (ms), fingerprint ('' = no idempotency key), idempotency ttl (s),
--       content refs (JSON [[sha, manifest or false], ...]), content key prefix, expected current ('' = any),
--       bodies to keep (0 = all), body sha256 ('' = the body is inline), the write's answer ('' = none; JSON,
--       kept with the idempotency key so that a retry gets it)
local done = redis.call('GET', KEYS[6])
if done then
  return {1, tonumber(done)}  -- a retry of a write call that was applied: the same version, not a second one
end
local now = redis.call('TIME')
if tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000) > tonumber(ARGV[9]) then
  return {-2, 0}  -- the writer has given up on this call (the server was hung): never apply it late
end
if ARGV[10] ~= '' then
  local seen = redis.call('HMGET', KEYS[7], 'fingerprint', 'version')
  if seen[1] then
    if seen[1] ~= ARGV[10] then
      return {-4, 0}  -- the key was used for another request
    end
    return {2, tonumber(seen[2])}  -- a retried request: its first result, nothing written again
  end
end
local name, action = ARGV[2], ARGV[3]
if action == 'delete' and redis.call('SISMEMBER', KEYS[4], name) == 0 then
  return {-1, 0}
end
if ARGV[14] ~= '' then
  local cur = redis.call('GET', KEYS[2])
  if cur ~= ARGV[14] then
    return {-5, tonumber(cur) or 0}  -- the scenario changed since the caller read it
  end
end
local cprefix = ARGV[13]
local refs = cjson.decode(ARGV[12])
for _, ref in ipairs(refs) do
  local sha, manifest = ref[1], ref[2]
  if manifest then
    if redis.call('EXISTS', cprefix .. sha .. ':m') == 0 then
      redis.call('HSET', cprefix .. sha .. ':m', 'size', manifest[1], 'chunks', manifest[2], 'encoding', manifest[3])
    end
  elseif redis.call('EXISTS', cprefix .. sha .. ':m') == 0 and redis.call('EXISTS', cprefix .. sha) == 0 then
    return {-3, 0}
  end
end
local v, vkey
repeat
  v = redis.call('INCR', KEYS[1])
  vkey = ARGV[1] .. v
until redis.call('EXISTS', vkey) == 0
local fields = {'version', v, 'action', action, 'created_at', ARGV[4]}
if action ~= 'delete' then
  table.insert(fields, 'type'); table.insert(fields, ARGV[5])
  if ARGV[16] ~= '' then
    table.insert(fields, 'body_sha256'); table.insert(fields, ARGV[16])
  else
    table.insert(fields, 'scenario'); table.insert(fields, ARGV[6])
  end
end
if ARGV[7] ~= '' then
  table.insert(fields, 'from_version'); table.insert(fields, ARGV[7])
end
local shas = {}
for _, ref in ipairs(refs) do
  table.insert(shas, ref[1])
  redis.call('SADD', cprefix .. ref[1] .. ':refs', name .. ':' .. v)
end
if #shas > 0 then
  table.insert(fields, 'refs'); table.insert(fields, table.concat(shas, ','))
end
redis.call('HSET', vkey, unpack(fields))
redis.call('RPUSH', KEYS[3], v)
redis.call('SADD', KEYS[5], name)
if action == 'delete' then
  redis.call('DEL', KEYS[2])
  redis.call('SREM', KEYS[4], name)
else
  redis.call('SET', KEYS[2], v)
  redis.call('SADD', KEYS[4], name)
  -- bounded history: the oldest bodies beyond the newest ARGV[15] are dropped, their metadata stays
  redis.call('RPUSH', KEYS[8], v)
  local keep = tonumber(ARGV[15])
  while keep > 0 and redis.call('LLEN', KEYS[8]) > keep do
    local old = redis.call('LPOP', KEYS[8])
    local okey = ARGV[1] .. old
    local oldrefs = redis.call('HGET', okey, 'refs')
    redis.call('HDEL', okey, 'scenario', 'body_sha256', 'refs')
    redis.call('HSET', okey, 'pruned', ARGV[4])
    if oldrefs then
      for sha in string.gmatch(oldrefs, '[^,]+') do
        local rkey = cprefix .. sha .. ':refs'
        if redis.call('SREM', rkey, name .. ':' .. old) == 1 and redis.call('SCARD', rkey) == 0 then
          local chunks = tonumber(redis.call('HGET', cprefix .. sha .. ':m', 'chunks') or '0')
          for i = 0, chunks - 1 do
            redis.call('UNLINK', cprefix .. sha .. ':' .. i)
          end
          redis.call('UNLINK', cprefix .. sha .. ':m', rkey)
        end
      end
    end
  end
end
redis.call('SET', KEYS[6], v, 'EX', 3600)
if ARGV[10] ~= '' then
  redis.call('HSET', KEYS[7], 'fingerprint', ARGV[10], 'action', action, 'name', name, 'version', v,
             'from_version', ARGV[7], 'answer', ARGV[17])
  redis.call('EXPIRE', KEYS[7], tonumber(ARGV[11]))
end
redis.call('PUBLISH', ARGV[8], cjson.encode({name = name, version = v, action = action}))
return {1, v}
"""

# KEYS: idempotency key; ARGV: fingerprint, action, name, version, answer (JSON), ttl (s). A request that wrote
# nothing keeps its answer under its key, unless the key already holds a record (then: reused, or the same request).
_REMEMBER_SCRIPT = """
local seen = redis.call('HGET', KEYS[1], 'fingerprint')
if seen then
  if seen ~= ARGV[1] then
    return -4
  end
  return 2
end
redis.call('HSET', KEYS[1], 'fingerprint', ARGV[1], 'action', ARGV[2], 'name', ARGV[3], 'version', ARGV[4],
           'from_version', '', 'answer', ARGV[5])
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[6]))
return 1
"""


class BaseChanged(ServiceError):
    """A conditional write (``expect_current``) found another version in force: nothing was written (409).
    ``current`` is the version in force (None when the scenario is deleted)."""

    def __init__(self, name: str, expected: int | None, current: int | None):
        self.current = current
        super().__init__(409, f"scenario {name!r} changed underneath: the write was based on version {expected}, "
                              f"the current version is {current if current is not None else 'none (deleted)'}; "
                              "nothing was written: read the current version and send the change again",
                         {"name": name, "field": "base_version", "base_version": expected, "current_version": current})


class WriteResult(int):
    """The version number a write made (an ``int``); ``replayed`` is True when the write was not applied
    because its idempotency key names an earlier write of the same request, whose version this is."""

    replayed: bool

    def __new__(cls, version: int, replayed: bool = False) -> "WriteResult":
        result = super().__new__(cls, version)
        result.replayed = bool(replayed)
        return result


def validate_idempotency_key(key: Any) -> str:
    """Return ``key`` if it can be an idempotency key (1 to 200 printable ASCII characters, no spaces),
    else raise ``ServiceError(422)``."""
    if not isinstance(key, str) or not _IDEMPOTENCY_KEY_RE.fullmatch(key):
        raise ServiceError(422, "invalid Idempotency-Key: 1 to 200 printable ASCII characters without spaces "
                                "(e.g. a UUID)", {"field": "Idempotency-Key"})
    return key


def _compress(data: bytes) -> tuple[bytes, str]:
    packed = zlib.compress(data, 1)
    return (data, "raw") if len(packed) >= len(data) else (packed, "zlib")


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


def request_fingerprint(action: str, name: str, body: Any = None, from_version: int | None = None) -> str:
    """SHA-256 (hex) of an admin write request as the client sent it: the action, the name, the body (keys
    sorted, so their order does not matter) and the rolled-back version. An idempotency key may only be
    reused for a request with the same fingerprint."""
    text = json.dumps([action, name, body, from_version], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def content_sha256(body: Any) -> str | None:
    """The ``content_sha256`` of a tree body stored with the content of its file, else None."""
    if isinstance(body, dict) and body.get("type") == "tree" and isinstance(body.get("content_sha256"), str):
        return body["content_sha256"]
    return None


def pruned_error(name: str, version: int) -> ServiceError:
    """The 410 for a version whose body was dropped by the bounded history (``history_bodies``)."""
    return ServiceError(410, f"version {version} of scenario {name!r} no longer has its body: the history keeps "
                             "the newest bodies only (setting history_bodies); its metadata is still listed",
                        {"name": name, "version": version, "pruned": True})


def validate_name(name: Any) -> str:
    """Return ``name`` if it is a valid scenario name, else raise ``ServiceError(422)``."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ServiceError(422, f"invalid scenario name {name!r}: {_NAME_RULE}", {"field": "name"})
    return name


def _redis_errors(method):
    """Turn Redis failures into ``ServiceError``: 503 when unreachable, 500 otherwise."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        # Redis's own texts name its socket path or host: they go to the log, clients get what happened.
        except (redis.ConnectionError, redis.TimeoutError, redis.ReadOnlyError) as exc:
            logging.getLogger("ray.serve").warning("scenario store unavailable: %s: %s", type(exc).__name__, exc)
            what = ("Redis did not answer in time" if isinstance(exc, redis.TimeoutError) else
                    "Redis is read-only" if isinstance(exc, redis.ReadOnlyError) else "cannot connect to Redis")
            raise ServiceError(503, f"scenario store unavailable: {what}; retry later") from exc
        except redis.RedisError as exc:
            logging.getLogger("ray.serve").error("scenario store error: %s: %s", type(exc).__name__, exc)
            raise ServiceError(500, f"scenario store error ({type(exc).__name__}; the manager's log has the detail)") from exc

    return wrapper


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class ScenarioStore:
    """Versioned scenario bodies in Redis (see the module docstring for the key layout).

    Args:
        redis_client: a ``redis.Redis`` with ``decode_responses=True``. The attribute ``client`` may
            be replaced later (e.g. after the embedded server was restarted).
        prefix: prefix of every key and of the change channel.

    Example::

        store = ScenarioStore(connect_redis(None, "./data"))
        v = store.put("sentiment", {"type": "labels", "labels": ["positive", "negative"]})
        store.get("sentiment")["version"] == v
    """

    def __init__(self, redis_client: redis.Redis, prefix: str = "cs:", *, idempotency_ttl_s: float = IDEMPOTENCY_TTL_S,
                 history_bodies: int | None = 0):
        self.client = redis_client
        self.prefix = prefix
        self.history_bodies = max(0, int(history_bodies or 0))
        self.idempotency_ttl_s = max(1.0, float(idempotency_ttl_s))
        self.channel = f"{prefix}changes"
        self._script = redis_client.register_script(_WRITE_SCRIPT)
        self._remember_script = redis_client.register_script(_REMEMBER_SCRIPT)

    # ------------------------------------------------------------------ keys

    def _key(self, name: str, part: str) -> str:
        return f"{self.prefix}s:{name}:{part}"

    def version_key(self, name: str, version: int) -> str:
        """The key of one version's record."""
        return f"{self.prefix}s:{name}:v:{int(version)}"

    def current_key(self, name: str) -> str:
        """The key of the ``current`` pointer (keyspace notifications watch it)."""
        return self._key(name, "current")

    @property
    def names_key(self) -> str:
        return f"{self.prefix}names"

    @property
    def all_key(self) -> str:
        return f"{self.prefix}all"

    def content_key(self, sha256: str) -> str:
        """The key of stored tree-file content (see :meth:`content`)."""
        return f"{self.prefix}c:{sha256}"

    def idempotency_key(self, key: str) -> str:
        """The key that remembers the write made with the idempotency key ``key``."""
        return f"{self.prefix}i:{key}"

    # ------------------------------------------------------------------ writes

    # ------------------------------------------------------------------ writes

    def _write(self, name: str, action: str, body: dict | None = None, from_version: int | None = None, *,
               idempotency_key: str | None = None, fingerprint: str | None = None,
               content: bytes | None = None, expect_current: int | None = None,
               body_json: bytes | None = None, packed_body: PackedBody | None = None,
               answer: dict[str, Any] | None = None) -> WriteResult:
        validate_name(name)
        if body is not None:
            if not isinstance(body, dict):
                raise ServiceError(422, f"a scenario body must be a JSON object, got {type(body).__name__}")
            if body_json is None:
                body_json = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode("utf-8", "surrogatepass")
            kind = body.get("type")
            kind = kind if isinstance(kind, str) else ""
        else:
            body_json, kind = b"", ""
        if idempotency_key is None:
            fingerprint = None
        else:
            validate_idempotency_key(idempotency_key)
            if fingerprint is None:
                fingerprint = request_fingerprint(action, name, body, from_version)
        for attempt in range(2):  # again, uploading, when the content was pruned between our check and the write
            refs: list[list[Any]] = []  # [sha, manifest or False]: content this version refers to
            uploaded = 0
            sha = content_sha256(body)
            if sha is not None:
                manifest: Any = False
                if content is not None:
                    if hashlib.sha256(content).hexdigest() != sha:
                        raise ServiceError(500, f"tree content does not match its content_sha256 {sha}", {"name": name})
                    if attempt or not self._content_stored(sha):  # stored once, not sent again
                        manifest = self._put_chunks(sha, content)
                        uploaded += len(content)
                refs.append([sha, manifest])
            elif content is not None:
                raise ServiceError(500, "tree content given for a body without content_sha256", {"name": name})
            body_sha, text = "", ""
            if len(body_json) > BODY_INLINE_BYTES:  # a large body (an inline tree) goes to chunks like tree content
                body_sha = hashlib.sha256(body_json).hexdigest()  # packed_body is used only if it is of these bytes
                stored = not attempt and self._content_stored(body_sha)
                refs.append([body_sha, False if stored else self._put_chunks(body_sha, body_json, packed_body)])
                uploaded += len(body_json)
            else:  # kept in the version's hash
                text = body_json.decode("utf-8", "surrogatepass")
            wid = f"{self.prefix}w:{uuid.uuid4().hex}"
            keys = [self._key(name, "seq"), self._key(name, "current"), self._key(name, "history"),
                    self.names_key, self.all_key, wid,
                    self.idempotency_key(idempotency_key) if idempotency_key is not None else wid,
                    self._key(name, "bodies")]
            # A write that reaches the server after this instant is dropped: a call that timed out (and
            # answered 503) never takes effect later, when a hung server wakes up and runs its backlog. The
            # instant is in the server's clock (its TIME now), so clock skew between hosts does not matter.
            seconds, micros = self.client.time()
            deadline_ms = int(seconds) * 1000 + int(micros) // 1000 + int(
                (WRITE_DEADLINE_S + (len(text) + uploaded) / UPLOAD_BYTES_PER_S) * 1000)
            args = [self._key(name, "v:"), name, action, _now(), kind, text,
                    "" if from_version is None else str(int(from_version)), self.channel, str(deadline_ms),
                    fingerprint or "", str(int(self.idempotency_ttl_s)), json.dumps(refs), f"{self.prefix}c:",
                    "" if expect_current is None else str(int(expect_current)), str(int(self.history_bodies or 0)),
                    body_sha, "" if answer is None else json.dumps(answer, separators=(",", ":"))]
            status, version = (int(x) for x in self._script(keys=keys, args=args, client=self.client))
            if status != NO_CONTENT or (content is None and not body_sha):
                break
        if status == TOO_LATE:
            raise ServiceError(503, "scenario store unavailable: Redis did not run the write in time; "
                                    "it was not applied")
        if status == KEY_REUSED:
            raise self._key_reused(idempotency_key)
        if status == NO_CONTENT:
            raise ServiceError(422, f"content_sha256: no tree content {sha} is stored; leave content_sha256 out "
                                    "to store the file named by path", {"name": name, "field": "content_sha256"})
        if status == BASE_CHANGED:
            raise BaseChanged(name, expect_current, version or None)
        if status == NOT_LIVE:
            return WriteResult(-1)
        return WriteResult(version, replayed=status == REPLAYED)

    # ------------------------------------------------------------------ chunked content

    def _content_stored(self, sha: str) -> bool:
        return bool(self.client.exists(self.content_key(sha) + ":m", self.content_key(sha)))

    def _put_chunks(self, sha: str, data: bytes, packed: PackedBody | None = None) -> list[str]:
        """Write ``data`` (compressed) as chunks of at most :data:`CHUNK_BYTES` under ``P c:<sha>:<i>`` and return
        its manifest ``[size, chunks, encoding]``; the manifest key itself is written by the write script,
        with the version that refers to it, so no reader ever sees content whose chunks are not all there.
        One SET per chunk in a pipeline without a transaction: Redis serves other clients between chunks.
        ``packed``: ``data`` already compressed by :func:`pack_body` (used when it is of these very bytes)."""
        if packed is not None and packed.sha256 == sha:
            packed_data, encoding = packed.data, packed.encoding
        else:
            packed_data, encoding = _compress(data)
        base = self.content_key(sha)
        pipe = self.client.pipeline(transaction=False)
        count = 0
        for count, start in enumerate(range(0, len(packed_data), CHUNK_BYTES), start=1):
            pipe.set(f"{base}:{count - 1}", packed_data[start:start + CHUNK_BYTES])
        if count == 0:  # empty content: one empty chunk
            pipe.set(f"{base}:0", b"")
            count = 1
        pipe.execute()
        return [str(len(data)), str(count), encoding]

    def _read_content(self, sha: str) -> bytes | None:
        """The bytes stored under ``sha``: chunked (manifest ``P c:<sha>:m``) or, as written before chunking,
        one string ``P c:<sha>``; None when neither exists."""
        base = self.content_key(sha)
        manifest = self.client.hgetall(base + ":m")
        if not manifest:
            return self.client.execute_command("GET", base, **{NEVER_DECODE: []})
        try:
            size, chunks, encoding = int(manifest["size"]), int(manifest["chunks"]), manifest["encoding"]
        except (KeyError, ValueError):
            raise ServiceError(500, f"stored content manifest {base}:m is corrupt") from None
        pipe = self.client.pipeline(transaction=False)
        for i in range(chunks):
            pipe.execute_command("GET", f"{base}:{i}", **{NEVER_DECODE: []})
        parts = pipe.execute()
        if any(part is None for part in parts):
            raise ServiceError(500, f"stored content {base} is missing chunks")
        packed = b"".join(parts)
        data = zlib.decompress(packed) if encoding == "zlib" else packed
        if len(data) != size:
            raise ServiceError(500, f"stored content {base} has {len(data)} bytes, its manifest says {size}")
        return data

    @staticmethod
    def _key_reused(key: str | None) -> ServiceError:
        return ServiceError(422, f"Idempotency-Key {key!r} was already used for a different request (another "
                                 "scenario, action or body); use a new key for a new request",
                            {"field": "Idempotency-Key"})

    @_redis_errors
    def put(self, name: str, body: dict, *, idempotency_key: str | None = None, fingerprint: str | None = None,
            content: bytes | None = None, expect_current: int | None = None, action: str = "put",
            body_json: bytes | None = None, packed_body: PackedBody | None = None,
            answer: dict[str, Any] | None = None) -> WriteResult:
        """Store ``body`` as the new current version of ``name``; return its version number.

        ``idempotency_key``: a write already made with this key for the same request (same
        ``fingerprint``, by default :func:`request_fingerprint` of this put) is not made again: its version
        is returned with ``replayed`` set; a key used for another request is a 422. ``content``: the tree
        file bytes a body with ``content_sha256`` refers to, stored with the version unless already stored;
        without it, such a body is refused (422) unless its content is stored. ``expect_current``: write only
        while that version is current, else raise :class:`BaseChanged` (409) and write nothing. ``action``:
        ``put`` or ``patch`` (a PATCH stores the whole resulting body; the action is what the history shows).
        ``body_json``: the body's JSON (UTF-8 bytes), stored instead of serializing ``body`` (a large inline tree as
        the client sent it; ``body`` then holds its other fields, for its type and content reference).
        ``packed_body``: :func:`pack_body` of those bytes, made while it compiled (not compressed again here).
        ``answer``: what the write answers besides its name and version (a PATCH's report), kept with the
        idempotency key in the same script, so :meth:`idempotent_result` gives a retry the first answer exactly.
        """
        if action not in ("put", "patch"):
            raise ValueError(f"action {action!r}")
        return self._write(name, action, body, idempotency_key=idempotency_key, fingerprint=fingerprint,
                           content=content, expect_current=expect_current, body_json=body_json,
                           packed_body=packed_body, answer=answer)

    @_redis_errors
    def delete(self, name: str, *, idempotency_key: str | None = None) -> WriteResult:
        """Record a delete entry and drop ``name`` from the live names; return the entry's version.

        The history stays; a later :meth:`put` continues the numbering. Raises ``ServiceError(404)``
        when ``name`` is not live (unless ``idempotency_key`` names this delete, already made).
        """
        version = self._write(name, "delete", idempotency_key=idempotency_key)
        if version < 0:
            raise ServiceError(404, f"scenario {name!r} does not exist", {"known": self.names()})
        return version

    @_redis_errors
    def rollback(self, name: str, version: int, *, idempotency_key: str | None = None) -> WriteResult:
        """Store a NEW version of ``name`` whose body is that of ``version``; return its number.

        Raises ``ServiceError(404)`` when ``version`` does not exist and ``ServiceError(409)`` when
        it is a delete entry (it has no body to restore). ``idempotency_key`` as for :meth:`put`.
        """
        record = self.get(name, version)
        if record is None:
            raise ServiceError(404, f"scenario {name!r} has no version {version}",
                               {"versions": [v["version"] for v in self.versions(name)]})
        if record.get("pruned"):
            raise pruned_error(name, int(version))
        if record["scenario"] is None:
            raise ServiceError(409, f"version {version} of scenario {name!r} is a delete entry; "
                                    "there is no body to roll back to")
        return self._write(name, "rollback", record["scenario"], from_version=int(version),
                           idempotency_key=idempotency_key,
                           fingerprint=request_fingerprint("rollback", name, None, int(version)))

    @_redis_errors
    def idempotent_result(self, key: str, fingerprint: str) -> dict[str, Any] | None:
        """The write made earlier with idempotency key ``key``: ``{"action", "name", "version"}`` (plus
        ``from_version`` for a rollback, ``answer`` where the write kept one: see :meth:`put` and
        :meth:`remember_result`), or None when the key is unknown (or expired). Raises
        ``ServiceError(422)`` when the key was used for a request with another ``fingerprint``."""
        validate_idempotency_key(key)
        raw = self.client.hgetall(self.idempotency_key(key))
        if not raw:
            return None
        if raw.get("fingerprint") != fingerprint:
            raise self._key_reused(key)
        try:
            result: dict[str, Any] = {"action": raw["action"], "name": raw["name"], "version": int(raw["version"])}
            if raw.get("from_version"):
                result["from_version"] = int(raw["from_version"])
            if raw.get("answer"):
                result["answer"] = json.loads(raw["answer"])
        except (KeyError, ValueError) as exc:
            raise ServiceError(500, f"stored idempotency record {self.idempotency_key(key)} is corrupt: {exc}") from None
        return result

    @_redis_errors
    def remember_result(self, key: str, fingerprint: str, action: str, name: str, version: int,
                        answer: dict[str, Any]) -> dict[str, Any] | None:
        """Keep the answer of a request made with idempotency key ``key`` that wrote nothing (a PATCH that changed
        nothing), as a write keeps its own: a retry gets this answer, not a new write. Returns None when kept,
        or the record already kept under ``key`` for the same request (a concurrent first attempt; see
        :meth:`idempotent_result`); 422 when the key was used for another request."""
        validate_idempotency_key(key)
        status = int(self._remember_script(keys=[self.idempotency_key(key)], client=self.client, args=[
            fingerprint, action, name, str(int(version)), json.dumps(answer, separators=(",", ":")),
            str(int(self.idempotency_ttl_s))]))
        if status == KEY_REUSED:
            raise self._key_reused(key)
        return None if status == WRITTEN else self.idempotent_result(key, fingerprint)

    @_redis_errors
    def content(self, sha256: str) -> bytes | None:
        """The tree-file bytes stored under ``sha256`` (hex), or None when nothing is."""
        if not isinstance(sha256, str) or not _SHA256_RE.fullmatch(sha256):
            return None
        return self._read_content(sha256)

    # ------------------------------------------------------------------ reads

    def _parse(self, name: str, version: int, raw: dict[str, str]) -> dict[str, Any]:
        key = self.version_key(name, version)
        try:
            action = raw["action"]
            stored_version = int(raw["version"])
            if stored_version != int(version) or action not in ("put", "patch", "rollback", "delete"):
                raise ValueError(f"version field {raw.get('version')!r}, action {action!r}")
            if action == "delete" or raw.get("pruned"):
                scenario = None
            else:
                text = raw.get("scenario")
                if text is None and raw.get("body_sha256"):
                    data = self._read_content(raw["body_sha256"])
                    if data is None:
                        raise ValueError(f"its body {raw['body_sha256'][:12]} is not stored")
                    text = data.decode("utf-8", "surrogatepass")
                if text is None:
                    raise KeyError("scenario")
                scenario = json.loads(text)
                if not isinstance(scenario, dict):
                    raise ValueError(f"the scenario is a {type(scenario).__name__}, not an object")
        except (KeyError, ValueError, TypeError) as exc:
            problem = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
            raise ServiceError(500, f"stored record {key} is corrupt: {problem}",
                               {"name": name, "version": int(version)}) from None
        record = {
            "name": name,
            "version": stored_version,
            "scenario": scenario,
            "created_at": raw.get("created_at"),
            "action": action,
        }
        if raw.get("from_version"):
            record["from_version"] = int(raw["from_version"])
        if raw.get("pruned"):
            record["pruned"] = True
            record["type"] = raw.get("type") or None
        return record

    def _current(self, name: str) -> int | None:
        raw = self.client.get(self._key(name, "current"))
        if raw is None:
            return None
        try:
            return int(raw)
        except ValueError:
            raise ServiceError(500, f"stored pointer {self._key(name, 'current')} is corrupt: {raw[:80]!r}",
                               {"name": name}) from None

    @_redis_errors
    def get(self, name: str, version: int | None = None) -> dict[str, Any] | None:
        """``{"name", "version", "scenario", "created_at", "action"}`` (plus ``from_version`` after a
        rollback) of ``version``, or of the current version when ``version`` is None; ``None``
        when there is no such version (or ``name`` is deleted and no version was asked for).
        A delete entry has ``scenario: None``."""
        validate_name(name)
        if version is None:
            version = self._current(name)
            if version is None:
                return None
            raw = self.client.hgetall(self.version_key(name, version))
            if not raw:
                raise ServiceError(500, f"stored pointer {self._key(name, 'current')} names version {version}, "
                                        "which does not exist", {"name": name})
        else:
            raw = self.client.hgetall(self.version_key(name, version))
            if not raw:
                return None
        return self._parse(name, version, raw)

    @_redis_errors
    def current_version(self, name: str) -> int | None:
        """The version in force for ``name``, or ``None`` if it does not exist (or is deleted)."""
        validate_name(name)
        return self._current(name)

    @_redis_errors
    def current_versions(self) -> dict[str, int | None]:
        """``{name: current version}`` for every live name in one round trip; ``None`` where the
        pointer is missing or not a number."""
        names = sorted(self.client.smembers(self.names_key))
        if not names:
            return {}
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            pipe.get(self._key(name, "current"))
        out: dict[str, int | None] = {}
        for name, raw in zip(names, pipe.execute()):
            try:
                out[name] = int(raw) if raw is not None else None
            except ValueError:
                out[name] = None
        return out

    @_redis_errors
    def names(self) -> list[str]:
        """The live names, sorted."""
        return sorted(self.client.smembers(self.names_key))

    @_redis_errors
    def is_empty(self) -> bool:
        """True when no scenario was ever stored under this prefix (deleted ones count as stored)."""
        return not self.client.exists(self.all_key)

    @_redis_errors
    def list(self) -> list[dict[str, Any]]:
        """``[{"name", "type", "version"}]`` for every live scenario, sorted by name."""
        current = self.current_versions()
        pipe = self.client.pipeline(transaction=False)
        for name, version in current.items():
            pipe.hget(self.version_key(name, version if version is not None else 0), "type")
        types = pipe.execute(raise_on_error=False) if current else []
        return [
            {"name": name, "type": kind if isinstance(kind, str) else None, "version": version}
            for (name, version), kind in zip(current.items(), types)
        ]

    @_redis_errors
    def versions(self, name: str) -> list[dict[str, Any]]:
        """The history of ``name``, oldest first: ``[{"version", "action", "created_at", "type"}]``
        (plus ``from_version`` for rollbacks), without the bodies. Empty if ``name`` never existed."""
        validate_name(name)
        numbers = self.client.lrange(self._key(name, "history"), 0, -1)
        if not numbers:
            return []
        pipe = self.client.pipeline(transaction=False)
        for n in numbers:
            pipe.hmget(self.version_key(name, int(n)), ["action", "created_at", "type", "from_version", "pruned"])
        out = []
        for n, fields in zip(numbers, pipe.execute(raise_on_error=False)):
            if isinstance(fields, Exception):
                fields = [None, None, None, None, None]
            action, created_at, kind, from_version, pruned = fields
            entry: dict[str, Any] = {"version": int(n), "action": action, "created_at": created_at,
                                     "type": kind or None}
            if from_version:
                entry["from_version"] = int(from_version)
            if pruned:
                entry["pruned"] = True
            out.append(entry)
        return out

    @_redis_errors
    def ping(self) -> bool:
        """True when Redis answers (raises ``ServiceError(503)`` when it does not)."""
        return bool(self.client.ping())
