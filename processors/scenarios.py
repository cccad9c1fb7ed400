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

from config.echo import SHOWN_NAMES, shown_path
from config.limit_checks import LimitExceeded
from config.scenario_base import ConstraintError, ScenarioBase, ScenarioError, read_scenario_file, scenario_to_dict
from processors.kinds import kind_packages

if TYPE_CHECKING:
    from config.settings import Limits

__all__ = [
    "SCENARIO_TYPES",
    "Scenario",
    "ScenarioAdapter",
    "check_limits",
    "check_scenario_body",
    "checked_one_off",
    "field_error",
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


def check_limits(body: Any, limits: Limits) -> Any:
    """The cheap limit checks of a raw scenario body (before validation; wrongly typed fields are left to
    validation): those of its kind (the config model's :meth:`~config.ScenarioBase.check_limits`: label count,
    inline tree keys, schema nesting and size, regex length and repetition, also of the patterns in a schema),
    then the scenario's ``description`` (:meth:`config.Limits.check_description`, every kind) and its own
    ``max_new_tokens`` (:meth:`config.Limits.check_max_new_tokens`). A tree given as a
    ``path`` is counted when it is loaded (:meth:`config.Limits.check_tree_keys`). Returns what the kind's check
    built for the validation of this body to reuse (:func:`validate_scenario_body`'s ``prepared``), or None.

    Raises:
        LimitExceeded: naming the field and the limit.
    """
    if not isinstance(body, Mapping):
        return None
    model = scenario_model(body.get("type"))
    prepared = model.check_limits(body, limits) if model is not None else None
    limits.check_description(body)
    limits.check_max_new_tokens(body)
    return prepared


# --------------------------------------------------------------------------------------------- the pipeline's first stage


def _join(parts: list[str]) -> str:
    """Up to five messages, then a count of the rest."""
    return "; ".join(parts[:5]) + (f"; and {len(parts) - 5} more" if len(parts) > 5 else "")


def _invalid(body: Mapping[str, Any], error: ValidationError) -> ScenarioError:
    """One :class:`ScenarioError` for pydantic's errors: each names its field inside the body (a key the client gave
    shown bounded, :func:`config.echo.shown_path`); the detail lists the first ``SHOWN_NAMES`` (``locs`` and the
    message count them all)."""
    errors: list[dict[str, Any]] = []
    locs: list[tuple] = []
    parts: list[str] = []
    for err in error.errors():
        loc = tuple(err.get("loc", ()))
        if loc and loc[0] == body.get("type"):  # the discriminated union puts the tag first
            loc = loc[1:]
        where = shown_path(loc)
        if not where and str(err.get("type", "")).startswith("union_tag"):
            where = "type"
        msg = str(err.get("msg", "")).removeprefix("Value error, ")
        if err.get("type") == "union_tag_not_found":
            msg = (f"missing: a scenario body needs \"type\", one of {', '.join(SCENARIO_TYPES)} (a bare tree file "
                   "goes under \"tree\": {\"type\": \"tree\", \"tree\": {...}}; cs-admin put --tree does that)")
        if len(errors) < SHOWN_NAMES:
            errors.append({"field": where or None, "message": msg})
        locs.append(loc)
        parts.append(f"{where}: {msg}" if where else msg)
    return ScenarioError("invalid", _join(parts), detail={"errors": errors}, locs=locs)


def check_scenario_body(body: Any, limits: Limits | None = None, *, one_off: bool = False,
                        field: str = "body") -> Any:
    """The cheap checks of a raw scenario body, before anything walks it recursively: a JSON object, the
    ``limits`` (:func:`check_limits`, then the nesting depth, named ``field``; with ``one_off`` the
    smaller bounds of a one-off constraint, :meth:`ScenarioBase.check_one_off_limits`), and with ``one_off`` what a
    one-off constraint may not use (:meth:`ScenarioBase.check_one_off`). Returns what the limit checks built for
    the validation to reuse (:func:`check_limits`), or None.

    Raises:
        ScenarioError: ``invalid`` or ``limit``.
    """
    prepared = None
    if not isinstance(body, Mapping):
        raise ScenarioError("invalid", f"a scenario body must be a JSON object, got {type(body).__name__}")
    if limits is not None:
        try:
            prepared = check_limits(body, limits)  # first: it names the limit of the field (schema depth, ...)
            limits.check_json_depth(body, field)
            if one_off and (kind := scenario_model(body.get("type"))) is not None:
                kind.check_one_off_limits(body, limits)
        except LimitExceeded as exc:
            raise ScenarioError("limit", str(exc), field=exc.field, reason=exc.reason, detail=exc.detail()) from None
    if one_off:
        model = scenario_model(body.get("type"))
        if model is not None:
            model.check_one_off(body)
    return prepared


def parse_scenario(body: Any, limits: Limits | None = None, *, one_off: bool = False, field: str = "body",
                   from_json: bool = False) -> Scenario:
    """Stage one of the scenario pipeline: :func:`check_scenario_body`, then validation into its config model.
    ``from_json``: the body was just parsed from JSON text (the config manager's bodies, from HTTP or Redis), so the
    check that it serializes as JSON (a full ``json.dumps``, seconds for a large inline tree) is skipped.

    Raises:
        ScenarioError: ``invalid`` (the message names each bad field, ``errors`` in its detail) or ``limit``.
    """
    prepared = check_scenario_body(body, limits, one_off=one_off, field=field)
    if not from_json:
        try:
            json.dumps(body)
        except (TypeError, ValueError) as exc:
            raise ScenarioError("invalid", f"the scenario body is not JSON: {exc}") from None
    return validate_scenario_body(body, prepared)


def validate_scenario_body(body: Mapping[str, Any], prepared: Any = None) -> Scenario:
    """Validate a checked body (see :func:`parse_scenario`) into its config model; :class:`ScenarioError`
    (``invalid``) naming each bad field. ``prepared``: what :func:`check_scenario_body` returned for this body
    (the validators read it as ``info.context["prepared"]``)."""
    data = body if isinstance(body, dict) else dict(body)
    try:
        if prepared is None:
            return ScenarioAdapter.validate_python(data)
        return ScenarioAdapter.validate_python(data, context={"prepared": prepared})
    except ValidationError as exc:
        raise _invalid(body, exc) from None


# --------------------------------------------------------------------------------------- fields named as sent


def field_error(error: ScenarioError, field: str, main: str | None) -> ConstraintError:
    """``error`` (of a constraint given inside a request) with its fields named as the client sent them: ``main``
    (the scenario's field holding the constraint) is ``field``; the status is that of its kind
    (:attr:`ScenarioError.STATUS <config.ScenarioError>`)."""
    status = ScenarioError.STATUS[error.kind]
    if error.kind == "limit":
        inner = error.field or ""
        inside = main is not None and (inner == main or inner.startswith((f"{main}.", f"{main}[")))
        where = field + inner[len(main):] if main is not None and inside else f"{field}.{inner}"
        return ConstraintError(status, f"{where}: {error.reason}", {**error.detail, "field": where})
    parts = []
    for loc, item in zip(error.locs, error.detail.get("errors", ())):
        names = list(loc)
        if names and names[0] == main:  # `field` already names it
            names = names[1:]
        where = f"{field}.{shown_path(names)}" if names else field
        parts.append(f"{where}: {item['message']}")
    message = "; ".join(parts[:5]) + (f"; and {len(error.locs) - 5} more" if len(error.locs) > 5 else "")
    return ConstraintError(status, message or f"{field}: {error.message}")


def checked_one_off(scenario: dict[str, Any], field: str, limits: Limits | None = None) -> dict[str, Any]:
    """A one-off scenario given in a request's ``field``, checked (cheap: :func:`parse_scenario` with ``one_off``,
    ``limits`` first) and returned as stored (:func:`~config.scenario_to_dict`).

    Raises:
        ConstraintError: naming the request's field (``schema.allOf[0].pattern`` ->
            ``response_format.json_schema.schema.allOf[0].pattern``; :func:`field_error`).
    """
    try:
        return scenario_to_dict(parse_scenario(scenario, limits, one_off=True))
    except ScenarioError as error:
        raise field_error(error, field, getattr(scenario_model(scenario["type"]), "constraint_field", None)) from None
