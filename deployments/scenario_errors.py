"""Scenario pipeline and scenario store failures at the HTTP edge: the one place their HTTP statuses are chosen.

The pipeline (``config.parse_scenario``, ``processors.ScenarioCompiler``) raises one :class:`config.ScenarioError`
per failure, with its message; here it becomes the :class:`~deployments.protocol.ServiceError` the routes answer:
422 for a body that is invalid or past a limit, 400 for one that does not compile (also past the compile
limits). Used by the model replica (one-off constraints), the OpenAI translation and the config manager.

The scenario store (``deployments/store.py``) raises its failures by kind (``deployments/store_errors.py``); their
statuses are :data:`STORE_ERROR_STATUS`, looked up by :func:`store_error_status` when one is raised.
"""

from __future__ import annotations

from config import ScenarioError
from deployments.protocol import ServiceError

__all__ = ["SCENARIO_ERROR_STATUS", "STORE_ERROR_STATUS", "scenario_service_error", "store_error_status"]

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
