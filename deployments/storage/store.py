"""Scenario storage in Redis: every version of every scenario, immutable, with its history.

Redis is the source of truth; the config manager compiles what is stored here. The keys are listed in
``deployments/storage/scripts.py`` (the scripts that write them) and docs/design.md section 4.1.

A tree scenario given as a ``path`` is stored with the content of the file: its body keeps ``path``
(where the content was read from, for display) and adds ``content_sha256``, the key of the bytes in
``P c:<sha256>``. A version therefore means the same tokens forever, whatever happens to the file.

Large values never block Redis for other clients: content is compressed and cut into chunks of at most 1 MiB,
written one SET each in a pipeline (no transaction) BEFORE the write script runs; the script then writes the
manifest ``P c:<sha>:m`` together with the version that refers to it. A reader finds the manifest only once every
chunk is there, so it never sees content half-written; chunks of a write that failed are overwritten by its retry
(their keys name the content's hash). A catalog PATCH's content is stored as a line delta of its base's (its
manifest names the base and the chain of bases below it; every version refers to the whole chain, so pruning keeps
a base while any version needs it), until the chain would pass ``delta_chain`` deltas: then the whole content is
stored (compacted). Reading such content rebuilds it from the chain and checks its hash. With ``compact_behind``
(the config manager's), content stored as a delta at that limit gets its whole bytes stored beside it, on a
thread after the write (``P c:<sha>:w<i>``, named by ``wsize`` / ``wchunks`` / ``wencoding`` in its manifest): reads
take them, and a chain ends at such a base, so no PATCH pays for a compaction (at 10^7 items one took 2.3 s of a
PATCH). A chain may then grow to twice the limit (at most 64) while the compaction runs; past it the write compacts
itself.

History is bounded: with ``history_bodies`` N > 0 the script drops, in the
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
different request is an :class:`InvalidRequest`. A write with ``expect_current`` (a PATCH) is applied only while
that version is current, else it raises :class:`BaseChanged` and writes nothing. Two concurrent writers therefore get distinct versions,
both land in the history, and ``current`` always names the newest write. Names are checked against
:data:`NAME_PATTERN` because they become parts of keys and URLs.

Failures are raised by kind (:mod:`deployments.storage.errors`: Redis unreachable is :class:`StoreUnavailable`; a
record that is not what this module writes, another tool's garbage, :class:`StoreCorrupt` naming the key); their
HTTP statuses are chosen in one place, ``deployments/scenario_errors.py:STORE_ERROR_STATUS``. The package's other parts:
``content.py`` (names, fingerprints, packing and chunks), ``chains.py`` (delta chains, content staged ahead of a write,
the compaction behind the writes: the store's ``chains``), ``scripts.py`` (the Lua scripts), ``records.py`` (stored
records read back), ``errors.py`` (the failure kinds).
"""

from __future__ import annotations

import hashlib
import json
import uuid
from datetime import datetime, timezone
from typing import Any

import redis

from deployments.storage.content import BODY_INLINE_BYTES, CHUNK_BYTES, IDEMPOTENCY_KEY_PATTERN, NAME_PATTERN
from deployments.storage.content import ContentDelta, PackedBody, _SHA256_RE, content_sha256, pack_body, read_content
from deployments.storage.content import request_fingerprint, validate_idempotency_key, validate_name
from deployments.storage.chains import STAGED_MARGIN_S, STAGED_TTL_S, WHOLE_CHUNK_TTL_S, DeltaChains
from deployments.storage.records import parse_idempotency_record, parse_version_record
from deployments.storage.errors import BaseChanged, Gone, InvalidRequest, NotFound, StoreCorrupt, StoreError
from deployments.storage.errors import StoreUnavailable, VersionConflict, key_reused, pruned_error, redis_errors
from deployments.storage.scripts import BASE_CHANGED, KEY_REUSED, NO_CONTENT, NOT_LIVE, REMEMBER_SCRIPT, REPLAYED
from deployments.storage.scripts import TOO_LATE, WRITE_SCRIPT, WRITTEN

