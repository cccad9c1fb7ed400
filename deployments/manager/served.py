"""What the config manager serves now: one compiled version per scenario name, and the stored versions it refused."""

from __future__ import annotations

import asyncio
import logging
import sys
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["ServedScenario", "ServedScenarios", "object_ref"]


@dataclass
class ServedScenario:
    version: int
    kind: str
    compiled: Any  # the CompiledScenario without Ray; None with Ray (the object store holds it)
    ref: Any  # ObjectRef when Ray is initialized, else the compiled object itself
    # a catalog PATCH's delta from the version served before it: {"base", "add", "remove", "tables"} (the items the
    # PATCH added and removed, and the ``version`` of the tables they give; ``update``: the entries of a PATCH that
    # only changed item metadata, a metadata delta); a replica serving ``base`` may apply it
    # to its own tables instead of fetching ``ref`` (deployments/replica/table_delta.py)
    delta: dict[str, Any] | None = None


def object_ref(compiled):
    """The tables in Ray's object store when this manager is a Ray actor (its replicas are other processes),
    else the object itself (a manager constructed in a plain process, e.g. in tests, even if that process
    is a Ray driver)."""
    ray = sys.modules.get("ray")  # not imported means not initialized: keep the import cost out of tests
    if ray is not None and ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
        return ray.put(compiled)
    return compiled


def _overlay_base(compiled) -> Any:
    """The base tables of ``compiled``'s overlay version of a catalog's tables, else None."""
    from processors.kinds.tree.tables.overlay import is_overlay, overlay_base

    tables = getattr(compiled, "constraint", None)
    return overlay_base(tables) if is_overlay(tables) else None


class ServedScenarios:
    """The served table: ``name -> ServedScenario`` (what every replica gets in a snapshot) and ``name -> refusal``
    for a stored version that did not validate or compile (the last good version keeps serving).

    ``lock`` is held from a Redis write to the install of what it wrote (by an admin write) and around reading
    Redis's current pointers (by the reconciler), so a version is never compiled and installed twice.
    """

    def __init__(self):
        self.served: dict[str, ServedScenario] = {}
        self.bases: dict[str, Any] = {}  # name -> the base of the overlay version it serves (its replicas may ask)
        self.errors: dict[str, dict[str, Any]] = {}  # name -> {"version", "error"[, "serving"]}: stored, not served
        self.new_loop()

    def new_loop(self) -> None:
        """A new event loop (tests): asyncio primitives are tied to one."""
        self.lock = asyncio.Lock()

    def install(self, name: str, version: int, compiled, ref, delta: dict[str, Any] | None = None) -> None:
        """Serve ``compiled`` (in the object store as ``ref``) as ``version`` of ``name``. ``delta``: how the items
        changed from ``delta["base"]`` (a PATCH); kept only when that is the version served until now."""
        # With Ray the object store holds the tables; keeping the Python object too would double
        # the manager's memory for large trees.
        kept = compiled if ref is compiled else None
        before = self.served.get(name)
        if delta is not None and (before is None or before.version != delta.get("base")):
            delta = None
        self.served[name] = ServedScenario(int(version), compiled.kind, kept, ref, delta)
        self.errors.pop(name, None)
        base = _overlay_base(compiled)
        if base is None:
            self.bases.pop(name, None)
        else:
            self.bases[name] = base

    def remove(self, name: str) -> None:
        self.served.pop(name, None)
        self.errors.pop(name, None)
        self.bases.pop(name, None)

    def base_ref(self, version: str) -> Any:
        """The plain tables ``version`` that a served overlay version is built on (``processors/kinds/tree/
        overlay.py``), in the object store (put at the first ask, kept while served), for a replica that does not
        hold them (one started after the PATCH); None when no served version is built on them."""
        for base in self.bases.values():
            if base.version == version:
                ref = base.__dict__.get("_publish_ref")
                if ref is None:
                    ref = object_ref(base)
                    object.__setattr__(base, "_publish_ref", ref)
                return ref
        return None

    def refuse(self, name: str, version, message: str) -> None:
        """``version`` of ``name`` in Redis is not usable: remember why (shown in health); what served keeps serving."""
        if self.errors.get(name, {}).get("version", object()) != version:
            served = self.served.get(name)
            logger.error("scenario %r version %s in Redis is not usable: %s; %s", name, version, message,
                         f"still serving version {served.version}" if served else "it is not served")
        self.errors[name] = {"version": version, "error": message}
        served = self.served.get(name)
        if served is not None:
            self.errors[name]["serving"] = served.version

    def tables(self) -> dict[str, dict[str, Any]]:
        """``{name: {"version", "ref"}}``: the scenarios part of a replica snapshot."""
        return {n: {"version": s.version, "ref": s.ref, **({"delta": s.delta} if s.delta else {})}
                for n, s in sorted(self.served.items())}

    def versions(self) -> dict[str, int]:
        return {n: s.version for n, s in sorted(self.served.items())}

    def listing(self) -> list[dict[str, Any]]:
        return [{"name": n, "type": s.kind, "version": s.version} for n, s in sorted(self.served.items())]
