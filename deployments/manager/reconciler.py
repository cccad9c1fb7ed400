"""Keeping what the config manager serves in line with Redis: at start, on every change, and while Redis is away.

Changes made behind the manager's back (another process writing Redis) arrive through the
``cs:changes`` channel, keyspace notifications on the ``current`` pointers when the server allows
them, and a reconcile every ``reconcile_interval_s`` as the fallback; the background task loads,
validates, compiles and broadcasts them. A stored version that does not validate or compile is
logged (and shown in health, with the version served instead) and the last good version keeps
serving; also across a restart: a manager that starts while the current version is unusable serves the
newest usable earlier one (back to the last delete entry), never nothing. While Redis is down
the replicas keep their tables, admin writes raise 503, and the reconcile loop re-syncs when
Redis is back (an embedded server that died is started again from its files).
"""

from __future__ import annotations

import asyncio
import logging
import threading

import redis

from config import ServerSettings
from deployments.protocol import ServiceError
from deployments.storage.redis_server import connect_redis, enable_keyspace_notifications, keyspace_notifications_enabled
from deployments.storage.store import ScenarioStore

from .compiler import StoredScenarioCompiler
from .registry import ReplicaRegistry
from .served import ServedScenarios, object_ref

logger = logging.getLogger(__name__)

__all__ = ["StoreReconciler"]


