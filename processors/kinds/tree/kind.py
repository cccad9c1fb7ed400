"""The ``tree`` kind: a token tree (inline or a tree file) compiled into :class:`~processors.tables.MaskTables`."""

from __future__ import annotations

import copy

import numpy as np

from processors.kinds.tree.treefile.load import load_tree
from config import ConstraintError, ScenarioError
from config.settings import LimitExceeded

from ...registry import register
from ...tables import DONE, MaskTables, build_tree_tables, item_metrics
from ...tree import TreeCursor
from ..base import Capabilities, CompileResult, ConstraintKind
from processors.kinds.tree.filters.language import filter_limits
from processors.kinds.tree.filters.index import ItemFilterIndex
from .spec import TreeScenario


def check_multi_item(tables: MaskTables, separator: int | None) -> None:
    """Refuse multi-item settings under which an output could not be split back into items.

    With a separator: it must not be the end token and no state where an item ends may also continue with it.
    Without one (the fixed-width form): a state where an item ends must allow nothing but the end token.
    """
    counts = np.diff(tables.offsets)
    src = np.repeat(np.arange(tables.n_states, dtype=np.int64), counts)
    ends_here = np.zeros(tables.n_states, dtype=bool)
    ends_here[src[tables.next_state == DONE]] = True
    if separator is not None:
        if separator == tables.end_token_id:
            raise ValueError(f"separator_token_id {separator} is the tree's end token")
        if separator >= tables.vocab_size:
            raise ValueError(f"separator_token_id {separator} is outside the vocabulary of {tables.vocab_size}")
        clash = ends_here[src[tables.tokens == separator]]
        if clash.any():
            raise ValueError(f"separator_token_id {separator} also continues an item in "
                             f"{int(clash.sum())} state(s) where another item ends; choose another separator")
        return
    mixed = ends_here & (counts > 1)
    if mixed.any():
        raise ValueError(f"max_items > 1 without separator_token_id (items back to back) needs every item to end "
                         f"where only the end token follows; {int(mixed.sum())} state(s) end an item and also "
                         "continue (set separator_token_id)")


class TreeKind(ConstraintKind):
    """Tree files and inline trees; the cursor walks the tables, the tree's own end token ends a row."""

    config_model = TreeScenario
    compiled_type = MaskTables
    capabilities = Capabilities(items=True, patch=True)
    upload_format = "items"  # a catalog (.catalog)

    def stored_content(self, host):
        from processors.kinds.tree.store.content import TreeContent

        return TreeContent(host)

    def compile(self, scenario, info, *, worker=None) -> CompileResult:
        strict = bool(scenario.strict)
        if scenario.tree is not None:  # validated already: reuse that load when every id fits the vocabulary
            tree = scenario.tree.loaded(info.vocab_size, strict)
        else:
            tree = load_tree(scenario.path, vocab_size=info.vocab_size, strict=strict)
        return self.compile_prebuilt(scenario, info, (build_tree_tables(tree, info.vocab_size), int(tree.start_token_id)))

    def compile_prebuilt(self, scenario, info, prebuilt) -> CompileResult:
        """``prebuilt``: ``(tables, start_token_id)``, the tables of the tree the scenario names, built by the caller
        (the config manager, from a catalog's items or an inline tree's split body: the tables its tree file would
        give); the rest of the compile (item metrics, the multi-item checks) runs as for any tree."""
        tables, start_token_id, *catalog = prebuilt
        held = catalog[1] if len(catalog) > 1 else None  # a filter index a metadata PATCH updated

        item_metrics(tables)  # min_remaining / item_count, computed once here and shipped with the tables
        if scenario.max_items > 1:
            check_multi_item(tables, scenario.separator_token_id)
        default = getattr(scenario, "filter", None)
        if catalog:
            try:
                fits = held is not None and held.default == default and held.tables_version == tables.version
                index = held if fits else ItemFilterIndex.build(tables, catalog[0], default)
            except ConstraintError as exc:  # the scenario's own filter: an invalid body, naming the field
                raise ScenarioError("invalid", exc.message, field="filter") from None
        elif default is not None:
            raise ScenarioError("invalid", "filter: only a catalog whose items carry metadata has a filter (upload "
                                           "it as NDJSON with {\"ids\", \"metadata\"} lines)", field="filter")
        else:
            index = None
        if index is not None:  # a catalog with item metadata: its filter index travels with (a copy of) the tables
            tables = _with_index(tables, index)
        return CompileResult(tables, int(start_token_id) if scenario.append_start_token else None)

    def item_filter(self, constraint, value, limits):
        index = getattr(constraint, "item_filters", None)
        if index is None:
            return super().item_filter(constraint, value, limits)
        return index.resolve(constraint, value, filter_limits(limits))

    def check_compiled(self, scenario, constraint, limits) -> None:
        # an inline tree was counted before compiling (TreeScenario.check_limits); a file only now
        if scenario.path is None:
            return
        try:
            limits.check_tree_keys(constraint.n_states, "path")
        except LimitExceeded as exc:  # the same limit, naming the file
            raise LimitExceeded(exc.field, f"{exc.what} in tree file {scenario.path}", exc.limit_name,
                                exc.limit) from None

    def patch_compiled(self, constraint, add, remove, update=None):
        from processors.kinds.tree.patch.items import patched_tables

        index = getattr(constraint, "item_filters", None)
        if update:  # a metadata delta (only metadata changed): the same tables, the index updated beside its arrays
            if add or remove or index is None:
                return None
            new = index.updated_by(constraint, update)
            return None if new is None else _with_index(constraint, new)
        # (a catalog with metadata is never published with an add / remove delta: its replicas fetch the version)
        return patched_tables(constraint, add, remove, overlay=index is None)

    def cursor(self, constraint, info) -> TreeCursor:
        return TreeCursor(constraint)

    def item_tables(self, constraint) -> MaskTables:
        return constraint

    def apply_patch(self, name, body, add, remove, store, prepared=None, update=None):
        """Items of any tree form added and removed; the result is stored as a catalog (``catalog_delta.py``)."""
        from processors.kinds.tree.patch.items import patch_stored_tree

        return patch_stored_tree(name, body, add, remove, store, prepared, update or [])


def _with_index(tables: MaskTables, index: ItemFilterIndex) -> MaskTables:
    """A copy of ``tables`` (the same arrays) with the filter index ``index`` joined, versioned with the metadata:
    the same items with other metadata are another version (:attr:`ItemFilterIndex.version`)."""
    tables = copy.copy(tables)
    object.__setattr__(tables, "item_filters", index)
    object.__setattr__(tables, "version", index.version)
    return tables


register(TreeKind())
