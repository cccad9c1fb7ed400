"""A ConfigManager's finalizer never waits for the embedded-Redis registry lock (real redis-server, real tokenizer).

The garbage collector runs ``ConfigManager.__del__`` wherever it happens to run, also inside ``connect_redis`` of
the same thread while that holds the registry lock; waiting there deadlocked a test run. Holding the lock here
stands for that moment.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from config import ServerSettings
from deployments.storage import redis_server
from deployments.manager import ConfigManager
from deployments.storage.redis_server import embedded_server_pid

pytestmark = pytest.mark.integration


def test_finalizer_does_not_wait_for_the_registry_lock(tokenizer, data_dir):
    manager = ConfigManager(ServerSettings(data_dir=data_dir, seed_examples=False), tokenizer=tokenizer)
    pid = embedded_server_pid(data_dir)
    assert pid and manager._embedded

    finalizer = threading.Thread(target=manager.__del__, daemon=True)
    redis_server._EMBEDDED_LOCK.acquire()
    try:
        finalizer.start()
        finalizer.join(timeout=5)
        returned = not finalizer.is_alive()
    finally:
        redis_server._EMBEDDED_LOCK.release()
    assert returned, "ConfigManager.__del__ waited for the registry lock"

    # Once the lock is free the embedded server is shut down all the same.
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"embedded redis-server {pid} still runs")
    assert embedded_server_pid(data_dir) is None
