"""The Serve options of each deployment (replica counts, requests taken at once, resources), from the settings.

``deployments/app.py`` builds the application with them; the ingress reads from here what the model replicas take
at once (it tells a busy service from a dead one by it, ``deployments/ingress/replicas.py``). A leaf: it imports
only ``config``.
"""

from __future__ import annotations

from typing import Any

from config import ServerSettings

__all__ = ["INGRESS_MAX_ONGOING_REQUESTS", "MANAGER_MAX_ONGOING_REQUESTS", "REPLICA_REQUESTS_PER_BATCH_SLOT",
           "deployment_options", "replica_slots"]

# Long polls from every model replica plus admin calls; the manager's methods are async and cheap to hold.
MANAGER_MAX_ONGOING_REQUESTS = 1000
# The ingress only awaits other deployments; Serve's default (5) would cap the whole service at 5 requests.
INGRESS_MAX_ONGOING_REQUESTS = 1000
# Requests a model replica accepts per batch slot: queued rows wait there for the next step, not at the proxy.
REPLICA_REQUESTS_PER_BATCH_SLOT = 4


def deployment_options(settings: ServerSettings) -> dict[str, dict[str, Any]]:
    """The ``.options(...)`` of each deployment for ``settings`` (separate so it can be inspected and tested)."""
    options: dict[str, dict[str, Any]] = {
        "manager": {
            "name": "ConfigManager",
            "num_replicas": 1,
            "max_ongoing_requests": MANAGER_MAX_ONGOING_REQUESTS,
            "ray_actor_options": {"num_cpus": 0},
        },
        "model": {
            "name": "ModelReplica",
            "num_replicas": settings.num_replicas,
            "max_ongoing_requests": REPLICA_REQUESTS_PER_BATCH_SLOT * settings.max_batch_size,
            "ray_actor_options": {
                "num_cpus": settings.num_cpus_per_replica,
                "num_gpus": settings.num_gpus_per_replica,
            },
        },
        "ingress": {
            "name": "Ingress",
            "num_replicas": 1,
            "max_ongoing_requests": INGRESS_MAX_ONGOING_REQUESTS,
            "ray_actor_options": {"num_cpus": 0},
        },
    }
    if settings.max_replicas_per_node is not None:
        options["model"]["max_replicas_per_node"] = settings.max_replicas_per_node
    for key, resources in settings.custom_resources.items():
        if resources:
            options[key]["ray_actor_options"]["resources"] = dict(resources)
    if settings.engine == "vllm" and settings.beam_replicas > 0:  # the model's options, its own name and count
        beams = {**options["model"], "name": "BeamReplica", "num_replicas": settings.beam_replicas}
        beams["ray_actor_options"] = dict(options["model"]["ray_actor_options"])
        options["beams"] = beams
    return options




def replica_slots(settings: ServerSettings) -> int:
    """The requests the model replicas take at once, all of them (``num_replicas`` times each one's
    ``max_ongoing_requests``)."""
    return settings.num_replicas * REPLICA_REQUESTS_PER_BATCH_SLOT * settings.max_batch_size
