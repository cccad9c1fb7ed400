"""One package per constraint kind (``processors/kinds/<kind>/``), each owning all of its kind: ``spec.py`` (the
config model, torch-free, joined into ``config.Scenario``) and ``kind.py`` (the compile side, registered with
:mod:`processors.registry`), plus whatever else the kind alone uses.

Nothing here is imported eagerly: ``config`` imports the specs without torch, and :func:`load_kinds` (called by
the registry on its first lookup) imports every package's ``kind`` module, so a new kind is found without being
listed anywhere. Plain modules here (``base``, ``llguidance_kind``) are shared code, not kinds.
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
