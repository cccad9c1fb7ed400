"""One-row requests beside wide beam requests, on every generating route: 128 beams after a 700-word message (the
shape that, through /v1/chat/completions with 1,024 beams, once held every other request of its replica for the
whole run) go to both model replicas through /v1/generate (messages), /v1/chat/completions and /v1/completions,
while another client sends one-row labels requests one after another.

Asserted on order, not on time: each model replica runs a wide request (its own log lines, by request id), and
while every replica still runs one the other client gets several answers, each a label of its scenario. The engine-level bound (how many wide rows a forward reads beside one-row rows) is
tests/integration/test_wide_fairness.py."""

from __future__ import annotations

import glob
import http.client
import json
import os
import threading
import time
import uuid

import pytest

from serve_app import WIDE_BEAMS, check_label

pytestmark = pytest.mark.serve

WORDS = ("cat", "dog", "sun", "red", "blue", "tree", "fish")
TEXT = " ".join(WORDS[i % len(WORDS)] for i in range(700))
LABELS = ["red", "green", "blue"]
ROUTES = {
    "generate": ("/v1/generate", {"messages": [{"role": "user", "content": TEXT}], "max_new_tokens": 24}),
    "chat": ("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": TEXT}],
                                      "max_tokens": 24}),
    "completions": ("/v1/completions", {"model": "default", "prompt": TEXT, "max_tokens": 24}),
}


def _post(port: int, path: str, body: dict, source: str, request_id: str) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600, source_address=(source, 0))
    try:
        conn.request("POST", path, body=json.dumps(body),
                     headers={"content-type": "application/json", "X-Request-Id": request_id})
        answer = conn.getresponse()
        return answer.status, json.loads(answer.read() or b"{}")
    finally:
        conn.close()


def _replica_of(ids: list[str]) -> dict[str, str]:
    """Which model replica's log file has each request id's ``generate`` line (polls: the files are appended)."""
    import ray

    logs = os.path.join(ray._private.worker._global_node.get_session_dir_path(), "logs", "serve")
    found: dict[str, str] = {}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(found) < len(ids):
        for path in glob.glob(os.path.join(logs, "replica_*_ModelReplica_*.log")):
            with open(path, encoding="utf-8", errors="replace") as f:
                for line in f:
                    if "generate scenario=" in line:
                        for rid in ids:
                            if rid in line:
                                found[rid] = os.path.basename(path)
        time.sleep(0.5)
    return found


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_one_row_requests_are_answered_while_wide_beams_run(serve_app, route):
    serve_app.put("wide-probe-colors", {"type": "labels", "labels": LABELS})
    path, body = ROUTES[route]
    body = {**body, "num_beams": WIDE_BEAMS, "n": 1}
    tag = uuid.uuid4().hex[:8]
    results: dict[str, tuple[int, dict]] = {}
    running: dict[str, list[threading.Thread]] = {}  # replica log file -> its wide requests' threads

    t0 = time.monotonic()
    events: list[str] = []  # for the failure message

    def wide(rid: str, source: str) -> None:  # each from its own address: a client's rows are bounded together
        results[rid] = _post(serve_app.port, path, body, source, rid)
        events.append(f"{rid} answered at {time.monotonic() - t0:.1f} s")

    # wide requests until each of the two replicas runs one (the router picks the replica)
    for i in range(6):
        rid = f"wide-{tag}-{i}"
        thread = threading.Thread(target=wide, args=(rid, f"127.0.1.{i + 1}"))
        thread.start()
        replica = _replica_of([rid]).get(rid)
        assert replica is not None, f"{rid} reached no model replica"
        running.setdefault(replica, []).append(thread)
        events.append(f"{rid} on {replica} at {time.monotonic() - t0:.1f} s")
        if len(running) == 2:
            break
    assert len(running) == 2, f"the wide requests all reached one replica: {sorted(running)}"

    def both_busy() -> bool:
        return all(any(t.is_alive() for t in threads) for threads in running.values())

    probes: list[tuple[int, dict]] = []
    while both_busy():
        answer = _post(serve_app.port, "/v1/generate", {"scenario": "wide-probe-colors", "temperature": 0,
                                                        "prompt": "Name a color:"}, "127.0.0.2",
                       f"probe-{tag}-{len(probes)}")
        if both_busy():  # answered while every replica still ran a wide request
            probes.append(answer)
    for threads in running.values():
        for t in threads:
            t.join()
    for rid, (status, answer) in results.items():
        assert status == 200, (rid, answer)
        outputs = answer.get("outputs") or answer.get("choices")
        assert len(outputs) == 1 and outputs[0].get("score") is not None, answer
    assert len(probes) >= 3, f"only {len(probes)} one-row answers while the wide requests ran: {events}"
    for status, answer in probes:
        assert status == 200, answer
        check_label(answer["outputs"][0], LABELS, bare=False)
