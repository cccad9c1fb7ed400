"""A catalog version's item metadata joined to its tables: what a request's ``filter`` resolves against.

Built once per compiled version (the config manager's compile, :meth:`ItemFilterIndex.build`): each item's terminal
in the tables (:func:`processors.kinds.tree.filters.edges.item_terminals`) gives its slot, and the metadata columns
are kept in slot order with their block summaries (:class:`processors.kinds.tree.filters.slots.SlotIndex`). It
travels with the compiled tables to the replicas. A request's filter is checked
(:func:`processors.kinds.tree.filters.language.parse_filter`, a 422 naming the field) and resolved lazily
(:class:`~processors.kinds.tree.filters.lazy.LazyFilter`): the request reads it as a book of the items that do not
pass (:class:`~processors.kinds.tree.filters.lazy.FilterView`), so the item controls treat those as excluded and
``n``, ``distinct``, beams, multi-item rows and the token budget all count only items that pass; each state's count
is computed when a row first asks it. The resolved filter is cached per filter (its canonical JSON) for this
version: a repeated filter costs a dictionary lookup, and the counts its earlier requests asked for.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from config import ConstraintError
from processors.tables import content_hash

from processors.kinds.tree.filters.edges import item_terminals
from processors.kinds.tree.filters.language import Filter, FilterLimits, parse_filter
from processors.kinds.tree.filters.metadata import ItemMetadata
from processors.kinds.tree.filters.lazy import FilterView, LazyFilter
from processors.kinds.tree.filters.slots import SlotIndex

__all__ = ["ItemFilterIndex", "ResolvedFilter"]

#: an index holds updates beside its arrays up to 1/UPDATES_SHARE of its items (then it is built anew)
UPDATES_SHARE = 8
#: resolved filters kept per version (each holds a vector over the blocks and the counts of the states asked)
CACHED_FILTERS = 32


class ResolvedFilter:
    """A filter resolved for one version (:class:`~processors.kinds.tree.filters.lazy.LazyFilter`): read by a
    request as a book of the items it leaves out, with the request's cap (:meth:`view`)."""

    __slots__ = ("lazy",)

    def __init__(self, lazy: LazyFilter):
        self.lazy = lazy

    def view(self, cap: int) -> FilterView:
        """The book a request with at most ``cap - 1`` items taken, occupied or excluded reads (``ItemRequest.base``)."""
        return FilterView(self.lazy, cap)

    def passing(self, cap: int) -> int:
        """How many items pass, at most ``cap`` (exact below it)."""
        return FilterView(self.lazy, cap).passing()


