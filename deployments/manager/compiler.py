"""The config manager's compile step: a scenario body -> its compiled tables for the served tokenizer, or a refusal.

Every compile the manager makes goes through :meth:`StoredScenarioCompiler.compile` (async) or
:meth:`StoredScenarioCompiler.compile_blocking` (at start), which run :meth:`StoredScenarioCompiler._prepare`
on the compiler's own threads, one at a time, bounded by ``limits.compile_timeout_s``:
``validate`` (422: limits, ``processors.scenarios.load_scenario``, a tree path confined to ``tree_dir``) ->
``_compile_now`` (400: ``processors.pipeline.ScenarioCompiler.compile_now``: grammars in its bounded worker
process, each kind's limits on the compiled form). ``_compile_now`` is the one place that calls the processors.

A kind that keeps stored content (a tree's file pinned to its SHA-256 at the PUT, a catalog's items and tables,
a large inline tree read its own way) does so in its package (:meth:`processors.kinds.base.ConstraintKind.stored_content`,
the tree's :class:`processors.kinds.tree.store.content.TreeContent`); the compiler lends it a
:class:`~processors.kinds.patch.ContentHost` (its data directory, the store's bytes, its threads) and asks it by the
body's type, naming no kind.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from config import ConstraintError, ScenarioError, ServerSettings
from config.settings import LimitExceeded
from deployments.protocol import ServiceError
from deployments.scenario_errors import refused_as_service_error, scenario_service_error
from deployments.storage.store import ScenarioStore, content_sha256
from processors.kinds.patch import ContentHost

logger = logging.getLogger(__name__)

__all__ = ["StoredScenarioCompiler", "compile_warnings", "lower_manager_priority"]


def _lower_priority(nice: int) -> None:
    """Thread initializer: raise this thread's niceness by ``nice`` (Linux schedules threads one by one)."""
    if nice <= 0:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), min(19, os.getpriority(os.PRIO_PROCESS, 0) + nice))
    except (AttributeError, OSError):  # not Linux, or not allowed: compile at the process's priority
        logger.debug("cannot lower the compile threads' priority", exc_info=True)


def lower_manager_priority(nice: int) -> None:
    """When the config manager runs in a process of its own (a Ray actor), raise the niceness of all its threads
    (and so of every thread and child process started later: the body parses, the store's calls, an embedded Redis)
    by ``nice``: on a node that also serves, a swap's work then takes the CPU the model replicas leave. The manager is
    the control plane: a lower priority delays writes and acknowledgements, never a generate request."""
    if nice <= 0:
        return
    try:
        import ray

        if not (ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None):
            return  # in a driver or a test process: leave the process alone
        for tid in os.listdir("/proc/self/task"):
            current = os.getpriority(os.PRIO_PROCESS, int(tid))
            os.setpriority(os.PRIO_PROCESS, int(tid), min(19, current + nice))
    except Exception:  # noqa: BLE001 - not Linux, not allowed, no Ray: run at the process's priority
        logger.debug("cannot lower the config manager's priority", exc_info=True)


def compile_warnings(compiled) -> list[str]:
    """What a compile accepted but reports (a lenient tree load: keys outside the root, unknown fields, skipped ids;
    see ``processors.kinds.tree.treefile.load.load_tree``): the admin PUT returns them as ``warnings``."""
    return list(getattr(getattr(compiled, "constraint", None), "warnings", ()) or ())


_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


def _content_delta(base_sha: str, removed_lines: list[bytes], added_lines: list[bytes], content):
    """The stored form of content that is ``base_sha``'s with lines removed and appended
    (:class:`~deployments.storage.content.ContentDelta`; ``content`` gives the whole bytes)."""
    from deployments.storage.content import ContentDelta, line_delta

    return ContentDelta(base_sha, line_delta(removed_lines, added_lines), content)


