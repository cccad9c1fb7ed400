"""The config manager is killed (SIGKILL) just after an admin write reached Redis, before it answered.

The client was told 503 "retry later" although the version is stored. cs-admin retries with the same
Idempotency-Key and gets the first write's answer: exactly one new version. The window between the Redis
write and the answer is held open for real: the model replicas are stopped (SIGSTOP), so the manager waits
for their acknowledgements after writing; it is killed as soon as the write is visible in Redis.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import requests
from fault_helpers import LABELS, OTHER_LABELS, EmbeddedRedis, actors, ask, kill, pids, synced, until
from serve_app import ADMIN_TOKEN, check_label

from deployments.storage.store import ScenarioStore

pytestmark = pytest.mark.faults

CS_ADMIN = shutil.which("cs-admin", path=str(Path(sys.executable).parent)) or str(Path(sys.executable).parent / "cs-admin")


def test_manager_killed_after_the_redis_write_retry_with_the_key_makes_no_duplicate(serve_app, tmp_path):
    name = "f-idem"
    first = serve_app.put(name, {"type": "labels", "labels": LABELS})["version"]
    until(lambda: synced(serve_app, {name: first}), timeout=60, what="replicas in sync")
    store = ScenarioStore(EmbeddedRedis(serve_app.data_dir).client())
    (manager,) = actors("ConfigManager")
    replicas = sorted(pids("ModelReplica"))
    body = tmp_path / "other.json"
    body.write_text(json.dumps({"type": "labels", "labels": OTHER_LABELS}))
    env = {**{k: v for k, v in os.environ.items() if k not in ("CS_URL", "ADMIN_TOKEN")},
           "CS_URL": serve_app.url, "ADMIN_TOKEN": ADMIN_TOKEN}

    for pid in replicas:
        kill(pid, signal.SIGSTOP)  # the manager writes Redis, then waits for their acks
    try:
        put = subprocess.Popen([CS_ADMIN, "put", name, str(body), "--retries", "12"], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        until(lambda: store.current_version(name) == first + 1, timeout=60, what="the write in Redis",
              interval=0.02)
        kill(int(manager["Pid"]))  # stored, not yet answered
    finally:
        for pid in replicas:
            kill(pid, signal.SIGCONT)
    out, err = put.communicate(timeout=300)

    # cs-admin was answered 503, retried with the same key and got the first write's version.
    assert put.returncode == 0, (out, err)
    assert "HTTP 503" in err and "same Idempotency-Key" in err, err
    assert out.strip() == f"stored {name} version {first + 1} (every replica serves it)", out
    history = requests.get(f"{serve_app.url}/admin/scenarios/{name}/versions", headers=serve_app.admin, timeout=60)
    assert [v["version"] for v in history.json()["versions"]] == [first, first + 1]  # no duplicate
    until(lambda: synced(serve_app, {name: first + 1}), timeout=180, what="re-sync after the manager restart")
    check_label(ask(serve_app, name, max_new_tokens=8).json()["outputs"][0], OTHER_LABELS)

    # Over HTTP: the same key and body again is the first answer, marked; another body under the key is a 422.
    url = f"{serve_app.url}/admin/scenarios/{name}"
    key = {**serve_app.admin, "Idempotency-Key": str(uuid.uuid4())}
    again = {"type": "labels", "labels": LABELS}
    answers = [requests.put(url, json=again, headers=key, timeout=120) for _ in range(2)]
    assert [r.status_code for r in answers] == [200, 200], [r.text for r in answers]
    assert answers[0].json() == answers[1].json() == {"name": name, "version": first + 2}
    assert "Idempotent-Replayed" not in answers[0].headers and answers[1].headers["Idempotent-Replayed"] == "true"
    other = requests.put(url, json={"type": "labels", "labels": ["x", "y"]}, headers=key, timeout=120)
    assert other.status_code == 422 and "Idempotency-Key" in other.json()["error"]["message"], other.text
    history = requests.get(f"{url}/versions", headers=serve_app.admin, timeout=60).json()["versions"]
    assert [v["version"] for v in history] == [first, first + 1, first + 2]
    assert requests.delete(url, headers=serve_app.admin, timeout=120).status_code == 200
