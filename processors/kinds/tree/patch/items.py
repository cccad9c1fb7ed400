"""A PATCH of a tree's items: a catalog (:class:`~processors.kinds.tree.catalog.catalog.Catalog`) with items added and
removed, order kept, its canonical bytes spliced from the base's (:func:`apply_tree_delta`); and the tree kind's
PATCH of a stored body of any tree form (:func:`patch_stored_tree`: the result stored as a catalog, its tables
updated from the base's along the changed paths when the delta is small for the catalog)."""

from __future__ import annotations

import json
import threading
import time
from typing import Any, Sequence

import numpy as np

from config import ConstraintError

from processors.kinds.patch import DeltaReport, PatchResult, check_disjoint, check_unique, refused
from processors.kinds.tree.catalog.catalog import (
    _RESERVED, Catalog, _cut_rows, _line, _stored, catalog_body, items_from_tree, whole_content,
)
from processors.kinds.tree.catalog.columns import MetaRows
from processors.kinds.tree.catalog.parse import canonical_meta, check_items, split_item
from processors.kinds.tree.filters.metadata import ItemMetadata
from processors.kinds.tree.patch.rows import rows_of

__all__ = ["apply_tree_delta", "patch_stored_tree", "patched_tables", "pending_need"]


def _too_many_after_patch(count: int, limit: int) -> ConstraintError:
    return ConstraintError(422, f"add: the PATCH would give {count} items, over the limit max_tree_keys={limit} "
                             "(the limit of a catalog PUT)",
                        {"field": "add", "limit_name": "max_tree_keys", "limit": limit})


def apply_tree_delta(catalog: Catalog, add: list[Any], remove: list[Any], *, vocab_size: int,
                     max_items: int | None = None, max_item_tokens: int | None = None,
                     update: list[Any] | None = None) -> tuple[Catalog, DeltaReport]:
    """``catalog`` with the items ``add`` appended and ``remove`` taken out (order kept). A result of more than
    ``max_items`` items is a 422 naming ``max_tree_keys``, as a PUT of that catalog is; when the sizes alone show it
    (the result has at least ``len(add) - len(remove)`` items), before the items are checked. An added item longer
    than ``max_item_tokens`` is a 422 naming ``add[i]`` and ``max_item_tokens`` (removes are not bounded)."""
    if max_items is not None and len(add) - len(remove) > max_items:
        raise _too_many_after_patch(len(add) - len(remove), max_items)
    split = [split_item(value, f"add[{i}]", "add") for i, value in enumerate(add)]
    add = [ids for ids, _ in split]
    add_meta = {i: meta for i, (_, meta) in enumerate(split) if meta is not None}
    adds = check_items(add, end_token_id=catalog.end_token_id, vocab_size=vocab_size, where="add",
                       max_item_tokens=max_item_tokens)
    removes = check_items(remove, end_token_id=catalog.end_token_id, vocab_size=vocab_size, where="remove")
    check_unique(adds, "add")
    check_unique(removes, "remove")
    check_disjoint(adds, removes)
    updates = _updates(update or [], catalog, vocab_size, set(adds) | set(removes))
    return _pending_delta(catalog, adds, removes, max_items, add_meta, updates)


#: a pending PATCH result (``Catalog.pending``) is written out once it cuts this many of its base's rows (each a
#: piece its SHA-256 reads, and a slice when it is written out) or its delta passes 1/FOLD_SHARE of its base's items:
#: the next PATCH then starts from a new base. At 10^7 items and 1,000 removes a PATCH, one PATCH in about 65.
FOLD_ROWS = 1 << 16
FOLD_SHARE = 8


def _writes_out(base: Catalog, cut: int, appended: int) -> bool:
    """Whether a PATCH result pending on ``base`` with ``cut`` rows cut and ``appended`` items appended is written out
    (a new base) instead: past :data:`FOLD_ROWS` cut rows or 1/:data:`FOLD_SHARE` of the base's items."""
    return cut > FOLD_ROWS or (cut + appended) * FOLD_SHARE > len(base)