__all__ = ["BODY_INLINE_BYTES", "BaseChanged", "CHUNK_BYTES", "ContentDelta", "DELTA_CHAIN", "Gone", "HISTORY_BODIES",
           "STAGED_MARGIN_S", "STAGED_TTL_S", "WHOLE_CHUNK_TTL_S",
           "IDEMPOTENCY_KEY_PATTERN", "IDEMPOTENCY_TTL_S", "InvalidRequest", "NAME_PATTERN", "NotFound", "PackedBody",
           "ScenarioStore",
           "StoreCorrupt", "StoreError", "StoreUnavailable", "VersionConflict", "WriteResult", "content_sha256",
           "pack_body", "pruned_error", "request_fingerprint", "validate_idempotency_key", "validate_name"]

# Seconds a write may wait on the server before it runs (plus the upload time of its body at
# UPLOAD_BYTES_PER_S); later, it is dropped. Below the client's socket timeout, so a write either runs
# while the client still waits for the answer or never.
WRITE_DEADLINE_S = 3.0
UPLOAD_BYTES_PER_S = 10e6

# Default number of newest bodies kept per scenario (older versions keep their metadata; 0 keeps all).
HISTORY_BODIES = 20

# Most deltas between stored content and whole content: a catalog PATCH is stored as the delta of its base until its
# chain would be longer, then as the whole catalog (a compaction); reading one rebuilds it from the chain.
DELTA_CHAIN = 8

# Seconds an idempotency key is remembered after the write it made.
IDEMPOTENCY_TTL_S = 24 * 3600


class WriteResult(int):
    """The version number a write made (an ``int``); ``replayed`` is True when the write was not applied
    because its idempotency key names an earlier write of the same request, whose version this is."""

    replayed: bool

    def __new__(cls, version: int, replayed: bool = False) -> "WriteResult":
        result = super().__new__(cls, version)
        result.replayed = bool(replayed)
        return result




