"""Folding a catalog's overlay version into plain tables in the background (:class:`BackgroundFolds`, part of the tree
kind's stored content on the config manager, :class:`processors.kinds.tree.store.content.TreeContent`).

Each PATCH of a catalog appends to its overlay version (``processors/kinds/tree/tables/overlay.py``); the PATCH that takes the
appended part past its hard limit (:func:`~processors.kinds.tree.tables.overlay.needs_fold`, a quarter of the base) folds it itself, which costs
what a PATCH cost before overlays (about a second at 10^7 items). So that no PATCH pays it, a version past half that
limit is folded on the compiler's threads once no write has come for ``idle_s``: :func:`~processors.kinds.tree.tables.overlay.fold` (the base
patched by the net delta, byte for byte a full compile). The result replaces the remembered tables of that catalog
(``TreeContent.remember_tables``) when they are still the ones folded, so the next PATCH starts an overlay on the
folded tables; the version served does not change (the same items, the same answers). A write that comes while a fold
runs stops it at its next checkpoint (its work dropped), and it is tried again once the manager is idle.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Executor
from typing import Any, Callable

from config.cancel import CompileStopped, run_stoppable

from processors.kinds.tree.tables.overlay import FOLD_SHARE, fold, needs_fold, overlay_base

logger = logging.getLogger(__name__)

__all__ = ["BackgroundFolds"]


class BackgroundFolds:
    """Overlay versions waiting to be folded while the manager is idle (see the module).

    Args:
        pool: the compiler's threads (lower priority).
        replace: ``replace(sha, overlay, folded)``: keep ``folded`` for catalog ``sha`` if ``overlay`` is still kept.
        idle_s: seconds without a write before a fold starts.
    """

    def __init__(self, pool: Executor, replace: Callable[[str, Any, Any], None], idle_s: float = 2.0):
        self._pool = pool
        self._replace = replace
        self.idle_s = idle_s
        self._lock = threading.Lock()
        self._waiting: dict[str, Any] = {}  # sha -> overlay tables to fold
        self._timer: threading.Timer | None = None
        self._running: threading.Event | None = None  # set: the running fold unwinds
        self._writes = 0
        self._closed = False
        self.stats = {"folded": 0, "stopped": 0}

    @staticmethod
    def wanted(tables: Any) -> bool:
        """Fold ``tables`` in the background: an overlay past half its hard limit."""
        return needs_fold(tables, share=FOLD_SHARE / 2)

    def schedule(self, sha: str, tables: Any) -> None:
        """Fold ``tables`` (catalog ``sha``'s) once the manager is idle."""
        with self._lock:
            self._keep(sha, tables)
            self._arm()

    def _keep(self, sha: str, tables: Any) -> None:  # (under the lock) the newest version of each chain only
        base = overlay_base(tables)
        for other, waiting in list(self._waiting.items()):
            if overlay_base(waiting) is base:
                if waiting is not tables and len(waiting.tokens) > len(tables.tokens):
                    return  # a later PATCH of the same chain waits already
                del self._waiting[other]
        self._waiting[sha] = tables

    def _arm(self) -> None:  # (under the lock)
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None
        if self._closed or not self._waiting or self._writes or self._running is not None:
            return
        self._timer = threading.Timer(self.idle_s, self._start)
        self._timer.daemon = True
        self._timer.start()

    def _start(self) -> None:
        with self._lock:
            self._timer = None
            if self._closed or self._writes or self._running is not None or not self._waiting:
                return
            sha = next(iter(self._waiting))
            tables = self._waiting.pop(sha)
            stop = self._running = threading.Event()
        self._pool.submit(self._run, sha, tables, stop)

    def _run(self, sha: str, tables: Any, stop: threading.Event) -> None:
        t0 = time.perf_counter()
        folded = None
        try:
            folded = run_stoppable(stop, fold, tables)
        except CompileStopped:
            self.stats["stopped"] += 1
        except Exception:  # noqa: BLE001 - a fold is an optimisation: the overlay keeps serving
            logger.warning("folding the overlay tables of catalog %s failed", sha[:12], exc_info=True)
        with self._lock:
            self._running = None
            if folded is None and stop.is_set() and not self._closed:
                self._keep(sha, tables)  # stopped by a write: again once idle (unless a later PATCH replaced it)
            self._arm()
        if folded is not None:
            self._replace(sha, tables, folded)
            self.stats["folded"] += 1
            logger.info("catalog %s: overlay tables folded in %.2f s (%d states)", sha[:12],
                        time.perf_counter() - t0, folded.n_states)

    def write_started(self) -> None:
        """A write runs: a running fold stops, none starts until it ended."""
        with self._lock:
            self._writes += 1
            if self._running is not None:
                self._running.set()
            self._arm()

    def write_ended(self) -> None:
        with self._lock:
            self._writes = max(self._writes - 1, 0)
            self._arm()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._running is not None:
                self._running.set()
            self._arm()
