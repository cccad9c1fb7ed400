"""Scenario pipeline and scenario store failures at the HTTP edge: the one place they become the routes' answers.

The pipeline (``processors.scenarios.parse_scenario``, ``processors.ScenarioCompiler``) raises one
:class:`config.ScenarioError` per failure, with its message; here it becomes the
:class:`~deployments.protocol.ServiceError` the routes answer, with the status of its kind
(:data:`SCENARIO_ERROR_STATUS`: 422 for a body that is invalid or past a limit, 400 for one that does not compile,
also past the compile limits). A constraint field of a request refused with its name as the client sent it is a
:class:`config.ConstraintError` (one-off constraints, the tools' plan), answered as it is. Used by the model
replica (one-off constraints), the OpenAI translation and the config manager.

The scenario store (``deployments/storage/store.py``) raises its failures by kind (``deployments/storage/errors.py``); their
statuses are :data:`STORE_ERROR_STATUS`, looked up by :func:`store_error_status` when one is raised.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from config import ConstraintError, Limits, ScenarioError
from deployments.protocol import ServiceError
from processors.scenarios import checked_one_off

__all__ = ["SCENARIO_ERROR_STATUS", "STORE_ERROR_STATUS", "constraint_service_error", "refused_as_service_error", "scenario_service_error",
           "store_error_status", "validated_one_off"]

#: ScenarioError.kind -> HTTP status (written beside the kinds, :attr:`config.ScenarioError.STATUS`)
SCENARIO_ERROR_STATUS = ScenarioError.STATUS


def scenario_service_error(error: ScenarioError, noun: str = "scenario", name: str | None = None) -> ServiceError:
    """The answer to ``error``: its text (``invalid scenario: ...``, ``scenario 'x' does not compile ...``; with
    ``noun="constraint"`` for a one-off constraint) and its detail, plus ``name`` when given."""
    detail = {"name": name} if name is not None else {}
    detail.update(error.detail)
    return ServiceError(SCENARIO_ERROR_STATUS[error.kind], error.describe(noun, name), detail)


def constraint_service_error(error: ConstraintError) -> ServiceError:
    """The answer to a refused constraint field: its status, message and detail as they are."""
    return ServiceError(error.status, error.message, error.detail)


@contextmanager
def refused_as_service_error() -> Iterator[None]:
    """A block (or, called, a decorator) whose :class:`config.ConstraintError` (a kind's refusal: a catalog line, a
    PATCH item) leaves it as the :class:`ServiceError` it answers (:func:`constraint_service_error`)."""
    try:
        yield
    except ConstraintError as error:
        raise constraint_service_error(error) from None


#: the scenario store's failure kinds (deployments/storage/errors.py, by class name; a subclass takes its base's) -> status
STORE_ERROR_STATUS = {"InvalidRequest": 422, "NotFound": 404, "VersionConflict": 409, "Gone": 410,
                      "StoreUnavailable": 503, "StoreCorrupt": 500}


def store_error_status(error: Exception) -> int:
    """The HTTP status of a scenario store failure (``deployments.storage.errors.StoreError``): its kind's."""
    for cls in type(error).__mro__:
        if cls.__name__ in STORE_ERROR_STATUS:
            return STORE_ERROR_STATUS[cls.__name__]
    return 500


def validated_one_off(scenario: dict[str, Any], field: str, limits: Limits | None = None) -> dict[str, Any]:
    """Check a one-off scenario here (cheap), so a bad schema or label list is a 422 naming the OpenAI field.

    The first stage of the scenario pipeline (``processors.scenarios.checked_one_off``: ``limits`` first, the
    stored scenarios' limits: label count, schema depth and size, regex length and repetition, before the schema
    checker walks a possibly deep schema; then validation); its error names the scenario's field, renamed to the
    OpenAI field that holds it (``schema.allOf[0].pattern`` -> ``response_format.json_schema.schema.allOf[0].pattern``).
    """
    try:
        return checked_one_off(scenario, field, limits)
    except ConstraintError as error:
        raise constraint_service_error(error) from None

