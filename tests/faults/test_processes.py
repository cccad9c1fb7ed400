"""A model replica or the config manager is killed (SIGKILL) while the app serves traffic."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from fault_helpers import LABELS, OTHER_LABELS, actors, ask, kill, pids, serve_log_lines, synced, until
from serve_app import check_label

pytestmark = pytest.mark.faults


def test_replica_killed_mid_request_retries_and_the_replica_comes_back(serve_app):
    version = serve_app.put("f-kill", {"type": "labels", "labels": LABELS})["version"]
    until(lambda: synced(serve_app, {"f-kill": version}), timeout=60, what="replicas in sync")
    before = pids("ModelReplica")
    assert len(before) == 2
    victim = sorted(before)[0]
    retries_before = len(serve_log_lines("Ingress", "died during a request"))

    # Long requests (a regex that cannot end before 60 letters) keep both replicas busy through the kill.
    long_version = serve_app.put("f-long", {"type": "regex", "pattern": "[a-z]{60}"})["version"]
    until(lambda: synced(serve_app, {"f-long": long_version}), timeout=60, what="replicas in sync")
    long_body = {"scenario": "f-long", "prompt": "Letters:", "max_new_tokens": 64, "temperature": 1.0}
    with ThreadPoolExecutor(12) as pool:
        busy = [pool.submit(serve_app.generate, {**long_body, "seed": i}, 180) for i in range(8)]
        labelled = [pool.submit(ask, serve_app, "f-kill", max_new_tokens=8, seed=i) for i in range(4)]
        time.sleep(2.0)  # the requests are in flight on both replicas
        kill(victim)
        started = time.monotonic()
        responses = [f.result(timeout=240) for f in busy + labelled]
        waited = time.monotonic() - started

    # Every request got an answer (retried on the surviving replica), none hung.
    for r in responses:
        assert r.status_code == 200, r.text
    for r in responses[len(busy):]:
        check_label(r.json()["outputs"][0], LABELS)
    for r in responses[: len(busy)]:
        out = r.json()["outputs"][0]
        assert out["finish_reason"] == "stop" and re.fullmatch("[a-z]{60}", out["text"]), out
    assert waited < 240
    # The kill hit requests in flight: the ingress logged their retries.
    assert len(serve_log_lines("Ingress", "died during a request")) > retries_before

    # Serve starts a new replica; it registers with the manager and serves the current versions.
    def replaced():
        now = pids("ModelReplica")
        return len(now) == 2 and victim not in now and now
    until(replaced, timeout=180, what="a new replica process")
    until(lambda: synced(serve_app, {"f-kill": version}), timeout=120, what="the new replica to serve f-kill")
    # Both replicas answer correctly (8 requests spread over them by Serve's router).
    with ThreadPoolExecutor(8) as pool:
        for r in pool.map(lambda i: ask(serve_app, "f-kill", max_new_tokens=8, seed=100 + i), range(8)):
            assert r.status_code == 200, r.text
            check_label(r.json()["outputs"][0], LABELS)


def test_manager_killed_replicas_keep_serving_and_nothing_acknowledged_is_lost(serve_app):
    acked = [serve_app.put("f-mgr", {"type": "labels", "labels": labels})["version"] for labels in (LABELS, OTHER_LABELS)]
    until(lambda: synced(serve_app, {"f-mgr": acked[-1]}), timeout=60, what="replicas in sync")
    (manager,) = actors("ConfigManager")
    kill(int(manager["Pid"]))

    # While the manager is dead or restarting, the replicas answer from the tables they hold.
    for i in range(4):
        r = ask(serve_app, "f-mgr", max_new_tokens=8, seed=i)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["version"] == acked[-1]
        check_label(body["outputs"][0], OTHER_LABELS)

    # A new manager process starts, reloads from Redis and re-syncs every replica.
    def restarted():
        now = actors("ConfigManager")
        return len(now) == 1 and now[0]["Pid"] != manager["Pid"]
    until(restarted, timeout=120, what="a new config manager process")
    body = until(lambda: synced(serve_app, {"f-mgr": acked[-1]}), timeout=120, what="re-sync after the manager restart")
    assert body["manager"]["scenarios"]["f-mgr"] == acked[-1]

    # No acknowledged write was lost, and the new manager takes writes that reach every replica.
    r = serve_app_get_versions(serve_app, "f-mgr")
    assert [v["version"] for v in r][-2:] == acked
    again = serve_app.put("f-mgr", {"type": "labels", "labels": LABELS})["version"]
    assert again == acked[-1] + 1
    until(lambda: synced(serve_app, {"f-mgr": again}), timeout=60, what="the write after the restart")
    r = ask(serve_app, "f-mgr", max_new_tokens=8)
    assert r.json()["version"] == again
    check_label(r.json()["outputs"][0], LABELS)


def serve_app_get_versions(app, name):
    r = requests.get(f"{app.url}/admin/scenarios/{name}/versions", headers=app.admin, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["versions"]
