"""The config manager: Redis <-> compiled tables <-> model replicas.

:class:`ConfigManager` is a plain class (the app builder wraps it with ``serve.deployment``; run it
as ONE replica). It is the only writer of compiled tables: it validates and compiles a scenario
before anything is stored, stores it in Redis (:class:`~deployments.storage.store.ScenarioStore`), puts
the compiled tables in the Ray object store once per version, and broadcasts them to the model
replicas. It is the facade the ingress and the replicas call; the work is done by its parts:

* :class:`~deployments.manager.compiler.StoredScenarioCompiler`: validate and compile a body (422/400), bounded;
  pins a tree file to its content at the PUT (a version means the same tokens forever).
* :class:`~deployments.manager.served.ServedScenarios`: what is served now, and the refused versions.
* :class:`~deployments.manager.registry.ReplicaRegistry`: the replicas' long poll, acks and liveness, and
  waiting for acks (the protocol is described there).
* :class:`~deployments.manager.reconciler.StoreReconciler`: the load at start, the change listener and the
  reconcile loop, the embedded-Redis restart, refusing unusable stored versions.

Every admin write (``put``, ``put_items``, ``patch``, ``rollback``, ``delete``) is one
:class:`~deployments.manager.write_flow.WriteFlow` run (draft -> validate -> compile -> store -> publish -> ack); each
method supplies only what differs. ``put``/``delete``/``rollback`` return once every live replica acknowledged an epoch that includes the change
(read-your-writes), or raise 504 after ``broadcast_timeout_s``; a retry with the same ``Idempotency-Key`` gets
the first write's answer instead of a second version.

IMPORTANT for the app builder: every replica holds one long poll open on this deployment, so
give it ``max_ongoing_requests`` well above the number of model replicas plus concurrent admin
calls (e.g. 1000); Serve's default (5) would queue acks behind polls.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from config import ServerSettings
from deployments.metrics import ManagerMetrics, route_logs_to_serve
from deployments.protocol import ServiceError
from deployments.storage.redis_server import connect_redis
from deployments.storage.store import IDEMPOTENCY_TTL_S, ScenarioStore, pack_body, pruned_error, request_fingerprint
from deployments.storage.store import validate_name

from deployments.json_body import parse_json_body
from .compiler import StoredScenarioCompiler, compile_warnings, lower_manager_priority
from .item_writes import patch_write, put_items_write, upload_draft
from .memory_guard import PEAK_PER_BODY_BYTE, check_write_memory
from .reconciler import StoreReconciler
from .registry import ReplicaRegistry
from .served import ServedScenarios
from .uploads import UploadSpool
from .write_flow import Draft, Write, WriteFlow, as_version, body_fingerprint

logger = logging.getLogger(__name__)

__all__ = ["ConfigManager"]



def _setting(part: str, attr: str) -> property:
    """A constructor setting kept by one of the manager's parts, readable and settable on the manager."""
    return property(lambda self: getattr(getattr(self, part), attr),
                    lambda self, value: setattr(getattr(self, part), attr, float(value)))


_CATALOG_FILE = ", a catalog file"  # the log note of a PUT naming a catalog file by path (read as an upload)