class StoreReconciler:
    """Loads the stored scenarios at start (seeding the examples into an empty store), then follows Redis: a
    listener thread (change channel, keyspace events) and a reconcile task compile and install what another
    process wrote, refuse what is unusable (the last good version keeps serving), and restart an embedded Redis
    that died.

    Args:
        store: the scenario store (its ``client`` is replaced when the embedded server is restarted).
        scenarios: the served table it installs into and refuses in.
        compiler: compiles what it picks up.
        registry: told (``bump``) when the served state changed, so the replicas get it.
        settings: ``seed_examples`` and ``data_dir`` (the embedded server's files).
        embedded: whether the manager started the embedded Redis itself (only then is it restarted).
        interval_s: period of the fallback reconcile.
    """

    def __init__(self, store: ScenarioStore, scenarios: ServedScenarios, compiler: StoredScenarioCompiler,
                 registry: ReplicaRegistry, *, settings: ServerSettings, embedded: bool, interval_s: float):
        self.store = store
        self.scenarios = scenarios
        self.compiler = compiler
        self.registry = registry
        self.settings = settings
        self.embedded = embedded
        self.interval_s = float(interval_s)
        self.keyspace_notifications = keyspace_notifications_enabled(store.client)
        self.redis_error: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._listener: threading.Thread | None = None
        self.stop_event = threading.Event()
        self.new_loop()

    def new_loop(self) -> None:
        """A new event loop (tests): asyncio primitives are tied to one."""
        self._wake_event = asyncio.Event()

    # ------------------------------------------------------------------ at start

    def load(self) -> None:
        """Seed the examples into an empty store (``seed_examples``), then compile and install every current
        version; one that is unusable is refused and the newest usable earlier one serves instead."""
        try:
            if self.settings.seed_examples and self.store.is_empty():
                self._seed_examples()
            current = self.store.current_versions()
        except ServiceError as exc:
            self.redis_error = exc.message
            logger.error("cannot read scenarios at start (%s); the reconcile loop retries", exc.message)
            return
        for name, version in current.items():
            try:
                if version is None:
                    raise ServiceError(500, "the current pointer is missing or not a number")
                record = self.store.get(name, version)
                if record is None or record["scenario"] is None:
                    raise ServiceError(500, f"version {version} has no scenario body")
                compiled = self.compiler.compile_blocking(name, record["scenario"])
            except ServiceError as exc:
                # Keep the last good version across restarts: a scenario that had one is never a 404
                # because of what another tool wrote into Redis since.
                good = self._last_good_blocking(name, version)
                if good is not None:
                    self.scenarios.install(name, good[0], good[1], object_ref(good[1]))
                self.scenarios.refuse(name, version, exc.message)
                continue
            self.scenarios.install(name, version, compiled, object_ref(compiled))
        served = self.scenarios.served
        logger.info("serving %d scenario(s): %s", len(served),
                    ", ".join(f"{n} v{s.version}" for n, s in sorted(served.items())) or "none")

    def _last_good_blocking(self, name: str, bad_version: int | None):
        """``(version, compiled)`` of the newest version of ``name`` before ``bad_version`` (any, when the
        pointer itself is unusable) that compiles, looking back no further than the last delete entry (before
        it the scenario did not exist); None when there is none."""
        try:
            history = self.store.versions(name)
        except ServiceError:
            return None
        for entry in reversed(history):
            version = entry["version"]
            if bad_version is not None and version >= bad_version:
                continue
            if entry["action"] == "delete":
                return None
            try:
                record = self.store.get(name, version)
                if record is None or record["scenario"] is None:
                    raise ServiceError(500, f"version {version} has no scenario body")
                return version, self.compiler.compile_blocking(name, record["scenario"])
            except ServiceError as exc:
                logger.warning("scenario %r version %d is not usable either: %s", name, version, exc.message)
        return None

    def _seed_examples(self) -> None:
        from deployments.examples import example_scenarios

        for name, body in example_scenarios(self.compiler.tokenizer).items():
            try:
                self.compiler.compile_blocking(name, body)
            except ServiceError as exc:
                logger.warning("example scenario %r skipped: %s", name, exc.message)
                continue
            version = self.store.put(name, body)
            logger.info("seeded example scenario %r (version %d)", name, version)

    # ------------------------------------------------------------------ reconcile

    async def sync(self) -> bool:
        """Bring the served state in line with Redis now. Returns whether anything changed."""
        served, errors = self.scenarios.served, self.scenarios.errors
        try:
            # Under the lock: a put holds it from its Redis write to its install, so what is read here
            # is either before the write or already served, never a version compiled twice.
            async with self.scenarios.lock:
                current = await asyncio.to_thread(self.store.current_versions)
        except ServiceError as exc:
            if exc.status != 503:
                raise
            if self.redis_error is None:
                logger.error("Redis is unreachable (%s); replicas keep serving their tables", exc.message)
            self.redis_error = exc.message
            await self._restart_embedded()
            return False
        if self.redis_error is not None:
            logger.info("Redis is reachable again; re-syncing scenarios")
            self.redis_error = None
        changed = False
        for name in [n for n in errors if n not in current]:
            del errors[name]
        for name, version in current.items():
            entry = served.get(name)
            if entry is not None and entry.version == version:
                errors.pop(name, None)
                continue
            if name in errors and errors[name]["version"] == version:
                continue  # already refused this exact version
            try:
                if version is None:
                    raise ServiceError(500, "the current pointer is missing or not a number")
                record = await asyncio.to_thread(self.store.get, name, version)
                if record is None or record["scenario"] is None:
                    raise ServiceError(500, f"version {version} does not exist or has no body")
                compiled = await self.compiler.compile(name, record["scenario"])
            except ServiceError as exc:
                if exc.status == 503:
                    return changed
                self.scenarios.refuse(name, version, exc.message)
                continue
            async with self.scenarios.lock:  # a put may have moved on meanwhile: apply only what is still current
                if await asyncio.to_thread(self.store.current_version, name) != version:
                    continue
                if name in served and served[name].version == version:
                    continue
                self.scenarios.install(name, version, compiled, await asyncio.to_thread(object_ref, compiled))
                self.registry.bump()
                changed = True
            logger.info("picked up scenario %r version %d from Redis (written by another process)", name, version)
        gone = [n for n in served if n not in current]
        if gone:
            async with self.scenarios.lock:
                live = set(await asyncio.to_thread(self.store.names))
                for name in gone:
                    if name not in live and name in served:
                        del served[name]
                        logger.info("scenario %r was deleted in Redis by another process", name)
                        self.registry.bump()
                        changed = True
        return changed

    async def _restart_embedded(self) -> None:
        if not self.embedded:
            return  # redis-py reconnects by itself to a configured server
        try:
            client = await asyncio.to_thread(connect_redis, None, self.settings.data_dir)
        except Exception as exc:
            logger.warning("could not restart the embedded Redis: %s", exc)
            return
        self.store.client = client
        self.keyspace_notifications = keyspace_notifications_enabled(client)

    # ------------------------------------------------------------------ background

    def running_on(self, loop: asyncio.AbstractEventLoop) -> bool:
        return self._loop is loop and self._task is not None and not self._task.done()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the reconcile task on ``loop`` and the listener thread (after :meth:`stop_listener` and
        :meth:`new_loop` when an earlier loop had them)."""
        self._loop = loop
        self.stop_event = threading.Event()
        self._task = loop.create_task(self._reconcile_loop(), name="config-manager-reconcile")
        self._listener = threading.Thread(target=self._listen, args=(self.stop_event,), daemon=True,
                                          name="config-manager-listener")
        self._listener.start()

    def _wake(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._wake_event.set)
            except RuntimeError:  # the loop closed meanwhile
                pass

    async def _reconcile_loop(self) -> None:
        # asyncio.timeout, not asyncio.wait_for: on Python 3.11 wait_for swallows a cancellation
        # that arrives as the awaited event fires (the listener thread sets it at any moment),
        # and the task would never stop.
        while True:
            try:
                async with asyncio.timeout(self.interval_s):
                    await self._wake_event.wait()
            except TimeoutError:
                pass
            self._wake_event.clear()
            try:
                await self.sync()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("reconcile with Redis failed")

    def _listen(self, stop: threading.Event) -> None:
        """Thread: subscribe to the change channel (and keyspace events) and wake the reconcile task."""
        backoff = 0.1
        while not stop.is_set():
            client = self.store.client
            pubsub = None
            try:
                # Again on every (re)connect: a restarted server forgets a CONFIG SET.
                self.keyspace_notifications = enable_keyspace_notifications(client)
                pubsub = client.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(self.store.channel)
                if self.keyspace_notifications:
                    db = client.connection_pool.connection_kwargs.get("db", 0)
                    pubsub.psubscribe(f"__keyspace@{db}__:{self.store.current_key('*')}")
                self._wake()  # messages may have been missed while (re)connecting
                backoff = 0.1
                while not stop.is_set() and self.store.client is client:
                    if pubsub.get_message(timeout=0.5) is not None:
                        self._wake()
            except (redis.RedisError, OSError, ValueError) as exc:
                # ValueError: the connection's socket was closed under us (the manager shutting down)
                if stop.is_set():
                    break
                logger.debug("change listener: %s; retrying in %.1f s", exc, backoff)
                stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
            finally:
                if pubsub is not None:
                    try:
                        pubsub.close()
                    except Exception:
                        pass

    def stop_listener(self) -> None:
        self.stop_event.set()
        if self._listener is not None:
            self._listener.join(timeout=5)
            self._listener = None

    async def cancel_task(self) -> None:
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
