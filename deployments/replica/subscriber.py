"""The replica's scenario subscription: the compiled scenarios it serves, kept current from the config manager.

:class:`ScenarioSubscriber` registers with the manager and installs the current snapshot (so a replica started after
a PUT serves the current versions at once), then a background thread long-polls the manager for changes, installs
them (fetching only changed versions' tables, or applying a catalog PATCH's delta to the served tables,
``table_delta.py``) and acknowledges. It is the one owner of the served scenarios: the request handler
(``requests.py``) reads them through :meth:`ScenarioSubscriber.scenario` and :meth:`ScenarioSubscriber.served` (its
:class:`~deployments.replica.requests.ScenarioSource`).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from typing import Any

from processors import CompiledScenario
from processors.kinds.tree.tables.overlay import missing_base, resolve

from .table_delta import apply_table_delta, delta_wanted

logger = logging.getLogger(__name__)

__all__ = ["ScenarioSubscriber"]


async def _fetch(ref) -> Any:
    """What a snapshot entry or the manager hands over: an ObjectRef (awaited: ``ray.get`` without blocking the event
    loop), or the object itself (a manager run without Ray)."""
    return await ref if inspect.isawaitable(ref) else ref


async def _ask(manager_method, *args):
    """Call a manager method and await its answer: through a Serve handle (``.remote()``) or directly."""
    remote = getattr(manager_method, "remote", None)
    result = remote(*args) if remote is not None else manager_method(*args)
    return await result if inspect.isawaitable(result) else result


class ScenarioSubscriber:
    """The scenarios a replica serves, by name: ``(version, compiled)``; registration, the long poll and acks (held by
    :class:`~deployments.replica.model_replica.ModelReplica` as ``replica.subscriber``).

    Args:
        manager: a handle to the config manager (or the manager itself), or None: no stored scenarios.
        replica_id: the replica's id, as it registers and acknowledges.
        table_delta: the ``replica_table_delta`` setting (whether a catalog PATCH's delta is applied here).
        metrics: the replica's :class:`~deployments.metrics.ReplicaMetrics` (the served versions).
    """

    def __init__(self, manager=None, *, replica_id: str, table_delta: str, metrics: Any) -> None:
        self.replica_id = replica_id
        self.table_delta = table_delta
        self.metrics = metrics
        self._scenarios: dict[str, tuple[int, CompiledScenario]] = {}
        self._lock = threading.Lock()
        self._epoch = -1
        self.table_deltas = 0  # catalog PATCHes applied to the served tables here (table_delta.py), not fetched
        self._manager = manager
        self._stop = threading.Event()

    def scenario(self, name: str) -> tuple[int, CompiledScenario] | None:
        """The served ``(version, compiled)`` of ``name``, or None."""
        with self._lock:
            return self._scenarios.get(name)

    def served(self) -> dict[str, tuple[int, CompiledScenario]]:
        """Every served scenario (the mapping in place now; a new snapshot replaces it whole)."""
        return self._scenarios

    @property
    def epoch(self) -> int:
        """The manager's epoch this replica acknowledged last (-1 before its registration)."""
        return self._epoch

    async def register(self) -> None:
        """The one registration path (ModelReplica's constructor runs it with ``asyncio.run``, ServeModelReplica's
        async constructor awaits it): register with the manager, install and acknowledge the current snapshot (so a
        replica started after a PUT serves the current versions at once), then start the poll thread."""
        await self._apply(await _ask(self._manager.register, self.replica_id))
        self._poller = threading.Thread(target=self._poll_loop, name="scenario-poll", daemon=True)
        self._poller.start()
        logger.info("%s ready (%d scenarios)", self.replica_id, len(self._scenarios))

    async def _apply(self, snapshot: dict | None) -> None:
        """Serve a snapshot from the manager (fetching only the tables of changed versions) and acknowledge it."""
        if not snapshot:
            return
        new: dict[str, tuple[int, CompiledScenario]] = {}
        for name, entry in snapshot.get("scenarios", {}).items():
            version = int(entry["version"])
            current = self._scenarios.get(name)
            if current is not None and current[0] == version:
                new[name] = current  # unchanged: keep the object, no fetch
                continue
            compiled = None
            delta = entry.get("delta")
            if (delta is not None and current is not None and current[0] == delta.get("base")
                    and await asyncio.to_thread(delta_wanted, self.table_delta, entry["ref"], delta)):
                compiled = await asyncio.to_thread(apply_table_delta, current[1], delta)
                self.table_deltas += compiled is not None
            if compiled is None:
                compiled = await _fetch(entry["ref"])
                await self._complete(compiled)
            new[name] = (version, compiled)
        with self._lock:
            self._scenarios = new
            self._epoch = int(snapshot.get("epoch", self._epoch))
        self.metrics.set_versions({name: v for name, (v, _) in new.items()})
        await _ask(self._manager.ack, self.replica_id, self._epoch, self.versions(), self.table_deltas)

    async def _complete(self, compiled: CompiledScenario) -> None:
        """An overlay version of a catalog's tables travels without its base's arrays (``processors/kinds/tree/
        overlay.py``): a replica holds them when it served the base; otherwise it asks the manager for them."""
        version = missing_base(compiled.constraint)
        if version is None:
            return
        ref = await _ask(self._manager.base_tables, version)
        if ref is None:
            raise RuntimeError(f"the manager no longer serves the base tables {version} of an overlay version")
        resolve(compiled.constraint, await _fetch(ref))

    def _poll_loop(self) -> None:
        """Thread: the long poll, on an event loop of its own (the replica's loop serves requests)."""
        asyncio.run(self._poll())

    async def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                snapshot = await _ask(self._manager.wait_for_update, self.replica_id, self._epoch)
                if snapshot:
                    await self._apply(snapshot)
            except Exception:
                logger.warning("%s: scenario poll failed; retrying", self.replica_id, exc_info=True)
                await asyncio.to_thread(self._stop.wait, 1.0)

    def versions(self) -> dict[str, int]:
        """The scenario versions this replica serves now."""
        with self._lock:
            return {name: v for name, (v, _) in self._scenarios.items()}

    def stop_polling(self) -> None:
        self._stop.set()
