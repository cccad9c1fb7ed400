"""Scenario pipeline failures at the HTTP edge: the one place their HTTP statuses are chosen.

The pipeline (``config.parse_scenario``, ``processors.ScenarioCompiler``) raises one :class:`config.ScenarioError`
per failure, with its message; here it becomes the :class:`~deployments.protocol.ServiceError` the routes answer:
422 for a body that is invalid or past a limit, 400 for one that does not compile (also past the compile
limits). Used by the model replica (one-off constraints), the OpenAI translation and the config manager.
"""

from __future__ import annotations

from config import ScenarioError
from deployments.protocol import ServiceError

__all__ = ["SCENARIO_ERROR_STATUS", "scenario_service_error"]

#: ScenarioError.kind -> HTTP status
SCENARIO_ERROR_STATUS = {"invalid": 422, "limit": 422, "compile": 400, "timeout": 400}


def scenario_service_error(error: ScenarioError, noun: str = "scenario", name: str | None = None) -> ServiceError:
    """The answer to ``error``: its text (``invalid scenario: ...``, ``scenario 'x' does not compile ...``; with
    ``noun="constraint"`` for a one-off constraint) and its detail, plus ``name`` when given."""
    detail = {"name": name} if name is not None else {}
    detail.update(error.detail)
    return ServiceError(SCENARIO_ERROR_STATUS[error.kind], error.describe(noun, name), detail)
