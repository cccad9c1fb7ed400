"""Request ids and structured log lines of the shared app, read back from Serve's log files.

Serve writes one file per replica under ``<session dir>/logs/serve/`` (``replica_<app>_<deployment>_<id>.log``),
TEXT by default (``LEVEL time deployment replica request_id -- message``) or JSON lines when the app's
``logging_config`` (or ``RAY_SERVE_LOG_ENCODING``) says JSON; the checks here read either.
"""

from __future__ import annotations

import glob
import json
import os
import time
import uuid

import pytest
import requests

pytestmark = pytest.mark.serve

SCENARIO = "l-labels"
LOG_DEADLINE_S = 30.0


def _logs_dir() -> str:
    import ray

    return os.path.join(ray._private.worker._global_node.get_session_dir_path(), "logs", "serve")


def _lines(deployment: str) -> list[tuple[str, dict | None]]:
    """Every line of the deployment's replica log files, with its JSON record when it is one."""
    out = []
    for path in sorted(glob.glob(os.path.join(_logs_dir(), f"replica_*_{deployment}_*.log"))):
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    record = None
                out.append((line.rstrip("\n"), record if isinstance(record, dict) else None))
    return out


def _tagged(line: str, record: dict | None, request_id: str) -> bool:
    if record is not None:
        return record.get("request_id") == request_id
    return f" {request_id} -- " in line


def _message(line: str, record: dict | None) -> str:
    return record.get("message", "") if record is not None else line.split(" -- ", 1)[-1]


def wait_for_lines(deployment: str, request_id: str, needle: str, count: int = 1) -> list[tuple[str, dict | None]]:
    """The deployment's log lines of ``request_id`` whose message contains ``needle`` (polls: files are appended)."""
    deadline = time.monotonic() + LOG_DEADLINE_S
    while True:
        found = [(line, rec) for line, rec in _lines(deployment) if _tagged(line, rec, request_id) and needle in _message(line, rec)]
        if len(found) >= count or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(found) >= count, (
        f"no {deployment} log line with request id {request_id} containing {needle!r} in {_logs_dir()}; lines with "
        f"the id: {[line for line, rec in _lines(deployment) if request_id in line]}"
    )
    return found


def _check_scenario_fields(record: dict | None, name: str, version: int) -> None:
    if record is not None:  # JSON encoding: the extra= fields are fields of the record
        assert record.get("scenario") == name and record.get("scenario_version") == version, record


@pytest.fixture(scope="module")
def version(serve_app):
    return serve_app.put(SCENARIO, {"type": "labels", "labels": ["alpha", "beta"]})["version"]


def test_generate_returns_a_request_id_that_tags_ingress_and_replica_lines(serve_app, version):
    r = serve_app.generate({"scenario": SCENARIO, "prompt": "Pick one:"})
    assert r.status_code == 200, r.text
    request_id = r.headers.get("x-request-id")
    assert request_id and len(request_id) >= 16, r.headers
    needle = f"generate scenario={SCENARIO} version={version}"
    for deployment in ("Ingress", "ModelReplica"):
        for _line, record in wait_for_lines(deployment, request_id, needle):
            _check_scenario_fields(record, SCENARIO, version)


def test_client_request_id_is_echoed_and_used_in_logs(serve_app, version):
    request_id = f"client-{uuid.uuid4().hex}"
    r = requests.post(f"{serve_app.url}/v1/generate", json={"scenario": SCENARIO, "prompt": "Pick:"},
                      headers={"X-Request-Id": request_id}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == request_id
    wait_for_lines("Ingress", request_id, f"generate scenario={SCENARIO} version={version}")
    wait_for_lines("ModelReplica", request_id, f"generate scenario={SCENARIO} version={version}")


def test_streamed_generate_logs_scenario_and_version(serve_app, version):
    request_id = f"stream-{uuid.uuid4().hex}"
    r = requests.post(f"{serve_app.url}/v1/generate", json={"scenario": SCENARIO, "prompt": "Pick:", "stream": True},
                      headers={"X-Request-Id": request_id}, stream=True, timeout=120)
    assert r.status_code == 200 and r.headers["x-request-id"] == request_id
    assert b"[DONE]" in b"".join(r.iter_lines())
    for deployment in ("Ingress", "ModelReplica"):
        for _line, record in wait_for_lines(deployment, request_id, f"generate scenario={SCENARIO} version={version}"):
            _check_scenario_fields(record, SCENARIO, version)


def test_every_response_carries_a_request_id(serve_app):
    for method, path, body in (("GET", "/healthz", None), ("GET", "/no/such/route", None),
                               ("POST", "/v1/generate", {"scenario": SCENARIO}),  # 422: no prompt
                               ("PUT", f"/admin/scenarios/{SCENARIO}", {"type": "labels", "labels": ["x"]})):  # 401
        r = requests.request(method, serve_app.url + path, json=body, timeout=60)
        assert r.status_code in (200, 401, 404, 422), (path, r.status_code, r.text)
        assert r.headers.get("x-request-id"), (path, r.headers)


def test_an_insane_client_request_id_is_refused(serve_app):
    for bad in ("has spaces in it", "x" * 129, 'quote"d'):
        r = requests.get(f"{serve_app.url}/healthz", headers={"X-Request-Id": bad}, timeout=60)
        assert r.status_code == 422, (bad, r.text)
        assert r.json()["error"]["field"] == "X-Request-Id"


def test_project_info_lines_reach_the_manager_log(serve_app):
    request_id = f"put-{uuid.uuid4().hex}"
    r = requests.put(f"{serve_app.url}/admin/scenarios/{SCENARIO}", json={"type": "labels", "labels": ["alpha", "gamma"]},
                     headers={**serve_app.admin, "X-Request-Id": request_id}, timeout=120)
    assert r.status_code == 200, r.text
    # an INFO line of the `deployments.manager` module logger, with the PUT's request id
    wait_for_lines("ConfigManager", request_id, f"stored scenario {SCENARIO!r} version {r.json()['version']}")


def test_client_error_in_a_replica_is_one_line_without_traceback(serve_app, version):
    request_id = f"e404-{uuid.uuid4().hex}"
    r = requests.post(f"{serve_app.url}/v1/generate", json={"scenario": "l-no-such-scenario", "prompt": "x"},
                      headers={"X-Request-Id": request_id}, timeout=60)
    assert r.status_code == 404 and r.headers["x-request-id"] == request_id
    (line, record), = wait_for_lines("ModelReplica", request_id, "404: unknown scenario 'l-no-such-scenario'")
    if record is not None:
        assert "exc_text" not in record and record.get("levelname") == "INFO", record
    else:
        assert line.startswith("INFO "), line
        lines = [text for text, _ in _lines("ModelReplica")]
        following = lines[lines.index(line) + 1] if lines.index(line) + 1 < len(lines) else ""
        assert not following.startswith("Traceback"), following
