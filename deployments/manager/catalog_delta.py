"""Delta updates of stored scenarios (``PATCH /admin/scenarios/{name}``), the manager's side: :func:`apply_delta`
(on a worker thread) hands a PATCH to the stored body's kind (:meth:`processors.kinds.base.ConstraintKind.apply_patch`,
with the kind's stored content as its :class:`~processors.kinds.patch.PatchStore`, ``compiler.patch_store``) and gives back its
:class:`~processors.kinds.patch.PatchResult`: the whole new body, the content to store, the report.
"""

from __future__ import annotations

from typing import Any

from deployments.protocol import ServiceError
from deployments.scenario_errors import refused_as_service_error
from processors.kinds.patch import PatchResult

__all__ = ["apply_delta"]


@refused_as_service_error()
def apply_delta(compiler: Any, name: str, body: dict[str, Any] | None, add: list[Any], remove: list[Any],
                prepared: tuple[str, Any] | None = None, update: list[Any] | None = None) -> PatchResult:
    """A PATCH's delta applied to a stored body (worker thread). ``compiler``: the manager's
    :class:`~deployments.manager.compiler.StoredScenarioCompiler` (it gives the kind's ``PatchStore``). ``prepared``:
    ``(type, what the compiler holds of the current version)`` when it has read it already
    (``StoredScenarioCompiler.held_base``; ``body`` is not needed then)."""
    from processors import registry

    if prepared is not None:
        kind_name, held = prepared
        return registry.get(kind_name).apply_patch(name, body, add, remove, compiler.patch_store(kind_name), held,
                                                   update=update)
    assert body is not None
    type_name = body.get("type")
    kind = registry.get(type_name) if type_name in registry.names() else None
    if kind is None or not kind.capabilities.patch:
        raise ServiceError(409, f"scenario {name!r} is a {type_name} scenario: PATCH adds and removes items (of a "
                                "tree or labels); PUT the whole scenario instead", {"name": name, "type": type_name})
    return kind.apply_patch(name, body, add, remove, compiler.patch_store(type_name), update=update)
