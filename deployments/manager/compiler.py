"""The config manager's compile step: a scenario body -> its compiled tables for the served tokenizer, or a refusal.

Every compile the manager makes goes through :meth:`StoredScenarioCompiler.compile` (async) or
:meth:`StoredScenarioCompiler.compile_blocking` (at start), which run :meth:`StoredScenarioCompiler._prepare`
on the compiler's own threads, one at a time, bounded by ``limits.compile_timeout_s``:
``validate`` (422: limits, ``processors.scenarios.load_scenario``, a tree path confined to ``tree_dir``) ->
``_compile_now`` (400: ``processors.pipeline.ScenarioCompiler.compile_now``: grammars in its bounded worker
process, each kind's limits on the compiled form). ``_compile_now`` is the one place that calls the processors.

It also pins tree files: a tree given as a ``path`` is read once, at the PUT, into a local copy named by its
SHA-256 (:meth:`StoredScenarioCompiler.pin_tree_file`); a stored body carrying ``content_sha256`` compiles that
content (the local copy, fetched from Redis when this host has none), never the file.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import re
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from config import ScenarioError, ServerSettings
from deployments.protocol import ServiceError
from deployments.scenario_errors import scenario_service_error
from deployments.storage.store import ScenarioStore, content_sha256

from .tree_bases import HeldBase, InlineTreeBases

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
    see ``processors.kinds.tree.file.load_tree``): the admin PUT returns them as ``warnings``."""
    return list(getattr(getattr(compiled, "constraint", None), "warnings", ()) or ())


_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")
# The path a split inline tree compiles under: only a name for its prebuilt tables (never opened, never stored).
INLINE_TREE_PATH = "(inline tree)"


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


