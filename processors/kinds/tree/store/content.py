"""The tree kind's stored content on the config manager: :class:`TreeContent`, what
:meth:`TreeKind.stored_content <processors.kinds.tree.kind.TreeKind.stored_content>` gives the manager's compiler.

A tree's tokens must not change under a version, so a tree given by ``path`` is read once, at its PUT, into a local
copy named by its SHA-256 (:meth:`TreeContent.pin`); the stored body then carries ``content_sha256`` and every
compile of that version, now and after any restart, reads the copy, fetched from the store when this host has none
(:meth:`TreeContent.content_file`), never the file again. A catalog (``content_format: items``,
:mod:`processors.kinds.tree.catalog.catalog`) is stored content too: its parsed items and their tables are kept in memory for the next PATCH
(the newest few), and its tables are compiled straight from the items (:meth:`TreeContent.prebuilt`). A large tree
given inline is split out of its PUT body (:mod:`processors.kinds.tree.store.inline`) and its items read for a first PATCH once the manager
is idle (:mod:`processors.kinds.tree.store.inline_bases`).

Refusals are :class:`config.ConstraintError` with their status (422 invalid, 400 does not compile, 500 a stored
copy that does not match its hash); the manager answers them as they are. Methods run on the compiler's threads.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from typing import Any

from config import ConstraintError

from processors.kinds.patch import ContentHost
from processors.kinds.tree.store.inline import InlineTree, split_inline_tree
from processors.kinds.tree.store.folds import BackgroundFolds
from processors.kinds.tree.store.inline_bases import HeldBase, InlineTreeBases

__all__ = ["INLINE_TREE_PATH", "TreeContent"]

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


#: a catalog's canonical bytes of at least this size are read from its local copy, memory-mapped, once written there
#: (10^8 4-token items: 2.2 GB that the manager's heap does not hold through the compile; the pages are the file's,
#: read when a PATCH hashes or splices them, and the kernel may drop them again)
MAP_CONTENT_BYTES = 64 << 20


def _mapped(path: str) -> Any:
    """The file ``path`` memory-mapped read-only (bytes-like: hashed, sliced and joined like ``bytes``)."""
    import mmap

    with open(path, "rb") as handle:
        return mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)


def catalog_file_format(path: str) -> str | None:
    """The upload format of a catalog file by its name (``processors.kinds.tree.catalog.parquet``; ``.ndjson`` / ``.jsonl``), None for a tree
    file."""
    lower = path.strip().lower()
    if lower.endswith(".parquet"):
        return "parquet"
    return "ndjson" if lower.endswith((".ndjson", ".jsonl")) else None


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


class TreeContent:
    """Tree files pinned to their content, stored catalogs parsed and their tables, trees given inline; the
    :class:`~processors.kinds.patch.PatchStore` a tree's PATCH works with.

    Args:
        host: what the manager lends (:class:`~processors.kinds.patch.ContentHost`: its data directory, the
            store's bytes, the served vocabulary, its compile threads, ...).
    """

    def __init__(self, host: ContentHost):
        self.host = host
        self.content_dir = os.path.join(host.data_dir, "tree-content")  # one file per SHA-256 (the store keeps the originals)
        self._catalogs: dict[str, Any] = {}  # sha -> parsed Catalog, the newest few
        self._tables: dict[str, Any] = {}  # sha -> a catalog's tables (catalog_tables' form), the newest two
        # sha -> a catalog's filter index as its compile built it or a metadata PATCH updated it, the newest two
        self._indexes: dict[str, Any] = {}
        self.tables_patched = 0  # PATCHes whose tables were updated from their base's (not compiled in full)
        # a PATCH of more items than the base's states / this compiles the new items in full: faster there (about
        # 6 touched paths an item, each ~50 states' worth of a full compile; docs/benchmarks.md, catalog PATCH)
        self.patch_states_per_item = 300
        # trees given inline: their items read for a first PATCH, once no write comes (see .inline_bases)
        self.bases = InlineTreeBases(host.pool, host.vocab_size, stage=host.stage_content,
                                     unstage=host.unstage_content)
        # catalogs' overlay tables folded into plain ones while no write comes (see .folds)
        self.folds = BackgroundFolds(host.pool, self._folded)

    def _local(self, sha: str) -> str:
        """Where the local copy of content ``sha`` is (it may not be there)."""
        return os.path.join(self.content_dir, f"{sha}.json")

    # -- what a PATCH asks of the store (processors.kinds.patch.PatchStore) ------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.host.vocab_size()

    @property
    def limits(self) -> Any:
        return self.host.limits()

    def validate(self, name: str, body: dict[str, Any]) -> Any:
        return self.host.validate(name, body)

    def content_delta(self, base_sha: str, removed_lines: list[bytes], added_lines: list[bytes], content: Any) -> Any:
        return self.host.content_delta(base_sha, removed_lines, added_lines, content)

    # -- a body's path and stored content ----------------------------------------------------------------------

    def resolve_path(self, name: str, path: str) -> str:
        """An admin names a file on the manager's host: only files under the tree directory (422 otherwise)."""
        try:
            return self.host.resolve_path(path)
        except ValueError as exc:
            raise ConstraintError(422, f"invalid scenario: path: {exc}", {"name": name, "field": "path"}) from None

    def bind(self, name: str, scenario: Any, sha: str | None, content_format: str | None) -> Any:
        """``scenario`` (validated) with its ``path`` pointing at what it compiles: the stored content ``sha`` when
        the body carried ``content_sha256`` (a catalog's local copy is not fetched here: :meth:`prebuilt` compiles
        its tables from the parsed items), else the admin's file confined to the tree directory."""
        if sha is None:
            if scenario.path is None:
                return scenario
            return scenario.model_copy(update={"path": self.resolve_path(name, scenario.path)})
        if scenario.path is None:
            raise ConstraintError(422, "invalid scenario: content_sha256: only a tree given by path has stored content",
                                  {"name": name, "field": "content_sha256"})
        # The content stored at the PUT; the path is only where it was read from (it may be gone).
        if content_format == "items":
            return scenario.model_copy(update={"path": self._local(sha)})
        return scenario.model_copy(update={"path": self.content_file(name, sha)})

    def pin(self, name: str, body: Any) -> Any:
        """For a tree given by ``path`` (and no ``content_sha256`` yet): read the file ONCE, into a local copy
        named by its SHA-256, and return the body to store: ``path`` resolved (where the content came from)
        plus ``content_sha256``. Any other body is returned as it is. The file is streamed (a tree file may be
        tens of MB)."""
        if not (isinstance(body, dict) and isinstance(body.get("path"), str) and body["path"].strip()
                and "content_sha256" not in body and body.get("tree") is None):
            return body  # validation reports anything wrong with it
        source = self.resolve_path(name, body["path"])
        os.makedirs(self.content_dir, exist_ok=True)
        digest = hashlib.sha256()
        fd, tmp = tempfile.mkstemp(dir=self.content_dir, prefix=".incoming-")
        try:
            with os.fdopen(fd, "wb") as out:
                try:
                    with open(source, "rb") as handle:
                        for chunk in iter(lambda: handle.read(1 << 20), b""):
                            digest.update(chunk)
                            out.write(chunk)
                except OSError as exc:
                    raise ConstraintError(400, f"scenario {name!r} does not compile for the served tokenizer: tree "
                                               f"file {source}: {exc.strerror or exc}",
                                          {"name": name, "field": "path"}) from None
            sha = digest.hexdigest()
            os.replace(tmp, self._local(sha))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return {**body, "path": source, "content_sha256": sha}

    def catalog_file(self, name: str, body: Any) -> tuple[Any, str] | None:
        """For a body ``{"type": "tree", "path": "<file under the tree directory>"}`` whose file is a catalog (a name
        ending in ``processors.kinds.tree.catalog.parquet``, or ``.ndjson`` / ``.jsonl``): ``(its bytes, upload format)``, read here (a Parquet
        file memory-mapped, not copied into the process: the data pipeline's file never crosses the ingress or sits
        whole in this process's heap), for :meth:`upload`. None for any other body. 422 for fields besides ``type``
        and ``path`` (a catalog's scenario fields are its header's); 400 for a file that cannot be read."""
        if not (isinstance(body, dict) and isinstance(body.get("path"), str) and body.get("tree") is None
                and "content_sha256" not in body):
            return None
        upload_format = catalog_file_format(body["path"])
        if upload_format is None:
            return None
        others = sorted(set(body) - {"type", "path"})
        if others:
            raise ConstraintError(422, f"invalid scenario: {', '.join(others)}: a catalog file's scenario fields are "
                                       "its header's (start_token_id, end_token_id, description, ...); give only "
                                       "type and path", {"name": name, "field": others[0]})
        source = self.resolve_path(name, body["path"])
        try:  # mapped, not read: the memory guard sees its size before anything is copied into the heap
            return self.map_upload(source, upload_format), upload_format
        except OSError as exc:
            raise ConstraintError(400, f"scenario {name!r}: catalog file {source}: {exc.strerror or exc}",
                                  {"name": name, "field": "path"}) from None

    @staticmethod
    def map_upload(path: str, upload_format: str) -> Any:
        """A catalog file in ``upload_format`` (``ndjson`` / ``parquet``), memory-mapped for :meth:`upload` (bytes-
        like; a Parquet file as an Arrow buffer): its pages are the file's, not the heap's. Raises ``OSError``."""
        if upload_format == "parquet":
            import pyarrow as pa

            with pa.memory_map(path, "r") as mapped:
                return mapped.read_buffer()
        return _mapped(path) if os.path.getsize(path) else b""

    def content_file(self, name: str, sha: str) -> str:
        """The local copy of the tree content ``sha`` (checked against its hash), fetched from the store when
        this host has none. 422 when the store has no such content either."""
        local = self._local(sha)
        if _file_sha256(local) == sha:
            return local
        data = self.host.fetch(sha)
        if data is None:
            raise ConstraintError(422, f"content_sha256: no tree content {sha} is stored; leave content_sha256 out "
                                       "to store the file named by path", {"name": name, "field": "content_sha256"})
        if hashlib.sha256(data).hexdigest() != sha:
            raise ConstraintError(500, f"stored tree content {self.host.content_key(sha)} does not match its hash",
                                  {"name": name})
        _write_atomic(self.content_dir, local, data)
        return local

    def stored_bytes(self, sha: str) -> bytes | None:
        """The bytes of the local copy of content ``sha`` (to store them with the version); None when there is
        none (the store then requires the content to be there already)."""
        local = self._local(sha)
        try:
            with open(local, "rb") as handle:
                data = handle.read()
        except OSError:
            return None
        return data if hashlib.sha256(data).hexdigest() == sha else None

    def keep_content(self, data: bytes) -> tuple[str, bool]:
        """Keep ``data`` (a catalog upload, canonical) as a local copy under its SHA-256: the hash, and whether the
        copy is new (no copy was there): a write refused before anything was stored gives a new copy back with
        :meth:`discard_content`."""
        sha = hashlib.sha256(data).hexdigest()
        local = self._local(sha)
        if _file_sha256(local) == sha:
            return sha, False
        _write_atomic(self.content_dir, local, data)
        return sha, True

    def discard_content(self, sha: str) -> None:
        """Remove the local copy of content ``sha`` that a refused write made (and forget its parsed catalog).
        Only for a copy :meth:`keep_content` called new: stored versions keep theirs (and the store has the bytes)."""
        self._catalogs.pop(sha, None)
        self._tables.pop(sha, None)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._local(sha))

    # -- catalogs ----------------------------------------------------------------------------------------------

    def upload(self, data: bytes, upload_format: str = "ndjson") -> tuple[dict[str, Any], bytes, str | None]:
        """A catalog upload (the items format, :mod:`processors.kinds.tree.catalog.catalog`; ``upload_format`` ``"parquet"``: a Parquet file,
        :mod:`processors.kinds.tree.catalog.parquet`), parsed and validated once: the body to store (it names its content), the canonical
        content, and its SHA-256 when its local copy is new (a refused write discards it). The parsed catalog is
        kept for the next PATCH."""
        from processors.kinds.tree.catalog.catalog import catalog_body
        from processors.kinds.tree.catalog.parse import parse_catalog

        limits = self.limits
        if upload_format == "parquet":
            from processors.kinds.tree.catalog.parquet import parquet_items

            catalog = parquet_items(data, vocab_size=self.vocab_size, max_items=limits.max_tree_keys,
                                    max_item_tokens=limits.max_item_tokens)
        elif upload_format != "ndjson":
            raise ConstraintError(415, f"no catalog format {upload_format!r} (ndjson or parquet)", {"field": "body"})
        else:  # (a catalog file named by path comes mapped: its bytes copied once, after the memory guard)
            catalog = parse_catalog(data if isinstance(data, (bytes, bytearray)) else bytes(data),
                                    vocab_size=self.vocab_size, max_items=limits.max_tree_keys,
                                    max_item_tokens=limits.max_item_tokens)
        content = catalog.content()
        sha, new = self.keep_content(content)
        if len(content) >= MAP_CONTENT_BYTES:  # the bytes from the local copy, mapped: not in this process's heap
            content = catalog._content = _mapped(self._local(sha))
        self.remember_catalog(sha, catalog)
        return catalog_body(catalog, sha), content, sha if new else None

    def catalog(self, name: str, sha: str):
        """The stored catalog ``sha`` parsed (:class:`~processors.kinds.tree.catalog.catalog.Catalog`); the last few are
        kept in memory, so a PATCH does not parse its base again."""
        from processors.kinds.tree.catalog.parse import parse_catalog

        cached = self._catalogs.get(sha)
        if cached is None:
            with open(self.content_file(name, sha), "rb") as handle:
                data = handle.read()
            # a stored catalog may hold the empty item (a patched tree whose root allows the end token)
            cached = parse_catalog(data, vocab_size=self.vocab_size, allow_empty=True)
            if cached.content() == data:
                cached._content = data  # its canonical bytes as they are, one copy (a PATCH splices its result's from them)
            self.remember_catalog(sha, cached)
        return cached

    def remember_catalog(self, sha: str, catalog) -> None:
        self._catalogs[sha] = catalog
        while len(self._catalogs) > 4:
            self._catalogs.pop(next(iter(self._catalogs)))

    def catalog_tables(self, sha: str):
        """The tables of catalog ``sha`` when built here lately (a PATCH updates them: :mod:`processors.kinds.tree.tables.delta`)."""
        return self._tables.get(sha)

    def patch_need(self, body: Any, delta_items: int = 0) -> int | None:
        """The memory a PATCH of ``delta_items`` items of the stored catalog ``body`` takes beside what is held, when
        its parsed catalog and tables are held and it has no metadata: its result pending on the held items (its
        delta's bytes, ``catalog_delta.pending_need``; a copy of the item list, half again for the bytes spliced
        beside it, when the result is written out as a new base) and at most one copy of its tables (an overlay's
        arrays read whole, or its fold). None otherwise (the PATCH then compiles in full)."""
        from processors.kinds.tree.patch.items import pending_need

        sha = body.get("content_sha256") if isinstance(body, dict) else None
        if not isinstance(sha, str):
            return None
        catalog, tables = self._catalogs.get(sha), self._tables.get(sha)
        if catalog is None or tables is None or catalog.has_meta:
            return None
        return pending_need(catalog, delta_items) + int(tables.nbytes)

    def filter_index(self, sha: str) -> Any:
        """The filter index (:class:`~processors.kinds.tree.filters.index.ItemFilterIndex`) of catalog ``sha``'s
        compiled version when held here, else None."""
        return self._indexes.get(sha)

    def remember_index(self, sha: str, index: Any) -> None:
        """Keep the filter index of catalog ``sha`` (the newest two), for its compile or the next metadata PATCH."""
        self._indexes.pop(sha, None)
        self._indexes[sha] = index
        while len(self._indexes) > 2:
            self._indexes.pop(next(iter(self._indexes)))

    def remember_tables(self, sha: str, tables, patched: bool = False) -> None:
        """Keep the tables of catalog ``sha`` (the newest two: a large catalog's tables are large). ``patched``:
        a PATCH updated them from its base's (counted in ``tables_patched``)."""
        self._tables.pop(sha, None)
        self._tables[sha] = tables
        while len(self._tables) > 2:
            self._tables.pop(next(iter(self._tables)))
        if patched:
            self.tables_patched += 1
            if self.folds.wanted(tables):
                self.folds.schedule(sha, tables)

    def _folded(self, sha: str, overlay, folded) -> None:
        """A background fold ended: keep its plain tables for catalog ``sha`` if the overlay is still kept."""
        if self._tables.get(sha) is overlay:
            self._tables[sha] = folded

    # -- compiles ----------------------------------------------------------------------------------------------

    def prebuilt(self, name: str, body: dict[str, Any], sha: str | None) -> Any:
        """What the compile of ``body`` starts from instead of reading a file: a catalog's tables straight from its
        parsed items (kept in memory after a PUT or PATCH; equal to those of the tree file they spell), as
        ``(tables, start token, catalog)``. None: the kind compiles the scenario itself."""
        if sha is None or body.get("content_format") != "items":
            return None
        from processors.kinds.tree.patch.rows import index_row_keys
        from processors.kinds.tree.tables.compile import catalog_tables

        catalog = self.catalog(name, sha)
        tables = self._tables.get(sha)  # a PATCH's, updated from its base's along the changed paths
        if tables is None:
            tables = catalog_tables(catalog, self.vocab_size)
            self.remember_tables(sha, tables)
        # a large catalog's key index, for its first PATCH: made here, after the compile's peak, not by that PATCH
        index_row_keys(catalog)
        # a metadata PATCH's filter index, updated from its base's (the compile then builds none)
        return tables, catalog.start_token_id, catalog, self._indexes.get(sha)

    def compiled(self, name: str, compiled: Any, fields: dict[str, Any], scenario: Any) -> None:
        """A body was compiled: a catalog's filter index is kept for its next metadata PATCH; a tree given inline is
        remembered for its first PATCH (:mod:`processors.kinds.tree.store.inline_bases`)."""
        index = getattr(compiled.constraint, "item_filters", None)
        sha = fields.get("content_sha256") if isinstance(fields, dict) else None
        if index is not None and isinstance(sha, str) and fields.get("content_format") == "items":
            self.remember_index(sha, index)
        if scenario.tree is not None:
            self.bases.note_form(name, compiled, fields, getattr(scenario.tree, "start_token_id", None))

    def split(self, raw: bytes) -> InlineTree | None:
        """A large PUT body with an inline tree, split at the tree's braces (:mod:`processors.kinds.tree.store.inline`); None: parse it whole."""
        return split_inline_tree(raw, self.host.parse_body)

    def compile_split(self, name: str, inline: InlineTree, parse: Any, compile_now: Any) -> Any:
        """Compile a split body (:meth:`split`): its other fields through ``parse`` (the scenario model; the tree
        left out, its path :data:`INLINE_TREE_PATH`, a name only), its tree's text through the tree loader's scan,
        the tables from that one load (``compile_now(name, scenario, prebuilt)``). Raises on anything refused: the
        exact way then parses the whole body and names the problem as for any inline tree."""
        from processors.tables import build_tree_tables
        from processors.kinds.tree.treefile.load import load_tree

        scenario = parse({**inline.rest, "tree": None, "path": INLINE_TREE_PATH})
        tree = load_tree(inline.tree, vocab_size=self.vocab_size, strict=bool(scenario.strict))
        self.limits.check_tree_keys(len(tree), "tree.prefix_dict")
        compiled = compile_now(name, scenario, (build_tree_tables(tree, self.vocab_size), tree.start_token_id))
        self.bases.note_form(name, compiled, inline.rest, tree.start_token_id)
        return compiled

    # -- the current version, for a PATCH -----------------------------------------------------------------------

    def installed(self, name: str, version: int, compiled: Any) -> None:
        """``compiled`` (None: removed) is what ``name`` serves from ``version`` on."""
        self.bases.note_installed(name, version, compiled)

    def held(self, name: str, current_version: int | None, log: Any) -> HeldBase | None:
        """The items of ``name``'s current version when it is a tree given inline (:meth:`InlineTreeBases.held`)."""
        return self.bases.held(name, current_version, log)

    def postpone(self) -> None:
        """A write came: reads of inline trees' items wait until none comes."""
        self.bases.postpone()

    def write_started(self) -> None:
        """A write runs: reads of inline trees' items and folds of overlay tables stop, none starts until it ended."""
        self.bases.write_started()
        self.folds.write_started()

    def write_ended(self) -> None:
        self.bases.write_ended()
        self.folds.write_ended()

    def close(self) -> None:
        self.bases.close()
        self.folds.close()

