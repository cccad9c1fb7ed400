"""Helpers for the benchmarks that run the whole Ray Serve app in-process (as ``tests/serve`` does).

:class:`ServeBench` starts Ray and Serve's HTTP proxy on a free loopback port, deploys
``deployments.app.build_app(args)`` with a temporary data directory and a fixed admin token, and
talks to it over real HTTP. Use it as a context manager: Serve and Ray are shut down on the way
out, also after an error or Ctrl-C.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import log  # noqa: E402

ADMIN_TOKEN = "bench-admin-token"
APP_NAME = "constrained-bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) by linear interpolation; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def serve_actors(app_name: str, deployment: str) -> list[dict[str, Any]]:
    """The live Ray actors (records with ``Pid`` and ``Address.NodeID``) of ``deployment`` of the Serve
    application ``app_name`` in this process's Ray cluster, from Ray's actor table."""
    import ray._private.state as state

    wanted = f"ServeReplica:{app_name}:{deployment}"
    return [a for a in state.actors().values() if a["ActorClassName"] == wanted and a["State"] == "ALIVE"]


def replica_versions(health: dict) -> dict[str, dict[str, int]]:
    """``{replica_id: {scenario: version}}`` from a ``/healthz`` body."""
    replicas = health.get("replicas") or {}
    return {rid: dict((info or {}).get("versions") or {}) for rid, info in replicas.items()}


def in_sync(health: dict, replicas: int) -> bool:
    """Whether a ``/healthz`` body says: healthy, exactly ``replicas`` live model replicas, and every one of
    them serving exactly the manager's scenario versions."""
    served = (health.get("manager") or {}).get("scenarios")
    views = replica_versions(health)
    return (health.get("status") == "ok" and isinstance(served, dict) and len(views) == replicas
            and all(v == served for v in views.values()))


class ServeBench:
    """The app running in this process's Ray cluster, reachable at :attr:`url`.

    Args:
        num_cpus: logical CPUs Ray may hand out (replicas reserve ``num_cpus_per_replica`` each).
    """

    def __init__(self, num_cpus: int = 4):
        self.num_cpus = num_cpus
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        self.data_dir = tempfile.mkdtemp(prefix="cs-bench-")
        self.session = requests.Session()

    def __enter__(self) -> "ServeBench":
        import ray
        from ray import serve

        os.environ.setdefault("RAY_SERVE_LOG_TO_STDERR", "0")
        log(f"starting Ray and Serve (HTTP on {self.url}, data_dir {self.data_dir})")
        # address="local": a new cluster even when /tmp/ray/ray_current_cluster names another one.
        ray.init(address="local", num_cpus=self.num_cpus, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": self.port})
        except BaseException:
            ray.shutdown()
            raise
        return self

    def __exit__(self, *exc) -> bool:
        import ray
        from ray import serve

        log("shutting down Serve and Ray")
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            self._stop_orphan_redis()
            shutil.rmtree(self.data_dir, ignore_errors=True)
        return False

    def _stop_orphan_redis(self) -> None:
        from deployments.storage.redis_server import stop_orphaned_servers

        for pid in stop_orphaned_servers(self.data_dir):
            log(f"stopped the embedded redis-server left in {self.data_dir} (pid {pid})")

    def settings(self, **overrides: Any) -> dict[str, Any]:
        """Builder ``args``: the temporary data dir and fixed token, plus ``overrides``."""
        return {"data_dir": self.data_dir, "admin_token": ADMIN_TOKEN, **overrides}

    def deploy(self, args: dict[str, Any], *, replicas: int, timeout: float = 300.0) -> float:
        """``serve.run(build_app(args))`` under :data:`APP_NAME` (a redeploy when it already runs),
        then wait until ``/healthz`` is ``ok`` with exactly ``replicas`` live model replicas that
        serve the same versions as the manager. Returns the seconds it took."""
        from ray import serve

        from deployments.app import build_app

        t0 = time.perf_counter()
        serve.run(build_app(args), name=APP_NAME, route_prefix="/", blocking=False)
        self.wait_ready(replicas, timeout=timeout - (time.perf_counter() - t0))
        return time.perf_counter() - t0

    def wait_ready(self, replicas: int, timeout: float = 300.0) -> dict:
        deadline = time.time() + timeout
        last: Any = None
        while time.time() < deadline:
            try:
                health = self.health()
                if in_sync(health, replicas):
                    return health
                last = health
            except requests.RequestException as exc:
                last = exc
            time.sleep(1.0)
        raise RuntimeError(f"app not ready after {timeout:.0f} s: {last}")

    def health(self) -> dict:
        r = self.session.get(f"{self.url}/healthz", timeout=30)
        r.raise_for_status()
        return r.json()

    def put(self, name: str, body: dict | bytes, timeout: float = 120.0) -> dict:
        """PUT a scenario (a dict, or an already serialized JSON body); raises on a non-200."""
        if isinstance(body, bytes):
            r = self.session.put(f"{self.url}/admin/scenarios/{name}", data=body, timeout=timeout,
                                 headers={**self.admin, "Content-Type": "application/json"})
        else:
            r = self.session.put(f"{self.url}/admin/scenarios/{name}", json=body, headers=self.admin, timeout=timeout)
        if r.status_code != 200:
            raise RuntimeError(f"PUT {name} -> {r.status_code}: {r.text[:500]}")
        return r.json()

    def model_stats(self) -> dict:
        """The decode engine's counters of one model replica (``ModelReplica.health()["stats"]``)."""
        from ray import serve

        handle = serve.get_deployment_handle("ModelReplica", app_name=APP_NAME)
        return dict(handle.health.remote().result()["stats"])


def serve_process_cpu() -> dict[str, dict[str, float]]:
    """CPU seconds (user + system) so far of this machine's Serve processes, by role: ``proxy``,
    ``controller`` and one entry per deployment of :data:`APP_NAME` (summed over its replicas),
    found by the process titles Ray gives its workers (``ray::ServeReplica:<app>:<deployment>``).
    Only descendants of this process count (the local Ray node started here), not other clusters."""
    import psutil

    out: dict[str, dict[str, float]] = {}
    for proc in psutil.Process().children(recursive=True):
        try:
            title = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if not title.startswith("ray::"):
            continue
        prefix = f"ray::ServeReplica:{APP_NAME}:"
        if title.startswith(prefix):
            role = title[len(prefix):].split()[0].split(".")[0]
        elif title.startswith("ray::ProxyActor"):
            role = "proxy"
        elif title.startswith("ray::ServeController"):
            role = "controller"
        else:
            continue
        try:
            t = proc.cpu_times()
        except psutil.Error:
            continue
        entry = out.setdefault(role, {"cpu_s": 0.0, "processes": 0})
        entry["cpu_s"] += t.user + t.system
        entry["processes"] += 1
    return out


def cpu_delta(before: dict, after: dict, per: int = 1) -> dict[str, float]:
    """CPU seconds each role used between two :func:`serve_process_cpu` readings, divided by ``per``."""
    return {role: round((after[role]["cpu_s"] - before.get(role, {}).get("cpu_s", 0.0)) / per, 4)
            for role in sorted(after)}
