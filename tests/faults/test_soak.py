"""Load with scenario swaps: 32 clients mix scenarios while an admin swaps versions every 3 s.

15 s of warm-up and 40 s measured here (``SOAK_SECONDS`` sets the measured length; the full soak is
``python bench/soak.py``, 20 s + 120 s).
Zero failed requests, every output valid for the version it names, replica memory growth under 10%.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from serve_app import APP_NAME

pytestmark = pytest.mark.faults

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SOAK_SECONDS = float(os.environ.get("SOAK_SECONDS", "40"))


def test_soak_with_swaps_no_failures_valid_outputs_bounded_memory(serve_app, tokenizer):
    from bench.soak import run_soak

    report = run_soak(serve_app.url, serve_app.admin, tokenizer, duration_s=SOAK_SECONDS, clients=32,
                      swap_every_s=3.0, app_name=APP_NAME, warmup_s=15.0)
    print(json.dumps(report, indent=1))
    assert report["failed"] == 0 and report["invalid"] == 0, report["errors"]
    assert report["requests"] >= 32
    assert report["swaps"] >= SOAK_SECONDS / 3 - 3 and not report["swap_errors"], report["swap_errors"]
    assert report["versions_seen"] >= 4  # answers came from several versions of the swapped scenarios
    assert not report["replicas_replaced"]
    assert report["replica_rss_growth_pct"] and all(g < 10 for g in report["replica_rss_growth_pct"].values()), report
