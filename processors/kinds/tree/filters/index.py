"""A catalog version's item metadata joined to its tables: what a request's ``filter`` resolves against.

Built once per compiled version (the config manager's compile, :meth:`ItemFilterIndex.build`): the metadata by
column (:mod:`processors.kinds.tree.filters.metadata`) and each item's terminal in the tables (:func:`processors.kinds.tree.filters.edges.item_terminals`). It travels
with the compiled tables to the replicas. A request's filter is checked (:func:`processors.kinds.tree.filters.language.parse_filter`, a 422 naming
the field), evaluated over the columns (numpy passes) and turned into a :class:`~processors.items.DenseBook` of the
items that do not pass (:func:`processors.kinds.tree.filters.edges.filter_book`): the item controls then treat those as excluded, so
``n``, ``distinct``, beams, multi-item rows and the token budget all count only items that pass. The resolved book
is cached per filter (its canonical JSON) for this version: a repeated filter costs a dictionary lookup.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from config import ConstraintError

from processors.kinds.tree.filters.edges import filter_book, item_terminals
from processors.kinds.tree.filters.language import FilterLimits, parse_filter
from processors.kinds.tree.filters.metadata import ItemMetadata

__all__ = ["ItemFilterIndex", "ResolvedFilter"]

#: resolved filters kept per version (each holds two arrays over the tables' states and terminals)
CACHED_FILTERS = 32


class ResolvedFilter:
    """A filter resolved for one version: the book of items left out and how many items pass."""

    __slots__ = ("book", "passing")

    def __init__(self, book, passing: int):
        self.book, self.passing = book, passing


class ItemFilterIndex:
    """The metadata of a compiled catalog's items and their terminals (see the module docstring)."""

    def __init__(self, metadata: ItemMetadata, terminals: np.ndarray, default: dict[str, Any] | None = None):
        self.metadata = metadata
        self.terminals = terminals
        self.default = default  # the scenario's own filter: every request's filter is ANDed with it
        self._default_mask: np.ndarray | None = None  # the items it passes, evaluated once in each process
        self._cache: OrderedDict[str, ResolvedFilter] = OrderedDict()
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:  # the cache and its lock stay where they were made
        return {"metadata": self.metadata, "terminals": self.terminals, "default": self.default}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.metadata, self.terminals, self.default = state["metadata"], state["terminals"], state["default"]
        self._default_mask = None
        self._cache = OrderedDict()
        self._lock = threading.Lock()

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
        terminals.setflags(write=False)
        index = cls(metadata, terminals, default)
        if default is not None and not index.default_mask().any():
            raise ConstraintError(422, "filter: no item of the catalog passes the scenario's filter",
                                  {"field": "filter"})
        return index

    def default_mask(self) -> np.ndarray:
        """The items the scenario's own filter passes (it has one), evaluated once in this process."""
        if self._default_mask is None:
            assert self.default is not None
            self._default_mask = parse_filter(self.default, self.metadata).mask(self.metadata)
        return self._default_mask

    def resolve(self, tables, value: Any, limits: FilterLimits = FilterLimits(), field: str = "filter"
                ) -> ResolvedFilter | None:
        """``value`` (a request's filter; None: none) resolved over ``tables`` (the ones this index was built on),
        joined with the scenario's own filter (both must hold; a request narrows it, never widens it). None when
        neither is given. A :class:`~config.ConstraintError` (422) naming the request's field on a bad filter."""
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
            passing = self.default_mask()
        else:
            passing = parse_filter(value, self.metadata, limits, field).mask(self.metadata)
            if self.default is not None:
                passing = passing & self.default_mask()
        book = filter_book(tables, self.terminals, passing)
        book.edge_ok(tables)  # what the vector lane and the beam step read, made here (off the event loop) once
        resolved = ResolvedFilter(book, int(passing.sum()))
        with self._lock:
            self._cache[key] = resolved
            while len(self._cache) > CACHED_FILTERS:
                self._cache.popitem(last=False)
        return resolved
