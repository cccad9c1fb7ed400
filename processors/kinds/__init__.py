"""One package per constraint kind (``processors/kinds/<kind>/``), each owning all of its kind: ``spec.py`` (its
config models, torch-free, joined into ``processors.scenarios.Scenario``) and ``kind.py`` (the compile side,
registered with :mod:`processors.registry`), plus whatever else the kind alone uses.

:func:`kind_packages` is how the kinds are found, the one place: every package here. ``processors.scenarios``
imports each package's ``spec`` to build the union (torch-free), :func:`load_kinds` (called by the registry on its
first lookup) each package's ``kind``; so a new kind is found without being listed anywhere. Nothing here is
imported eagerly. Plain modules here (``base``, ``llguidance_kind``) are shared code, not kinds.
"""

from __future__ import annotations

import importlib
import pkgutil

from .base import Capabilities, CompileResult, ConstraintKind

__all__ = ["Capabilities", "CompileResult", "ConstraintKind", "kind_packages", "load_kinds"]


def kind_packages() -> list[str]:
    """The names of the kind packages, sorted."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if m.ispkg and not m.name.startswith("_"))


def load_kinds() -> None:
    """Import every kind package's ``kind`` module (each registers its kind)."""
    for name in kind_packages():
        importlib.import_module(f"{__name__}.{name}.kind")
