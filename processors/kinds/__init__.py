"""One module per constraint kind; each registers its kind with :mod:`processors.registry` when imported.

Every module of this package is imported here (``base`` holds the contract), so adding a kind is adding its module
(and its config model); nothing lists the kinds by hand.
"""

from __future__ import annotations

import importlib
import pkgutil

from .base import Capabilities, CompileResult, ConstraintKind

__all__ = ["Capabilities", "CompileResult", "ConstraintKind"]

for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if _module != "base" and not _module.startswith("_"):
        importlib.import_module(f"{__name__}.{_module}")
