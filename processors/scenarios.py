"""The ``Scenario`` union: every kind's config model, and the first stage of the scenario pipeline.

Torch-free (pydantic only): the ingress, the config manager and the CLI import it without loading a model. It sits
above the kinds' specs (``processors/kinds/<kind>/spec.py``) and below their compile side.

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

The kinds are found once, by :func:`processors.kinds.kind_packages` (every package under ``processors/kinds/``):
here each package's ``spec`` module gives its config models (the :class:`~config.ScenarioBase` subclasses it
defines with a ``type`` literal), in :attr:`~config.ScenarioBase.union_order`; the registry imports each package's
``kind`` module from the same list. The union :data:`Scenario` is then the one map from a ``type`` name to its
config model (:func:`scenario_model`). Each model carries what is specific to its kind on the config side: the
cheap limit checks of a raw body (:meth:`~config.ScenarioBase.check_limits`), whether a one-off (unstored) body
may use it as given (:meth:`~config.ScenarioBase.check_one_off`) and the field that holds the constraint
(``constraint_field``).

:func:`parse_scenario` is the first stage of the scenario pipeline (shape -> limits -> validation), pure Python so
that the ingress can run it too; every failure is one :class:`~config.ScenarioError`. ``processors.pipeline`` adds
the compile stage.

Example::

    >>> s = load_scenario({"type": "labels", "labels": ["positive", "negative"]})
    >>> type(s).__name__, s.multi_label
    ('LabelsScenario', False)
    >>> scenario_to_dict(s)
    {'type': 'labels', 'labels': ['positive', 'negative'], 'multi_label': False, 'separator': ','}
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Union, get_args

from pydantic import ConfigDict, Field, TypeAdapter, ValidationError

from config.limit_checks import LimitExceeded
from config.scenario_base import ScenarioBase, ScenarioError, read_scenario_file, scenario_to_dict
from processors.kinds import kind_packages

if TYPE_CHECKING:
    from config.settings import Limits

__all__ = [
    "SCENARIO_TYPES",
    "Scenario",
    "ScenarioAdapter",
    "check_limits",
    "check_scenario_body",
    "load_scenario",
    "parse_scenario",
    "scenario_model",
    "scenario_to_dict",
    "validate_scenario_body",
]


def _type_name(model: type[ScenarioBase]) -> str:
    return get_args(model.model_fields["type"].annotation)[0]


def _spec_models() -> list[type[ScenarioBase]]:
    """The config models of every kind package's ``spec`` module, in union order (ties: package, then definition
    order)."""
    found: list[type[ScenarioBase]] = []
    for package in kind_packages():
        spec = importlib.import_module(f"processors.kinds.{package}.spec")
        found.extend(obj for obj in vars(spec).values()
                     if isinstance(obj, type) and issubclass(obj, ScenarioBase) and obj.__module__ == spec.__name__
                     and "type" in obj.model_fields)
    return sorted(found, key=lambda model: model.union_order)  # stable: ties keep package order


_UNION_MODELS = _spec_models()

if TYPE_CHECKING:
    Scenario = ScenarioBase
else:
    #: the discriminated union of every kind's config model
    Scenario = Annotated[Union[tuple(_UNION_MODELS)], Field(discriminator="type")]
ScenarioAdapter: TypeAdapter[Scenario] = TypeAdapter(Scenario, config=ConfigDict(title="Scenario"))
#: ``type`` name -> config model, in the order of the union
_MODELS: dict[str, type[ScenarioBase]] = {_type_name(model): model for model in _UNION_MODELS}
#: the values of ``type``, in the order of the union
SCENARIO_TYPES: tuple[str, ...] = tuple(_MODELS)


def scenario_model(type_name: Any) -> type[ScenarioBase] | None:
    """The config model of the scenario kind ``type_name`` (None for anything else)."""
    return _MODELS.get(type_name) if isinstance(type_name, str) else None


def load_scenario(source: dict[str, Any] | str | os.PathLike[str]) -> Scenario:
    """Validate a scenario given as a dict, or read it from a JSON / YAML (``.yaml``, ``.yml``) file.

    Paths inside a scenario read from a file (a tree's relative ``path``) are resolved against the scenario
    file's directory (:meth:`~config.ScenarioBase.resolve_paths`).

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
    scenario = ScenarioAdapter.validate_python(read_scenario_file(path))
    return scenario.resolve_paths(path.resolve().parent)


def check_limits(body: Any, limits: Limits) -> None:
    """The cheap limit checks of a raw scenario body (before validation; wrongly typed fields are left to
    validation): those of its kind (the config model's :meth:`~config.ScenarioBase.check_limits`: label count,
    inline tree keys, schema nesting and size, regex length and repetition, also of the patterns in a schema),
    then the scenario's own ``max_new_tokens`` (:meth:`config.Limits.check_max_new_tokens`). A tree given as a
    ``path`` is counted when it is loaded (:meth:`config.Limits.check_tree_keys`).

    Raises:
        LimitExceeded: naming the field and the limit.
    """
    if not isinstance(body, Mapping):
        return
    model = scenario_model(body.get("type"))
    if model is not None:
        model.check_limits(body, limits)
    limits.check_max_new_tokens(body)


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
    ``limits`` (:func:`check_limits`, then the nesting depth, named ``field``; with ``one_off`` the
    smaller bounds of a one-off constraint, :meth:`ScenarioBase.check_one_off_limits`), and with ``one_off`` what a
    one-off constraint may not use (:meth:`ScenarioBase.check_one_off`).

    Raises:
        ScenarioError: ``invalid`` or ``limit``.
    """
    if not isinstance(body, Mapping):
        raise ScenarioError("invalid", f"a scenario body must be a JSON object, got {type(body).__name__}")
    if limits is not None:
        try:
            check_limits(body, limits)  # first: it names the limit of the field (schema depth, ...)
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
