"""Scenario models: what a stored scenario may say, validated with pydantic.

A scenario is discriminated by ``type``:

=============== =================================================================================
``tree``        a token tree, inline as ``tree`` (the tree file format) or as a ``path`` to a tree file
``labels``      a label set (single or multi label)
``json_schema`` a JSON Schema in ``schema``
``json``        any JSON value
``regex``       a regular expression in ``pattern``
``grammar``     a context-free grammar in ``grammar`` (Lark syntax, as llguidance reads it)
``tools``       a stored tool set: OpenAI function ``tools`` and the default ``tool_choice`` (a call's JSON schema)
=============== =================================================================================

Every kind may also carry ``think`` (a thinking budget), a ``system_prompt``, a ``description`` and generation
defaults (``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``).

The union :data:`Scenario` is the one map from a ``type`` name to its config model (:func:`scenario_model`). The
models live in their kinds' packages (``processors/kinds/<kind>/spec.py``, torch-free); each carries what is specific to its kind on the config side: the cheap limit checks of a raw body
(:meth:`ScenarioBase.check_limits`), whether a one-off (unstored) body may use it as given
(:meth:`ScenarioBase.check_one_off`) and the field that holds the constraint (``constraint_field``). The compile
side of each kind is in the same package (``processors/kinds/<kind>/``).

:func:`parse_scenario` is the first stage of the scenario pipeline (shape -> limits -> validation), pure Python so
that the ingress can run it too; every failure is one :class:`ScenarioError`. ``processors.pipeline`` adds the
compile stage.

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
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Union, get_args

from pydantic import (
    ConfigDict, Field, TypeAdapter, ValidationError,
)


if TYPE_CHECKING:
    from config.settings import Limits

__all__ = [
    "GrammarScenario",
    "JsonScenario",
    "JsonSchemaScenario",
    "LabelsScenario",
    "RegexScenario",
    "SCENARIO_TYPES",
    "Scenario",
    "ScenarioAdapter",
    "ScenarioBase",
    "ScenarioError",
    "ThinkConfig",
    "ToolsScenario",
    "TreeScenario",
    "TreeSpec",
    "check_scenario_body",
    "load_scenario",
    "parse_scenario",
    "scenario_model",
    "scenario_to_dict",
    "validate_scenario_body",
]


from config.scenario_base import ConfigModel, ScenarioBase, ScenarioError, ThinkConfig, _rebuild_error  # noqa: F401
# Each kind's config model lives in its package (processors/kinds/<kind>/spec.py, torch-free); adding a kind is
# adding its import here and its member to the union below.
from processors.kinds.grammar.spec import GrammarScenario
from processors.kinds.json_schema.spec import JsonSchemaScenario, JsonScenario
from processors.kinds.labels.spec import LabelsScenario
from processors.kinds.regex.spec import RegexScenario
from processors.kinds.tools.spec import ToolsScenario
from processors.kinds.tree.spec import TreeScenario, TreeSpec

Scenario = Annotated[
    Union[TreeScenario, LabelsScenario, JsonSchemaScenario, JsonScenario, RegexScenario, GrammarScenario,
          ToolsScenario],
    Field(discriminator="type"),
]
ScenarioAdapter: TypeAdapter[Scenario] = TypeAdapter(Scenario, config=ConfigDict(title="Scenario"))
#: ``type`` name -> config model, from the union (the only place the names are written down)
_MODELS: dict[str, type[ScenarioBase]] = {
    get_args(model.model_fields["type"].annotation)[0]: model for model in get_args(get_args(Scenario)[0])
}
#: the values of ``type``, in the order of the union
SCENARIO_TYPES: tuple[str, ...] = tuple(_MODELS)


def scenario_model(type_name: Any) -> type[ScenarioBase] | None:
    """The config model of the scenario kind ``type_name`` (None for anything else)."""
    return _MODELS.get(type_name) if isinstance(type_name, str) else None


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


# --------------------------------------------------------------------------------------------- the pipeline's first stage


def _join(parts: list[str]) -> str:
    """Up to five messages, then a count of the rest."""
    return "; ".join(parts[:5]) + (f"; and {len(parts) - 5} more" if len(parts) > 5 else "")


def _invalid(body: Mapping[str, Any], error: ValidationError) -> ScenarioError:
    """One :class:`ScenarioError` for pydantic's errors: each names its field inside the body."""
    errors: list[dict[str, Any]] = []
    locs: list[tuple] = []
    parts: list[str] = []
    for err in error.errors():
        loc = tuple(err.get("loc", ()))
        if loc and loc[0] == body.get("type"):  # the discriminated union puts the tag first
            loc = loc[1:]
        where = ".".join(str(p) for p in loc)
        if not where and str(err.get("type", "")).startswith("union_tag"):
            where = "type"
        msg = str(err.get("msg", "")).removeprefix("Value error, ")
        if err.get("type") == "union_tag_not_found":
            msg = (f"missing: a scenario body needs \"type\", one of {', '.join(SCENARIO_TYPES)} (a bare tree file "
                   "goes under \"tree\": {\"type\": \"tree\", \"tree\": {...}}; cs-admin put --tree does that)")
        errors.append({"field": where or None, "message": msg})
        locs.append(loc)
        parts.append(f"{where}: {msg}" if where else msg)
    return ScenarioError("invalid", _join(parts), detail={"errors": errors}, locs=locs)


