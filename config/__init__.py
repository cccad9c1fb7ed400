"""Configuration models for the constrained-decoding service: scenarios, think mode and tree files.

Pure Python (pydantic, numpy, ijson, jsonschema, pyyaml): nothing here imports Ray or torch.
"""

from config.scenarios import (
    JsonSchemaScenario,
    JsonScenario,
    LabelsScenario,
    RegexScenario,
    SCENARIO_TYPES,
    Scenario,
    ScenarioAdapter,
    ScenarioBase,
    ThinkConfig,
    TreeScenario,
    TreeSpec,
    load_scenario,
    scenario_to_dict,
)
from config.settings import Limits, ServerSettings
from config.tree_file import DEFAULT_SEP, MAX_REPORTED_PROBLEMS, TreeData, TreeFileError, is_tree_path, load_tree

__all__ = [
    "DEFAULT_SEP",
    "MAX_REPORTED_PROBLEMS",
    "JsonSchemaScenario",
    "JsonScenario",
    "LabelsScenario",
    "SCENARIO_TYPES",
    "Limits",
    "RegexScenario",
    "Scenario",
    "ScenarioAdapter",
    "ScenarioBase",
    "ServerSettings",
    "ThinkConfig",
    "TreeData",
    "TreeFileError",
    "TreeScenario",
    "TreeSpec",
    "is_tree_path",
    "load_scenario",
    "load_tree",
    "scenario_to_dict",
]
