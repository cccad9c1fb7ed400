"""The content side of :class:`~deployments.storage.store.ScenarioStore` that works around its writes: chunks uploaded
before a write names them, catalog content stored as delta chains, content staged ahead of the write that names it
(:meth:`DeltaChains.stage_content`: an inline tree's catalog, the base of its first PATCH) and the compaction behind
the writes (:meth:`DeltaChains.compact_content`). The store holds one (``store.chains``) and its write asks it
what to upload and how (:meth:`DeltaChains.put_chunks`, :meth:`DeltaChains.chain_of`, ...). The store's module
docstring describes the keys and the chains; the scripts are ``deployments/storage/scripts.py``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from typing import Any, Callable

from deployments.storage.content import PackedBody, STAGED_PART, WHOLE_PART, put_chunks
from deployments.storage.errors import StoreCorrupt, redis_errors
from deployments.storage.scripts import DROP_CHUNKS_SCRIPT, NO_CONTENT, REPLAYED, WHOLE_SCRIPT, WRITTEN

__all__ = ["DeltaChains", "STAGED_MARGIN_S", "STAGED_TTL_S", "WHOLE_CHUNK_TTL_S"]

_log = logging.getLogger(__name__)

#: seconds the chunks of a compaction behind the writes live until its script names them (and lifts the expiry)
WHOLE_CHUNK_TTL_S = 3600

#: seconds staged content (:meth:`DeltaChains.stage_content`) stays in Redis unless a write names it; the store
#: offers it as a delta's base for this long less :data:`STAGED_MARGIN_S` (a write then finds every chunk there)
STAGED_TTL_S = 3600
STAGED_MARGIN_S = 300


class DeltaChains:
    """Chunks, delta chains, staged content and compaction of the content of a
    :class:`~deployments.storage.store.ScenarioStore` (held by it as ``store.chains``).

    Args:
        client: the store's Redis client now (the store's ``client`` may be replaced, e.g. after the embedded server
            was restarted: every call reads it again).
        content_key: the key of stored content by its sha256 (``ScenarioStore.content_key``).
        delta_chain: most deltas between stored content and whole content.
        compact_behind: content stored as a delta at that limit gets its whole bytes stored beside it on a thread
            of its own (:meth:`compact_content`), so the write past it is a delta too.
    """

    def __init__(self, client: Callable[[], Any], content_key: Callable[[str], str], *, delta_chain: int,
                 compact_behind: bool):
        self._client = client
        self.content_key = content_key
        self._drop_chunks_script = client().register_script(DROP_CHUNKS_SCRIPT)
        self._whole_script = client().register_script(WHOLE_SCRIPT)
        self.delta_chain = max(0, int(delta_chain))
        self.compact_behind = bool(compact_behind)
        self._compacting: threading.Thread | None = None
        self._compact_lock = threading.Lock()
        self.compactions = {"behind": 0, "in_write": 0, "failed": 0}
        # content uploaded ahead of the write that names it (stage_content): sha -> (manifest, offered until)
        self._staged: dict[str, tuple[list[Any], float]] = {}
        self._staged_lock = threading.Lock()

    @property
    def client(self) -> Any:
        """The store's Redis client now."""
        return self._client()

    def drop_chunks(self, refs: list[list[Any]]) -> None:
        """Remove the chunks a refused write uploaded (``refs`` entries with a manifest), each set only while no
        manifest names it (``DROP_CHUNKS_SCRIPT``, atomic on the server)."""
        for sha, manifest in refs:
            if manifest:
                self._drop_chunks_script(keys=[self.content_key(sha)], args=[manifest[1]], client=self.client)

    def put_chunks(self, sha: str, data: bytes, packed: PackedBody | None = None) -> list[str]:
        """:func:`~deployments.storage.content.put_chunks` of content ``sha``: the chunks, not yet its manifest."""
        return put_chunks(self.client, self.content_key(sha), data, packed)

    @redis_errors
    def stage_content(self, sha: str, data: bytes) -> bool:
        """Upload ``data``, content ``sha``, ahead of the write that will name it: a catalog PATCH's delta of it
        (a tree given inline is not stored as a catalog; its first PATCH would store the whole catalog, about 0.2 s
        of it at 10^6 items: compressing and uploading, now done while the manager is idle). Its chunks carry an
        expiry (:data:`STAGED_TTL_S`) that the write script lifts as it writes their manifest; until then no
        version refers to them and readers do not see them. True when ``sha`` is stored or staged now (a delta
        of it may be written); compressed on the calling thread, at its priority."""
        if hashlib.sha256(data).hexdigest() != sha:
            raise StoreCorrupt(f"staged content does not match its content_sha256 {sha}")
        if self.stored(sha):
            return True
        manifest = [*put_chunks(self.client, self.content_key(sha), data, part=STAGED_PART, expire_s=STAGED_TTL_S,
                                parallel=False), False, False, STAGED_PART]  # (no base, no chain; its chunks' infix)
        with self._staged_lock:
            now = time.monotonic()
            self._staged = {k: v for k, v in self._staged.items() if v[1] > now}  # (drop the ones past their time)
            self._staged[sha] = (manifest, now + STAGED_TTL_S - STAGED_MARGIN_S)
        return True

    @redis_errors
    def unstage_content(self, sha: str) -> None:
        """Content staged for a write that will not come (the scenario changed otherwise): its staged chunks are
        removed now (a write that named them renamed them already)."""
        with self._staged_lock:
            entry = self._staged.pop(sha, None)
        if entry is not None:
            key = self.content_key(sha)
            self.client.delete(*(f"{key}:{STAGED_PART}{i}" for i in range(int(entry[0][1]))))

    def staged_manifest(self, sha: str) -> list[Any] | None:
        """The manifest (for the write script) of content ``sha`` staged and still offered, else None."""
        if self.chain_limit() < 1:  # (every catalog stored whole: no delta will name it)
            return None
        with self._staged_lock:
            entry = self._staged.get(sha)
        return entry[0] if entry is not None and entry[1] > time.monotonic() else None

    def settle_staged(self, refs: list[list[Any]], staged_ref: list[Any] | None, status: int,
                       base: str | None) -> None:
        """After a write with ``refs`` (``staged_ref`` among them: the staged content it named; ``base``: the base of
        the delta it stored, if any): content it stored is not offered staged any more; the staged chunks it renamed
        are gone already; any other staged copy of content it stored or found stored (a delta's base that another
        write stored meanwhile), or of the staged content when a staged chunk was found gone, is removed."""
        if status not in (WRITTEN, REPLAYED, NO_CONTENT):
            return
        for ref in refs:
            if ref is staged_ref and status != NO_CONTENT:
                with self._staged_lock:
                    self._staged.pop(ref[0], None)
            else:
                self.unstage_content(ref[0])
        if base is not None and staged_ref is None:
            self.unstage_content(base)

    def chain_limit(self) -> int:
        """The deltas a chain may hold: ``delta_chain``; with ``compact_behind``, twice that (at most 64): the
        compaction behind the writes starts at ``delta_chain`` and the chain is cut at the compacted base once it
        ends, so only writes that outrun it (as many deltas again meanwhile) compact in the write."""
        if self.compact_behind:
            return max(self.delta_chain, min(2 * self.delta_chain, 64))
        return self.delta_chain

    def compact_content(self, sha: str, data: bytes) -> bool:
        """Store ``data``, the whole bytes of content ``sha`` stored as a delta, beside it (``WHOLE_SCRIPT``): reads
        and the next delta of it then start from them, not from its chain. False when the content is gone. The
        chunks are written with an expiry (:data:`WHOLE_CHUNK_TTL_S`) the script lifts as it names them: a manager
        that dies in between leaves nothing in Redis for long. Content whose whole bytes are named already: True."""
        if hashlib.sha256(data).hexdigest() != sha:
            raise StoreCorrupt(f"tree content does not match its content_sha256 {sha}")
        key = self.content_key(sha)
        if self.client.hget(key + ":m", "wchunks"):  # (its chunks are not written again: they hold no expiry now)
            return True
        size, chunks, encoding = put_chunks(self.client, key, data, part=WHOLE_PART, expire_s=WHOLE_CHUNK_TTL_S,
                                            parallel=False)  # (on this thread, at its priority)
        return bool(self._whole_script(keys=[key + ":m"], args=[size, chunks, encoding, f"{key}:{WHOLE_PART}"],
                                       client=self.client))

    def compact_later(self, sha: str, whole: Any) -> None:
        """:meth:`compact_content` of ``sha`` (``whole()`` its bytes) on a thread, unless one runs already."""
        with self._compact_lock:
            if self._compacting is not None and self._compacting.is_alive():
                return
            self._compacting = threading.Thread(target=self._compact, args=(sha, whole), name="content-compaction",
                                                daemon=True)
            self._compacting.start()

    def _compact(self, sha: str, whole: Any) -> None:
        try:  # (the lowest priority: the writes and their PATCHes take the CPU first)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
        try:
            if self.compact_content(sha, whole()):
                self.compactions["behind"] += 1
        except Exception:  # noqa: BLE001 - the write at the chain's limit compacts then
            self.compactions["failed"] += 1
            _log.warning("compaction of stored content %s failed; the next write at the chain limit stores it whole",
                         sha[:12], exc_info=True)

    def wait_compacted(self, timeout: float | None = None) -> bool:
        """Wait for a compaction behind the writes to end; whether none runs now."""
        thread = self._compacting
        if thread is not None:
            thread.join(timeout)
        return thread is None or not thread.is_alive()

    def stored(self, sha: str) -> bool:
        """Whether content ``sha`` is stored (its manifest, or content stored whole under its key)."""
        return bool(self.client.exists(self.content_key(sha) + ":m", self.content_key(sha)))

    def chain_of(self, sha: str) -> list[str] | None:
        """The bases under stored content ``sha`` (nearest first; empty for whole content), down to the first whose
        whole bytes are stored beside its delta (:meth:`compact_content`); None when not stored."""
        chain, manifest, whole = self.client.hmget(self.content_key(sha) + ":m", "chain", "size", "wchunks")
        if manifest is None:
            return [] if self.client.exists(self.content_key(sha)) else None
        if not chain or whole:  # (its whole bytes stored beside it: a chain of none)
            return []
        bases = chain.split(",")
        # the chain ends at the first base whose whole bytes a compaction behind the writes stored meanwhile
        pipe = self.client.pipeline(transaction=False)
        for one in bases:
            pipe.hget(self.content_key(one) + ":m", "wchunks")
        for i, whole in enumerate(pipe.execute()):
            if whole:
                return bases[:i + 1]
        return bases
