"""The ready line's address (``deployments.ready.serve_http_url``) read through Serve's REST API: from the driver
and from inside a Ray worker (where the ingress replica runs), with the dashboard off its default port. A real
local Ray cluster with Serve, started in a child process so that no Ray state leaks into this test session."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from deployments.ready import ready_line, serve_http_url
from helpers import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_outside_ray_there_is_no_address_and_the_line_says_so():
    assert serve_http_url() is None
    assert ready_line(None, 1, 2).startswith("constrained-serve ready (1 replica serving 2 scenarios)")


def test_the_address_is_serves_http_options_in_the_driver_and_in_a_worker():
    http_port, dashboard_port = free_port(), free_port()
    script = textwrap.dedent(f"""
        import json, ray
        from ray import serve
        from deployments.ready import serve_http_url
        ray.init(address="local", num_cpus=1, include_dashboard=True, dashboard_port={dashboard_port},
                 log_to_driver=False)
        try:
            serve.start(http_options={{"host": "0.0.0.0", "port": {http_port}, "root_path": "/cs"}})
            inside = ray.remote(lambda: serve_http_url())
            print("RESULT " + json.dumps([serve_http_url(), ray.get(inside.remote())]))
        finally:
            serve.shutdown()
            ray.shutdown()
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-2000:] + done.stderr[-4000:]
    want = f"http://127.0.0.1:{http_port}/cs"  # 0.0.0.0 is shown as the loopback address
    assert json.loads(lines[0][len("RESULT "):]) == [want, want]
