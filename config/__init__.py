"""Configuration models for the constrained-decoding service: scenarios, think mode and tree files.

Pure Python (pydantic, numpy, ijson, jsonschema, pyyaml): nothing here imports Ray or torch.
"""

from config.scenarios import (
    GrammarScenario,
    JsonSchemaScenario,
    JsonScenario,
    LabelsScenario,
    RegexScenario,
    SCENARIO_TYPES,
    Scenario,
    ScenarioAdapter,
    ScenarioBase,
    ScenarioError,
    ThinkConfig,
    ToolsScenario,
    TreeScenario,
    TreeSpec,
    check_scenario_body,
    load_scenario,
    parse_scenario,
    scenario_model,
    scenario_to_dict,
    validate_scenario_body,
)
from config.settings import Limits, ServerSettings
from config.tree_file import DEFAULT_SEP, MAX_REPORTED_PROBLEMS, TreeData, TreeFileError, is_tree_path, load_tree

__all__ = [
    "DEFAULT_SEP",
    "MAX_REPORTED_PROBLEMS",
    "GrammarScenario",
    "JsonSchemaScenario",
    "JsonScenario",
    "LabelsScenario",
    "SCENARIO_TYPES",
    "Limits",
    "RegexScenario",
    "Scenario",
    "ScenarioAdapter",
    "ScenarioBase",
    "ScenarioError",
    "ServerSettings",
    "ThinkConfig",
    "ToolsScenario",
    "TreeData",
    "TreeFileError",
    "TreeScenario",
    "TreeSpec",
    "check_scenario_body",
    "is_tree_path",
    "load_scenario",
    "load_tree",
    "parse_scenario",
    "scenario_model",
    "scenario_to_dict",
    "validate_scenario_body",
]