class ConfigManager:
    """The facade the ingress and the replicas call: admin writes and reads, the replica protocol, health.

    Args:
        settings: :class:`config.ServerSettings` (or the builder's ``args`` dict).
        tokenizer: the served model's tokenizer; loaded from ``settings.model`` when None.
        redis_client: a ``redis.Redis`` (``decode_responses=True``); from ``settings.redis_url``
            or the embedded server under ``settings.data_dir`` when None.
        replica_timeout_s: a replica not heard from for this long is dropped.
        broadcast_timeout_s: how long a write waits for the replicas' acknowledgements (then 504).
        reconcile_interval_s: period of the fallback check of Redis for external changes.
        prefix: Redis key prefix (see :mod:`deployments.storage.store`).
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
        lower_manager_priority(self.settings.compile_nice)  # the control plane yields the CPU to serving
        route_logs_to_serve()
        self.metrics = ManagerMetrics()
        if tokenizer is None:
            from deployments.model_loader import load_tokenizer

            tokenizer = load_tokenizer(self.settings.model)
        self.tokenizer = tokenizer
        # Only an embedded server we started ourselves is restarted when it dies (and stopped by __del__).
        self._embedded = redis_client is None and not self.settings.redis_url
        if redis_client is None:
            redis_client = connect_redis(self.settings.redis_url, self.settings.data_dir)
        self.store = ScenarioStore(redis_client, prefix=prefix, idempotency_ttl_s=idempotency_ttl_s,
                                   history_bodies=self.settings.history_bodies,
                                   delta_chain=self.settings.catalog_delta_chain,
                                   compact_behind=self.settings.catalog_compact_behind)
        self.scenarios = ServedScenarios()
        self.registry = ReplicaRegistry(self.scenarios.tables, replica_timeout_s=replica_timeout_s,
                                        broadcast_timeout_s=broadcast_timeout_s)
        self.compiler = StoredScenarioCompiler(self.settings, tokenizer, self.store)
        self.reconciler = StoreReconciler(self.store, self.scenarios, self.compiler, self.registry,
                                          settings=self.settings, embedded=self._embedded,
                                          interval_s=reconcile_interval_s)
        # every admin write: draft -> validate -> compile -> store -> publish -> ack
        self._writes = WriteFlow(store=self.store, compiler=self.compiler, scenarios=self.scenarios,
                                 registry=self.registry, metrics=self.metrics, ensure_started=self._ensure_started,
                                 sync=self.sync_from_store)
        # catalog uploads streamed by the ingress in parts, spooled to files until their last part (.uploads)
        self._uploads = UploadSpool(os.path.join(self.settings.data_dir, "uploads"),
                                    lambda: self.settings.limits.max_upload_bytes)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.reconciler.load()
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass  # started by the first async call
        else:
            self._ensure_started()

    replica_timeout_s = _setting("registry", "replica_timeout_s")
    broadcast_timeout_s = _setting("registry", "broadcast_timeout_s")
    reconcile_interval_s = _setting("reconciler", "interval_s")

    @property
    def keyspace_notifications(self) -> bool:
        """Whether Redis sends keyspace events (else changes by other processes arrive by channel or reconcile)."""
        return self.reconciler.keyspace_notifications

    # ------------------------------------------------------------------ admin API

    async def put(self, name: str, body: dict, idempotency_key: str | None = None) -> dict[str, Any]:
        """Validate, compile, store a new version of ``name`` and wait until every live replica
        serves it. Returns ``{"name", "version"}``, plus ``warnings`` when the compile accepted something it reports
        (a lenient tree load: keys outside the root, unknown fields, skipped ids; see ``processors.kinds.tree.treefile.load.load_tree``; not kept
        for an idempotent replay). 422: invalid name or body; 400: does not compile (nothing stored in either case);
        503: Redis down; 504: replicas did not ack.

        A tree given as ``path`` is read once, here, and its content stored with the version
        (``content_sha256`` in the stored body): that version means those tokens forever. A body that
        already has ``content_sha256`` (e.g. one read back with :meth:`get`) uses the stored content.

        ``idempotency_key`` (the ``Idempotency-Key`` header): when a write with this key and the same request was
        already made (its client got a 503 although the write was stored, and retries), nothing is written again:
        the answer is the first write's, with ``"replayed": True``. The same key with another request is a 422."""
        raw = inline = None

        async def request() -> None:
            nonlocal body, raw, inline
            if isinstance(body, (bytes, bytearray)):  # the HTTP body as received: parsed here, once
                raw = bytes(body)
                check_write_memory(self.settings, PEAK_PER_BODY_BYTE * len(raw), f"a PUT of {len(raw):,} bytes",
                                   name=name)
                # a large body a kind reads its own way (an inline tree: its text to the tree loader, not through
                # JSON objects and pydantic)
                inline = await asyncio.to_thread(self.compiler.split_body, raw)
                if inline is None:
                    body = await asyncio.to_thread(parse_json_body, raw, self.settings.limits, scenario=True)

        def fingerprint() -> str:
            return body_fingerprint("put", name, body if inline is None else inline[1].fingerprint_body())

        async def draft(_fingerprint: str | None) -> Draft:
            nonlocal body
            if inline is not None:
                # the body's compression for the store runs beside the compile (zlib releases the GIL)
                packing = asyncio.ensure_future(asyncio.to_thread(pack_body, inline[1].json))
                try:
                    compiled = await self.compiler.compile_split(name, inline)
                finally:
                    packed = await packing
                if compiled is not None:  # stored as the client sent it (a GET gives back its tree)
                    return Draft(body=inline[1].rest, compiled=compiled, body_json=inline[1].json, packed=packed,
                                 note=", body split")
                # refused on the split way: the whole body, parsed and compiled the exact way, names the problem
                body = await asyncio.to_thread(parse_json_body, raw, self.settings.limits, scenario=True)
            catalog_file = await asyncio.to_thread(self.compiler.catalog_file, name, body)
            if catalog_file is not None:  # a catalog file named by path: read here, as an upload of it
                draft = await asyncio.to_thread(upload_draft, self, name, *catalog_file)
                draft.note = _CATALOG_FILE
                return draft
            stored = await asyncio.to_thread(self.compiler.pin_content, name, body)
            return Draft(body=stored, load_content=True)

        def store(d: Draft, fp: str | None):
            return self.store.put(name, d.body, idempotency_key=idempotency_key, fingerprint=fp, content=d.content,
                                  body_json=d.body_json, packed_body=d.packed)

        def finish(d: Draft, answer: dict[str, Any], replayed: bool) -> dict[str, Any]:
            warnings = [] if replayed else compile_warnings(d.compiled)
            items = d.body["items"] if d.note == _CATALOG_FILE else None  # (a catalog file's: as an upload answers)
            return {**answer, **({"items": items} if items is not None else {}),
                    **({"warnings": warnings} if warnings else {})}

        return await self._writes.run(Write("put", name, draft, store, fingerprint=fingerprint, request=request,
                                            finish=finish, idempotency_key=idempotency_key))

    async def put_items(self, name: str, data: bytes, idempotency_key: str | None = None,
                        upload_format: str = "ndjson") -> dict[str, Any]:
        """Store a catalog (the items format of :mod:`processors.kinds.tree.catalog.catalog`: a header line, then one JSON
        array of token ids per line; ``upload_format`` ``"parquet"``: a Parquet file, :mod:`processors.kinds.tree.catalog.parquet`)
        as a new version of tree scenario ``name``, like :meth:`put`. The bytes are
        parsed and validated once, here; the canonical catalog is stored as tree content (chunked) and the stored
        body names it (``content_sha256``, ``content_format: items``). Returns ``{"name", "version", "items"}``."""
        return await self._writes.run(put_items_write(self, name, data, idempotency_key, upload_format))

    async def upload_part(self, upload_id: str, offset: int, data: bytes) -> int:
        """A part of a catalog upload streamed by the ingress (:mod:`deployments.manager.uploads`): appended to its
        spool file at byte ``offset``; returns the bytes received so far. 413 past ``max_upload_bytes``, 429 when
        too many uploads are under way, 409 for a part out of order."""
        return await asyncio.to_thread(self._uploads.append, upload_id, int(offset), data)

    async def put_upload(self, name: str, upload_id: str, size: int, idempotency_key: str | None = None,
                         upload_format: str = "ndjson") -> dict[str, Any]:
        """:meth:`put_items` of a streamed upload once its ``size`` bytes arrived (:meth:`upload_part`): its spool
        file is mapped, not read into memory, and removed once stored or refused."""
        path = await asyncio.to_thread(self._uploads.finished, upload_id, int(size))
        try:
            data = await asyncio.to_thread(self.compiler.map_upload, path, upload_format)
            return await self._writes.run(put_items_write(self, name, data, idempotency_key, upload_format))
        finally:
            await asyncio.to_thread(self._uploads.drop, upload_id)

    async def drop_upload(self, upload_id: str) -> None:
        """A streamed upload that will not finish (its client went away): its spool file is removed."""
        await asyncio.to_thread(self._uploads.drop, upload_id)

    async def patch(self, name: str, delta: Any, idempotency_key: str | None = None,
                    base_version: int | None = None) -> dict[str, Any]:
        """Apply ``delta`` = ``{"add": [...], "remove": [...], "base_version": n}`` to the current version of
        ``name`` and store the result as a new version (history, acks, ``Idempotency-Key``: as for :meth:`put`).

        Tree: items are lists of token ids after the root, without the end token (the result is stored as a
        catalog); labels: label strings. Adds already present and removes not present are no-ops, reported in
        the answer (``already_present``, ``not_present``), so a retried PATCH is safe; a PATCH that changes nothing
        makes no version (``changed: false``, the current version). ``base_version`` (or the ``If-Match`` header,
        passed here as ``base_version``): 409 unless that version is current when the new one is written, nothing
        stored. Without it, a write that lands between our read and our write (a PUT) is not overwritten: the
        delta is applied again to the new current version. Returns ``{"name", "version", "base_version",
        "changed", "added", "removed", "already_present", "not_present"}``."""
        return await self._writes.run(patch_write(self, name, delta, idempotency_key, base_version))

    async def rollback(self, name: str, version: int, idempotency_key: str | None = None) -> dict[str, Any]:
        """Store a NEW version of ``name`` with the body of ``version`` (compiled and broadcast like a
        put; a tree read from a file gets the content stored with ``version``, not today's file). Returns
        ``{"name", "version", "from_version"}``. ``idempotency_key`` as for :meth:`put`."""

        async def request() -> None:
            nonlocal version
            version = as_version(version)

        def fingerprint() -> str:
            return request_fingerprint("rollback", name, None, version)

        async def draft(_fingerprint: str | None) -> Draft:
            body = await self._stored_body(name, version, "there is no body to roll back to", None)
            return Draft(body=body,
                         replay={"action": "rollback", "name": name, "from_version": version})

        def store(d: Draft, fp: str | None):
            return self.store.rollback(name, version, idempotency_key=idempotency_key)

        def finish(d: Draft, answer: dict[str, Any], replayed: bool) -> dict[str, Any]:
            return answer if replayed else {**answer, "from_version": version}

        def log(d: Draft, new_version: int) -> None:
            logger.info("rolled scenario %r back to the body of version %d as version %d", name, version, new_version)

        return await self._writes.run(Write("rollback", name, draft, store, fingerprint=fingerprint, request=request,
                                            finish=finish, log=log, idempotency_key=idempotency_key))

    async def delete(self, name: str, idempotency_key: str | None = None) -> dict[str, Any]:
        """Delete ``name`` (a delete entry in its history) and wait until no live replica serves it.
        Returns ``{"name", "version", "deleted": True}`` where version is the delete entry's.
        ``idempotency_key`` as for :meth:`put` (a retried delete gets its first answer, not a 404)."""

        async def draft(_fingerprint: str | None) -> Draft:
            return Draft(removes=True)

        def store(d: Draft, fp: str | None):
            return self.store.delete(name, idempotency_key=idempotency_key)

        def finish(d: Draft, answer: dict[str, Any], replayed: bool) -> dict[str, Any]:
            return answer if replayed else {**answer, "deleted": True}

        def log(d: Draft, version: int) -> None:
            logger.info("deleted scenario %r (version %d)", name, version)

        return await self._writes.run(Write("delete", name, draft, store, finish=finish, log=log,
                                            fingerprint=lambda: request_fingerprint("delete", name),
                                            idempotency_key=idempotency_key))

    async def get(self, name: str, version: int | None = None) -> dict[str, Any]:
        """The stored record ``{"name", "version", "scenario", "created_at", "action"}`` of the
        current version (or of ``version``). 404 when there is none."""
        self._ensure_started()
        validate_name(name)
        version = None if version is None else as_version(version)
        record = await asyncio.to_thread(self.store.get, name, version)
        if record is None:
            await self._not_found(name, version)
        if record.get("pruned"):
            raise pruned_error(name, int(record["version"]))
        return record

    async def versions(self, name: str) -> list[dict[str, Any]]:
        """The history of ``name`` (also after a delete), oldest first."""
        self._ensure_started()
        validate_name(name)
        history = await asyncio.to_thread(self.store.versions, name)
        if not history:
            await self._not_found(name, None)
        return history

    async def list(self) -> list[dict[str, Any]]:
        """``[{"name", "type", "version"}]`` of the scenarios being served (works while Redis is down)."""
        self._ensure_started()
        return self.scenarios.listing()

    async def inspect(self, name: str, version: int | None = None, token_ids=(), limit: int = 100,
                      last_only: bool = False) -> dict[str, Any]:
        """What a row of ``name`` may emit after ``token_ids``, step by step (the web console's tree view and
        playground; see :func:`deployments.console.replay` for the result). Read-only.

        ``version`` None is the version served now; another stored version is compiled for the occasion, from
        what was stored (a tree read from a file: the content stored at its PUT, not the file today).
        404: unknown name or version; 409: a delete entry; 422: an id outside the vocabulary."""
        self._ensure_started()
        validate_name(name)
        served = self.scenarios.served.get(name)
        if version is None and served is None:
            await self._not_found(name, None)
        version = served.version if version is None else as_version(version)
        if served is not None and served.version == version:
            # With Ray the object store holds the tables (awaiting the ref is ray.get without blocking).
            compiled = served.compiled if served.compiled is not None else await served.ref
        else:
            body = await self._stored_body(name, version, "it allows nothing", {"name": name, "version": version})
            compiled = await self.compiler.compile(name, body)
        from deployments.console import replay

        report = await asyncio.to_thread(replay, compiled, self.tokenizer, list(token_ids),
                                         limit=int(limit), last_only=bool(last_only))
        return {"name": name, "version": version, "type": compiled.kind, **report}

    async def _stored_body(self, name: str, version: int, delete_entry: str, detail: dict | None) -> Any:
        """The stored body of ``version`` of ``name``: 404 unknown, 410 pruned, 409 a delete entry."""
        record = await asyncio.to_thread(self.store.get, name, version)
        if record is None:
            await self._not_found(name, version)
        if record.get("pruned"):
            raise pruned_error(name, version)
        if record["scenario"] is None:
            raise ServiceError(409, f"version {version} of scenario {name!r} is a delete entry; {delete_entry}", detail)
        return record["scenario"]

    async def _not_found(self, name: str, version) -> None:
        known = sorted(self.scenarios.served)
        if version is None:
            raise ServiceError(404, f"unknown scenario {name!r}", {"known": known})
        history = await asyncio.to_thread(self.store.versions, name)
        if not history:
            raise ServiceError(404, f"unknown scenario {name!r}", {"known": known})
        raise ServiceError(404, f"scenario {name!r} has no version {version}",
                           {"known": known, "versions": [h["version"] for h in history]})

    # ------------------------------------------------------------------ replica protocol (see registry.py)

    async def register(self, replica_id: str) -> dict[str, Any]:
        """A replica (re)starts: returns the current snapshot; the replica acks once it serves it."""
        self._ensure_started()
        return await self.registry.register(replica_id)

    async def wait_for_update(self, replica_id: str, epoch: int, timeout_s: float = 10.0) -> dict[str, Any] | None:
        """Long poll: the snapshot as soon as the manager's epoch differs from ``epoch`` (normally:
        is greater), or ``None`` after ``timeout_s`` (cut to half of ``replica_timeout_s``)."""
        self._ensure_started()
        return await self.registry.wait_for_update(replica_id, epoch, timeout_s)

    async def ack(self, replica_id: str, epoch: int, versions: dict[str, int], table_deltas: int = 0) -> None:
        """A replica serves the snapshot of ``epoch`` (``versions``: what it now serves; ``table_deltas``: the
        catalog PATCHes it applied to its own tables, shown by ``/healthz``)."""
        await self.registry.ack(replica_id, epoch, versions, table_deltas)

    async def base_tables(self, version: str) -> Any:
        """The base tables ``version`` of a served overlay version (a replica that does not hold them asks:
        ``deployments/replica/subscriber.py``), as an object reference; None when nothing served is built on them."""
        return self.scenarios.base_ref(version)

    async def replica_versions(self) -> dict[str, dict[str, Any]]:
        """``{replica_id: {"epoch", "versions", "last_seen", "table_deltas"}}`` for the live replicas."""
        return self.registry.view()

    # ------------------------------------------------------------------ health

    async def health(self) -> dict[str, Any]:
        """Redis reachability, served scenarios and versions, refused versions, replicas."""
        self._ensure_started()
        try:
            await asyncio.to_thread(self.store.ping)
            redis_ok, error = True, None
        except ServiceError as exc:
            redis_ok, error = False, exc.message
        errors = self.scenarios.errors
        return {
            "status": "ok" if redis_ok and not errors else "degraded",
            "redis": {"ok": redis_ok, "error": error, "embedded": self._embedded,
                      "keyspace_notifications": self.keyspace_notifications},
            "epoch": self.registry.epoch,
            "scenarios": self.scenarios.versions(),
            "errors": {n: dict(e) for n, e in sorted(errors.items())},
            "replicas": self.registry.view(),
        }

    async def sync_from_store(self) -> bool:
        """Bring the served state in line with Redis now (the background loop does this on every
        change notification and every ``reconcile_interval_s``). Returns whether anything changed."""
        return await self.reconciler.sync()

    # ------------------------------------------------------------------ lifecycle

    def _ensure_started(self) -> None:
        """Run the reconciler on the running event loop (again after a new loop: asyncio primitives are tied to
        one, so every part renews its own)."""
        loop = asyncio.get_running_loop()
        if self.reconciler.running_on(loop):
            return
        if self._loop is not None and self._loop is not loop:
            self.reconciler.stop_listener()
            for part in (self.scenarios, self.registry, self.compiler, self.reconciler):
                part.new_loop()
        self._loop = loop
        self.reconciler.start(loop)

    async def close(self) -> None:
        """Stop the background task and the listener thread (the store and Redis stay as they are)."""
        await asyncio.get_running_loop().run_in_executor(None, self.reconciler.stop_listener)
        self.compiler.close()
        await self.reconciler.cancel_task()

    def __del__(self):
        """Serve calls this on a graceful shutdown: stop listening, and stop the embedded Redis
        this manager started (its files stay; the next start reads them). A manager that dies
        without it leaves the server running, and the next one reuses it."""
        reconciler = getattr(self, "reconciler", None)
        if reconciler is not None:
            reconciler.stop_event.set()
        compiler = getattr(self, "compiler", None)
        if compiler is not None:
            compiler.close()
        if getattr(self, "_embedded", False):
            try:
                from deployments.storage.redis_server import close_embedded_from_finalizer

                close_embedded_from_finalizer(self.settings.data_dir)
            except Exception:  # pragma: no cover - interpreter shutdown
                pass
