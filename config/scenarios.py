"""Scenario models: what a stored scenario may say, validated with pydantic.

A scenario is discriminated by ``type``:

=============== =================================================================================
``tree``        a token tree, inline as ``tree`` (the tree file format) or as a ``path`` to a tree file
``labels``      a label set (single or multi label)
``json_schema`` a JSON Schema in ``schema``
``json``        any JSON value
``regex``       a regular expression in ``pattern``
=============== =================================================================================

Every kind may also carry ``think`` (a thinking budget), a ``system_prompt``, a ``description`` and generation
defaults (``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``).

Example::

    >>> s = load_scenario({"type": "labels", "labels": ["positive", "negative"]})
    >>> type(s).__name__, s.multi_label
    ('LabelsScenario', False)
    >>> scenario_to_dict(s)
    {'type': 'labels', 'labels': ['positive', 'negative'], 'multi_label': False, 'separator': ','}
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, TypeAdapter, WithJsonSchema, model_validator

from config.tree_file import DEFAULT_SEP, load_tree

__all__ = [
    "JsonScenario",
    "JsonSchemaScenario",
    "LabelsScenario",
    "RegexScenario",
    "Scenario",
    "ScenarioAdapter",
    "ScenarioBase",
    "ThinkConfig",
    "TreeScenario",
    "TreeSpec",
    "load_scenario",
    "scenario_to_dict",
]


class ConfigModel(BaseModel):
    """Base of every config model: unknown fields are errors."""

    model_config = ConfigDict(extra="forbid")


class ThinkConfig(ConfigModel):
    """Thinking budget: the answer starts inside a think block, free text until the budget or the end marker."""

    max_thinking_tokens: int = Field(ge=1, strict=True, description="Most tokens the model may spend inside the think block.")
    begin: str = Field(default="<think>\n", min_length=1, description="Marker that opens the think block.")
    end: str = Field(default="</think>\n\n", min_length=1, description="Marker that closes the think block.")

    @model_validator(mode="after")
    def _markers_differ(self) -> ThinkConfig:
        if self.begin == self.end:
            raise ValueError(f"think.begin and think.end must differ (both are {self.begin!r})")
        return self


class ScenarioBase(ConfigModel):
    """Fields every scenario kind may carry."""

    description: str | None = Field(default=None, description="Free text for people reading the scenario list.")
    think: ThinkConfig | None = Field(default=None, description="Optional thinking budget before the constraint.")
    system_prompt: str | None = Field(default=None, description="System message prepended to chat requests.")
    # strict: true is not 1 and "3" is not 3; floats must be finite (a default of Infinity broke every batch)
    max_new_tokens: int | None = Field(default=None, ge=1, strict=True, description="Default limit on generated tokens.")
    temperature: float | None = Field(default=None, ge=0, strict=True, allow_inf_nan=False,
                                      description="Default sampling temperature (0 = greedy).")
    top_p: float | None = Field(default=None, gt=0, le=1, strict=True, allow_inf_nan=False,
                                description="Default nucleus sampling mass, in (0, 1].")
    top_k: int | None = Field(default=None, ge=0, strict=True, description="Default top-k cutoff (0 = no cutoff).")

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> ScenarioBase:
        """Load a scenario of this kind from a JSON or YAML file (see :func:`load_scenario`)."""
        scenario = load_scenario(path)
        if not isinstance(scenario, cls):
            raise ValueError(f"{os.fspath(path)}: expected a {cls.__name__}, got type {scenario.type!r}")
        return scenario


_PREFIX_DICT_SCHEMA = {
    "type": "object",
    "additionalProperties": {"type": "array", "items": {"type": "integer", "minimum": 0}},
}


class TreeSpec(ConfigModel):
    """An inline token tree, in the tree file format (checked by the same rules as tree files)."""

    start_token_id: StrictInt = Field(ge=0, description="Root token id; the first state is str(start_token_id).")
    end_token_id: StrictInt = Field(ge=0, description="Token id that ends the sequence.")
    sep: str = Field(default=DEFAULT_SEP, description="Separator between ids in keys; no digits or '-'.")
    # The values are typed loosely on purpose: the shared tree checker reports bad entries with the same
    # messages as for files, capped at MAX_REPORTED_PROBLEMS, instead of one pydantic error per bad id.
    prefix_dict: Annotated[dict[str, Any], WithJsonSchema(_PREFIX_DICT_SCHEMA)] = Field(
        description="State key -> allowed next token ids; a missing or empty entry allows only the end token."
    )

    @model_validator(mode="after")
    def _check_tree(self) -> TreeSpec:
        load_tree(self)  # raises TreeFileError (a ValueError) naming every bad key
        return self


class TreeScenario(ScenarioBase):
    """Constrain output to the paths of a token tree."""

    type: Literal["tree"] = Field(description="Scenario kind.")
    tree: TreeSpec | None = Field(default=None, description="The tree inline (exclusive with path).")
    path: str | None = Field(
        default=None, description="Path to a tree file (exclusive with tree); relative to the scenario file."
    )
    append_start_token: bool = Field(
        default=True, strict=True, description="Append start_token_id to the prompt when it does not already end with it."
    )

    @model_validator(mode="after")
    def _tree_or_path(self) -> TreeScenario:
        if (self.tree is None) == (self.path is None):
            raise ValueError("a tree scenario needs exactly one of 'tree' (inline) or 'path' (a tree file)")
        if self.path is not None and not self.path.strip():
            raise ValueError("path: must not be empty")
        return self


class LabelsScenario(ScenarioBase):
    """Constrain output to one label, or to several joined by a separator."""

    type: Literal["labels"] = Field(description="Scenario kind.")
    labels: list[str] = Field(min_length=1, description="The allowed labels: unique, non-empty, not padded.")
    multi_label: bool = Field(default=False, strict=True, description="Allow several labels joined by separator.")
    separator: str = Field(default=",", min_length=1, description="Joins labels when multi_label is true.")
    max_labels: int | None = Field(default=None, ge=1, strict=True, description="Most labels per answer (multi_label only).")

    @model_validator(mode="after")
    def _check_labels(self) -> LabelsScenario:
        seen: set[str] = set()
        for i, label in enumerate(self.labels):
            if not label:
                raise ValueError(f"labels[{i}]: a label must not be empty")
            if label != label.strip():
                raise ValueError(f"labels[{i}]: label {label!r} has leading or trailing whitespace")
            if label in seen:
                raise ValueError(f"labels[{i}]: duplicate label {label!r}")
            if self.multi_label and self.separator in label:
                raise ValueError(
                    f"labels[{i}]: label {label!r} contains the separator {self.separator!r}, "
                    "so a multi-label answer could not be split unambiguously"
                )
            seen.add(label)
        if self.max_labels is not None and not self.multi_label:
            raise ValueError("max_labels is only meaningful with multi_label: true")
        return self


class JsonSchemaScenario(ScenarioBase):
    """Constrain output to JSON documents valid under a JSON Schema (field ``schema``)."""

    model_config = ConfigDict(populate_by_name=True, serialize_by_alias=True)

    type: Literal["json_schema"] = Field(description="Scenario kind.")
    json_schema: dict[str, Any] = Field(alias="schema", description="The JSON Schema the output must satisfy.")

    @model_validator(mode="after")
    def _check_schema(self) -> JsonSchemaScenario:
        from jsonschema.exceptions import SchemaError
        from jsonschema.validators import validator_for

        try:
            validator_for(self.json_schema).check_schema(self.json_schema)
        except SchemaError as error:
            where = "/".join(str(p) for p in error.absolute_path) or "<root>"
            raise ValueError(f"schema: invalid JSON Schema at {where}: {error.message}") from None
        except RecursionError:  # the checker recurses per level; servers bound the depth first (Limits)
            raise ValueError("schema: nested too deeply to check") from None
        return self


class JsonScenario(ScenarioBase):
    """Constrain output to any JSON value."""

    type: Literal["json"] = Field(description="Scenario kind.")


class RegexScenario(ScenarioBase):
    """Constrain output to full matches of a regular expression."""

    type: Literal["regex"] = Field(description="Scenario kind.")
    pattern: str = Field(min_length=1, description="The regular expression the whole output must match.")


Scenario = Annotated[
    Union[TreeScenario, LabelsScenario, JsonSchemaScenario, JsonScenario, RegexScenario],
    Field(discriminator="type"),
]
#: the values of ``type``, in the order of the union
SCENARIO_TYPES: tuple[str, ...] = ("tree", "labels", "json_schema", "json", "regex")
ScenarioAdapter: TypeAdapter[Scenario] = TypeAdapter(Scenario, config=ConfigDict(title="Scenario"))


def _read_mapping(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"scenario file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"cannot read scenario file {path}: {error}") from None
    if not text.strip():
        raise ValueError(f"scenario file {path} is empty")
    if path.suffix.lower() in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as error:
            raise ValueError(f"scenario file {path} is not valid YAML: {error}") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"scenario file {path} is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"scenario file {path} must hold a mapping at the top level, got {type(data).__name__}")
    return data


def load_scenario(source: dict[str, Any] | str | os.PathLike[str]) -> Scenario:
    """Validate a scenario given as a dict, or read it from a JSON / YAML (``.yaml``, ``.yml``) file.

    A tree scenario read from a file with a relative ``path`` gets that path resolved against the scenario
    file's directory.

    Raises:
        pydantic.ValidationError: the body breaks a rule (the message names the field).
        FileNotFoundError: the file does not exist.
        ValueError: the file cannot be read or parsed, or does not hold a mapping.
    """
    if isinstance(source, dict):
        return ScenarioAdapter.validate_python(source)
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"load_scenario() expects a dict or a path, got {type(source).__name__}")
    path = Path(source)
    scenario = ScenarioAdapter.validate_python(_read_mapping(path))
    if isinstance(scenario, TreeScenario) and scenario.path is not None:
        tree_path = Path(scenario.path)
        if not tree_path.is_absolute():
            resolved = path.resolve().parent / tree_path
            scenario = scenario.model_copy(update={"path": os.path.normpath(resolved)})
    return scenario


def scenario_to_dict(scenario: ScenarioBase) -> dict[str, Any]:
    """A JSON-ready dict of the scenario (aliases such as ``schema``, no ``None`` fields), for storage."""
    return scenario.model_dump(mode="json", by_alias=True, exclude_none=True)
