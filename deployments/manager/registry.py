"""The model replicas the config manager broadcasts to, and the long-poll protocol they speak.

Replica protocol (a long poll: a Serve handle routes a call to one replica, so the manager cannot
push to all of them; each replica pulls instead; see ``deployments/replica/subscriber.py:ScenarioSubscriber.register``)::

    snap = await manager.register.remote(rid)         # {"epoch", "scenarios": {name: {"version", "ref"}}}
    # load every ref (ray.get), serve those tables, then
    await manager.ack.remote(rid, snap["epoch"], {name: s["version"] for name, s in snap["scenarios"].items()})
    while True:
        new = await manager.wait_for_update.remote(rid, snap["epoch"], 10.0)
        if new is not None:
            snap = new; load and serve it; ack as above

A snapshot is the whole state (every served scenario), so a replica that missed updates catches
up in one step. The epoch starts at the manager's start time in milliseconds and grows by one per
change, so it keeps growing across manager restarts; ``wait_for_update`` also answers at once
when the replica's epoch is not the manager's (e.g. newer, from before a restart).

A replica is live while it calls in: one not heard from for ``replica_timeout_s`` is dropped and
no longer waited for (a poll is cut to half that timeout so a live replica always calls again in
time). A write waits (:meth:`ReplicaRegistry.wait_for_acks`) until every live replica acknowledged an
epoch that includes the change, or raises 504 after ``broadcast_timeout_s`` naming the replicas that did
not (the version stays stored and they get it when they catch up).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from deployments.protocol import ServiceError

logger = logging.getLogger(__name__)

__all__ = ["ReplicaRegistry"]


@dataclass
class _Replica:
    epoch: int = -1  # last acknowledged epoch
    versions: dict[str, int] = field(default_factory=dict)
    last_seen: float = 0.0  # time.time() of the last call, for display
    seen_mono: float = 0.0  # time.monotonic() of the last call, for liveness
    table_deltas: int = 0  # catalog PATCHes it applied to its own tables instead of fetching them (as it reported)


class ReplicaRegistry:
    """The live replicas and the epoch of the served state: register, long poll, ack, liveness (touch, prune), and
    waiting until every live replica acknowledged an epoch. Plain asyncio; nothing of Redis or compiling.

    Args:
        tables: returns the scenarios part of a snapshot, ``{name: {"version", "ref"}}``, as served now.
        replica_timeout_s: a replica not heard from for this long is dropped.
        broadcast_timeout_s: how long :meth:`wait_for_acks` waits (then 504).
    """

    def __init__(self, tables: Callable[[], dict[str, dict[str, Any]]], *, replica_timeout_s: float,
                 broadcast_timeout_s: float):
        self.tables = tables
        self.replica_timeout_s = float(replica_timeout_s)
        self.broadcast_timeout_s = float(broadcast_timeout_s)
        self.epoch = int(time.time() * 1000)
        self._replicas: dict[str, _Replica] = {}
        self.new_loop()

    def new_loop(self) -> None:
        """A new event loop (tests): asyncio primitives are tied to one."""
        self._epoch_event = asyncio.Event()
        self._ack_event = asyncio.Event()

    # ------------------------------------------------------------------ the served state changed

    def bump(self) -> int:
        """The served state changed: a new epoch, and every long poll wakes with the new snapshot."""
        self.epoch += 1
        event, self._epoch_event = self._epoch_event, asyncio.Event()
        event.set()
        return self.epoch

    def snapshot(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "scenarios": self.tables()}

    # ------------------------------------------------------------------ the protocol

    async def register(self, replica_id: str) -> dict[str, Any]:
        """A replica (re)starts: returns the current snapshot; the replica acks once it serves it."""
        replica = self._touch(str(replica_id))
        replica.epoch, replica.versions = -1, {}  # a restarted replica has no tables yet
        return self.snapshot()

    async def wait_for_update(self, replica_id: str, epoch: int, timeout_s: float = 10.0) -> dict[str, Any] | None:
        """Long poll: the snapshot as soon as the epoch differs from ``epoch`` (normally: is greater), or
        ``None`` after ``timeout_s`` (cut to half of ``replica_timeout_s``)."""
        self._touch(str(replica_id))
        deadline = time.monotonic() + max(0.0, min(float(timeout_s), self.replica_timeout_s / 2))
        while self.epoch == epoch:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            try:
                async with asyncio.timeout(remaining):
                    await self._epoch_event.wait()
            except TimeoutError:
                return None
        return self.snapshot()

    async def ack(self, replica_id: str, epoch: int, versions: dict[str, int], table_deltas: int = 0) -> None:
        """A replica serves the snapshot of ``epoch`` (``versions``: what it now serves; ``table_deltas``: how many
        catalog PATCHes it has applied to its own tables since it started)."""
        replica = self._touch(str(replica_id))
        if int(epoch) >= replica.epoch:
            replica.epoch = int(epoch)
            replica.versions = {str(k): int(v) for k, v in dict(versions).items()}
            replica.table_deltas = int(table_deltas)
        self._notify_acks()

    def view(self) -> dict[str, dict[str, Any]]:
        """``{replica_id: {"epoch", "versions", "last_seen", "table_deltas"}}`` for the live replicas."""
        self._prune()
        return {
            rid: {"epoch": r.epoch, "versions": dict(r.versions), "last_seen": r.last_seen,
                  "table_deltas": r.table_deltas}
            for rid, r in sorted(self._replicas.items())
        }

    async def wait_for_acks(self, epoch: int, name: str, version: int) -> None:
        """Return once every live replica acknowledged ``epoch`` or later; 504 after ``broadcast_timeout_s``
        (``name`` and ``version``, the write being waited for, only name it in the error)."""
        deadline = time.monotonic() + self.broadcast_timeout_s
        while True:
            self._prune()
            pending = sorted(rid for rid, r in self._replicas.items() if r.epoch < epoch)
            if not pending:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ServiceError(
                    504,
                    f"scenario {name!r} version {version} is stored, but replica(s) {', '.join(pending)} did not "
                    f"acknowledge it within {self.broadcast_timeout_s:g} s; they pick it up when they catch up",
                    {"name": name, "version": version, "pending_replicas": pending},
                )
            try:  # wake on every ack, and at least every 0.25 s to drop silent replicas
                async with asyncio.timeout(min(remaining, 0.25)):
                    await self._ack_event.wait()
            except TimeoutError:
                pass

    # ------------------------------------------------------------------ liveness

    def _touch(self, replica_id: str) -> _Replica:
        replica = self._replicas.get(replica_id)
        if replica is None:
            replica = self._replicas[replica_id] = _Replica()
            logger.info("replica %s joined", replica_id)
        replica.last_seen, replica.seen_mono = time.time(), time.monotonic()
        return replica

    def _prune(self) -> None:
        now = time.monotonic()
        dropped = False
        for rid, replica in list(self._replicas.items()):
            if now - replica.seen_mono > self.replica_timeout_s:
                del self._replicas[rid]
                dropped = True
                logger.warning("replica %s not heard from for %.1f s; dropped (no longer waited for)",
                               rid, now - replica.seen_mono)
        if dropped:
            self._notify_acks()

    def _notify_acks(self) -> None:
        event, self._ack_event = self._ack_event, asyncio.Event()
        event.set()