def check_scenario_body(body: Any, limits: Limits | None = None, *, one_off: bool = False,
                        field: str = "body") -> None:
    """The cheap checks of a raw scenario body, before anything walks it recursively: a JSON object, the
    ``limits`` (:meth:`config.Limits.check_scenario`, then the nesting depth, named ``field``; with ``one_off`` the
    smaller bounds of a one-off constraint, :meth:`ScenarioBase.check_one_off_limits`), and with ``one_off`` what a
    one-off constraint may not use (:meth:`ScenarioBase.check_one_off`).

    Raises:
        ScenarioError: ``invalid`` or ``limit``.
    """
    from config.settings import LimitExceeded

    if not isinstance(body, Mapping):
        raise ScenarioError("invalid", f"a scenario body must be a JSON object, got {type(body).__name__}")
    if limits is not None:
        try:
            limits.check_scenario(body)  # first: it names the limit of the field (schema depth, ...)
            limits.check_json_depth(body, field)
            if one_off and (kind := scenario_model(body.get("type"))) is not None:
                kind.check_one_off_limits(body, limits)
        except LimitExceeded as exc:
            raise ScenarioError("limit", str(exc), field=exc.field, reason=exc.reason, detail=exc.detail()) from None
    if one_off:
        model = scenario_model(body.get("type"))
        if model is not None:
            model.check_one_off(body)


def parse_scenario(body: Any, limits: Limits | None = None, *, one_off: bool = False, field: str = "body",
                   from_json: bool = False) -> Scenario:
    """Stage one of the scenario pipeline: :func:`check_scenario_body`, then validation into its config model.
    ``from_json``: the body was just parsed from JSON text (the config manager's bodies, from HTTP or Redis), so the
    check that it serializes as JSON (a full ``json.dumps``, seconds for a large inline tree) is skipped.

    Raises:
        ScenarioError: ``invalid`` (the message names each bad field, ``errors`` in its detail) or ``limit``.
    """
    check_scenario_body(body, limits, one_off=one_off, field=field)
    if not from_json:
        try:
            json.dumps(body)
        except (TypeError, ValueError) as exc:
            raise ScenarioError("invalid", f"the scenario body is not JSON: {exc}") from None
    return validate_scenario_body(body)


def validate_scenario_body(body: Mapping[str, Any]) -> Scenario:
    """Validate a checked body (see :func:`parse_scenario`) into its config model; :class:`ScenarioError`
    (``invalid``) naming each bad field."""
    try:
        return ScenarioAdapter.validate_python(body if isinstance(body, dict) else dict(body))
    except ValidationError as exc:
        raise _invalid(body, exc) from None