def _write_atomic(directory: str, path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in ``directory``: readers see all of it or nothing."""
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".incoming-")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


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
        self._catalogs: dict[str, Any] = {}  # sha -> parsed Catalog, the newest few
        self._tables: dict[str, Any] = {}  # sha -> a catalog's tables (catalog_tables' form), the newest two
        self.tables_patched = 0  # PATCHes whose tables were updated from their base's (not compiled in full)
        # a PATCH of more items than the base's states / this compiles the new items in full: faster there (about
        # 6 touched paths an item, each ~50 states' worth of a full compile; docs/benchmarks.md, catalog PATCH)
        self.patch_states_per_item = 300
        # trees given inline: their items read for a first PATCH, once no write comes (see .tree_bases)
        self.tree_bases = InlineTreeBases(self._pool, lambda: self.vocab_size)
        self.new_loop()

    def new_loop(self) -> None:
        """A new event loop (tests): asyncio primitives are tied to one."""
        self._gate = asyncio.Lock()

    def close(self) -> None:
        self.tree_bases.close()
        self.pipeline.close()

    # ------------------------------------------------------------------ validate

    def validate(self, name: str, body: Any):
        """The scenario of ``body`` (422 when invalid). A tree stored with the content of its file
        (``content_sha256``) gets ``path`` pointing at that content (see :meth:`content_file`), never
        at the file it was read from."""
        if not isinstance(body, dict):
            raise ServiceError(422, f"a scenario body must be a JSON object, got {type(body).__name__}")
        sha = fmt = None
        if "content_sha256" in body:
            body = dict(body)
            sha = body.pop("content_sha256")
            if not isinstance(sha, str) or not _SHA256_HEX.fullmatch(sha):
                raise ServiceError(422, "invalid scenario: content_sha256: expected 64 lowercase hex digits",
                                   {"name": name, "field": "content_sha256"})
            if "content_format" in body:  # a catalog (processors/kinds/tree/catalog.py): items, not a tree file
                fmt = body.pop("content_format")
                if fmt != "items":
                    raise ServiceError(422, f"invalid scenario: content_format: only 'items' (a catalog), got {fmt!r}",
                                       {"name": name, "field": "content_format"})
                body.pop("items", None)  # the item count, for display
                body.pop("metadata", None)  # the metadata fields' summary, for display
        try:
            # limits first (before anything walks the body), then validation; the manager's bodies come from JSON
            # (an HTTP body or Redis), so they are not serialized again to check that they are JSON
            scenario = self.pipeline.parse(body, from_json=True)
        except ScenarioError as exc:
            raise scenario_service_error(exc, "scenario", name=name) from None
        if sha is not None:
            if scenario.type != "tree" or scenario.path is None:
                raise ServiceError(422, "invalid scenario: content_sha256: only a tree given by path has stored "
                                        "content", {"name": name, "field": "content_sha256"})
            # The content stored at the PUT; the path is only where it was read from (it may be gone). A catalog's
            # path names its local copy, not fetched here: _prepare compiles its tables from the parsed items
            # (catalog_tables), which :meth:`catalog` keeps in memory or reads (a PATCH's from Redis: a delta chain).
            if fmt == "items":
                return scenario.model_copy(update={"path": os.path.join(self._content_dir, f"{sha}.json")})
            return scenario.model_copy(update={"path": self.content_file(name, sha)})
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

    def pin_tree_file(self, name: str, body: Any) -> Any:
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

    def content_file(self, name: str, sha: str) -> str:
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
        _write_atomic(self._content_dir, local, data)
        return local

    @property
    def vocab_size(self) -> int:
        return int(self.pipeline.info.vocab_size)

    def catalog(self, name: str, sha: str):
        """The stored catalog ``sha`` parsed (:class:`~processors.kinds.tree.catalog.Catalog`); the last few are
        kept in memory, so a PATCH does not parse its base again."""
        from processors.kinds.tree.catalog import parse_catalog

        from deployments.scenario_errors import refused_as_service_error

        cached = self._catalogs.get(sha)
        if cached is None:
            with open(self.content_file(name, sha), "rb") as handle:
                data = handle.read()
            # a stored catalog may hold the empty item (a patched tree whose root allows the end token)
            with refused_as_service_error():
                cached = parse_catalog(data, vocab_size=self.vocab_size, allow_empty=True)
            head = cached.header()
            if data.startswith(head + b"\n") and len(data) == len(head) + 1 + sum(map(len, cached.lines)) + len(cached):
                cached._content = data  # its canonical bytes as they are (a PATCH splices its result's from them)
            self.remember_catalog(sha, cached)
        return cached

    def remember_catalog(self, sha: str, catalog) -> None:
        self._catalogs[sha] = catalog
        while len(self._catalogs) > 4:
            self._catalogs.pop(next(iter(self._catalogs)))

    def catalog_tables(self, sha: str):
        """The tables of catalog ``sha`` when built here lately (a PATCH updates them: processors/kinds/tree/delta.py)."""
        return self._tables.get(sha)

    def remember_tables(self, sha: str, tables, patched: bool = False) -> None:
        """Keep the tables of catalog ``sha`` (the newest two: a large catalog's tables are large). ``patched``:
        a PATCH updated them from its base's (counted in ``tables_patched``)."""
        self._tables.pop(sha, None)
        self._tables[sha] = tables
        while len(self._tables) > 2:
            self._tables.pop(next(iter(self._tables)))
        if patched:
            self.tables_patched += 1

    def note_installed(self, name: str, version: int, compiled) -> None:
        """``compiled`` (None: removed) is what ``name`` serves from ``version`` on (a tree given inline: its items
        are read for its first PATCH, :mod:`.tree_bases`)."""
        self.tree_bases.note_installed(name, version, compiled)

    def held_base(self, store: ScenarioStore, name: str) -> HeldBase | None:
        """What this compiler holds of the current version of ``name`` for a PATCH (a tree given inline: its items,
        :meth:`InlineTreeBases.held`); ``None`` when nothing: the PATCH then reads the stored body."""
        return self.tree_bases.held(name, store.current_version(name), logger)

    # -- what a kind's PATCH asks of the stored content (processors.kinds.patch.PatchStore) -------------------

    @property
    def limits(self):
        return self.settings.limits

    def content_delta(self, base_sha: str, removed_lines: list[bytes], added_lines: list[bytes], content):
        """The stored form of catalog content that is ``base_sha``'s with lines removed and appended
        (:class:`~deployments.storage.content.ContentDelta`; ``content`` gives the whole bytes)."""
        from deployments.storage.content import ContentDelta, line_delta

        return ContentDelta(base_sha, line_delta(removed_lines, added_lines), content)

    def keep_content(self, data: bytes) -> tuple[str, bool]:
        """Keep ``data`` (a catalog upload, canonical) as a local copy under its SHA-256: the hash, and whether the
        copy is new (no copy was there): a write refused before anything was stored gives a new copy back with
        :meth:`discard_content`."""
        sha = hashlib.sha256(data).hexdigest()
        local = os.path.join(self._content_dir, f"{sha}.json")
        if _file_sha256(local) == sha:
            return sha, False
        _write_atomic(self._content_dir, local, data)
        return sha, True

    def discard_content(self, sha: str) -> None:
        """Remove the local copy of content ``sha`` that a refused write made (and forget its parsed catalog).
        Only for a copy :meth:`keep_content` called new: stored versions keep theirs (and Redis has the bytes)."""
        self._catalogs.pop(sha, None)
        self._tables.pop(sha, None)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self._content_dir, f"{sha}.json"))

    def stored_content(self, body: Any) -> bytes | None:
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

    # ------------------------------------------------------------------ compile

    def _compile_now(self, name: str, scenario, prebuilt: Any = None):
        """The compile itself and the limits of its result (400 / 422): the one call into ``processors``
        (``prebuilt``: a tree's tables built here, see ``processors.compile.compile_scenario``)."""
        try:
            return self.pipeline.compile_now(scenario, prebuilt=prebuilt)
        except ScenarioError as exc:
            raise scenario_service_error(exc, "scenario", name=name) from None

    def _prepare(self, name: str, body: Any):
        """Validate (422) and compile (400) a body; runs in a worker thread (a large tree takes a while)."""
        scenario = self.validate(name, body)
        try:
            sha = content_sha256(body)
            if sha is not None and body.get("content_format") == "items":
                # a catalog: its tables straight from the parsed items (kept in memory after a PUT or PATCH), equal
                # to those of the tree file they spell, without writing and parsing that file
                from processors.kinds.tree.catalog_tables import catalog_tables

                catalog = self.catalog(name, sha)
                tables = self._tables.get(sha)  # a PATCH's, updated from its base's along the changed paths
                if tables is None:
                    tables = catalog_tables(catalog, self.vocab_size)
                    self.remember_tables(sha, tables)
                compiled = self._compile_now(name, scenario, (tables, catalog.start_token_id, catalog))
            else:
                compiled = self._compile_now(name, scenario)
                if body.get("type") == "tree" and scenario.tree is not None:
                    self.tree_bases.note_form(name, compiled, body, getattr(scenario.tree, "start_token_id", None))
        except ServiceError as exc:
            sha = content_sha256(body)
            if sha is not None and isinstance(body.get("path"), str):  # name the admin's file, not the local copy
                exc.message = exc.message.replace(scenario.path, f"{body['path']} (stored content {sha[:12]})")
            raise
        for message in compile_warnings(compiled):
            logger.warning("scenario %r: %s", name, message)
        return compiled

    def _prepare_inline(self, name: str, inline):
        """:meth:`_prepare` for a body split by :func:`~deployments.manager.inline_tree.split_inline_tree`: the
        other fields through the scenario model, the tree's text through the tree loader (its numpy scan), the
        tables from that one load. ``None`` when anything is refused here: the exact way then decides, and names
        the problem as for any inline tree (a tree counted by its keys, as there)."""
        from processors.kinds.tree.file import load_tree
        from config.settings import LimitExceeded
        from processors.tables import build_tree_tables

        try:
            scenario = self.pipeline.parse({**inline.rest, "tree": None, "path": INLINE_TREE_PATH}, from_json=True)
            tree = load_tree(inline.tree, vocab_size=self.vocab_size, strict=bool(scenario.strict))
            self.settings.limits.check_tree_keys(len(tree), "tree.prefix_dict")
            compiled = self._compile_now(name, scenario, (build_tree_tables(tree, self.vocab_size), tree.start_token_id))
            self.tree_bases.note_form(name, compiled, inline.rest, tree.start_token_id)
        except (ScenarioError, ServiceError, LimitExceeded, ValueError) as exc:
            logger.info("scenario %r: inline tree refused on the split way, parsing the whole body (%s)", name,
                        str(exc)[:200])
            return None
        for message in compile_warnings(compiled):
            logger.warning("scenario %r: %s", name, message)
        return compiled

    # ------------------------------------------------------------------ entry points

    async def compile_inline(self, name: str, inline):
        """Compile a split inline-tree body (:meth:`_prepare_inline`) off the event loop, bounded as
        :meth:`compile`; ``None`` when the whole body must be parsed and compiled the exact way."""
        return await self._bounded(self._prepare_inline, name, inline)

    def compile_blocking(self, name: str, body: Any):
        """:meth:`compile` for a caller without an event loop (the manager's start)."""
        try:
            return self.pipeline.run_bounded_blocking(self._prepare, name, body)
        except ScenarioError as exc:  # the time limit
            raise scenario_service_error(exc, "scenario", name=name) from None

    async def compile(self, name: str, body: Any):
        """Validate and compile ``body`` off the event loop, bounded by ``limits.compile_timeout_s``."""
        return await self._bounded(self._prepare, name, body)

    async def _bounded(self, prepare, name: str, body: Any):
        self.tree_bases.postpone()  # a write: reads of inline trees' items wait until none comes
        async with self._gate:  # one compile at a time: the tokenizer is shared
            try:
                return await self.pipeline.run_bounded(prepare, name, body)
            except ScenarioError as exc:  # the time limit; the thread was told to stop (config.cancel)
                raise scenario_service_error(exc, "scenario", name=name) from None
