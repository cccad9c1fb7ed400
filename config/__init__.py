"""Configuration models for the constrained-decoding service: settings and limits and the base of the scenario
models (tree files are the tree kind's: ``processors/kinds/tree/treefile/load.py``).

Pure Python (pydantic, numpy, ijson, jsonschema, pyyaml): nothing here imports Ray or torch, nor the packages
above it (``processors``, ``deployments``). The ``Scenario`` union of every kind's config model is
``processors/scenarios.py``.

Names that lived here before (``load_scenario``, ``load_tree``, ``TreeFileError``, ...) still import, with a
``DeprecationWarning`` naming their new module (``config/moved.py``).
"""

from config.scenario_base import (
    ConstraintError,
    ScenarioBase,
    ScenarioError,
    ThinkConfig,
    read_scenario_file,
    scenario_to_dict,
)
from config.moved import forward as _forward
from config.settings import Limits, ServerSettings

__all__ = [
    "ConstraintError",
    "Limits",
    "ScenarioBase",
    "ScenarioError",
    "ServerSettings",
    "ThinkConfig",
    "read_scenario_file",
    "scenario_to_dict",
]


def __getattr__(name: str):
    """A name that moved out of ``config`` (``config/moved.py``): its object, with a ``DeprecationWarning``."""
    return _forward(__name__, name)
