"""The app's embedded Redis hangs (SIGSTOP), comes back (SIGCONT), dies (SIGKILL), or gets garbage written
into it by another tool, while the app runs."""

from __future__ import annotations

import json
import signal
import time

import pytest
import requests
from fault_helpers import LABELS, OTHER_LABELS, EmbeddedRedis, actors, ask, healthz, serve_log_lines, synced, until
from serve_app import check_label

pytestmark = pytest.mark.faults


def _put(app, name, body, timeout=120):
    return requests.put(f"{app.url}/admin/scenarios/{name}", json=body, headers=app.admin, timeout=timeout)


def _versions(app, name):
    r = requests.get(f"{app.url}/admin/scenarios/{name}/versions", headers=app.admin, timeout=30)
    assert r.status_code == 200, r.text
    return [v["version"] for v in r.json()["versions"]]


def test_redis_hangs_generation_goes_on_writes_503_and_it_resyncs_when_back(serve_app):
    version = serve_app.put("f-redis", {"type": "labels", "labels": LABELS})["version"]
    until(lambda: synced(serve_app, {"f-redis": version}), timeout=60, what="replicas in sync")
    (manager,) = actors("ConfigManager")
    server = EmbeddedRedis(serve_app.data_dir)
    pid = server.signal(signal.SIGSTOP)
    try:
        for i in range(3):  # the replicas answer from the tables they hold
            r = ask(serve_app, "f-redis", max_new_tokens=8, seed=i)
            assert r.status_code == 200, r.text
            assert r.json()["version"] == version
            check_label(r.json()["outputs"][0], LABELS)
        started = time.monotonic()
        r = _put(serve_app, "f-redis", {"type": "labels", "labels": OTHER_LABELS})
        took = time.monotonic() - started
        assert r.status_code == 503, r.text
        assert "scenario store unavailable" in r.json()["error"]["message"]
        assert took < 60
        assert healthz(serve_app)["status"] == "degraded"
    finally:
        server.signal(signal.SIGCONT)

    # Back without restarting anything: the same manager process and Redis server take the next write.
    assert server.pid == pid
    until(lambda: synced(serve_app), timeout=60, what="a healthy manager after SIGCONT")
    r = _put(serve_app, "f-redis", {"type": "labels", "labels": OTHER_LABELS})
    assert r.status_code == 200, r.text
    assert r.json()["version"] == version + 1  # the refused write left nothing behind
    until(lambda: synced(serve_app, {"f-redis": version + 1}), timeout=60, what="the write after the outage")
    assert [a["Pid"] for a in actors("ConfigManager")] == [manager["Pid"]]


def test_redis_killed_is_restarted_from_its_files_with_every_acknowledged_write(serve_app):
    acked = [serve_app.put("f-persist", {"type": "labels", "labels": labels})["version"]
             for labels in (LABELS, OTHER_LABELS, LABELS)]
    everything = {name: _versions(serve_app, name) for name in ("f-persist", "sentiment")}
    server = EmbeddedRedis(serve_app.data_dir)
    pid = server.signal(signal.SIGKILL)

    # Generation does not need Redis.
    r = ask(serve_app, "f-persist", max_new_tokens=8)
    assert r.status_code == 200 and r.json()["version"] == acked[-1], r.text

    # The manager notices and starts the server again on the same append-only file.
    def writable():
        r = _put(serve_app, "f-persist", {"type": "labels", "labels": OTHER_LABELS})
        assert r.status_code in (200, 503), r.text
        return r.json()["version"] if r.status_code == 200 else None
    after = until(writable, timeout=90, interval=1.0, what="the embedded Redis to be restarted")
    assert server.pid != pid
    assert after == acked[-1] + 1
    history = _versions(serve_app, "f-persist")
    assert history[-4:] == acked + [after]
    assert _versions(serve_app, "sentiment") == everything["sentiment"]
    assert set(everything["f-persist"]) <= set(history)
    until(lambda: synced(serve_app, {"f-persist": after}), timeout=60, what="replicas on the write after the restart")


def test_garbage_written_by_another_tool_is_refused_and_the_last_good_version_serves(serve_app):
    good = serve_app.put("f-garbage", {"type": "labels", "labels": LABELS})["version"]
    until(lambda: synced(serve_app, {"f-garbage": good}), timeout=60, what="replicas in sync")
    raw = EmbeddedRedis(serve_app.data_dir).client()
    garbage = {
        good + 1: "{not json",
        good + 2: json.dumps({"type": "labels", "labels": []}),
        good + 3: json.dumps({"type": "regex", "pattern": "(unclosed"}),
    }
    for version, text in garbage.items():
        raw.hset(f"cs:s:f-garbage:v:{version}", mapping={"version": version, "action": "put", "scenario": text})
        raw.set("cs:s:f-garbage:current", version)
        raw.publish("cs:changes", json.dumps({"name": "f-garbage", "version": version, "action": "put"}))

        def refused(version=version):
            body = healthz(serve_app)
            error = (body.get("manager") or {}).get("errors", {}).get("f-garbage")
            return body if error and error.get("version") == version else None
        body = until(refused, timeout=60, what=f"the manager to refuse version {version}")
        assert body["status"] == "degraded"
        assert body["manager"]["scenarios"]["f-garbage"] == good
        # Every replica still serves the last good version, and answers with it.
        assert all(info["versions"].get("f-garbage") == good for info in body["replicas"].values())
        r = ask(serve_app, "f-garbage", max_new_tokens=8, seed=version)
        assert r.status_code == 200 and r.json()["version"] == good, r.text
        check_label(r.json()["outputs"][0], LABELS)
    assert serve_log_lines("ConfigManager", "f-garbage", "is not usable"), "the refusal is not in the manager's log"

    # A good write repairs it: numbering goes past the garbage versions and the app is healthy again.
    repaired = serve_app.put("f-garbage", {"type": "labels", "labels": OTHER_LABELS})["version"]
    assert repaired == good + len(garbage) + 1
    until(lambda: synced(serve_app, {"f-garbage": repaired}), timeout=60, what="a healthy app after the repair")
