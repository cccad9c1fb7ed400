"""Configuration models for the constrained-decoding service: settings and limits, the base of the scenario
models, and tree files.

Pure Python (pydantic, numpy, ijson, jsonschema, pyyaml): nothing here imports Ray or torch, nor the packages
above it (``processors``, ``deployments``). The ``Scenario`` union of every kind's config model is
``processors/scenarios.py``.
"""

from config.scenario_base import (
    ConstraintError,
    ScenarioBase,
    ScenarioError,
    ThinkConfig,
    read_scenario_file,
    scenario_to_dict,
)
from config.settings import Limits, ServerSettings
from config.tree_file import DEFAULT_SEP, MAX_REPORTED_PROBLEMS, TreeData, TreeFileError, is_tree_path, load_tree

__all__ = [
    "DEFAULT_SEP",
    "MAX_REPORTED_PROBLEMS",
    "ConstraintError",
    "Limits",
    "ScenarioBase",
    "ScenarioError",
    "ServerSettings",
    "ThinkConfig",
    "TreeData",
    "TreeFileError",
    "is_tree_path",
    "load_tree",
    "read_scenario_file",
    "scenario_to_dict",
]
