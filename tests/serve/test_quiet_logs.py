"""Quiet logs: the calls between deployments that succeed (the model replicas' long polls on the config manager,
each request's call on its model replica) write no access line; HTTP access lines and the project's own lines
stay (tests/serve/test_logs.py checks those carry the request id)."""

from __future__ import annotations

import glob
import os
import time

import pytest
import requests

pytestmark = pytest.mark.serve


def _log_text(deployment: str) -> str:
    import ray

    logs = os.path.join(ray._private.worker._global_node.get_session_dir_path(), "logs", "serve")
    text = ""
    for path in glob.glob(os.path.join(logs, f"replica_*_{deployment}_*.log")):
        with open(path, encoding="utf-8", errors="replace") as f:
            text += f.read()
    return text


def test_no_access_line_per_long_poll_or_replica_call(serve_app):
    serve_app.put("q-labels", {"type": "labels", "labels": ["alpha", "beta"]})  # answers every replica's long poll
    r = serve_app.generate({"scenario": "q-labels", "prompt": "Pick:"})
    assert r.status_code == 200, r.text
    request_id = r.headers["x-request-id"]
    deadline = time.monotonic() + 30
    while request_id not in _log_text("Ingress") and time.monotonic() < deadline:
        time.sleep(0.5)
    manager, replica, ingress = _log_text("ConfigManager"), _log_text("ModelReplica"), _log_text("Ingress")
    assert "wait_for_update" not in manager and "CALL register OK" not in manager
    assert "CALL generate OK" not in replica
    assert "generate scenario=q-labels" in replica and "POST /v1/generate 200" in ingress
    assert requests.get(f"{serve_app.url}/healthz", timeout=30).status_code == 200
