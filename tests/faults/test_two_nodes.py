"""The app on two Ray nodes of this machine (tests/faults/two_nodes.py, in its own process)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.faults


def test_two_nodes_both_get_every_broadcast_deltas_cross_and_one_serves_when_the_other_is_removed():
    script = Path(__file__).with_name("two_nodes.py")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                          cwd=script.parents[2])
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report == {"replica_nodes": 2, "puts_acked_by_both": 3, "delta_applied_on_the_other_node": True,
                      "patch_during_removal_served": True, "requests_after_removal": 24,
                      "replicas_after_removal": 1, "ok": True}