def pending_need(catalog: Catalog, delta_items: int) -> int:
    """The bytes a PATCH of ``delta_items`` items of ``catalog`` (no metadata) makes beside it: a pending result's
    delta (its cut rows and appended items, about 100 bytes an item at most) and, when the store keeps this version
    whole (every ``catalog_delta_chain``-th PATCH: :func:`~processors.kinds.tree.catalog.catalog.whole_content`), its bytes joined and compressed (1.5 times
    the base's bytes); or, when the result is written out (:func:`_writes_out`, counting every item of the PATCH as cut
    or appended), a copy of the item list and half again for its bytes spliced beside it."""
    base, cut, appended = catalog._pending or (catalog, np.zeros(0, dtype=np.int64), None)
    held = len(appended) if appended is not None else 0
    if _writes_out(base, int(cut.size) + delta_items, held + delta_items):
        return base.held_nbytes() * 3 // 2
    whole = len(base._content) * 3 // 2 if base._content is not None else 0
    return (int(cut.size) + held + delta_items) * 100 + whole


def _pending_delta(catalog: Catalog, adds: list[tuple[int, ...]], removes: list[tuple[int, ...]],
                   max_items: int | None, add_meta: dict[int, Any] | None = None,
                   updates: Sequence[tuple[tuple[int, ...], bytes | None]] = ()) -> tuple[Catalog, DeltaReport]:
    """:func:`apply_tree_delta`, its result pending (``Catalog.pending``) on the base under ``catalog`` (``catalog``
    itself when written out): the removed items among the base's rows added to its cut rows, those among the appended
    ones cut from them, the new items appended; an updated item cut where it is and appended again with its new
    metadata (so the stored lines stay a line delta). Items are looked up in the base's rows (its key index, or a
    gather of every row's bucket flag) and the appended ones; nothing the size of the catalog is copied. With
    metadata, the added rows are checked here (a field of two kinds is a 422) and the columns are spliced when first
    read (``Catalog.metadata``: the limits on the result, which :func:`_patch` reads before anything is stored)."""
    if catalog._pending is not None:
        base, cut, appended = catalog._pending
    else:
        base, cut, appended = catalog, np.zeros(0, dtype=np.int64), None
    wanted = adds + removes + [ids for ids, _ in updates]
    in_base = rows_of(base, wanted)  # {item: base row}, less the rows cut already
    if cut.size and in_base:
        gone = np.isin(np.fromiter(in_base.values(), dtype=np.int64, count=len(in_base)), cut).tolist()
        in_base = {item: row for (item, row), out in zip(in_base.items(), gone) if not out}
    in_appended = rows_of(appended, wanted) if appended is not None else {}
    report = DeltaReport()
    base_rows: dict[int, tuple[int, ...]] = {}
    appended_rows: dict[int, tuple[int, ...]] = {}
    for item in removes:
        if item in in_base:
            base_rows[in_base[item]] = item
        elif item in in_appended:
            appended_rows[in_appended[item]] = item
        else:
            report.not_present.append(list(item))
    new_items: list[tuple[int, ...]] = []
    new_meta: list[bytes | None] = []
    for i, item in enumerate(adds):
        if item in in_base or item in in_appended:
            report.already_present.append(list(item))
        else:
            new_items.append(item)
            new_meta.append(canonical_meta(add_meta[i]) if add_meta and i in add_meta else None)
    report.removed, report.added = len(base_rows) + len(appended_rows), len(new_items)
    base_meta = base.meta
    appended_meta = appended.meta if appended is not None else None
    held = len(base) - int(cut.size)  # the catalog's rows from the base come first, then the appended ones
    moved: list[tuple[int, tuple[int, ...], bytes | None]] = []  # (row in the catalog, item, its new metadata)
    for i, (ids, meta) in enumerate(updates):
        if ids in in_base:
            row = in_base[ids]
            old = base_meta[row] if base_meta is not None else None
            if old != meta:
                base_rows[row] = ids
                moved.append((row - int(np.searchsorted(cut, row)), ids, meta))
        elif ids in in_appended:
            row = in_appended[ids]
            old = appended_meta[row] if appended_meta is not None else None
            if old != meta:
                appended_rows[row] = ids
                moved.append((held + row, ids, meta))
        else:
            raise refused(f"update[{i}]: {list(ids)} is not an item of the catalog (add it instead)", "update")
    report.updated = len(moved)
    moved.sort()  # (appended in the catalog's row order, after the new items)
    new_items += [ids for _, ids, _ in moved]
    new_meta += [meta for _, _, meta in moved]
    with_meta = base_meta is not None or appended_meta is not None or any(m is not None for m in new_meta)
    extra = Catalog.from_items(0, 0, new_items) if new_items else None
    kept = extra
    cut_appended = sorted(appended_rows)
    if appended is not None:  # its removed items cut, the new ones appended
        flat, lengths = _cut_rows(appended, cut_appended, extra)
        kept = Catalog(0, 0, flat, lengths) if lengths.size else None
    if kept is not None and with_meta:  # the appended rows' metadata, cut and appended alike
        before = appended_meta if appended_meta is not None else MetaRows.none(len(appended or ()))
        kept.meta = before.spliced(cut_appended, new_meta)
    cut_base = np.fromiter(base_rows, dtype=np.int64, count=len(base_rows))
    new_cut = np.union1d(cut, cut_base) if base_rows else cut
    size = len(base) - int(new_cut.size) + (len(kept) if kept is not None else 0)
    if max_items is not None and size > max_items:
        raise _too_many_after_patch(size, max_items)
    result = Catalog.pending(base, new_cut, kept)
    if with_meta:  # the columns cut and appended (the added rows checked now: a 422 naming the item and the field;
        # the limits on values and fields when spliced, which patch_stored_tree does before anything is stored)
        columns = catalog.metadata()  # (None: no item of the catalog had metadata before this PATCH)
        if columns is None:
            columns = ItemMetadata(len(catalog), {})
        keep = np.ones(len(catalog), dtype=bool)
        keep[cut_base - np.searchsorted(cut, cut_base)] = False
        keep[held + np.asarray(cut_appended, dtype=np.int64)] = False
        added = ItemMetadata.from_objects([None if m is None else json.loads(m) for m in new_meta])
        columns.check_splice(keep, added)
        result._metadata_splice = (columns, keep, added)  # (spliced when first read: Catalog.metadata)

    def stored(item: tuple[int, ...], meta: MetaRows | None, row: int) -> bytes:
        return _stored(_line(item), meta[row] if meta is not None else None)

    # the stored lines cut (in the catalog's row order: the base's, then the appended ones) and appended
    result.line_delta = ([stored(base_rows[row], base_meta, row) for row in sorted(base_rows)]
                         + [stored(appended_rows[row], appended_meta, row) for row in cut_appended],
                         [_stored(_line(i), m) for i, m in zip(new_items, new_meta)])
    if _writes_out(base, int(new_cut.size), len(kept) if kept is not None else 0):
        result.settle()  # (a new base for the next PATCH)
    return result, report


