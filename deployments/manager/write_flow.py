"""The one admin write flow of the manager: ``draft -> validate -> compile -> store -> publish -> ack``.

Every admin write (PUT, catalog upload, PATCH, rollback, delete; :class:`~deployments.manager.facade.ConfigManager`)
goes through :meth:`WriteFlow.run`; a write supplies only what differs, as a :class:`Write`:

* ``request`` (optional): the body received parsed once (PUT, PATCH), before anything else;
* ``fingerprint``: the request's fingerprint for its ``Idempotency-Key`` (a known key answers with the first
  write's result, nothing is written);
* ``draft``: what is stored, as a :class:`Draft` (the body, its content, an already compiled form, or an answer
  without a write: a PATCH that changes nothing);
* ``store``: the store call (``ScenarioStore.put`` / ``rollback`` / ``delete``), made under the write lock;
* ``finish``: the answer, from ``{"name", "version"}`` (or the replayed first answer).

The flow itself: the name checked, the idempotency check, the draft, the compile (validation included:
``StoredScenarioCompiler.compile``: 422 invalid, 400 does not compile; nothing is stored on a refusal, and a local
content copy the draft made is removed again), the store write and the publish (install of the compiled tables or
removal of the name, epoch + 1) under ``ServedScenarios.lock``, then the wait for every live replica's ack.
A conditional write (``Draft.expect_current``) that finds another version current raises
:class:`~deployments.storage.store.BaseChanged`; with ``Write.attempts`` > 1 and ``Draft.redraft_on_conflict`` it is
drafted again on the new current version.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from deployments.metrics import ManagerMetrics
from deployments.protocol import ServiceError
from deployments.storage.store import BaseChanged, ScenarioStore, request_fingerprint, validate_idempotency_key
from deployments.storage.store import validate_name

from .compiler import StoredScenarioCompiler
from .registry import ReplicaRegistry
from .served import ServedScenarios, object_ref

logger = logging.getLogger(__name__)

__all__ = ["Draft", "Write", "WriteFlow", "as_version", "body_fingerprint"]


def body_fingerprint(action: str, name: str, body: Any) -> str:
    """The request fingerprint of an admin write (422 for a body that is not JSON)."""
    try:
        return request_fingerprint(action, name, body)
    except (TypeError, ValueError) as exc:
        raise ServiceError(422, f"the scenario body is not JSON: {exc}") from None


def as_version(version: Any) -> int:
    """A version number from a caller (``"3"`` from a URL is fine); 422 for anything else."""
    try:
        number = int(version)
    except (TypeError, ValueError):
        number = 0
    if number < 1 or isinstance(version, bool) or (isinstance(version, float) and not version.is_integer()):
        raise ServiceError(422, f"invalid version {version!r}: versions are integers from 1", {"field": "version"})
    return number


@dataclass
class Draft:
    """What one write stores.

    ``body``: the body to store (None: a delete); ``compiled``: its compiled form when the draft already has it
    (a split inline tree), else the flow compiles ``body`` (unless ``removes``); ``removes``: the write takes the
    name out of service (a delete) instead of installing tables; ``load_content``: the stored content of a pinned
    tree file is read after the compile and stored with the version; ``content`` (bytes, or the
    ``ContentDelta`` of a catalog PATCH), ``body_json``, ``packed``: what the store writes besides the body;
    ``new_content``: the sha of a local content copy this write made (removed
    again when the write is refused before anything is stored); ``answer``: kept with the ``Idempotency-Key``
    (a PATCH's report); ``expect_current``: a conditional write; ``redraft_on_conflict``: drafted again when
    another version became current; ``result``: the answer with no write at all; ``replay``: the first answer's
    record when the store finds the same write already made; ``lookup_first``: look that record up by the
    ``Idempotency-Key`` first."""

    body: Any = None
    compiled: Any = None
    removes: bool = False
    load_content: bool = False
    content: Any = None  # bytes, or a PATCH's store_content.ContentDelta
    body_json: str | None = None
    packed: Any = None
    new_content: str | None = None
    answer: dict[str, Any] | None = None
    expect_current: int | None = None
    redraft_on_conflict: bool = False
    result: dict[str, Any] | None = None
    replay: dict[str, Any] | None = None
    lookup_first: bool = False
    replica_delta: dict[str, Any] | None = None  # a PATCH's {"base", "add", "remove"[, "update"]} for the replicas (served.py)
    note: str = ""  # added to the log line (how the body came)


@dataclass
class Write:
    """One admin write: what differs between PUT, catalog upload, PATCH, rollback and delete (see the module)."""

    action: str
    name: str
    draft: Callable[[str | None], Awaitable[Draft]]
    store: Callable[[Draft, str | None], Any]
    fingerprint: Callable[[], Any] | None = None
    request: Callable[[], Awaitable[None]] | None = None
    finish: Callable[[Draft, dict[str, Any], bool], dict[str, Any]] | None = None
    log: Callable[[Draft, int], None] | None = None
    attempts: int = 1
    exhausted: Callable[[], ServiceError] | None = None
    idempotency_key: str | None = None


class WriteFlow:
    """Runs :class:`Write` s with the manager's parts it is given.

    Args:
        store: the scenario store (a retried write's first answer: ``idempotent_result``).
        compiler: validation and compile (``compile``, ``stored_content``, ``discard_content``, ``note_installed``,
            ``writing``).
        scenarios: what is served (``lock``, ``install``, ``remove``, ``served``).
        registry: the replicas (``bump``, ``epoch``, ``wait_for_acks``).
        metrics: the manager's metrics (``swapped``).
        ensure_started: the manager's background parts started on the running event loop (first in every write).
        sync: bring the served state in line with the store now (a retried write whose first attempt is not served).
    """

    def __init__(self, *, store: ScenarioStore, compiler: StoredScenarioCompiler, scenarios: ServedScenarios,
                 registry: ReplicaRegistry, metrics: ManagerMetrics, ensure_started: Callable[[], None],
                 sync: Callable[[], Awaitable[bool]]):
        self.store = store
        self.compiler = compiler
        self.scenarios = scenarios
        self.registry = registry
        self.metrics = metrics
        self.ensure_started = ensure_started
        self.sync = sync

    async def run(self, write: Write) -> dict[str, Any]:
        if write.action == "patch":  # (its draft asks for the read of its own base: not stopped)
            return await self._run(write)
        with self.compiler.writing():  # no background read shares the CPU with this write
            return await self._run(write)

    async def _run(self, write: Write) -> dict[str, Any]:
        started = time.monotonic()
        self.ensure_started()
        validate_name(write.name)
        if write.request is not None:
            await write.request()
        fingerprint = None
        if write.idempotency_key is not None:
            validate_idempotency_key(write.idempotency_key)
            if write.fingerprint is not None:
                fingerprint = await asyncio.to_thread(write.fingerprint)
            first = await asyncio.to_thread(self.store.idempotent_result, write.idempotency_key, fingerprint)
            if first is not None:
                return await self.replay(first)
        for attempt in range(1, write.attempts + 1):
            draft = await write.draft(fingerprint)
            if draft.result is not None:
                return draft.result
            try:
                return await self._write(write, draft, fingerprint, started)
            except BaseChanged:
                if not draft.redraft_on_conflict or (attempt == write.attempts and write.exhausted is None):
                    raise
                # a write landed since the draft read the current version: draft again on it
        assert write.exhausted is not None
        raise write.exhausted()

    async def _write(self, write: Write, draft: Draft, fingerprint: str | None, started: float) -> dict[str, Any]:
        name, compiler, scenarios = write.name, self.compiler, self.scenarios
        drafted = time.monotonic()

        async def refused() -> None:
            if draft.new_content is not None:
                await asyncio.to_thread(compiler.discard_content, draft.new_content)

        compiled = draft.compiled
        if compiled is None and not draft.removes:
            try:  # validate (422) and compile (400): nothing is stored when either refuses
                compiled = await compiler.compile(name, draft.body)
            except BaseException:
                await refused()
                raise
            draft.compiled = compiled
            if draft.load_content:
                draft.content = await asyncio.to_thread(compiler.stored_content, draft.body)
        compiled_at = time.monotonic()
        async with scenarios.lock:
            try:
                version = await asyncio.to_thread(functools.partial(write.store, draft, fingerprint))
            except BaseException:
                await refused()
                raise
            stored_at = time.monotonic()
            if not version.replayed:  # publish: the new tables (or the removal) and epoch + 1
                if draft.removes:
                    scenarios.remove(name)
                else:
                    delta = draft.replica_delta
                    if delta is not None:  # the tables it gives, for the replica to check its own result against
                        delta = {**delta, "tables": getattr(compiled.constraint, "version", None)}
                    scenarios.install(name, version, compiled, await asyncio.to_thread(object_ref, compiled), delta)
                compiler.note_installed(name, int(version), None if draft.removes else compiled)
                epoch = self.registry.bump()
        if version.replayed:  # the same request, stored meanwhile: its first answer
            first = None
            if draft.lookup_first and write.idempotency_key is not None and fingerprint is not None:
                first = await asyncio.to_thread(self.store.idempotent_result, write.idempotency_key, fingerprint)
            replay = draft.replay or {"action": write.action, "name": name, "version": int(version)}
            answer = await self.replay(first or {**replay, "version": int(version)})
            return write.finish(draft, answer, True) if write.finish is not None else answer
        if write.log is not None:
            write.log(draft, int(version))
        else:  # where a large write's time went before the replicas fetch it (the rest is theirs)
            logger.info("stored scenario %r version %d (%s%s; draft %.3f s, compile %.3f s, store %.3f s, "
                        "object store %.3f s)", name, version, write.action, draft.note, drafted - started,
                        compiled_at - drafted, stored_at - compiled_at, time.monotonic() - stored_at)
        await self.registry.wait_for_acks(epoch, name, version)
        self.metrics.swapped(name, write.action, started)
        answer = {"name": name, "version": int(version)}
        return write.finish(draft, answer, False) if write.finish is not None else answer

    async def replay(self, first: dict[str, Any]) -> dict[str, Any]:
        """The answer to a retried write: the first write's result (plus ``"replayed": True``), once the
        replicas serve what is current (the first attempt may have stored its version and died before
        broadcasting it; a new manager loaded it at start, this one picks it up now)."""
        name, version, action = first["name"], int(first["version"]), first["action"]
        served = self.scenarios.served.get(name)
        behind = (name in self.scenarios.served) if action == "delete" else (served is None or served.version < version)
        if behind:
            await self.sync()
        logger.info("answered a retried %s of scenario %r with its first result (version %d)", action, name, version)
        await self.registry.wait_for_acks(self.registry.epoch, name, version)
        # the first answer exactly, where the write kept it (a PATCH's report), else what a write answers
        result: dict[str, Any] = {"name": name, **(first.get("answer") or {}), "version": version}
        if action == "rollback":
            result["from_version"] = first.get("from_version")
        if action == "delete":
            result["deleted"] = True
        result["replayed"] = True
        return result
