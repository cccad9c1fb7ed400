"""The application builder ``serve_config.yaml`` imports: ``import_path: deployments.app:build_app``.

Three deployments, each a plain class made a deployment here (so each stays constructible without Serve):

* ``ConfigManager`` (``deployments/manager/``; 1 replica, no CPU reserved): Redis <-> compiled tables <-> replicas.
  Every model replica keeps a long poll open on it and admin calls wait on it, hence its high
  ``max_ongoing_requests``.
* ``ModelReplica`` (``num_replicas``, CPUs/GPUs from the settings): the model and the decode loop.
* ``BeamReplica`` (only with ``engine: vllm`` and ``beam_replicas`` > 0): ``ModelReplica`` on the transformers
  engine, the same model and settings otherwise; the ingress sends it the requests with ``num_beams`` > 1 (vLLM's
  engine does not run constrained beam search, see docs/engines.md). It registers with the manager like any model
  replica (scenario versions, acks).
* ``Ingress`` (no CPU reserved): the FastAPI app, handed to Serve through ``__serve_build_asgi_app__``.

Settings travel to every constructor as ``ServerSettings.model_dump()`` dicts; each deployment's options (replicas,
requests taken at once, resources) are ``deployments/options.py``'s.
"""

from __future__ import annotations

import os
from typing import Any

from ray import serve

from config import ServerSettings
from deployments.options import (
    INGRESS_MAX_ONGOING_REQUESTS, MANAGER_MAX_ONGOING_REQUESTS, REPLICA_REQUESTS_PER_BATCH_SLOT, deployment_options,
)

__all__ = ["MANAGER_MAX_ONGOING_REQUESTS", "INGRESS_MAX_ONGOING_REQUESTS", "REPLICA_REQUESTS_PER_BATCH_SLOT", "build_app",
           "deployment_options"]


def build_app(args: dict[str, Any] | None = None) -> serve.Application:
    """Build the Serve application from ``serve_config.yaml``'s ``args`` (see ``config.ServerSettings``)."""
    from deployments.ingress import Ingress
    from deployments.manager import ConfigManager
    from deployments.replica import ServeModelReplica

    settings = ServerSettings.from_args(args)
    # Replicas may run with another working directory than the one `serve run` was started in.
    update: dict[str, Any] = {"data_dir": os.path.abspath(os.path.expanduser(settings.data_dir))}
    if settings.model and os.path.exists(os.path.expanduser(settings.model)):
        update["model"] = os.path.abspath(os.path.expanduser(settings.model))
    settings = settings.model_copy(update=update)
    options = deployment_options(settings)
    settings_dict = settings.model_dump()

    manager = serve.deployment(ConfigManager).options(**options["manager"]).bind(settings_dict)
    model = serve.deployment(ServeModelReplica).options(**options["model"]).bind(settings_dict, manager)
    beams = None
    if "beams" in options:  # engine vllm: beam requests go to transformers-engine replicas of the same model
        beams = serve.deployment(ServeModelReplica).options(**options["beams"]).bind(
            {**settings_dict, "engine": "transformers"}, manager)
    # serve.ingress() without an app: the class's __serve_build_asgi_app__ returns the FastAPI app that
    # Ingress built with routes bound to itself (no class-based-view rewriting, same app in unit tests).
    ingress = serve.deployment(serve.ingress()(Ingress)).options(**options["ingress"])
    return ingress.bind(settings_dict, model, manager, beams)
