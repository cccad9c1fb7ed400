"""Public names that moved (out of ``config``; the tree file loader into ``processors.kinds.tree.treefile``), still
importable from their old places, with a ``DeprecationWarning`` that names the new place.

``config`` is the floor of the layering (it imports neither ``processors`` nor ``deployments``), so it never imports
these names itself: :data:`MOVED` names each old place and the module that defines the name now, and
:func:`forward` (the module ``__getattr__`` of the old places) imports that module by name on first use, only when
a caller asks for a moved name. Nothing in this repository imports a name through here (``tests/unit/
test_public_names.py`` checks every entry resolves and warns).
"""

from __future__ import annotations

import importlib
import sys
import warnings
from typing import Any

__all__ = ["MOVED", "forward"]

_SCENARIOS = "processors.scenarios"
_TREE_FILE = "processors.kinds.tree.treefile.load"

#: the old module -> {name: the module that defines it now}
MOVED: dict[str, dict[str, str]] = {
    # the Scenario union and its loaders moved above the kinds' specs (config imports no kind)
    "config": {
        **{name: _SCENARIOS for name in (
            "SCENARIO_TYPES", "Scenario", "ScenarioAdapter", "check_scenario_body", "load_scenario", "parse_scenario",
            "scenario_model", "validate_scenario_body")},
        "GrammarScenario": "processors.kinds.grammar.spec",
        "JsonSchemaScenario": "processors.kinds.json_schema.spec",
        "JsonScenario": "processors.kinds.json_schema.spec",
        "LabelsScenario": "processors.kinds.labels.spec",
        "RegexScenario": "processors.kinds.regex.spec",
        "ToolsScenario": "processors.kinds.tools.spec",
        "TreeScenario": "processors.kinds.tree.spec",
        "TreeSpec": "processors.kinds.tree.spec",
        # the tree file format is the tree kind's
        **{name: _TREE_FILE for name in (
            "DEFAULT_SEP", "MAX_REPORTED_PROBLEMS", "TreeData", "TreeFileError", "is_tree_path", "load_tree")},
    },
    "config.scenarios": {name: _SCENARIOS for name in (
        "SCENARIO_TYPES", "Scenario", "ScenarioAdapter", "check_scenario_body", "load_scenario", "parse_scenario",
        "scenario_model", "validate_scenario_body")},
    "config.tree_file": {name: _TREE_FILE for name in (
        "DEFAULT_SEP", "MAX_REPORTED_PROBLEMS", "TreeData", "TreeFileError", "fits_vocab", "is_tree_path",
        "load_tree")},
    "processors.kinds.tree.file": {name: _TREE_FILE for name in (
        "DEFAULT_SEP", "MAX_REPORTED_PROBLEMS", "TreeData", "TreeFileError", "fits_vocab", "is_tree_path",
        "load_tree")},
}


def forward(old_module: str, name: str) -> Any:
    """``name`` asked of ``old_module``: the object from the module that defines it now, with a
    ``DeprecationWarning`` (once: the object is then kept in the old module); ``AttributeError`` for a name that
    never lived there."""
    new_module = MOVED.get(old_module, {}).get(name)
    if new_module is None:
        raise AttributeError(f"module {old_module!r} has no attribute {name!r}")
    warnings.warn(f"{old_module}.{name} moved to {new_module}.{name}; import it from there "
                  f"(the old name will be removed)", DeprecationWarning, stacklevel=3)
    value = getattr(importlib.import_module(new_module), name)
    setattr(sys.modules[old_module], name, value)  # "from old import name" asks twice: one warning
    return value
