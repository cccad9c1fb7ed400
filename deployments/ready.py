"""The ready line: ``constrained-serve ready: http://127.0.0.1:8000 (2 replicas serving 3 scenarios)``.

Ray 2.60's ``serve run`` prints no "Deployed app" line, so a new user cannot tell when the service answers.
The ingress starts :func:`announce_when_ready` in its replica: a thread that asks the config manager which model
replicas have registered and prints the line once as many serve as the settings ask for (``num_replicas``).
The line goes to the ingress's stdout, which ``serve run`` shows on its console.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

logger = logging.getLogger("ray.serve")

__all__ = ["announce_when_ready", "ready_line", "serve_http_url"]

#: how long the thread waits for every replica before it gives up silently (the health route still tells)
READY_WAIT_S = 1800.0


def ready_line(url: str | None, replicas: int, scenarios: int) -> str:
    where = f": {url}" if url else ""
    return (f"constrained-serve ready{where} ({replicas} replica{'s' if replicas != 1 else ''} serving "
            f"{scenarios} scenario{'s' if scenarios != 1 else ''}); stop it with Ctrl-C (or SIGTERM to serve run)")


def serve_http_url() -> str | None:
    """The address Serve's HTTP proxy listens on (``http_options`` of serve_config.yaml), or None if unknown.

    ``serve.status()`` does not carry the HTTP options; Serve's REST API does (``GET /api/serve/applications/`` on
    the Ray dashboard answers a ``ServeInstanceDetails`` with ``http_options``). The dashboard is found from the
    cluster this process is connected to (``JobSubmissionClient`` resolves its address through the cluster's GCS,
    so a dashboard moved off its default port is still found, and it sends the cluster's authentication), and
    the REST API is read with the client the ``serve`` CLI uses.
    """
    try:
        import ray

        if not ray.is_initialized():  # not inside Ray: never start a cluster just to print a line
            return None
        from ray.dashboard.modules.serve.sdk import ServeSubmissionClient
        from ray.job_submission import JobSubmissionClient

        dashboard = JobSubmissionClient(ray.get_runtime_context().gcs_address).get_address()
        options = ServeSubmissionClient(dashboard).get_serve_details().get("http_options") or {}
        host = options.get("host") or "127.0.0.1"
        host = host if host not in ("0.0.0.0", "::") else "127.0.0.1"
        return f"http://{host}:{int(options['port'])}{options.get('root_path') or ''}"
    except Exception:  # no dashboard, or Serve not started: the line goes without the address
        logger.debug("could not read Serve's HTTP options", exc_info=True)
        return None


def _wait_and_print(ingress: Any, deadline: float) -> None:
    want = max(1, int(ingress.settings.num_replicas))
    while time.monotonic() < deadline:
        try:
            replicas = ingress.manager.replica_versions.remote().result(timeout_s=10)
            if len(replicas) >= want:
                scenarios = ingress.manager.list.remote().result(timeout_s=10)
                print(ready_line(serve_http_url(), len(replicas), len(scenarios)), flush=True)
                return
        except Exception:  # the manager is still starting
            logger.debug("ready check failed; retrying", exc_info=True)
        time.sleep(1.0)


def announce_when_ready(ingress: Any) -> threading.Thread:
    """Start the thread that prints :func:`ready_line` once every model replica serves."""
    thread = threading.Thread(target=_wait_and_print, args=(ingress, time.monotonic() + READY_WAIT_S),
                              name="ready-line", daemon=True)
    thread.start()
    return thread
