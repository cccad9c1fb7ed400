"""Two admins write the same scenario at the same moment."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from fault_helpers import ask, synced, until
from serve_app import check_label

pytestmark = pytest.mark.faults


def test_two_admins_put_the_same_scenario_at_once(serve_app):
    url = f"{serve_app.url}/admin/scenarios/f-race"
    for round_ in range(4):
        bodies = [{"type": "labels", "labels": [f"alpha {round_}", "beta"]},
                  {"type": "labels", "labels": [f"gamma {round_}", "delta", "epsilon"]}]
        barrier = threading.Barrier(len(bodies))

        def put(body):
            barrier.wait()
            return requests.put(url, json=body, headers=serve_app.admin, timeout=120)

        with ThreadPoolExecutor(len(bodies)) as pool:
            responses = list(pool.map(put, bodies))
        for r in responses:
            assert r.status_code == 200, r.text
        versions = [r.json()["version"] for r in responses]
        assert len(set(versions)) == 2, versions  # distinct versions

        history = requests.get(f"{url}/versions", headers=serve_app.admin, timeout=30).json()["versions"]
        by_version = {h["version"]: h for h in history}
        assert set(versions) <= set(by_version)  # both are in the history
        current = requests.get(url, headers=serve_app.admin, timeout=30).json()
        assert current["version"] == max(versions)  # the newest write is the one in force
        assert current["scenario"] == bodies[versions.index(max(versions))]

        # Every replica serves exactly that version, and answers with its labels.
        body = until(lambda: synced(serve_app, {"f-race": current["version"]}), timeout=60, what="replicas to agree")
        assert {info["versions"]["f-race"] for info in body["replicas"].values()} == {current["version"]}
        r = ask(serve_app, "f-race", max_new_tokens=8, seed=round_)
        assert r.status_code == 200 and r.json()["version"] == current["version"], r.text
        check_label(r.json()["outputs"][0], current["scenario"]["labels"])
