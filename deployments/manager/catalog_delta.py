"""Delta updates of stored scenarios (``PATCH /admin/scenarios/{name}``), the manager's side: :func:`apply_delta`
(on a worker thread) applies a PATCH to a stored body through the kind's delta (``processors/kinds/tree/
catalog_delta.py``: items of any tree form, the result stored as a catalog; ``processors/kinds/labels/delta.py``:
labels) and gives the whole new body, the content to store and a :class:`~processors.kinds.patch.DeltaReport`.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

from deployments.protocol import ServiceError
from deployments.scenario_errors import refused_as_service_error
from processors.kinds.labels.delta import apply_labels_delta
from processors.kinds.patch import DeltaReport
from processors.kinds.tree.catalog import _RESERVED, Catalog, _line, catalog_body, items_from_tree
from processors.kinds.tree.catalog_delta import apply_tree_delta

__all__ = ["apply_delta"]


@refused_as_service_error()
def apply_delta(compiler: Any, limits: Any, name: str, body: dict[str, Any] | None, add: list[Any], remove: list[Any],
                prepared: tuple[Catalog, Any] | None = None):
    """``(new body, content to store (bytes, a ``ContentDelta``) or None, report, sha of the content when its local
    copy is new)``: a PATCH's
    delta applied to a stored body (worker thread). ``compiler``: the manager's
    :class:`~deployments.manager.compiler.StoredScenarioCompiler` (validation, stored catalogs, content copies).
    ``prepared``: the current version's items and catalog tables when it is a tree given inline that the compiler
    has read already (``StoredScenarioCompiler.tree_base``; ``body`` is not needed then)."""
    from processors.kinds.tree.file import load_tree

    from processors import registry

    if prepared is not None:
        return _apply_tree(compiler, limits, name, body, add, remove, *prepared)
    assert body is not None
    kind = body.get("type")
    patch = registry.get(kind).capabilities.patch if kind in registry.names() else None
    if patch == "labels":
        new_body, report = apply_labels_delta(body, add, remove)
        return new_body, None, report, None
    if patch != "items":
        raise ServiceError(409, f"scenario {name!r} is a {kind} scenario: PATCH adds and removes tree items or "
                                "labels; PUT the whole scenario instead", {"name": name, "type": kind})
    sha = body.get("content_sha256")
    if body.get("content_format") == "items" and isinstance(sha, str):  # a stored catalog
        return _apply_tree(compiler, limits, name, body, add, remove, compiler.catalog(name, sha),
                           compiler.catalog_tables(sha), base_sha=sha)
    # an inline tree or a tree file: its items, once
    scenario = compiler.validate(name, body)
    tree = load_tree(scenario.tree if scenario.tree is not None else scenario.path, vocab_size=compiler.vocab_size)
    options = {k: v for k, v in body.items() if k not in _RESERVED}
    base = Catalog.from_items(int(tree.start_token_id), int(tree.end_token_id), items_from_tree(tree), options)
    return _apply_tree(compiler, limits, name, body, add, remove, base, None)


def _line_delta(add: list[Any], remove: list[Any], report: DeltaReport) -> bytes:
    """The stored form of a PATCH of a stored catalog (``store_content.line_delta``): the item lines it removed and
    those it appended, in the order ``apply_tree_delta`` applies them (the no-ops in ``report`` left out)."""
    from deployments.storage.content import line_delta

    added, removed = report.applied(add, remove)
    return line_delta([_line(item) for item in removed], [_line(item) for item in added])


def _apply_tree(compiler: Any, limits: Any, name: str, body: Any, add: list[Any], remove: list[Any], base: Catalog,
                base_tables: Any, base_sha: str | None = None):
    """:func:`apply_delta` of a tree whose items (``base``) and, when built here lately, catalog tables
    (``base_tables``) are known. ``base_sha``: the base is stored catalog content under this hash; the result is
    then stored as the delta of it (``ContentDelta``: no whole catalog written, here or in Redis, unless the store
    compacts the chain), else as a whole catalog."""
    from deployments.storage.content import ContentDelta

    t0 = time.perf_counter()
    catalog, report = apply_tree_delta(base, add, remove, vocab_size=compiler.vocab_size,
                                       max_items=limits.max_tree_keys, max_item_tokens=limits.max_item_tokens)
    t1 = time.perf_counter()
    if not report.changed:
        return body, None, report, None
    if not len(catalog):  # (not catalog.items: that makes a tuple per item)
        raise ServiceError(422, f"remove: the PATCH would leave scenario {name!r} without items; DELETE it instead",
                           {"name": name, "field": "remove"})
    content = catalog.content()
    if base_sha is not None:  # no local copy either: the catalog stays parsed in memory, Redis rebuilds the bytes
        sha, new = hashlib.sha256(content).hexdigest(), False
        stored: Any = ContentDelta(base_sha, _line_delta(add, remove, report), lambda: content)
    else:
        (sha, new), stored = compiler.keep_content(content), content
    compiler.remember_catalog(sha, catalog)
    t2 = time.perf_counter()
    # the base's tables updated along the changed paths (equal to a full compile), unless the delta is large for the
    # catalog: its Python work per touched path then costs more than a full compile's array passes. (Not on another
    # thread beside the bytes above: measured, the two together took longer than one after the other.)
    if base_tables is not None and (len(add) + len(remove)) * compiler.patch_states_per_item <= base_tables.n_states:
        from processors.kinds.tree.delta import patch_tables

        tables = patch_tables(base_tables, add, remove)
        if tables is not None:  # (None: the base's tables cannot tell their items; the compile builds them in full)
            compiler.remember_tables(sha, tables, patched=True)
    report.timings = {"items": t1 - t0, "bytes": t2 - t1, "tables": time.perf_counter() - t2}
    return catalog_body(catalog, content, sha), stored, report, (sha if new else None)
