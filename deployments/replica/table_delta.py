"""A replica applies a catalog PATCH to the tables it serves, instead of fetching the new
version's whole tables from the object store.

The config manager publishes a patched version with the delta it was made by (``deployments/manager/served.py``:
``{"base", "add", "remove", "tables"}``, and ``update``: the PATCH's entries, when it only changed item metadata). A
replica serving ``base`` updates its own tables along the changed paths (its kind's
:meth:`~processors.kinds.base.ConstraintKind.patch_compiled`: the tree's
:func:`processors.kinds.tree.tables.delta.patch_tables`, the manager's own step), or for a metadata delta keeps the
same tables and updates their filter index beside its arrays (``ItemFilterIndex.updated_by``, what the manager's
PATCH did: the replica's memory for the new version is the updated items'), and keeps the result only when its
``version`` (a content hash) is the announced ``tables``: then it holds the very tables a fetch would give. Any
other case (no delta, another version served, a hash that differs, an error) fetches the whole tables as before.

Whether to apply it is the setting ``replica_table_delta``: ``auto`` applies it where a fetch would cross the
network (the tables are not in this node's object store: a replica on another node than the manager), since on the
manager's node a fetch maps the shared memory and costs less than the update (a metadata delta is applied on
every node: :func:`delta_wanted`); ``always`` and ``never`` force it.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["apply_table_delta", "delta_wanted"]


def delta_wanted(mode: str, ref: Any, delta: dict[str, Any] | None = None) -> bool:
    """Apply a published ``delta`` (``mode``: the ``replica_table_delta`` setting) rather than fetch ``ref``? A
    metadata delta (``update``: the tables stay the same arrays) is applied unless the mode is ``never``: it costs
    the updated items, where a fetch takes a whole copy of the version's filter index."""
    if mode != "auto":
        return mode == "always"
    if delta is not None and delta.get("update"):
        return True
    ray = sys.modules.get("ray")
    if ray is None or not isinstance(ref, ray.ObjectRef):
        return False  # a manager without Ray hands over the object itself: nothing to fetch
    try:
        from ray.experimental import get_object_locations

        here = ray.get_runtime_context().get_node_id()
        nodes = (get_object_locations([ref], timeout_ms=1000).get(ref) or {}).get("node_ids") or []
        return bool(nodes) and here not in nodes  # none: a small object, sent inline with its reference
    except Exception:  # noqa: BLE001 - no answer: fetch, as without a delta
        logger.debug("object location lookup failed; fetching the tables", exc_info=True)
        return False


def apply_table_delta(compiled: Any, delta: dict[str, Any]) -> Any | None:
    """``compiled`` (the replica's ``CompiledScenario`` of ``delta["base"]``) with its tree tables updated by the
    delta's items, or None when that does not give the announced tables (the caller then fetches them)."""
    kind = compiled.constraint_kind
    if kind is None:
        return None
    try:
        tables = kind.patch_compiled(compiled.constraint, delta["add"], delta["remove"], delta.get("update"))
    except Exception:  # noqa: BLE001 - any failure here only means a fetch
        logger.warning("applying a catalog delta to the served tables failed; fetching them", exc_info=True)
        return None
    if tables is None or tables.version != delta.get("tables"):
        if tables is not None:
            logger.warning("a catalog delta gave tables %s, the manager's are %s; fetching them", tables.version,
                           delta.get("tables"))
        return None
    return dataclasses.replace(compiled, constraint=tables)
