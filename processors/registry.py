"""The registry of constraint kinds: the only map from a scenario ``type`` name to its kind.

Each kind package of ``processors/kinds/`` registers its kind when its ``kind`` module is imported; the first
lookup here imports them all (``processors.kinds.load_kinds``), so a new kind is found without being listed
anywhere. The registry checks that the kinds and the config models
(the ``processors.scenarios.Scenario`` union) name the same types.

Example::

    >>> from processors import registry
    >>> registry.names()
    ('tree', 'labels', 'json_schema', 'json', 'regex', 'grammar', 'tools')
    >>> registry.get("labels")
    <LabelsKind 'labels'>
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from processors.kinds.base import ConstraintKind

__all__ = ["get", "kind_of", "names", "register"]

_KINDS: dict[str, "ConstraintKind"] = {}
_BY_COMPILED: dict[type, "ConstraintKind"] = {}
_LOADED = False
_LOAD_LOCK = threading.RLock()


def register(kind: "ConstraintKind") -> "ConstraintKind":
    """Add ``kind`` (an instance) under its ``type_name``; a second kind for one name is an error."""
    name = kind.type_name
    if name in _KINDS and type(_KINDS[name]) is not type(kind):
        raise ValueError(f"scenario type {name!r} is already registered ({_KINDS[name]!r})")
    _KINDS[name] = kind
    _BY_COMPILED.setdefault(kind.compiled_type, kind)
    return kind


def _load() -> None:
    global _LOADED
    if _LOADED:
        return
    with _LOAD_LOCK:
        if _LOADED:
            return
        from processors.scenarios import SCENARIO_TYPES
        from processors.kinds import load_kinds

        load_kinds()  # each kind module registers its kind

        missing = [t for t in SCENARIO_TYPES if t not in _KINDS]
        extra = [t for t in _KINDS if t not in SCENARIO_TYPES]
        if missing or extra:
            raise RuntimeError(f"scenario kinds and config models disagree: no kind for {missing}, "
                               f"no config model for {extra}")
        _LOADED = True


def names() -> tuple[str, ...]:
    """The registered type names, in the order of the config union."""
    _load()
    from processors.scenarios import SCENARIO_TYPES

    return tuple(SCENARIO_TYPES)


def get(type_name: str) -> "ConstraintKind":
    """The kind of scenario ``type_name``; ``ValueError`` naming the known ones for anything else."""
    _load()
    try:
        return _KINDS[type_name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown scenario type {type_name!r}; known: {', '.join(names())}") from None


def kind_of(constraint: Any) -> "ConstraintKind":
    """The kind whose compiled objects ``constraint`` is one of (kinds sharing a compiled type share its
    cursor); ``TypeError`` for anything else."""
    _load()
    kind = _BY_COMPILED.get(type(constraint))
    if kind is None:
        for compiled_type, candidate in _BY_COMPILED.items():
            if isinstance(constraint, compiled_type):
                return candidate
        raise TypeError(f"unsupported constraint {type(constraint).__name__}")
    return kind
