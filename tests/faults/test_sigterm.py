"""SIGTERM to the process that runs the service (what systemd and docker send) ends it with one
line, not with Ray's failure-signal report (``*** SIGTERM received at time=... PC: @ ... clock_nanosleep ... and at
least 4 more frames``), which reads as a crash.

A real ``python -m cli.serve_run <config>`` (Ray's ``serve run`` with this project's SIGTERM handler, see
``cli/serve_run.py``) on its own local Ray, a free port and a throwaway data directory: wait for the ready line,
send SIGTERM, read everything it printed; the same with plain ``serve run``, which printed the report before
``scripts/setup.sh`` gave it the handler too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from cli.serve_run import MESSAGE
from helpers import free_port

pytestmark = pytest.mark.faults

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("launcher", ["cli.serve_run", "serve run"])
def test_sigterm_stops_the_service_with_one_line(tmp_path, launcher):
    """Both ways to start it: ``python -m cli.serve_run`` and the README's plain ``.venv/bin/serve run`` (which gets
    the same handler from the start-up hook ``scripts/setup.sh`` writes, ``constrained_serve_sigterm.pth``)."""
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    port = free_port()
    config["http_options"]["port"] = port
    config["applications"][0]["args"].update({"data_dir": str(tmp_path / "data"), "num_replicas": 1, "torch_threads": 1})
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    out_path = tmp_path / "out.log"
    # as from a user's shell: not the test session's RAY_SERVE_LOG_TO_STDERR=0 (tests/serve_app.py), under which
    # Serve keeps the replicas' output, the ready line included, off the console
    env = {k: v for k, v in os.environ.items() if k != "RAY_SERVE_LOG_TO_STDERR"}
    env["RAY_ADDRESS"] = "local"
    with open(out_path, "wb") as out:
        command = [sys.executable, "-m", "cli.serve_run", str(path)] if launcher == "cli.serve_run" else \
            [str(Path(sys.executable).parent / "serve"), "run", str(path)]
        proc = subprocess.Popen(command, cwd=ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 400
        while "constrained-serve ready" not in out_path.read_text(errors="replace"):
            assert proc.poll() is None, out_path.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, out_path.read_text(errors="replace")[-3000:]
            time.sleep(1)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = out_path.read_text(errors="replace")
    after = text[text.index("constrained-serve ready"):]
    assert "SIGTERM received at time" not in text and "PC: @" not in text, after[-3000:]
    assert after.count(MESSAGE) == 1, after[-3000:]
    assert "shutting down" in after and code == 0, (code, after[-3000:])
