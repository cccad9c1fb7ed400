"""The embedded redis-server ends with the process that owns it, also when that process is killed without any
cleanup (``serve run`` ended by SIGTERM takes its Ray node down that way), and keeps every acknowledged write.

Real processes: an owner process starts the embedded server through ``connect_redis``, writes a key and is then
SIGKILLed; the server must be gone within seconds, and a new server on the same directory must hold the key.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from deployments.storage.redis_server import _alive, close_embedded, connect_redis
from helpers import wait_until

OWNER = r"""
import sys, time
from deployments.storage.redis_server import connect_redis, embedded_server_pid
client = connect_redis(None, sys.argv[1])
client.set("acknowledged", "yes")
print(embedded_server_pid(sys.argv[1]), flush=True)
time.sleep(600)
"""


def test_server_stops_when_its_owner_is_killed(tmp_path):
    data_dir = str(tmp_path / "data")
    owner = subprocess.Popen([sys.executable, "-c", OWNER, data_dir], stdout=subprocess.PIPE, text=True,
                             cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    server = None
    try:
        server = int(owner.stdout.readline())
        assert _alive(server)
        owner.send_signal(signal.SIGKILL)  # no atexit, no finalizer: only the watchdog is left to act
        owner.wait(timeout=30)
        wait_until(lambda: not _alive(server), timeout=15.0, interval=0.2,
                   what=f"redis-server {server} to end with its owner")
        registry = os.path.join(data_dir, "redis.db.settings")
        deadline = time.monotonic() + 10.0
        while os.path.exists(registry) and time.monotonic() < deadline:  # the watchdog removes it after the exit
            time.sleep(0.1)
        assert not os.path.exists(registry)  # no stale registry left
        again = connect_redis(None, data_dir)  # a new server from the same files
        try:
            assert again.get("acknowledged") == "yes"
        finally:
            close_embedded(data_dir)
    finally:
        if owner.poll() is None:
            owner.kill()
        if server is not None and _alive(server):
            os.kill(server, signal.SIGTERM)