class ItemFilterIndex:
    """The metadata of a compiled catalog's items in slot order (see the module docstring)."""

    def __init__(self, slots: SlotIndex, default: dict[str, Any] | None = None, digest: str = "",
                 tables_version: str = ""):
        self.slots = slots
        self.digest = digest  # names the metadata (a compiled version's with its tables)
        # the version of the tables it was built on, before the metadata joined it (a compiled version's is
        # content_hash("tables+metadata", tables_version, digest): what a replica applying a metadata delta checks)
        self.tables_version = tables_version
        self.default = default  # the scenario's own filter: every request's filter is ANDed with it
        self._default_node: Any = None  # parsed once in each process
        self._cache: OrderedDict[str, ResolvedFilter] = OrderedDict()
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:  # the cache and its lock stay where they were made
        return {"slots": self.slots, "default": self.default, "digest": self.digest,
                "tables_version": self.tables_version}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["slots"], state["default"], state.get("digest", ""),  # type: ignore[misc]
                      state.get("tables_version", ""))

    @property
    def version(self) -> str:
        """The compiled version of the tables with this metadata joined (what the tree kind's compile names it)."""
        return content_hash("tables+metadata", self.tables_version, self.digest)

    @property
    def schema(self) -> ItemMetadata:
        """The fields a filter is checked against (kinds and values, no arrays)."""
        return self.slots.schema

    @classmethod
    def build(cls, tables, catalog, default: dict[str, Any] | None = None) -> "ItemFilterIndex | None":
        """The index of ``catalog`` (a :class:`~processors.kinds.tree.catalog.catalog.Catalog`) over its ``tables``; None when
        no item carries metadata. ``default``: the scenario's filter, checked here (a
        :class:`~config.ConstraintError` naming ``filter`` when it names what the catalog lacks or passes no item)."""
        metadata = catalog.metadata()
        if metadata is None:
            if default is not None:
                raise ConstraintError(422, "filter: the catalog's items carry no metadata to filter on",
                                      {"field": "filter"})
            return None
        terminals = item_terminals(tables, catalog.flat, catalog.lengths)
        index = cls(SlotIndex.build(tables, metadata, terminals), default, catalog.metadata_digest(),
                    str(getattr(tables, "version", "")))
        resolved = index.resolve(tables, None) if default is not None else None
        if resolved is not None and not resolved.passing(1):
            raise ConstraintError(422, "filter: no item of the catalog passes the scenario's filter",
                                  {"field": "filter"})
        return index

    def updated(self, tables, items: list[tuple[int, ...]], objects: list[dict[str, Any] | None]
                ) -> "ItemFilterIndex | None":
        """This index after the metadata of ``items`` (token ids, items of ``tables``) became ``objects`` (each
        replaces the item's metadata whole; None: none): the same arrays with the updates beside them
        (:meth:`SlotIndex.updated`), at the cost of the updated items. None when the updates held beside the arrays
        would pass an eighth of the items (the caller builds the index anew) or an item is not in the tables."""
        if self.slots.overridden + len(items) > max(self.slots.n // UPDATES_SHARE, 1):
            return None
        lengths = np.fromiter(map(len, items), dtype=np.int64, count=len(items))
        flat = np.fromiter((t for item in items for t in item), dtype=np.int64, count=int(lengths.sum()))
        slots = self.slots.terminal_slots(tables, item_terminals(tables, flat, lengths))
        if (slots < 0).any():
            return None
        metadata = ItemMetadata.from_objects(objects)
        text = json.dumps([[list(i), o] for i, o in zip(items, objects)], sort_keys=True, separators=(",", ":"))
        digest = content_hash("metadata-update", self.digest, text)
        return ItemFilterIndex(self.slots.updated(slots, metadata), self.default, digest, self.tables_version)

    def updated_by(self, tables, update: list[dict[str, Any]]) -> "ItemFilterIndex | None":
        """:meth:`updated` by a PATCH's ``update`` entries as it gave them (``{"ids": [...], "metadata": {...}}``,
        checked already): what the manager's PATCH and a replica applying its metadata delta both call, so both
        reach the same index and digest."""
        return self.updated(tables, [tuple(entry["ids"]) for entry in update],
                            [entry.get("metadata") or None for entry in update])

    def _default(self) -> Any:
        if self._default_node is None:
            assert self.default is not None
            self._default_node = parse_filter(self.default, self.schema)
        return self._default_node

    def resolve(self, tables, value: Any, limits: FilterLimits = FilterLimits(), field: str = "filter"
                ) -> ResolvedFilter | None:
        """``value`` (a request's filter; None: none) resolved over ``tables`` (the ones this index was built on),
        joined with the scenario's own filter (both must hold; a request narrows it, never widens it). None when
        neither is given. A :class:`~config.ConstraintError` (422) naming the request's field on a bad filter.
        Nothing is evaluated here but the blocks the filter may pass: the decode step asks the states it visits."""
        if value is None and self.default is None:
            return None
        try:
            key = json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ConstraintError(422, f"{field}: not a JSON filter: {exc}", {"field": field}) from None
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        if value is None:
            node = self._default()
        else:
            node = parse_filter(value, self.schema, limits, field)
            if self.default is not None:
                node = Filter("and", (node, self._default()))
        resolved = ResolvedFilter(LazyFilter(self.slots, tables, node))
        with self._lock:
            self._cache[key] = resolved
            while len(self._cache) > CACHED_FILTERS:
                self._cache.popitem(last=False)
        return resolved
