"""``GET /healthz``: the manager's health, the replicas' scenario versions and whether a model replica is alive.

:class:`HealthCheck` is held by :class:`deployments.ingress.service.Ingress` (``ingress.health_check``).
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from deployments.ingress.errors import redact_json
from deployments.ingress.replicas import NO_REPLICA_MESSAGE, ReplicaCalls, call
from deployments.protocol import ServiceError

HEALTH_TIMEOUT_S = 5.0


class HealthCheck:
    """The ingress's health report.

    Args:
        manager: handle to the config manager (``health``, ``replica_versions``).
        replicas: the ingress's calls into the model replicas (whether one is alive).
        redact: what the report's texts become before a client sees them (``ServerSettings.redact_paths``).
    """

    def __init__(self, manager: Any, replicas: ReplicaCalls, redact: Callable[[str], str]):
        self.manager = manager
        self.replicas = replicas
        self.redact = redact

    async def health(self) -> dict[str, Any]:
        async def ask(method: Any) -> tuple[dict[str, Any] | None, str | None]:
            try:
                return await asyncio.wait_for(call(method), HEALTH_TIMEOUT_S), None
            except ServiceError as error:
                return None, error.message
            except asyncio.TimeoutError:
                return None, f"no answer within {HEALTH_TIMEOUT_S:g} s"

        (manager, manager_error), (replicas, replicas_error), alive = await asyncio.gather(
            ask(self.manager.health), ask(self.manager.replica_versions), self.replicas.replica_alive(fresh=True)
        )
        if manager is None:
            manager = {"status": "unreachable", "error": manager_error}
        # No model replica: none answers a ping, or the manager (read fine) knows of none (a replica registers
        # before it takes traffic). Generation cannot work: 503, whatever the rest says.
        no_replica = not alive or (replicas_error is None and isinstance(replicas, dict) and not replicas)
        report = {
            "status": "ok" if _manager_ok(manager) and replicas_error is None else "degraded",
            "ingress": "ok",
            "manager": manager if isinstance(manager, dict) else {"report": manager},
            "replicas": replicas if isinstance(replicas, dict) else {},
        }
        if no_replica:
            report["status"] = "unavailable"
            report["model"] = (NO_REPLICA_MESSAGE if not alive else
                               "no model replica is registered with the config manager (none running, or one starting)")
        if replicas_error is not None:
            report["replicas_error"] = replicas_error
        return redact_json(report, self.redact)  # public: no internal paths (Redis socket, data dir)



_BAD_STATES = {"down", "unreachable", "error", "disconnected", "degraded", "unavailable"}


def _manager_ok(report: Any) -> bool:
    """Whether the manager's report looks healthy (its ``status``, and its ``redis`` entry if it has one)."""
    if not isinstance(report, dict) or report.get("status", "ok") != "ok" or report.get("redis_ok") is False:
        return False
    redis = report.get("redis")
    if isinstance(redis, dict):
        redis = False if redis.get("ok") is False else redis.get("status")
    return redis is not False and not (isinstance(redis, str) and redis.lower() in _BAD_STATES)