class StoredScenarioCompiler:
    """Validates and compiles scenario bodies for the served tokenizer (422 invalid, 400 does not compile), off the
    event loop and bounded in time; pins tree files to their content.

    Args:
        settings: the manager's :class:`config.ServerSettings` (limits, ``tree_dir``, ``data_dir``).
        tokenizer: the served model's tokenizer.
        store: the :class:`~deployments.storage.store.ScenarioStore` holding stored tree content.
    """

    def __init__(self, settings: ServerSettings, tokenizer, store: ScenarioStore):
        self.settings = settings
        self.tokenizer = tokenizer
        self.store = store
        # Compiles get their own threads, so that they never starve the Redis calls, which go to asyncio's default
        # executor. One past compile_timeout_s is told to stop and unwinds at its next checkpoint (config.cancel).
        # They run at a lower priority (compile_nice): on a node that also serves, a large tree's compile takes the CPU
        # the replicas leave, so requests in flight during a swap are not slowed by it.
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="config-manager-compile",
                                        initializer=_lower_priority, initargs=(settings.compile_nice,))
        # The scenario pipeline: limits, validation, compile (JSON-schema and regex grammars in a worker process
        # killed at the limits: their cost can explode on a small schema; a thread could not be stopped).
        from processors import ScenarioCompiler

        self.pipeline = ScenarioCompiler(tokenizer, settings.limits, executor=self._pool)
        host = ContentHost(
            data_dir=settings.data_dir, resolve_path=settings.resolve_tree_path, fetch=store.content,
            content_key=store.content_key, vocab_size=lambda: self.vocab_size, limits=lambda: self.settings.limits,
            pool=self._pool, validate=self.validate, content_delta=_content_delta, parse_body=self._parse_body,
            stage_content=store.stage_content, unstage_content=store.unstage_content)
        from processors import registry

        # each kind's stored content, by type (the tree's: processors/kinds/tree/store/content.py); kinds without: none
        self.contents: dict[str, Any] = {}
        self._upload_type: str | None = None  # the kind an upload is of (ConstraintKind.upload_format)
        self._formats: dict[str, str] = {}  # content_format -> the kind whose upload format it is
        for type_name in registry.names():
            kind = registry.get(type_name)
            content = kind.stored_content(host)
            if content is not None:
                self.contents[type_name] = content
                if kind.upload_format is not None:
                    self._upload_type = type_name
                    self._formats[kind.upload_format] = type_name
        self.new_loop()

    def new_loop(self) -> None:
        """A new event loop (tests): asyncio primitives are tied to one."""
        self._gate = asyncio.Lock()

    def close(self) -> None:
        for content in self.contents.values():
            content.close()
        self.pipeline.close()

    def _parse_body(self, raw: bytes) -> Any:
        from deployments.json_body import parse_json_body

        return parse_json_body(raw, self.settings.limits, scenario=True)

    def _content_of(self, body: Any) -> Any | None:
        """The stored content of the kind of ``body`` (a dict with ``type``), or None."""
        return self.contents.get(body.get("type")) if isinstance(body, dict) else None

    # ------------------------------------------------------------------ validate

    def validate(self, name: str, body: Any):
        """The scenario of ``body`` (422 when invalid). A body stored with its content (``content_sha256``) gets
        ``path`` pointing at that content (its kind's stored content binds it), never at the file it was read
        from."""
        if not isinstance(body, dict):
            raise ServiceError(422, f"a scenario body must be a JSON object, got {type(body).__name__}")
        sha = fmt = None
        if "content_sha256" in body:
            body = dict(body)
            sha = body.pop("content_sha256")
            if not isinstance(sha, str) or not _SHA256_HEX.fullmatch(sha):
                raise ServiceError(422, "invalid scenario: content_sha256: expected 64 lowercase hex digits",
                                   {"name": name, "field": "content_sha256"})
            if "content_format" in body:  # an upload (a catalog: processors/kinds/tree/catalog/catalog.py), not a file
                fmt = body.pop("content_format")
                if self._formats.get(fmt) != body.get("type"):
                    known = " or ".join(repr(f) for f in self._formats)
                    raise ServiceError(422, f"invalid scenario: content_format: only {known} (an upload's format), got "
                                            f"{fmt!r}", {"name": name, "field": "content_format"})
                body.pop("items", None)  # the item count, for display
                body.pop("metadata", None)  # the metadata fields' summary, for display
        try:
            # limits first (before anything walks the body), then validation; the manager's bodies come from JSON
            # (an HTTP body or Redis), so they are not serialized again to check that they are JSON
            scenario = self.pipeline.parse(body, from_json=True)
        except ScenarioError as exc:
            raise scenario_service_error(exc, "scenario", name=name) from None
        content = self.contents.get(scenario.type)
        if content is None:
            if sha is not None:
                raise ServiceError(422, f"invalid scenario: content_sha256: a {scenario.type} scenario has no stored "
                                        "content", {"name": name, "field": "content_sha256"})
            return scenario
        with refused_as_service_error():
            return content.bind(name, scenario, sha, fmt)

    # ------------------------------------------------------------------ stored content

    def pin_content(self, name: str, body: Any) -> Any:
        """The body to store for ``body``: its kind pins what it reads from outside the body (a tree file: read
        ONCE, into a local copy named by its SHA-256; the body then carries ``content_sha256``). Runs in a worker
        thread."""
        content = self._content_of(body)
        if content is None:
            return body
        with refused_as_service_error():
            return content.pin(name, body)

    def catalog_file(self, name: str, body: Any) -> tuple[Any, str] | None:
        """``(bytes, upload format)`` of the catalog file a PUT body names by ``path`` (its kind reads it:
        ``TreeContent.catalog_file``), for :meth:`upload`; None when the body names none. Runs in a worker thread."""
        content = self._content_of(body)
        read = getattr(content, "catalog_file", None)
        if read is None:
            return None
        with refused_as_service_error():
            return read(name, body)

    def split_body(self, raw: bytes) -> tuple[str, Any] | None:
        """A large PUT body a kind reads its own way (a tree given inline: split at its braces), as ``(type, split)``
        for :meth:`compile_split`; None: parse it whole."""
        for type_name, content in self.contents.items():
            split = content.split(raw)
            if split is not None:
                return type_name, split
        return None

    @property
    def vocab_size(self) -> int:
        return int(self.pipeline.info.vocab_size)

    def upload(self, data: bytes, upload_format: str = "ndjson") -> tuple[dict[str, Any], bytes, str | None]:
        """An upload in a kind's content format (a catalog, as NDJSON or ``upload_format`` ``"parquet"``): ``(body
        to store, content, sha of a new local copy)`` (422 when refused)."""
        if self._upload_type is None:
            raise ServiceError(415, "no scenario type takes an upload")
        with refused_as_service_error():
            return self.contents[self._upload_type].upload(data, upload_format)

    def map_upload(self, path: str, upload_format: str = "ndjson") -> Any:
        """A streamed upload's spool file, memory-mapped the way its kind reads its content format (for
        :meth:`upload`); 400 when it cannot be read."""
        if self._upload_type is None:
            raise ServiceError(415, "no scenario type takes an upload")
        try:
            return self.contents[self._upload_type].map_upload(path, upload_format)
        except OSError as exc:
            raise ServiceError(400, f"catalog upload: its spool file cannot be read: {exc.strerror or exc}") from None

    def patch_store(self, type_name: str) -> Any:
        """What a PATCH of a ``type_name`` scenario works with (:class:`processors.kinds.patch.PatchStore`): its
        kind's stored content, or this compiler (validate, limits, vocabulary) for a kind without."""
        return self.contents.get(type_name, self)

    @property
    def limits(self):
        return self.settings.limits

    def note_installed(self, name: str, version: int, compiled) -> None:
        """``compiled`` (None: removed) is what ``name`` serves from ``version`` on (a tree given inline: its items
        are read for its first PATCH)."""
        for content in self.contents.values():
            content.installed(name, version, compiled)

    def held_base(self, store: ScenarioStore, name: str):
        """What a kind's stored content holds of the current version of ``name`` for a PATCH (a
        :class:`~processors.kinds.tree.store.inline_bases.HeldBase`: a tree given inline, its items); ``None`` when
        nothing: the PATCH then reads the stored body."""
        version = store.current_version(name)
        for content in self.contents.values():
            held = content.held(name, version, logger)
            if held is not None:
                return held
        return None

    def patch_need(self, body: Any, delta_items: int = 0) -> int | None:
        """What a PATCH of ``delta_items`` items of stored ``body`` needs beside what is held, when its kind's
        content knows (a held catalog: ``TreeContent.patch_need``); None: the caller's per-item estimate applies."""
        content = self._content_of(body)
        need = getattr(content, "patch_need", None)
        return None if need is None else need(body, delta_items)

    def discard_content(self, sha: str) -> None:
        """Remove the local copy of content ``sha`` that a refused write made."""
        for content in self.contents.values():
            content.discard_content(sha)

    def stored_content(self, body: Any) -> bytes | None:
        """The bytes of the local copy a pinned body refers to (to store them with the version)."""
        sha = content_sha256(body)
        content = self._content_of(body)
        if sha is None or content is None:
            return None
        return content.stored_bytes(sha)

    # ------------------------------------------------------------------ compile

    def _compile_now(self, name: str, scenario, prebuilt: Any = None):
        """The compile itself and the limits of its result (400 / 422): the one call into ``processors``
        (``prebuilt``: what a kind's stored content built, see ``processors.compile.compile_scenario``)."""
        try:
            return self.pipeline.compile_now(scenario, prebuilt=prebuilt)
        except ScenarioError as exc:
            raise scenario_service_error(exc, "scenario", name=name) from None

    def _prepare(self, name: str, body: Any):
        """Validate (422) and compile (400) a body; runs in a worker thread (a large tree takes a while)."""
        scenario = self.validate(name, body)
        content = self.contents.get(scenario.type)
        sha = content_sha256(body)
        try:
            prebuilt = None
            if content is not None:
                with refused_as_service_error():
                    prebuilt = content.prebuilt(name, body, sha)
            compiled = self._compile_now(name, scenario, prebuilt)
            if content is not None:
                content.compiled(name, compiled, body, scenario)
        except ServiceError as exc:
            if sha is not None and isinstance(body.get("path"), str):  # name the admin's file, not the local copy
                exc.message = exc.message.replace(scenario.path, f"{body['path']} (stored content {sha[:12]})")
            raise
        for message in compile_warnings(compiled):
            logger.warning("scenario %r: %s", name, message)
        return compiled

    def _prepare_split(self, name: str, split: tuple[str, Any]):
        """:meth:`_prepare` for a body split by :meth:`split_body`: its kind compiles it from the split (a tree:
        the other fields through the scenario model, the tree's text through the tree loader's scan, the tables
        from that one load). ``None`` when anything is refused here: the exact way then decides, and names the
        problem as for any such body."""
        type_name, parts = split

        def parse(fields: dict[str, Any]) -> Any:
            return self.pipeline.parse(fields, from_json=True)

        try:
            compiled = self.contents[type_name].compile_split(name, parts, parse, self._compile_now)
        except (ScenarioError, ServiceError, ConstraintError, LimitExceeded, ValueError) as exc:
            logger.info("scenario %r: body refused on the split way, parsing the whole body (%s)", name,
                        str(exc)[:200])
            return None
        for message in compile_warnings(compiled):
            logger.warning("scenario %r: %s", name, message)
        return compiled

    # ------------------------------------------------------------------ entry points

    async def compile_split(self, name: str, split: tuple[str, Any]):
        """Compile a split body (:meth:`_prepare_split`) off the event loop, bounded as :meth:`compile`; ``None``
        when the whole body must be parsed and compiled the exact way."""
        return await self._bounded(self._prepare_split, name, split)

    def compile_blocking(self, name: str, body: Any):
        """:meth:`compile` for a caller without an event loop (the manager's start)."""
        try:
            return self.pipeline.run_bounded_blocking(self._prepare, name, body)
        except ScenarioError as exc:  # the time limit
            raise scenario_service_error(exc, "scenario", name=name) from None

    async def compile(self, name: str, body: Any):
        """Validate and compile ``body`` off the event loop, bounded by ``limits.compile_timeout_s``."""
        return await self._bounded(self._prepare, name, body)

    @contextmanager
    def writing(self) -> Iterator[None]:
        """While a write runs (``WriteFlow.run``): the kinds' background reads of stored content (a tree given inline:
        the read of its items for a first PATCH) stop, and none starts until no write has run for a while, so they
        never share the CPU with a write."""
        for content in self.contents.values():
            content.write_started()
        try:
            yield
        finally:
            for content in self.contents.values():
                content.write_ended()

    async def _bounded(self, prepare, name: str, body: Any):
        for content in self.contents.values():
            content.postpone()  # a write: background reads of stored content wait until none comes
        async with self._gate:  # one compile at a time: the tokenizer is shared
            try:
                return await self.pipeline.run_bounded(prepare, name, body)
            except ScenarioError as exc:  # the time limit; the thread was told to stop (config.cancel)
                raise scenario_service_error(exc, "scenario", name=name) from None
