"""The layering of the top-level packages, read from the source: ``config`` (the floor) imports neither
``processors`` nor ``deployments``; ``processors`` never imports ``deployments``. Every import counts, those inside
functions and under ``TYPE_CHECKING`` too (a deferred import is still a dependency)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: package -> the top-level packages it may not import
FORBIDDEN = {
    "config": ("processors", "deployments"),
    "processors": ("deployments",),
}


def _imported(source: str, module_path: str) -> list[tuple[int, str]]:
    """``(line, module)`` of every import in ``source``, the text of the module at ``module_path`` (``a/b/c.py``),
    relative imports resolved."""
    tree = ast.parse(source, filename=module_path)
    here = module_path.split("/")[:-1]  # the package the module is in (for __init__.py too)
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            if not node.module:  # "from . import x": x may be a submodule
                found.extend((node.lineno, f"{module}.{alias.name}") for alias in node.names)
    return found


def _modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_nothing_above_it(package):
    modules = _modules(package)
    assert modules, f"no modules found under {package}/"
    broken = []
    for path in modules:
        for line, module in _imported(path.read_text(encoding="utf-8"), path.relative_to(ROOT).as_posix()):
            top = module.split(".")[0]
            if top in FORBIDDEN[package]:
                broken.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not broken, f"{package} may not import {', '.join(FORBIDDEN[package])}:\n" + "\n".join(broken)


def test_the_walk_sees_every_kind_of_import():
    """Imports inside functions and under ``TYPE_CHECKING``, and relative ones, are all read."""
    source = """
import config.settings
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from deployments.protocol import ServiceError
def f():
    from ..tools import spec
    from . import kind
    import deployments.openai.tool_calls as calls
"""
    imported = [module for _, module in _imported(source, "processors/kinds/labels/x.py")]
    assert imported == ["config.settings", "typing", "deployments.protocol", "processors.kinds.tools",
                        "processors.kinds.labels", "processors.kinds.labels.kind", "deployments.openai.tool_calls"], imported