def _updates(update: list[Any], catalog: Catalog, vocab_size: int, elsewhere: set[tuple[int, ...]]
             ) -> list[tuple[tuple[int, ...], bytes | None]]:
    """``update`` entries as ``(ids, canonical metadata)``: each ``{"ids": [...], "metadata": {...}}`` (metadata
    ``null`` or ``{}``: none), an item once, in neither ``add`` nor ``remove`` (422 naming ``update[i]``)."""
    out: list[tuple[tuple[int, ...], bytes | None]] = []
    seen: set[tuple[int, ...]] = set()
    for i, value in enumerate(update):
        if not isinstance(value, dict):
            raise refused(f"update[{i}]: an update is {{\"ids\": [...], \"metadata\": {{...}}}}, got "
                          f"{type(value).__name__}", "update")
        ids, meta = split_item(value, f"update[{i}]", "update")
        (item,) = check_items([ids], end_token_id=catalog.end_token_id, vocab_size=vocab_size, where="update")
        if item in seen or item in elsewhere:
            raise refused(f"update[{i}]: {list(item)} is given twice (update, add or remove)", "update")
        seen.add(item)
        out.append((item, None if meta is None else canonical_meta(meta)))
    return out


class _Hashing(threading.Thread):
    """``catalog.content_sha256()`` on its own thread (:meth:`result` waits for it; ``took``: its seconds)."""

    def __init__(self, catalog: Catalog):
        super().__init__(name="catalog-sha256", daemon=True)
        self.catalog, self.sha, self.took = catalog, "", 0.0
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        started = time.perf_counter()
        try:
            self.sha = self.catalog.content_sha256()
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
            self.error = exc
        self.took = time.perf_counter() - started

    def result(self) -> str:
        self.join()
        if self.error is not None:
            raise self.error
        return self.sha


