"""The config manager: Redis <-> compiled tables <-> model replicas.

:class:`ConfigManager` is a plain class (the app builder wraps it with ``serve.deployment``; run it
as ONE replica). It is the only writer of compiled tables: it validates and compiles a scenario
before anything is stored, stores it in Redis (:class:`~deployments.store.ScenarioStore`), puts
the compiled tables in the Ray object store once per version, and broadcasts them to the model
replicas.

Replica protocol (a long poll: a Serve handle routes a call to one replica, so the manager cannot
push to all of them; each replica pulls instead)::

    snap = await manager.register.remote(rid)         # {"epoch", "scenarios": {name: {"version", "ref"}}}
    # load every ref (ray.get), serve those tables, then
    await manager.ack.remote(rid, snap["epoch"], {name: s["version"] for name, s in snap["scenarios"].items()})
    while True:
        new = await manager.wait_for_update.remote(rid, snap["epoch"], 10.0)
        if new is not None:
            snap = new; load and serve it; ack as above

A snapshot is the whole state (every served scenario), so a replica that missed updates catches
up in one step. The epoch starts at the manager's start time in milliseconds and grows by one per
change, so it keeps growing across manager restarts; ``wait_for_update`` also answers at once
when the replica's epoch is not the manager's (e.g. newer, from before a restart).

A replica is live while it calls in: one not heard from for ``replica_timeout_s`` is dropped and
no longer waited for (a poll is cut to half that timeout so a live replica always calls again in
time). ``put``/``delete``/``rollback`` return once every live replica acknowledged an epoch that
includes the change (read-your-writes), or raise 504 after ``broadcast_timeout_s`` naming the
replicas that did not (the version stays stored and they get it when they catch up). Each takes an
optional idempotency key (the ``Idempotency-Key`` header): a write that was stored although its
caller got an error (e.g. this manager died right after the Redis write) is answered, on a retry with
the same key and request, with its first result instead of being made twice.

A version means the same tokens forever: a tree given as a ``path`` is read once, at the PUT, and its
content is stored in Redis with the version (``content_sha256`` in the stored body, see
:mod:`deployments.store`); every later compile of that version (a restart, :meth:`inspect`, a
rollback) uses that content, through a local copy under ``<data_dir>/tree-content``, never the file.

IMPORTANT for the app builder: every replica holds one long poll open on this deployment, so
give it ``max_ongoing_requests`` well above the number of model replicas plus concurrent admin
calls (e.g. 1000); Serve's default (5) would queue acks behind polls.

Changes made behind the manager's back (another process writing Redis) arrive through the
``cs:changes`` channel, keyspace notifications on the ``current`` pointers when the server allows
them, and a reconcile every ``reconcile_interval_s`` as the fallback; the background task loads,
validates, compiles and broadcasts them. A stored version that does not validate or compile is
logged (and shown in :meth:`health`, with the version served instead) and the last good version keeps
serving; also across a restart: a manager that starts while the current version is unusable serves the
newest usable earlier one (back to the last delete entry), never nothing. While Redis is down
the replicas keep their tables, admin writes raise 503, and the reconcile loop re-syncs when
Redis is back (an embedded server that died is started again from its files).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import logging
import os
import re
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pydantic
import redis

from config import SCENARIO_TYPES, ServerSettings, load_scenario
from config.settings import LimitExceeded
from deployments.metrics import ManagerMetrics, route_logs_to_serve
from deployments.protocol import ServiceError
from deployments.redis_server import connect_redis, enable_keyspace_notifications, keyspace_notifications_enabled
from deployments.store import (
    IDEMPOTENCY_TTL_S,
    ScenarioStore,
    content_sha256,
    request_fingerprint,
    validate_idempotency_key,
    validate_name,
)

logger = logging.getLogger(__name__)

__all__ = ["ConfigManager"]


@dataclass
class _Served:
    version: int
    kind: str
    compiled: Any  # the CompiledScenario without Ray; None with Ray (the object store holds it)
    ref: Any  # ObjectRef when Ray is initialized, else the compiled object itself


@dataclass
class _Replica:
    epoch: int = -1  # last acknowledged epoch
    versions: dict[str, int] = field(default_factory=dict)
    last_seen: float = 0.0  # time.time() of the last call, for display
    seen_mono: float = 0.0  # time.monotonic() of the last call, for liveness


def _object_ref(compiled):
    """The tables in Ray's object store when this manager is a Ray actor (its replicas are other processes),
    else the object itself (a manager constructed in a plain process, e.g. in tests, even if that process
    is a Ray driver)."""
    ray = sys.modules.get("ray")  # not imported means not initialized: keep the import cost out of tests
    if ray is not None and ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
        return ray.put(compiled)
    return compiled


def _format_validation_error(body: dict, exc: pydantic.ValidationError) -> tuple[str, list[dict]]:
    errors = []
    for err in exc.errors():
        loc = list(err.get("loc", ()))
        if loc and loc[0] == body.get("type"):  # the discriminated union puts the tag first
            loc = loc[1:]
        where = ".".join(str(p) for p in loc)
        if not where and str(err.get("type", "")).startswith("union_tag"):
            where = "type"
        msg = str(err.get("msg", "")).removeprefix("Value error, ")
        if err.get("type") == "union_tag_not_found":
            msg = (f"missing: a scenario body needs \"type\", one of {', '.join(SCENARIO_TYPES)} (a bare tree file "
                   "goes under \"tree\": {\"type\": \"tree\", \"tree\": {...}}; cs-admin put --tree does that)")
        errors.append({"field": where or None, "message": msg})
    text = "; ".join(f"{e['field']}: {e['message']}" if e["field"] else e["message"] for e in errors[:5])
    if len(errors) > 5:
        text += f"; and {len(errors) - 5} more"
    return f"invalid scenario: {text}", errors


_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


def _file_sha256(path: str) -> str | None:
    """SHA-256 (hex) of a file's bytes, read in chunks; None when it cannot be read."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    except OSError:
        return None
    return digest.hexdigest()


