"""The layering of the top-level packages, read from the source: ``config`` (the floor) imports neither
``processors`` nor ``deployments``; ``processors`` never imports ``deployments``; no two modules import each other in
a cycle; no module outside a kind's package imports its internals. Every import counts, those inside functions and
under ``TYPE_CHECKING`` too (a deferred import is still a dependency)."""

from __future__ import annotations

import ast
import re
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


# ------------------------------------------------------------------------------------------- the module graph

#: the packages whose modules make the import graph (tests/ and bench/ import internals on purpose)
GRAPH_PACKAGES = ("config", "processors", "deployments", "cli")


def _module_files() -> dict[str, Path]:
    """Every module of :data:`GRAPH_PACKAGES` by its dotted name (a package's ``__init__.py`` by the package's)."""
    found: dict[str, Path] = {}
    for package in GRAPH_PACKAGES:
        for path in _modules(package):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imported_candidates(source: str, module_path: str) -> list[tuple[int, str]]:
    """:func:`_imported`, plus ``a.b.c`` for every ``from a.b import c`` (``c`` may be a submodule)."""
    found = _imported(source, module_path)
    here = module_path.split("/")[:-1]
    for node in ast.walk(ast.parse(source, filename=module_path)):
        if isinstance(node, ast.ImportFrom) and node.module:
            base = here[:len(here) - node.level + 1] if node.level else []
            module = ".".join([*base, node.module])
            found.extend((node.lineno, f"{module}.{alias.name}") for alias in node.names)
    return found


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The module an imported name lives in: the longest known module ``name`` starts with (``processors.masks.FREE``
    is ``processors.masks``), None outside the graph."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def _import_graph(modules: dict[str, Path] | None = None) -> dict[str, dict[str, int]]:
    """module -> {module it imports: the first line that does}, every import counted (inside functions and under
    ``TYPE_CHECKING`` too); a package's ``__init__`` is a module like any other."""
    modules = _module_files() if modules is None else modules
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges: dict[str, int] = {}
        for line, imported in _imported_candidates(path.read_text(encoding="utf-8"), path.relative_to(ROOT).as_posix()):
            target = _resolve(imported, modules)
            if target is not None and target != name:
                edges[target] = min(line, edges.get(target, line))
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, dict[str, int]]) -> set[frozenset[str]]:
    """The import cycles of ``graph``: its strongly connected components of more than one module (Tarjan's, without
    recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            for target in targets:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph.get(target, ())))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.add(frozenset(component))
    return found


def _cycle_edges(graph: dict[str, dict[str, int]], cycle: frozenset[str]) -> list[str]:
    return [f"{module}:{line} -> {target}" for module in sorted(cycle)
            for target, line in sorted(graph[module].items()) if target in cycle]


#: Import cycles that still exist, each by name (all in processors/, whose tree kind is being split up): the test
#: fails on any other cycle, and on one of these once it is gone (then delete its entry). Empty it; never add to it.
ALLOWED_CYCLES: dict[str, frozenset[str]] = {
    # masks.py's apply_steps hands a CPU batch to masks_cpu.py (imported at its end), which builds on masks.py's
    # step names (Step, ALLOW, ...) and its row revival
    "masks: the CPU path": frozenset({"processors.masks", "processors.masks_cpu"}),
    # processors/tables.py pickles and restores an overlay's tables through the tree kind's overlay (function-local
    # imports), whose overlay and delta tables build on MaskTables
    "tables: the tree kind's overlay": frozenset({"processors.tables", "processors.kinds.tree.tables.overlay",
                                                  "processors.kinds.tree.tables.delta"}),
}


def test_no_module_import_cycle():
    """No import cycle between the modules of config/, processors/, deployments/ and cli/, however deferred the import
    (inside a function, under ``TYPE_CHECKING``): a cycle hidden by a local import is still two modules that cannot be
    understood, tested or moved apart."""
    graph = _import_graph()
    assert len(graph) > 150 and "deployments.ingress.service" in graph
    found = _cycles(graph)
    allowed = set(ALLOWED_CYCLES.values())
    new = sorted(sorted(cycle) for cycle in found - allowed)
    assert not new, "import cycles (break each: a leaf module for what both need, a dependency passed in, a " \
        "Protocol instead of the class):\n" + "\n\n".join("\n".join(_cycle_edges(graph, frozenset(c))) for c in new)
    gone = sorted(name for name, cycle in ALLOWED_CYCLES.items() if cycle not in found)
    assert not gone, f"these allowed cycles are gone (or changed): delete them from ALLOWED_CYCLES: {gone}"


def test_the_cycle_check_finds_a_cycle_through_a_local_import():
    """The check itself: a cycle closed by an import inside a function is found, and ``from a import b`` counts as
    an import of the module ``a.b``."""
    graph = {"a": {"a.b": 1}, "a.b": {"c": 3}, "c": {"a": 9}, "d": {"a": 1}, "e": {}}
    assert _cycles(graph) == {frozenset({"a", "a.b", "c"})}
    source = "from x import y\ndef f():\n    from .z import w\n"
    known = {"x": Path("x"), "x.y": Path("x/y.py"), "p.z": Path("p/z.py")}
    imported = {_resolve(m, known) for _, m in _imported_candidates(source, "p/q.py")}
    assert imported == {"x", "x.y", "p.z"}, imported


# ------------------------------------------------------------------------------------------- a kind's internals

KINDS = ROOT / "processors" / "kinds"


def _public_kind_modules() -> set[str]:
    """The modules of the kinds that docs/api.md lists under "Public Python names" (e.g. the tree file's loader)."""
    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    block = text.split("<!-- public-names -->", 1)[1].split("<!-- /public-names -->", 1)[0]
    return set(re.findall(r"^- `(processors\.kinds\.[a-z_.]+)`", block, flags=re.MULTILINE))


def _kind_of(module: str) -> str | None:
    """The kind package ``module`` belongs to (``processors.kinds.tree`` for ``processors.kinds.tree.catalog.parse``),
    None outside every kind."""
    parts = module.split(".")
    if len(parts) >= 3 and parts[:2] == ["processors", "kinds"] and (KINDS / parts[2] / "__init__.py").is_file():
        return ".".join(parts[:3])
    return None


def _internal_imports() -> set[tuple[str, str]]:
    """``(importer, module)`` for every import of a kind's internal module from outside that kind's package: anything
    in ``processors/kinds/<kind>/`` but its ``__init__``, its ``spec`` module and the modules docs/api.md lists."""
    public = _public_kind_modules()
    found = set()
    for importer, imported in _import_graph().items():
        for module in imported:
            kind = _kind_of(module)
            if kind is None or _kind_of(importer) == kind or module in (kind, f"{kind}.spec") or module in public:
                continue
            found.add((importer, module))
    return found


#: Imports of a kind's internals from outside its package, as they are: the test fails on any other, and on one of
#: these once it is gone (then delete it). A kind is reached by its package, its ``spec`` module, its hooks
#: (:class:`processors.kinds.base.ConstraintKind`) and the objects they return; these predate that rule. Never add.
ALLOWED_INTERNAL_IMPORTS: set[tuple[str, str]] = {
    # the catalog uploads' content types (the ingress routes an upload by them; the manager reads a Parquet body)
    ("deployments.ingress.openapi", "processors.kinds.tree.catalog.catalog"),
    ("deployments.ingress.openapi", "processors.kinds.tree.catalog.parquet"),
    ("deployments.ingress.uploads", "processors.kinds.tree.catalog.catalog"),
    ("deployments.ingress.uploads", "processors.kinds.tree.catalog.parquet"),
    ("deployments.manager.item_writes", "processors.kinds.tree.catalog.parquet"),
    # the tree tables' memory, shared bases and overlays (the manager's memory guard, served tables, the replica's fetch)
    ("deployments.manager.memory_guard", "processors.kinds.tree.tables.chunks"),
    ("deployments.manager.served", "processors.kinds.tree.tables.overlay"),
    ("deployments.replica.subscriber", "processors.kinds.tree.tables.overlay"),
    # a stored tool set's output plan, read by the OpenAI routes
    ("deployments.openai.tool_calls", "processors.kinds.tools.plan"),
    # one kind built on another's compile side
    ("processors.kinds.tools.kind", "processors.kinds.json_schema.kind"),
    # processors' shared modules reaching into a kind (the label trie, the tree's stacked tables, overlay, scan)
    ("processors.labels", "processors.kinds.labels.trie"),
    ("processors.lanes", "processors.kinds.tree.tables.stacked"),
    ("processors.tables", "processors.kinds.tree.tables.overlay"),
    ("processors.tables", "processors.kinds.tree.treefile.scan"),
}


def test_no_module_imports_a_kinds_internals():
    """A module outside ``processors/kinds/<kind>/`` imports of that kind only its package, its ``spec`` module and
    the public modules docs/api.md lists; every import counts (inside functions and under ``TYPE_CHECKING`` too)."""
    assert "processors.kinds.tree.treefile.load" in _public_kind_modules()
    found = _internal_imports()
    new = sorted(found - ALLOWED_INTERNAL_IMPORTS)
    assert not new, "imports of a kind's internals (reach it by its package, its spec module or its hooks):\n" + \
        "\n".join(f"    ({importer!r}, {module!r})," for importer, module in new)
    gone = sorted(ALLOWED_INTERNAL_IMPORTS - found)
    assert not gone, "these allowed imports are gone: delete them from ALLOWED_INTERNAL_IMPORTS:\n" + \
        "\n".join(f"    ({importer!r}, {module!r})," for importer, module in gone)