def patched_tables(tables: Any, add: list[Any], remove: list[Any], overlay: bool = True) -> Any:
    """The tables of a PATCH's result from its base's: an overlay version over them (:mod:`processors.kinds.tree.tables.overlay`: the work
    follows the touched paths), folded into plain tables once its appended part has grown past its share of the
    base (:func:`~processors.kinds.tree.tables.overlay.needs_fold`), or without ``overlay`` (a catalog with metadata: its filter index reads
    plain tables) the plain tables :func:`~processors.kinds.tree.tables.delta.patch_tables` gives. The manager and a replica applying the same
    delta (``deployments/replica/table_delta.py``) call this, so both reach the same version. None: the base's
    tables cannot tell their items (the caller compiles in full)."""
    from processors.kinds.tree.tables.delta import patch_tables
    from processors.kinds.tree.tables.overlay import fold, needs_fold, overlay_tables

    if overlay:
        new = overlay_tables(tables, add, remove)
        if new is not None:
            return fold(new) if needs_fold(new) else new
    return patch_tables(fold(tables), add, remove)


def patch_stored_tree(name: str, body: dict[str, Any] | None, add: list[Any], remove: list[Any], store: Any,
                      prepared: tuple[Catalog, Any, str | None] | None = None, update: list[Any] | None = None) -> PatchResult:
    """A PATCH of a stored tree body (worker thread; :meth:`processors.kinds.base.ConstraintKind.apply_patch`).
    ``store``: a :class:`~processors.kinds.patch.PatchStore`; ``prepared``: ``(items, catalog tables, staged sha or
    None)`` of the current version when it is a tree given inline that the store has read already (``body`` is not
    needed then; its catalog's bytes staged in the store under that sha, :mod:`processors.kinds.tree.store.inline_bases`). A stored (or
    staged) catalog is patched as the delta of its content; an inline tree or a tree file is read into its items
    once and stored as a catalog."""
    from processors.kinds.tree.treefile.load import load_tree

    if prepared is not None:
        catalog, tables, staged = prepared
        return _patch(name, body, add, remove, store, catalog, tables, base_sha=staged, update=update)
    assert body is not None
    sha = body.get("content_sha256")
    if body.get("content_format") == "items" and isinstance(sha, str):  # a stored catalog
        return _patch(name, body, add, remove, store, store.catalog(name, sha), store.catalog_tables(sha), base_sha=sha,
                      update=update)
    scenario = store.validate(name, body)
    tree = load_tree(scenario.tree if scenario.tree is not None else scenario.path, vocab_size=store.vocab_size)
    options = {k: v for k, v in body.items() if k not in _RESERVED}
    base = Catalog.from_items(int(tree.start_token_id), int(tree.end_token_id), items_from_tree(tree), options)
    return _patch(name, body, add, remove, store, base, None, update=update)