def _fingerprint(action: str, name: str, body: Any) -> str:
    """The request fingerprint of an admin write (422 for a body that is not JSON)."""
    try:
        return request_fingerprint(action, name, body)
    except (TypeError, ValueError) as exc:
        raise ServiceError(422, f"the scenario body is not JSON: {exc}") from None


def _as_version(version: Any) -> int:
    """A version number from a caller (``"3"`` from a URL is fine); 422 for anything else."""
    try:
        number = int(version)
    except (TypeError, ValueError):
        number = 0
    if number < 1 or isinstance(version, bool) or (isinstance(version, float) and not version.is_integer()):
        raise ServiceError(422, f"invalid version {version!r}: versions are integers from 1", {"field": "version"})
    return number


class ConfigManager:
    """Owns the scenarios: validates, compiles, stores in Redis, and broadcasts to replicas.

    Args:
        settings: :class:`config.ServerSettings` (or the builder's ``args`` dict).
        tokenizer: the served model's tokenizer; loaded from ``settings.model`` when None.
        redis_client: a ``redis.Redis`` (``decode_responses=True``); from ``settings.redis_url``
            or the embedded server under ``settings.data_dir`` when None.
        replica_timeout_s: a replica not heard from for this long is dropped.
        broadcast_timeout_s: how long a write waits for the replicas' acknowledgements (then 504).
        reconcile_interval_s: period of the fallback check of Redis for external changes.
        prefix: Redis key prefix (see :mod:`deployments.store`).
        idempotency_ttl_s: how long an admin write's ``Idempotency-Key`` is remembered (24 h).
    """

    def __init__(
        self,
        settings: ServerSettings | dict,
        *,
        tokenizer=None,
        redis_client=None,
        replica_timeout_s: float = 15.0,
        broadcast_timeout_s: float = 30.0,
        reconcile_interval_s: float = 5.0,
        prefix: str = "cs:",
        idempotency_ttl_s: float = IDEMPOTENCY_TTL_S,
    ):
        self.settings = settings if isinstance(settings, ServerSettings) else ServerSettings.from_args(settings)
        route_logs_to_serve()
        self.metrics = ManagerMetrics()
        if tokenizer is None:
            from deployments.model_loader import load_tokenizer

            tokenizer = load_tokenizer(self.settings.model)
        self.tokenizer = tokenizer
        # Only an embedded server we started ourselves is restarted when it dies.
        self._embedded = redis_client is None and not self.settings.redis_url
        if redis_client is None:
            redis_client = connect_redis(self.settings.redis_url, self.settings.data_dir)
        self.store = ScenarioStore(redis_client, prefix=prefix, idempotency_ttl_s=idempotency_ttl_s)
        self.keyspace_notifications = keyspace_notifications_enabled(redis_client)
        self.replica_timeout_s = float(replica_timeout_s)
        self.broadcast_timeout_s = float(broadcast_timeout_s)
        self.reconcile_interval_s = float(reconcile_interval_s)

        self._served: dict[str, _Served] = {}
        self._errors: dict[str, dict[str, Any]] = {}  # name -> {"version", "error"}: stored but not served
        self._replicas: dict[str, _Replica] = {}
        self._epoch = int(time.time() * 1000)
        self._redis_error: str | None = None
        # Compiles get their own threads: one that times out keeps running (a thread cannot be
        # stopped) and must not starve the Redis calls, which go to asyncio's default executor.
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="config-manager-compile")
        # JSON-schema and regex grammars are built in a worker process that is killed at the limits
        # (their cost can explode on a small schema; a thread could not be stopped).
        from processors.compile_worker import GrammarWorker

        self._grammar_worker = GrammarWorker(tokenizer, timeout_s=self.settings.limits.compile_timeout_s,
                                             memory_mb=self.settings.limits.compile_memory_mb)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._listener: threading.Thread | None = None
        self._stop = threading.Event()
        self._new_primitives()
        self._load_initial()
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass  # started by the first async call
        else:
            self._ensure_started()

    # ------------------------------------------------------------------ validate and compile

    def _validate(self, name: str, body: Any):
        """The scenario of ``body`` (422 when invalid). A tree stored with the content of its file
        (``content_sha256``) gets ``path`` pointing at that content (see :meth:`_content_file`), never
        at the file it was read from."""
        if not isinstance(body, dict):
            raise ServiceError(422, f"a scenario body must be a JSON object, got {type(body).__name__}")
        sha = None
        if "content_sha256" in body:
            body = dict(body)
            sha = body.pop("content_sha256")
            if not isinstance(sha, str) or not _SHA256_HEX.fullmatch(sha):
                raise ServiceError(422, "invalid scenario: content_sha256: expected 64 lowercase hex digits",
                                   {"name": name, "field": "content_sha256"})
        limits = self.settings.limits
        try:
            # Before anything walks the body recursively (json.dumps, validation, the schema checker).
            limits.check_scenario(body)  # first: it names the limit of the field (schema depth, ...)
            limits.check_json_depth(body)
        except LimitExceeded as exc:
            raise ServiceError(exc.status, f"invalid scenario: {exc}", {"name": name, **exc.detail()}) from None
        try:
            json.dumps(body)
        except (TypeError, ValueError) as exc:
            raise ServiceError(422, f"the scenario body is not JSON: {exc}") from None
        try:
            scenario = load_scenario(body)
        except pydantic.ValidationError as exc:
            message, errors = _format_validation_error(body, exc)
            raise ServiceError(422, message, {"name": name, "errors": errors}) from None
        if sha is not None:
            if scenario.type != "tree" or scenario.path is None:
                raise ServiceError(422, "invalid scenario: content_sha256: only a tree given by path has stored "
                                        "content", {"name": name, "field": "content_sha256"})
            # The content stored at the PUT; the path is only where it was read from (it may be gone).
            return scenario.model_copy(update={"path": self._content_file(name, sha)})
        if scenario.type == "tree" and scenario.path is not None:
            # An admin names a file on the manager's host: only files under the tree directory.
            scenario = scenario.model_copy(update={"path": self._tree_path(name, scenario.path)})
        return scenario

    def _tree_path(self, name: str, path: str) -> str:
        try:
            return self.settings.resolve_tree_path(path)
        except ValueError as exc:
            raise ServiceError(422, f"invalid scenario: path: {exc}", {"name": name, "field": "path"}) from None

    # ------------------------------------------------------------------ tree content

    @property
    def _content_dir(self) -> str:
        """Local copies of stored tree content, one file per SHA-256 (Redis keeps the originals)."""
        return os.path.join(self.settings.data_dir, "tree-content")

    def _pin_tree_file(self, name: str, body: Any) -> Any:
        """For a tree given by ``path`` (and no ``content_sha256`` yet): read the file ONCE, into a local copy
        named by its SHA-256, and return the body to store: ``path`` resolved (where the content came from)
        plus ``content_sha256``. Every compile of that version, now and after any restart, reads the copy
        (or the bytes stored in Redis), never the file again. Any other body is returned as it is.
        Runs in a worker thread; the file is streamed (a tree file may be tens of MB)."""
        if not (isinstance(body, dict) and body.get("type") == "tree" and isinstance(body.get("path"), str)
                and body["path"].strip() and "content_sha256" not in body and body.get("tree") is None):
            return body  # validation reports anything wrong with it
        source = self._tree_path(name, body["path"])
        os.makedirs(self._content_dir, exist_ok=True)
        digest = hashlib.sha256()
        fd, tmp = tempfile.mkstemp(dir=self._content_dir, prefix=".incoming-")
        try:
            with os.fdopen(fd, "wb") as out:
                try:
                    with open(source, "rb") as handle:
                        for chunk in iter(lambda: handle.read(1 << 20), b""):
                            digest.update(chunk)
                            out.write(chunk)
                except OSError as exc:
                    raise ServiceError(400, f"scenario {name!r} does not compile for the served tokenizer: tree file "
                                            f"{source}: {exc.strerror or exc}", {"name": name, "field": "path"}) from None
            sha = digest.hexdigest()
            os.replace(tmp, os.path.join(self._content_dir, f"{sha}.json"))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return {**body, "path": source, "content_sha256": sha}

    def _content_file(self, name: str, sha: str) -> str:
        """The local copy of the tree content ``sha`` (checked against its hash), fetched from Redis when
        this host has none. 422 when Redis has no such content either."""
        local = os.path.join(self._content_dir, f"{sha}.json")
        if _file_sha256(local) == sha:
            return local
        data = self.store.content(sha)
        if data is None:
            raise ServiceError(422, f"content_sha256: no tree content {sha} is stored; leave content_sha256 out to "
                                    "store the file named by path", {"name": name, "field": "content_sha256"})
        if hashlib.sha256(data).hexdigest() != sha:
            raise ServiceError(500, f"stored tree content {self.store.content_key(sha)} does not match its hash",
                               {"name": name})
        os.makedirs(self._content_dir, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self._content_dir, prefix=".incoming-")
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(data)
            os.replace(tmp, local)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return local

    def _stored_content(self, body: Any) -> bytes | None:
        """The bytes of the local copy a pinned tree body refers to (to store them with the version)."""
        sha = content_sha256(body)
        if sha is None:
            return None
        local = os.path.join(self._content_dir, f"{sha}.json")
        try:
            with open(local, "rb") as handle:
                data = handle.read()
        except OSError:
            return None  # the store then requires the content to be in Redis already
        return data if hashlib.sha256(data).hexdigest() == sha else None

    def _check_compiled(self, name: str, scenario, compiled) -> None:
        """Limits that need the compiled form: the keys of a tree given as a ``path`` (counted once loaded)."""
        if scenario.type == "tree" and scenario.path is not None:
            try:
                self.settings.limits.check_tree_keys(int(compiled.constraint.offsets.size) - 1, "path")
            except LimitExceeded as exc:
                raise ServiceError(exc.status, f"tree file {scenario.path}: {exc}", {"name": name, **exc.detail()}) from None

    def _compile_now(self, name: str, scenario):
        from processors import compile_scenario
        from processors.compile_worker import CompileCrashed, CompileLimitError

        try:
            return compile_scenario(scenario, self.tokenizer, grammar_worker=self._grammar_worker)
        except CompileLimitError as exc:  # "did not compile within 60 s (limits.compile_timeout_s=60)"
            raise ServiceError(400, f"scenario {name!r} {exc}", {"name": name, **exc.detail()}) from None
        except CompileCrashed as exc:
            raise ServiceError(400, f"scenario {name!r} {exc}", {"name": name}) from None
        except (ValueError, OSError) as exc:  # TreeFileError is a ValueError
            raise ServiceError(400, f"scenario {name!r} does not compile for the served tokenizer: {exc}",
                               {"name": name}) from None
        except Exception as exc:  # a grammar engine may raise other types on a bad pattern
            logger.warning("compiling scenario %r failed", name, exc_info=True)
            raise ServiceError(400, f"scenario {name!r} does not compile: {type(exc).__name__}: {exc}",
                               {"name": name}) from None

    def _prepare(self, name: str, body: Any):
        """Validate (422) and compile (400) a body; runs in a worker thread (a large tree takes a while)."""
        scenario = self._validate(name, body)
        try:
            compiled = self._compile_now(name, scenario)
            self._check_compiled(name, scenario, compiled)
        except ServiceError as exc:
            sha = content_sha256(body)
            if sha is not None and isinstance(body.get("path"), str):  # name the admin's file, not the local copy
                exc.message = exc.message.replace(scenario.path, f"{body['path']} (stored content {sha[:12]})")
            raise
        return compiled

    def _compile_blocking(self, name: str, body: Any):
        timeout = self.settings.limits.compile_timeout_s
        future = self._pool.submit(self._prepare, name, body)
        try:
            return future.result(timeout=timeout)
        except TimeoutError:
            raise ServiceError(400, f"scenario {name!r} did not compile within {timeout:g} s "
                                    "(limits.compile_timeout_s)", {"name": name}) from None

    async def _compile(self, name: str, body: Any):
        """Validate and compile ``body`` off the event loop, bounded by ``limits.compile_timeout_s``."""
        timeout = self.settings.limits.compile_timeout_s
        async with self._compile_gate:  # one compile at a time: the tokenizer is shared
            future = asyncio.get_running_loop().run_in_executor(self._pool, self._prepare, name, body)
            try:
                async with asyncio.timeout(timeout):
                    return await future
            except TimeoutError:
                # The worker thread cannot be stopped; it finishes in the background, unused.
                raise ServiceError(400, f"scenario {name!r} did not compile within {timeout:g} s "
                                        "(limits.compile_timeout_s)", {"name": name}) from None

    async def _store(self, fn, *args):
        """Run a blocking call (Redis, ``ray.put``) off the event loop that serves the replicas' polls."""
        return await asyncio.to_thread(fn, *args)

    # ------------------------------------------------------------------ served state

    def _install(self, name: str, version: int, compiled, ref) -> None:
        # With Ray the object store holds the tables; keeping the Python object too would double
        # the manager's memory for large trees.
        kept = compiled if ref is compiled else None
        self._served[name] = _Served(int(version), compiled.kind, kept, ref)
        self._errors.pop(name, None)

    def _bump(self) -> int:
        self._epoch += 1
        event, self._epoch_event = self._epoch_event, asyncio.Event()
        event.set()
        return self._epoch

    def _snapshot(self) -> dict[str, Any]:
        return {
            "epoch": self._epoch,
            "scenarios": {n: {"version": s.version, "ref": s.ref} for n, s in sorted(self._served.items())},
        }

    def _refuse(self, name: str, version, message: str) -> None:
        if self._errors.get(name, {}).get("version", object()) != version:
            served = self._served.get(name)
            logger.error("scenario %r version %s in Redis is not usable: %s; %s", name, version, message,
                         f"still serving version {served.version}" if served else "it is not served")
        self._errors[name] = {"version": version, "error": message}
        served = self._served.get(name)
        if served is not None:
            self._errors[name]["serving"] = served.version

    def _load_initial(self) -> None:
        try:
            if self.settings.seed_examples and self.store.is_empty():
                self._seed_examples()
            current = self.store.current_versions()
        except ServiceError as exc:
            self._redis_error = exc.message
            logger.error("cannot read scenarios at start (%s); the reconcile loop retries", exc.message)
            return
        for name, version in current.items():
            try:
                if version is None:
                    raise ServiceError(500, "the current pointer is missing or not a number")
                record = self.store.get(name, version)
                if record is None or record["scenario"] is None:
                    raise ServiceError(500, f"version {version} has no scenario body")
                compiled = self._compile_blocking(name, record["scenario"])
            except ServiceError as exc:
                # Keep the last good version across restarts: a scenario that had one is never a 404
                # because of what another tool wrote into Redis since.
                good = self._last_good_blocking(name, version)
                if good is not None:
                    self._install(name, good[0], good[1], _object_ref(good[1]))
                self._refuse(name, version, exc.message)
                continue
            self._install(name, version, compiled, _object_ref(compiled))
        logger.info("serving %d scenario(s): %s", len(self._served),
                    ", ".join(f"{n} v{s.version}" for n, s in sorted(self._served.items())) or "none")

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
                return version, self._compile_blocking(name, record["scenario"])
            except ServiceError as exc:
                logger.warning("scenario %r version %d is not usable either: %s", name, version, exc.message)
        return None

    def _seed_examples(self) -> None:
        from deployments.examples import example_scenarios

        for name, body in example_scenarios(self.tokenizer).items():
            try:
                self._compile_blocking(name, body)
            except ServiceError as exc:
                logger.warning("example scenario %r skipped: %s", name, exc.message)
                continue
            version = self.store.put(name, body)
            logger.info("seeded example scenario %r (version %d)", name, version)

    # ------------------------------------------------------------------ admin API

    async def put(self, name: str, body: dict, idempotency_key: str | None = None) -> dict[str, Any]:
        """Validate, compile, store a new version of ``name`` and wait until every live replica
        serves it. Returns ``{"name", "version"}``. 422: invalid name or body; 400: does not
        compile (nothing stored in either case); 503: Redis down; 504: replicas did not ack.

        A tree given as ``path`` is read once, here, and its content stored with the version
        (``content_sha256`` in the stored body): that version means those tokens forever. A body that
        already has ``content_sha256`` (e.g. one read back with :meth:`get`) uses the stored content.

        ``idempotency_key`` (the ``Idempotency-Key`` header): when a write with this key and the same
        request was already made (its client got a 503 although the write was stored, and retries), nothing
        is written again: the answer is the first write's, with ``"replayed": True``. The same key with
        another request is a 422."""
        started = time.monotonic()
        self._ensure_started()
        validate_name(name)
        fingerprint = None
        if idempotency_key is not None:
            validate_idempotency_key(idempotency_key)
            fingerprint = await asyncio.to_thread(_fingerprint, "put", name, body)
            first = await self._store(self.store.idempotent_result, idempotency_key, fingerprint)
            if first is not None:
                return await self._replay(first)
        stored = await asyncio.to_thread(self._pin_tree_file, name, body)
        compiled = await self._compile(name, stored)
        content = await self._store(self._stored_content, stored)
        async with self._lock:
            version = await self._store(functools.partial(
                self.store.put, name, stored, idempotency_key=idempotency_key, fingerprint=fingerprint,
                content=content))
            if not version.replayed:
                self._install(name, version, compiled, await self._store(_object_ref, compiled))
                epoch = self._bump()
        if version.replayed:  # the same request, sent again while the first one was still running
            return await self._replay({"action": "put", "name": name, "version": int(version)})
        logger.info("stored scenario %r version %d", name, version)
        await self._wait_for_acks(epoch, name, version)
        self.metrics.swapped(name, "put", started)
        return {"name": name, "version": int(version)}

    async def rollback(self, name: str, version: int, idempotency_key: str | None = None) -> dict[str, Any]:
        """Store a NEW version of ``name`` with the body of ``version`` (compiled and broadcast like a
        put; a tree read from a file gets the content stored with ``version``, not today's file). Returns
        ``{"name", "version", "from_version"}``. ``idempotency_key`` as for :meth:`put`."""
        started = time.monotonic()
        self._ensure_started()
        validate_name(name)
        version = _as_version(version)
        if idempotency_key is not None:
            validate_idempotency_key(idempotency_key)
            first = await self._store(self.store.idempotent_result, idempotency_key,
                                      request_fingerprint("rollback", name, None, version))
            if first is not None:
                return await self._replay(first)
        record = await self._store(self.store.get, name, version)
        if record is None:
            await self._not_found(name, version)
        if record["scenario"] is None:
            raise ServiceError(409, f"version {version} of scenario {name!r} is a delete entry; "
                                    "there is no body to roll back to")
        compiled = await self._compile(name, record["scenario"])
        async with self._lock:
            new_version = await self._store(functools.partial(
                self.store.rollback, name, version, idempotency_key=idempotency_key))
            if not new_version.replayed:
                self._install(name, new_version, compiled, await self._store(_object_ref, compiled))
                epoch = self._bump()
        if new_version.replayed:
            return await self._replay({"action": "rollback", "name": name, "version": int(new_version),
                                       "from_version": version})
        logger.info("rolled scenario %r back to the body of version %d as version %d", name, version, new_version)
        await self._wait_for_acks(epoch, name, new_version)
        self.metrics.swapped(name, "rollback", started)
        return {"name": name, "version": int(new_version), "from_version": version}

    async def delete(self, name: str, idempotency_key: str | None = None) -> dict[str, Any]:
        """Delete ``name`` (a delete entry in its history) and wait until no live replica serves it.
        Returns ``{"name", "version", "deleted": True}`` where version is the delete entry's.
        ``idempotency_key`` as for :meth:`put` (a retried delete gets its first answer, not a 404)."""
        started = time.monotonic()
        self._ensure_started()
        validate_name(name)
        if idempotency_key is not None:
            validate_idempotency_key(idempotency_key)
            first = await self._store(self.store.idempotent_result, idempotency_key,
                                      request_fingerprint("delete", name))
            if first is not None:
                return await self._replay(first)
        async with self._lock:
            version = await self._store(functools.partial(self.store.delete, name, idempotency_key=idempotency_key))
            if not version.replayed:
                self._served.pop(name, None)
                self._errors.pop(name, None)
                epoch = self._bump()
        if version.replayed:
            return await self._replay({"action": "delete", "name": name, "version": int(version)})
        logger.info("deleted scenario %r (version %d)", name, version)
        await self._wait_for_acks(epoch, name, version)
        self.metrics.swapped(name, "delete", started)
        return {"name": name, "version": int(version), "deleted": True}

    async def _replay(self, first: dict[str, Any]) -> dict[str, Any]:
        """The answer to a retried write: the first write's result (plus ``"replayed": True``), once the
        replicas serve what is current (the first attempt may have stored its version and died before
        broadcasting it; a new manager loaded it at start, this one picks it up now)."""
        name, version, action = first["name"], int(first["version"]), first["action"]
        served = self._served.get(name)
        behind = (name in self._served) if action == "delete" else (served is None or served.version < version)
        if behind:
            await self.sync_from_store()
        logger.info("answered a retried %s of scenario %r with its first result (version %d)", action, name, version)
        await self._wait_for_acks(self._epoch, name, version)
        result: dict[str, Any] = {"name": name, "version": version}
        if action == "rollback":
            result["from_version"] = first.get("from_version")
        if action == "delete":
            result["deleted"] = True
        result["replayed"] = True
        return result

    async def get(self, name: str, version: int | None = None) -> dict[str, Any]:
        """The stored record ``{"name", "version", "scenario", "created_at", "action"}`` of the
        current version (or of ``version``). 404 when there is none."""
        self._ensure_started()
        validate_name(name)
        version = None if version is None else _as_version(version)
        record = await self._store(self.store.get, name, version)
        if record is None:
            await self._not_found(name, version)
        return record

    async def versions(self, name: str) -> list[dict[str, Any]]:
        """The history of ``name`` (also after a delete), oldest first."""
        self._ensure_started()
        validate_name(name)
        history = await self._store(self.store.versions, name)
        if not history:
            await self._not_found(name, None)
        return history

    async def list(self) -> list[dict[str, Any]]:
        """``[{"name", "type", "version"}]`` of the scenarios being served (works while Redis is down)."""
        self._ensure_started()
        return [{"name": n, "type": s.kind, "version": s.version} for n, s in sorted(self._served.items())]

    async def inspect(self, name: str, version: int | None = None, token_ids=(), limit: int = 100,
                      last_only: bool = False) -> dict[str, Any]:
        """What a row of ``name`` may emit after ``token_ids``, step by step (the web console's tree view and
        playground; see :func:`deployments.console.replay` for the result). Read-only.

        ``version`` None is the version served now; another stored version is compiled for the occasion, from
        what was stored (a tree read from a file: the content stored at its PUT, not the file today).
        404: unknown name or version; 409: a delete entry; 422: an id outside the vocabulary."""
        self._ensure_started()
        validate_name(name)
        served = self._served.get(name)
        if version is None and served is None:
            await self._not_found(name, None)
        version = served.version if version is None else _as_version(version)
        if served is not None and served.version == version:
            # With Ray the object store holds the tables (awaiting the ref is ray.get without blocking).
            compiled = served.compiled if served.compiled is not None else await served.ref
        else:
            record = await self._store(self.store.get, name, version)
            if record is None:
                await self._not_found(name, version)
            if record["scenario"] is None:
                raise ServiceError(409, f"version {version} of scenario {name!r} is a delete entry; it allows nothing",
                                   {"name": name, "version": version})
            compiled = await self._compile(name, record["scenario"])
        from deployments.console import replay

        report = await asyncio.to_thread(replay, compiled, self.tokenizer, list(token_ids),
                                         limit=int(limit), last_only=bool(last_only))
        return {"name": name, "version": version, "type": compiled.kind, **report}

    async def _not_found(self, name: str, version) -> None:
        known = sorted(self._served)
        if version is None:
            raise ServiceError(404, f"unknown scenario {name!r}", {"known": known})
        history = await self._store(self.store.versions, name)
        if not history:
            raise ServiceError(404, f"unknown scenario {name!r}", {"known": known})
        raise ServiceError(404, f"scenario {name!r} has no version {version}",
                           {"known": known, "versions": [h["version"] for h in history]})

    # ------------------------------------------------------------------ replica protocol

    def _touch(self, replica_id: str) -> _Replica:
        replica = self._replicas.get(replica_id)
        if replica is None:
            replica = self._replicas[replica_id] = _Replica()
            logger.info("replica %s joined", replica_id)
        replica.last_seen, replica.seen_mono = time.time(), time.monotonic()
        return replica

    def _prune(self) -> None:
        now = time.monotonic()
        dropped = False
        for rid, replica in list(self._replicas.items()):
            if now - replica.seen_mono > self.replica_timeout_s:
                del self._replicas[rid]
                dropped = True
                logger.warning("replica %s not heard from for %.1f s; dropped (no longer waited for)",
                               rid, now - replica.seen_mono)
        if dropped:
            self._notify_acks()

    def _notify_acks(self) -> None:
        event, self._ack_event = self._ack_event, asyncio.Event()
        event.set()

    async def register(self, replica_id: str) -> dict[str, Any]:
        """A replica (re)starts: returns the current snapshot; the replica acks once it serves it."""
        self._ensure_started()
        replica = self._touch(str(replica_id))
        replica.epoch, replica.versions = -1, {}  # a restarted replica has no tables yet
        return self._snapshot()

    async def wait_for_update(self, replica_id: str, epoch: int, timeout_s: float = 10.0) -> dict[str, Any] | None:
        """Long poll: the snapshot as soon as the manager's epoch differs from ``epoch`` (normally:
        is greater), or ``None`` after ``timeout_s`` (cut to half of ``replica_timeout_s``)."""
        self._ensure_started()
        self._touch(str(replica_id))
        deadline = time.monotonic() + max(0.0, min(float(timeout_s), self.replica_timeout_s / 2))
        while self._epoch == epoch:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            try:
                async with asyncio.timeout(remaining):
                    await self._epoch_event.wait()
            except TimeoutError:
                return None
        return self._snapshot()

    async def ack(self, replica_id: str, epoch: int, versions: dict[str, int]) -> None:
        """A replica serves the snapshot of ``epoch`` (``versions``: what it now serves)."""
        replica = self._touch(str(replica_id))
        if int(epoch) >= replica.epoch:
            replica.epoch = int(epoch)
            replica.versions = {str(k): int(v) for k, v in dict(versions).items()}
        self._notify_acks()

    async def replica_versions(self) -> dict[str, dict[str, Any]]:
        """``{replica_id: {"epoch", "versions", "last_seen"}}`` for the live replicas."""
        return self._replica_view()

    def _replica_view(self) -> dict[str, dict[str, Any]]:
        self._prune()
        return {
            rid: {"epoch": r.epoch, "versions": dict(r.versions), "last_seen": r.last_seen}
            for rid, r in sorted(self._replicas.items())
        }

    async def _wait_for_acks(self, epoch: int, name: str, version: int) -> None:
        deadline = time.monotonic() + self.broadcast_timeout_s
        while True:
            self._prune()
            pending = sorted(rid for rid, r in self._replicas.items() if r.epoch < epoch)
            if not pending:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ServiceError(
                    504,
                    f"scenario {name!r} version {version} is stored, but replica(s) {', '.join(pending)} did not "
                    f"acknowledge it within {self.broadcast_timeout_s:g} s; they pick it up when they catch up",
                    {"name": name, "version": version, "pending_replicas": pending},
                )
            try:  # wake on every ack, and at least every 0.25 s to drop silent replicas
                async with asyncio.timeout(min(remaining, 0.25)):
                    await self._ack_event.wait()
            except TimeoutError:
                pass

    # ------------------------------------------------------------------ health

    async def health(self) -> dict[str, Any]:
        """Redis reachability, served scenarios and versions, refused versions, replicas."""
        self._ensure_started()
        try:
            await self._store(self.store.ping)
            redis_ok, error = True, None
        except ServiceError as exc:
            redis_ok, error = False, exc.message
        return {
            "status": "ok" if redis_ok and not self._errors else "degraded",
            "redis": {"ok": redis_ok, "error": error, "embedded": self._embedded,
                      "keyspace_notifications": self.keyspace_notifications},
            "epoch": self._epoch,
            "scenarios": {n: s.version for n, s in sorted(self._served.items())},
            "errors": {n: dict(e) for n, e in sorted(self._errors.items())},
            "replicas": self._replica_view(),
        }

    # ------------------------------------------------------------------ external changes

    async def sync_from_store(self) -> bool:
        """Bring the served state in line with Redis now (the background loop does this on every
        change notification and every ``reconcile_interval_s``). Returns whether anything changed."""
        try:
            # Under the lock: a put holds it from its Redis write to its install, so what is read here
            # is either before the write or already served, never a version compiled twice.
            async with self._lock:
                current = await self._store(self.store.current_versions)
        except ServiceError as exc:
            if exc.status != 503:
                raise
            if self._redis_error is None:
                logger.error("Redis is unreachable (%s); replicas keep serving their tables", exc.message)
            self._redis_error = exc.message
            await self._restart_embedded()
            return False
        if self._redis_error is not None:
            logger.info("Redis is reachable again; re-syncing scenarios")
            self._redis_error = None
        changed = False
        for name in [n for n in self._errors if n not in current]:
            del self._errors[name]
        for name, version in current.items():
            served = self._served.get(name)
            if served is not None and served.version == version:
                self._errors.pop(name, None)
                continue
            if name in self._errors and self._errors[name]["version"] == version:
                continue  # already refused this exact version
            try:
                if version is None:
                    raise ServiceError(500, "the current pointer is missing or not a number")
                record = await self._store(self.store.get, name, version)
                if record is None or record["scenario"] is None:
                    raise ServiceError(500, f"version {version} does not exist or has no body")
                compiled = await self._compile(name, record["scenario"])
            except ServiceError as exc:
                if exc.status == 503:
                    return changed
                self._refuse(name, version, exc.message)
                continue
            async with self._lock:  # a put may have moved on meanwhile: apply only what is still current
                if await self._store(self.store.current_version, name) != version:
                    continue
                if name in self._served and self._served[name].version == version:
                    continue
                self._install(name, version, compiled, await self._store(_object_ref, compiled))
                self._bump()
                changed = True
            logger.info("picked up scenario %r version %d from Redis (written by another process)", name, version)
        gone = [n for n in self._served if n not in current]
        if gone:
            async with self._lock:
                live = set(await self._store(self.store.names))
                for name in gone:
                    if name not in live and name in self._served:
                        del self._served[name]
                        logger.info("scenario %r was deleted in Redis by another process", name)
                        self._bump()
                        changed = True
        return changed

    async def _restart_embedded(self) -> None:
        if not self._embedded:
            return  # redis-py reconnects by itself to a configured server
        try:
            client = await self._store(connect_redis, None, self.settings.data_dir)
        except Exception as exc:
            logger.warning("could not restart the embedded Redis: %s", exc)
            return
        self.store.client = client
        self.keyspace_notifications = keyspace_notifications_enabled(client)

    # ------------------------------------------------------------------ background

    def _new_primitives(self) -> None:
        self._lock = asyncio.Lock()
        self._compile_gate = asyncio.Lock()
        self._epoch_event = asyncio.Event()
        self._ack_event = asyncio.Event()
        self._wake_event = asyncio.Event()

    def _ensure_started(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is loop and self._task is not None and not self._task.done():
            return
        if self._loop is not None and self._loop is not loop:
            self._stop_listener()  # a new event loop (tests): asyncio primitives are tied to a loop
            self._new_primitives()
        self._loop = loop
        self._stop = threading.Event()
        self._task = loop.create_task(self._reconcile_loop(), name="config-manager-reconcile")
        self._listener = threading.Thread(target=self._listen, args=(self._stop,), daemon=True,
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
                async with asyncio.timeout(self.reconcile_interval_s):
                    await self._wake_event.wait()
            except TimeoutError:
                pass
            self._wake_event.clear()
            try:
                await self.sync_from_store()
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
            except (redis.RedisError, OSError) as exc:
                logger.debug("change listener: %s; retrying in %.1f s", exc, backoff)
                stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)
            finally:
                if pubsub is not None:
                    try:
                        pubsub.close()
                    except Exception:
                        pass

    def _stop_listener(self) -> None:
        self._stop.set()
        if self._listener is not None:
            self._listener.join(timeout=5)
            self._listener = None

    async def close(self) -> None:
        """Stop the background task and the listener thread (the store and Redis stay as they are)."""
        await asyncio.get_running_loop().run_in_executor(None, self._stop_listener)
        self._grammar_worker.close()
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass

    def __del__(self):
        """Serve calls this on a graceful shutdown: stop listening, and stop the embedded Redis
        this manager started (its files stay; the next start reads them). A manager that dies
        without it leaves the server running, and the next one reuses it."""
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
        worker = getattr(self, "_grammar_worker", None)
        if worker is not None:
            worker.close()
        if getattr(self, "_embedded", False):
            try:
                from deployments.redis_server import close_embedded_from_finalizer

                close_embedded_from_finalizer(self.settings.data_dir)
            except Exception:  # pragma: no cover - interpreter shutdown
                pass
