"""The items of trees given inline, read for their first PATCH: :class:`InlineTreeBases`, part of the tree kind's
stored content on the config manager (:class:`processors.kinds.tree.store.content.TreeContent`).

A tree PUT inline (a ``prefix_dict``) is served from tables built from its tree; a PATCH works on items and their
catalog tables (``processors/kinds/tree/patch/items.py``). So that the first PATCH of such a tree is a delta too,
without parsing and loading the stored body again, its items are read from the served tables
(``processors/kinds/tree/tables/items.py:tree_items``, array passes), their catalog tables built and their canonical
bytes made (and the keys a PATCH looks items up by), on the compiler's threads. At 10^6 items that is about a
second of CPU: it starts only once no write has come for ``idle_s``, or at once when a PATCH asks for it
(:meth:`held`). A write that comes while a read started by the idle timer runs stops it (at its next stage or
checkpoint, its work dropped) and it starts again once the manager is idle: the next PUT never shares the CPU with
it. A read a PATCH waits for is never stopped.

The read also stages those bytes in the store (``stage``: ``ScenarioStore.stage_content``, uploaded with an expiry
and named by no version yet), so that the first PATCH stores only its delta of them, as every later PATCH does: the
write names the staged catalog and the delta together. A base replaced before any PATCH used it is unstaged.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from concurrent.futures import Executor, Future
from typing import Any, Callable, NamedTuple

__all__ = ["HeldBase", "InlineTreeBases"]

_log = logging.getLogger(__name__)


class HeldBase(NamedTuple):
    """The current version of a scenario as the compiler holds it for a PATCH: its number, its kind, the kind's own
    form of it (a tree's: ``(Catalog, catalog tables, SHA-256 of its staged bytes or None)``) and its item count."""

    version: int
    kind: str
    base: Any
    items: int


class _Entry:
    __slots__ = ("version", "args", "future", "stop", "wanted")

    def __init__(self, version: int, args: tuple):
        self.version = version
        self.args = args
        self.future: Future | None = None  # None: not started yet (or stopped by a write)
        self.stop = threading.Event()  # set: the running read unwinds at its next checkpoint
        self.wanted = False  # a PATCH waits for the read: it runs to its end


class InlineTreeBases:
    """Inline trees' fields by (name, tables version), and, once served, their items read for a first PATCH.

    Args:
        pool: the compiler's threads (lower priority).
        vocab_size: the served vocabulary (catalog tables are built for it).
        idle_s: seconds without a write before a read starts by itself.
        stage: ``(sha, bytes) -> bool``: stage a catalog's bytes in the store for the first PATCH (True: a delta of
            them may be written); None: the first PATCH stores the whole catalog.
        unstage: ``sha -> None``: staged bytes no PATCH will use (their base was replaced).
    """

    def __init__(self, pool: Executor, vocab_size: Callable[[], int], idle_s: float = 2.0,
                 stage: Callable[[str, bytes], bool] | None = None, unstage: Callable[[str], None] | None = None):
        self._pool = pool
        self._vocab_size = vocab_size
        self._stage = stage
        self._unstage = unstage
        self.idle_s = idle_s
        self._forms: dict[tuple[str, str], tuple[dict[str, Any], int]] = {}
        self._bases: dict[str, _Entry] = {}
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._writes = 0  # writes running now (no read starts by itself meanwhile)
        #: reads started by the idle timer, by a PATCH; idle reads stopped by a write
        self.stats = {"idle_reads": 0, "patch_reads": 0, "stopped": 0}

    def note_form(self, name: str, compiled, fields: dict[str, Any], start_token_id: Any) -> None:
        """A tree given inline was compiled (``fields``: its body's other fields)."""
        from processors.kinds.tree.catalog.catalog import _RESERVED

        tables: Any = getattr(compiled, "constraint", None)
        if start_token_id is None or not hasattr(tables, "offsets"):
            return
        self._forms.pop((name, tables.version), None)
        self._forms[(name, tables.version)] = ({k: v for k, v in fields.items() if k not in _RESERVED},
                                               int(start_token_id))
        while len(self._forms) > 8:
            self._forms.pop(next(iter(self._forms)))

    def note_installed(self, name: str, version: int, compiled) -> None:
        """``compiled`` (None: removed) is what ``name`` serves from ``version`` on: a tree given inline is read once
        the manager is idle (or at its first PATCH)."""
        tables = getattr(compiled, "constraint", None)
        form = self._forms.get((name, getattr(tables, "version", "")))
        with self._lock:
            replaced = [self._bases.pop(name, None)]
            if form is not None:
                self._bases[name] = _Entry(int(version), (tables, *form))
                while len(self._bases) > 2:
                    replaced.append(self._bases.pop(next(iter(self._bases))))
        for entry in replaced:
            self._unstage_of(entry)
        self.postpone()

    def _unstage_of(self, entry: _Entry | None) -> None:
        """The staged bytes of a replaced base, dropped on the pool once its read ended (nothing when a PATCH
        stored them: the store keeps what a write named)."""
        if entry is None or entry.future is None or self._unstage is None:
            return
        unstage = self._unstage

        def drop(future: Future) -> None:
            try:
                sha = future.result()[2]
                if sha is not None:
                    self._pool.submit(unstage, sha)
            except Exception:  # noqa: BLE001 - a read that failed or was stopped staged nothing to drop
                pass

        entry.future.add_done_callback(drop)

    def postpone(self) -> None:
        """A write came: the reads not started yet wait for ``idle_s`` more, and a running read no PATCH waits for
        stops (it starts again after ``idle_s`` without writes)."""
        with self._lock:
            self._stop_idle_reads()
            self._arm()

    def write_started(self) -> None:
        """A write runs: as :meth:`postpone`, and no read starts by itself until :meth:`write_ended`."""
        with self._lock:
            self._writes += 1
            self._stop_idle_reads()
            self._arm()  # (no timer while a write runs)

    def write_ended(self) -> None:
        with self._lock:
            self._writes = max(0, self._writes - 1)
            self._arm()

    def _stop_idle_reads(self) -> None:  # (under the lock)
        for entry in self._bases.values():
            if entry.future is not None and not entry.wanted and not entry.future.done():
                entry.stop.set()
                entry.future, entry.stop = None, threading.Event()
                self.stats["stopped"] += 1

    def _arm(self) -> None:  # (under the lock) the idle timer, unless a write runs or nothing waits for a read
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._writes and any(entry.future is None for entry in self._bases.values()):
            self._timer = threading.Timer(self.idle_s, self._start_idle)
            self._timer.daemon = True
            self._timer.start()

    def _start_idle(self) -> None:
        with self._lock:
            if threading.current_thread() is not self._timer or self._writes:
                return  # (a timer replaced meanwhile, or a write runs)
            self._timer = None
            for entry in self._bases.values():
                if entry.future is None:
                    self._start(entry)
                    self.stats["idle_reads"] += 1

    def _start(self, entry: _Entry) -> None:
        from config.cancel import run_stoppable

        entry.future = self._pool.submit(run_stoppable, entry.stop, self._read, *entry.args)

    def _read(self, tables, fields: dict[str, Any], start_token_id: int):
        from config.cancel import checkpoint

        from processors.kinds.tree.catalog.catalog import Catalog
        from processors.kinds.tree.patch.rows import catalog_row_keys, index_row_keys
        from processors.kinds.tree.tables.compile import catalog_tables
        from processors.kinds.tree.tables.items import tree_items

        flat, lengths = tree_items(tables)
        checkpoint()
        catalog = Catalog.from_flat(start_token_id, tables.end_token_id, flat, lengths, fields)
        checkpoint()
        built = catalog_tables(catalog, self._vocab_size())  # (its catalog tables, not the served ``tables``)
        checkpoint()
        # the keys a PATCH looks its items up by (and their index, for a large catalog): at 10^6 items 0.15 s of
        # the first PATCH otherwise
        catalog_row_keys(catalog)
        index_row_keys(catalog)
        checkpoint()
        # its canonical bytes too, staged in the store: the first PATCH then stores its delta of them (at 10^6
        # items, making, compressing and uploading them took about 0.6 s of that PATCH's 0.87 s)
        content = catalog.content()
        checkpoint()
        return catalog, built, self._staged(content)

    def _staged(self, content: bytes) -> str | None:
        """``content`` staged in the store (:class:`InlineTreeBases`'s ``stage``): its SHA-256, or None when it is
        not (no store, or it failed: the first PATCH then stores the whole catalog)."""
        if self._stage is None:
            return None
        sha = hashlib.sha256(content).hexdigest()
        try:
            return sha if self._stage(sha, content) else None
        except Exception:  # noqa: BLE001 - Redis away: the first PATCH stores the catalog whole, as it can
            _log.warning("staging catalog content %s for a first PATCH failed", sha[:12], exc_info=True)
            return None

    def held(self, name: str, current_version: int | None, log: Any) -> HeldBase | None:
        """The items of ``name``'s current version when it is a tree given inline (read now if the read has not
        started; waits for it); ``None`` otherwise, or when the read failed (the PATCH then reads the stored
        body)."""
        with self._lock:
            entry = self._bases.get(name)
            if entry is None or entry.version != current_version:
                return None
            entry.wanted = True  # (a write meanwhile does not stop it)
            if entry.future is None:
                self._start(entry)
                self.stats["patch_reads"] += 1
            future = entry.future
        assert future is not None
        try:
            catalog, tables, staged = future.result()
        except Exception:  # noqa: BLE001 - the PATCH then takes the stored body's way
            log.exception("scenario %r: reading the items of version %d failed", name, entry.version)
            return None
        return HeldBase(entry.version, "tree", (catalog, tables, staged), len(catalog))

    def close(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