def _patch(name: str, body: Any, add: list[Any], remove: list[Any], store: Any, base: Catalog, base_tables: Any,
           base_sha: str | None = None, update: list[Any] | None = None) -> PatchResult:
    """:func:`patch_stored_tree` once the base's items (``base``) and, when built lately, its catalog tables
    (``base_tables``) are known. ``base_sha``: the base is stored catalog content under this hash; the result is then
    stored as the delta of it (no whole catalog written, here or in Redis, unless the store compacts the chain),
    else as a whole catalog."""
    t0 = time.perf_counter()
    limits = store.limits
    catalog, report = apply_tree_delta(base, add, remove, vocab_size=store.vocab_size,
                                       max_items=limits.max_tree_keys, max_item_tokens=limits.max_item_tokens,
                                       update=update)
    t1 = time.perf_counter()
    if not report.changed:
        return PatchResult(body, None, report, None)
    if not len(catalog):  # (not catalog.items: that makes a tuple per item)
        raise refused(f"remove: the PATCH would leave scenario {name!r} without items; DELETE it instead", "remove",
                      name=name)
    with_meta = catalog.has_meta or base.has_meta
    hashed: Any = None
    if base_sha is not None:  # no local copy either: the catalog stays parsed in memory, the store rebuilds the bytes
        # (a pending result's SHA-256 over its base's bytes and its delta: its own bytes are made only if the store
        # compacts the chain and wants them whole.) On a thread beside the tables below: hashing releases the GIL,
        # and the two are about as long at 10^7 items.
        hashed = _Hashing(catalog)
        cut, appended = catalog.line_delta
        stored: Any = store.content_delta(base_sha, cut, appended, lambda: whole_content(catalog))
        new = False
    else:
        content = catalog.content()
        (sha, new), stored = store.keep_content(content), content
    t2 = time.perf_counter()
    if with_meta:  # the columns spliced, beside the hash (a 422 past the limits, before anything is stored)
        catalog.metadata()
    index = None
    if report.updated and not (report.added or report.removed) and base_sha is not None and base_tables is not None:
        # only metadata changed: the new version's filter index from the base's, at the cost of the updated items
        # (the compile takes it; replicas serving the base make the same from the same entries: a metadata delta)
        held = store.filter_index(base_sha)
        index = held.updated_by(base_tables, update) if held is not None else None
    t_index = time.perf_counter()
    # the base's tables updated along the changed paths (equal to a full compile), unless the delta is large for the
    # catalog: its Python work per touched path then costs more than a full compile's array passes
    tables, patched = None, False
    if base_tables is not None and not (report.added or report.removed):  # only metadata changed: the same tables
        tables, patched = base_tables, False
    elif base_tables is not None and (len(add) + len(remove)) * store.patch_states_per_item <= base_tables.n_states:
        tables = patched_tables(base_tables, [split_item(v, "", "add")[0] for v in add], remove,
                                overlay=not with_meta)
        patched = tables is not None  # (None: the base's tables cannot tell their items; the compile builds them)
    t3 = time.perf_counter()
    if hashed is not None:
        sha = hashed.result()
    store.remember_catalog(sha, catalog)
    if tables is not None:
        store.remember_tables(sha, tables, patched=patched)
    if index is not None:
        store.remember_index(sha, index)
    report.timings = {"items": t1 - t0, "bytes": hashed.took if hashed is not None else t2 - t1,
                      "metadata": t_index - t2, "tables": t3 - t_index}
    # (a catalog with metadata whose items changed: replicas take the new version whole, its index comes with it)
    return PatchResult(catalog_body(catalog, sha), stored, report, sha if new else None,
                       replica_delta=(patched and not with_meta) or index is not None)
