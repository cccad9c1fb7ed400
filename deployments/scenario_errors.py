"""Scenario pipeline and scenario store failures at the HTTP edge: the one place their HTTP statuses are chosen.

The pipeline (``processors.scenarios.parse_scenario``, ``processors.ScenarioCompiler``) raises one :class:`config.ScenarioError`
per failure, with its message; here it becomes the :class:`~deployments.protocol.ServiceError` the routes answer:
422 for a body that is invalid or past a limit, 400 for one that does not compile (also past the compile
limits). Used by the model replica (one-off constraints), the OpenAI translation and the config manager.

The scenario store (``deployments/store.py``) raises its failures by kind (``deployments/store_errors.py``); their
statuses are :data:`STORE_ERROR_STATUS`, looked up by :func:`store_error_status` when one is raised.
"""

from __future__ import annotations

from typing import Any

from config import Limits, ScenarioError, scenario_to_dict
from processors.scenarios import parse_scenario, scenario_model
from deployments.protocol import ServiceError

__all__ = ["SCENARIO_ERROR_STATUS", "STORE_ERROR_STATUS", "openai_field_error", "scenario_service_error", "store_error_status",
           "validated_one_off"]

#: ScenarioError.kind -> HTTP status
SCENARIO_ERROR_STATUS = {"invalid": 422, "limit": 422, "compile": 400, "timeout": 400}


def scenario_service_error(error: ScenarioError, noun: str = "scenario", name: str | None = None) -> ServiceError:
    """The answer to ``error``: its text (``invalid scenario: ...``, ``scenario 'x' does not compile ...``; with
    ``noun="constraint"`` for a one-off constraint) and its detail, plus ``name`` when given."""
    detail = {"name": name} if name is not None else {}
    detail.update(error.detail)
    return ServiceError(SCENARIO_ERROR_STATUS[error.kind], error.describe(noun, name), detail)


#: the scenario store's failure kinds (deployments/store_errors.py, by class name; a subclass takes its base's) -> status
STORE_ERROR_STATUS = {"InvalidRequest": 422, "NotFound": 404, "VersionConflict": 409, "Gone": 410,
                      "StoreUnavailable": 503, "StoreCorrupt": 500}


def store_error_status(error: Exception) -> int:
    """The HTTP status of a scenario store failure (``deployments.store_errors.StoreError``): its kind's."""
    for cls in type(error).__mro__:
        if cls.__name__ in STORE_ERROR_STATUS:
            return STORE_ERROR_STATUS[cls.__name__]
    return 500


def validated_one_off(scenario: dict[str, Any], field: str, limits: Limits | None = None) -> dict[str, Any]:
    """Check a one-off scenario here (cheap), so a bad schema or label list is a 422 naming the OpenAI field.

    The first stage of the scenario pipeline (``processors.scenarios.parse_scenario``: ``limits`` first, the stored scenarios'
    limits: label count, schema depth and size, regex length and repetition, before the schema checker walks a
    possibly deep schema; then validation); its error names the scenario's field, renamed here to the OpenAI field
    that holds it (``schema.allOf[0].pattern`` -> ``response_format.json_schema.schema.allOf[0].pattern``).
    """
    try:
        return scenario_to_dict(parse_scenario(scenario, limits, one_off=True))
    except ScenarioError as error:
        raise openai_field_error(error, field, getattr(scenario_model(scenario["type"]), "constraint_field", None)) from None


def openai_field_error(error: ScenarioError, field: str, main: str | None) -> ServiceError:
    """``error`` with its fields named as the client sent them: ``main`` (the scenario's field holding the
    constraint) is ``field``."""
    status = SCENARIO_ERROR_STATUS[error.kind]
    if error.kind == "limit":
        inner = error.field or ""
        inside = main is not None and (inner == main or inner.startswith((f"{main}.", f"{main}[")))
        where = field + inner[len(main):] if inside else f"{field}.{inner}"
        return ServiceError(status, f"{where}: {error.reason}", {**error.detail, "field": where})
    parts = []
    for loc, item in zip(error.locs, error.detail.get("errors", ())):
        loc = [str(p) for p in loc]
        if loc and loc[0] == main:  # `field` already names it
            loc = loc[1:]
        parts.append(f"{'.'.join([field, *loc])}: {item['message']}")
    message = "; ".join(parts[:5]) + (f"; and {len(parts) - 5} more" if len(parts) > 5 else "")
    return ServiceError(status, message or f"{field}: {error.message}")