def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class ScenarioStore:
    """Versioned scenario bodies in Redis (see the module docstring for the key layout).

    Args:
        redis_client: a ``redis.Redis`` with ``decode_responses=True``. The attribute ``client`` may
            be replaced later (e.g. after the embedded server was restarted).
        prefix: prefix of every key and of the change channel.
        delta_chain, compact_behind: how catalog content is stored as deltas (:class:`DeltaChains`, the store's
            ``chains``: its chunks, delta chains, staged content and compaction).

    Example::

        store = ScenarioStore(connect_redis(None, "./data"))
        v = store.put("sentiment", {"type": "labels", "labels": ["positive", "negative"]})
        store.get("sentiment")["version"] == v
    """

    def __init__(self, redis_client: redis.Redis, prefix: str = "cs:", *, idempotency_ttl_s: float = IDEMPOTENCY_TTL_S,
                 history_bodies: int | None = 0, delta_chain: int = DELTA_CHAIN, compact_behind: bool = False):
        self.client = redis_client
        self.prefix = prefix
        self.history_bodies = max(0, int(history_bodies or 0))
        self.chains = DeltaChains(lambda: self.client, self.content_key, delta_chain=delta_chain,
                                  compact_behind=compact_behind)
        self.idempotency_ttl_s = max(1.0, float(idempotency_ttl_s))
        self.channel = f"{prefix}changes"
        self._script = redis_client.register_script(WRITE_SCRIPT)
        self._remember_script = redis_client.register_script(REMEMBER_SCRIPT)

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

    def _write(self, name: str, action: str, body: dict | None = None, from_version: int | None = None, *,
               idempotency_key: str | None = None, fingerprint: str | None = None,
               content: bytes | None = None, expect_current: int | None = None,
               body_json: bytes | None = None, packed_body: PackedBody | None = None,
               answer: dict[str, Any] | None = None, content_delta: ContentDelta | None = None) -> WriteResult:
        validate_name(name)
        if body is not None:
            if not isinstance(body, dict):
                raise InvalidRequest(f"a scenario body must be a JSON object, got {type(body).__name__}")
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
        chains = self.chains
        for attempt in range(2):  # again, uploading, when the content was pruned between our check and the write
            refs: list[list[Any]] = []  # [sha, manifest or False]: content this version refers to
            uploaded = 0
            chained = 0  # the length of the delta chain this write stores (0: none)
            staged_ref: list[Any] | None = None  # the base staged ahead (stage_content), named by this write
            sha = content_sha256(body)
            if sha is not None:
                manifest: Any = False
                if content_delta is not None and content is None and (attempt or not chains.stored(sha)):
                    chain = None if attempt else chains.chain_of(content_delta.base)
                    staged = None if chain is not None or attempt else chains.staged_manifest(content_delta.base)
                    if staged is not None:  # its base was staged: stored whole by this write, named with the delta
                        chain, staged_ref = [], [content_delta.base, staged]
                        refs.append(staged_ref)
                    if chain is not None and len(chain) < chains.chain_limit():  # stored as the delta of its base
                        manifest = [*chains.put_chunks(sha, content_delta.data), content_delta.base,
                                    ",".join([content_delta.base, *chain])]
                        uploaded += len(content_delta.data)
                        chained = len(chain) + 1
                    else:  # the chain is at its limit (compacted: whole content), or its base is gone
                        content = content_delta.whole()
                        chains.compactions["in_write"] += chain is not None
                if content is not None:
                    if hashlib.sha256(content).hexdigest() != sha:
                        raise StoreCorrupt(f"tree content does not match its content_sha256 {sha}", {"name": name})
                    if attempt or not chains.stored(sha):  # stored once, not sent again
                        manifest = chains.put_chunks(sha, content)
                        uploaded += len(content)
                refs.append([sha, manifest])
            elif content is not None:
                raise StoreCorrupt("tree content given for a body without content_sha256", {"name": name})
            body_sha, text = "", ""
            if len(body_json) > BODY_INLINE_BYTES:  # a large body (an inline tree) goes to chunks like tree content
                body_sha = hashlib.sha256(body_json).hexdigest()  # packed_body is used only if it is of these bytes
                stored = not attempt and chains.stored(body_sha)
                refs.append([body_sha, False if stored else chains.put_chunks(body_sha, body_json, packed_body)])
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
            if status != WRITTEN:  # nothing names the chunks this call uploaded: they would stay in Redis for ever
                chains.drop_chunks([ref for ref in refs if ref is not staged_ref])
            chains.settle_staged(refs, staged_ref, status, None if content_delta is None else content_delta.base)
            if status != NO_CONTENT or (content is None and content_delta is None and not body_sha):
                break
        if status == WRITTEN and chained and chains.compact_behind and chained >= max(1, chains.delta_chain):
            assert content_delta is not None and sha is not None
            chains.compact_later(sha, content_delta.whole)
        if status == TOO_LATE:
            raise StoreUnavailable("scenario store unavailable: Redis did not run the write in time; "
                                   "it was not applied")
        if status == KEY_REUSED:
            raise key_reused(idempotency_key)
        if status == NO_CONTENT:
            raise InvalidRequest(f"content_sha256: no tree content {sha} is stored; leave content_sha256 out "
                                 "to store the file named by path", {"name": name, "field": "content_sha256"})
        if status == BASE_CHANGED:
            raise BaseChanged(name, expect_current, version or None)
        if status == NOT_LIVE:
            return WriteResult(-1)
        return WriteResult(version, replayed=status == REPLAYED)

    @redis_errors
    def put(self, name: str, body: dict, *, idempotency_key: str | None = None, fingerprint: str | None = None,
            content: bytes | None = None, expect_current: int | None = None, action: str = "put",
            body_json: bytes | None = None, packed_body: PackedBody | None = None,
            answer: dict[str, Any] | None = None, content_delta: ContentDelta | None = None) -> WriteResult:
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
        ``content_delta``: instead of ``content``, the body's content as a line delta of stored content (a catalog
        PATCH, :class:`~deployments.storage.content.ContentDelta`): stored as that delta while its base's chain is
        shorter than ``chains.delta_chain``, else (and when the base is gone) as the whole content it makes.
        """
        if action not in ("put", "patch"):
            raise ValueError(f"action {action!r}")
        return self._write(name, action, body, idempotency_key=idempotency_key, fingerprint=fingerprint,
                           content=content, expect_current=expect_current, body_json=body_json,
                           packed_body=packed_body, answer=answer, content_delta=content_delta)

    @redis_errors
    def delete(self, name: str, *, idempotency_key: str | None = None) -> WriteResult:
        """Record a delete entry and drop ``name`` from the live names; return the entry's version.

        The history stays; a later :meth:`put` continues the numbering. Raises :class:`NotFound`
        when ``name`` is not live (unless ``idempotency_key`` names this delete, already made).
        """
        version = self._write(name, "delete", idempotency_key=idempotency_key)
        if version < 0:
            raise NotFound(f"scenario {name!r} does not exist", {"known": self.names()})
        return version

    @redis_errors
    def rollback(self, name: str, version: int, *, idempotency_key: str | None = None) -> WriteResult:
        """Store a NEW version of ``name`` whose body is that of ``version``; return its number.

        Raises :class:`NotFound` when ``version`` does not exist and :class:`VersionConflict` when
        it is a delete entry (it has no body to restore). ``idempotency_key`` as for :meth:`put`.
        """
        record = self.get(name, version)
        if record is None:
            raise NotFound(f"scenario {name!r} has no version {version}",
                           {"versions": [v["version"] for v in self.versions(name)]})
        if record.get("pruned"):
            raise pruned_error(name, int(version))
        if record["scenario"] is None:
            raise VersionConflict(f"version {version} of scenario {name!r} is a delete entry; "
                                  "there is no body to roll back to")
        return self._write(name, "rollback", record["scenario"], from_version=int(version),
                           idempotency_key=idempotency_key,
                           fingerprint=request_fingerprint("rollback", name, None, int(version)))

    @redis_errors
    def idempotent_result(self, key: str, fingerprint: str) -> dict[str, Any] | None:
        """The write made earlier with idempotency key ``key``: ``{"action", "name", "version"}`` (plus
        ``from_version`` for a rollback, ``answer`` where the write kept one: see :meth:`put` and
        :meth:`remember_result`), or None when the key is unknown (or expired). Raises
        :class:`InvalidRequest` when the key was used for a request with another ``fingerprint``."""
        validate_idempotency_key(key)
        raw = self.client.hgetall(self.idempotency_key(key))
        if not raw:
            return None
        if raw.get("fingerprint") != fingerprint:
            raise key_reused(key)
        return parse_idempotency_record(raw, self.idempotency_key(key))

    @redis_errors
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
            raise key_reused(key)
        return None if status == WRITTEN else self.idempotent_result(key, fingerprint)

    def stage_content(self, sha: str, data: bytes) -> bool:
        """Upload content ``sha`` ahead of the write that will name it (:meth:`DeltaChains.stage_content`)."""
        return self.chains.stage_content(sha, data)

    def unstage_content(self, sha: str) -> None:
        """Remove content staged for a write that will not come (:meth:`DeltaChains.unstage_content`)."""
        self.chains.unstage_content(sha)

    @redis_errors
    def content(self, sha256: str) -> bytes | None:
        """The tree-file bytes stored under ``sha256`` (hex), or None when nothing is."""
        if not isinstance(sha256, str) or not _SHA256_RE.fullmatch(sha256):
            return None
        return read_content(self.client, self.content_key(sha256))

    # ------------------------------------------------------------------ reads

    def _parse(self, name: str, version: int, raw: dict[str, str]) -> dict[str, Any]:
        return parse_version_record(raw, name, version, self.version_key(name, version),
                                    lambda sha: read_content(self.client, self.content_key(sha)))

    def _current(self, name: str) -> int | None:
        raw = self.client.get(self._key(name, "current"))
        if raw is None:
            return None
        try:
            return int(raw)
        except ValueError:
            raise StoreCorrupt(f"stored pointer {self._key(name, 'current')} is corrupt: {raw[:80]!r}",
                               {"name": name}) from None

    @redis_errors
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
                raise StoreCorrupt(f"stored pointer {self._key(name, 'current')} names version {version}, "
                                   "which does not exist", {"name": name})
        else:
            raw = self.client.hgetall(self.version_key(name, version))
            if not raw:
                return None
        return self._parse(name, version, raw)

    @redis_errors
    def current_version(self, name: str) -> int | None:
        """The version in force for ``name``, or ``None`` if it does not exist (or is deleted)."""
        validate_name(name)
        return self._current(name)

    @redis_errors
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

    @redis_errors
    def names(self) -> list[str]:
        """The live names, sorted."""
        return sorted(self.client.smembers(self.names_key))

    @redis_errors
    def is_empty(self) -> bool:
        """True when no scenario was ever stored under this prefix (deleted ones count as stored)."""
        return not self.client.exists(self.all_key)

    @redis_errors
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

    @redis_errors
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

    @redis_errors
    def ping(self) -> bool:
        """True when Redis answers (raises :class:`StoreUnavailable` when it does not)."""
        return bool(self.client.ping())
