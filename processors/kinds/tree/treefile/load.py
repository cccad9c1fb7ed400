"""Loading and validating token trees in the tree file format.

A tree file maps decoding states to the token ids allowed next::

    {"start_token_id": 225, "end_token_id": 2, "sep": "_",
     "prefix_dict": {"225": [64000, 64003], "225_64000": [64001], "225_64000_64001": [2]}}

The state starts at ``str(start_token_id)``; after token ``t`` it becomes ``state + sep + str(t)``. A state that is
missing or has an empty list allows only ``end_token_id``.

:func:`load_tree` reads such a tree from a file (streamed with ``ijson``, never loaded whole), from a plain dict,
or from a :class:`processors.kinds.tree.spec.TreeSpec`, checks every rule at once and returns a compact :class:`TreeData`
(keys in a list, candidates in one flat ``int64`` array with CSR offsets). All problems found are reported
together in one :class:`TreeFileError`, each naming the exact key and candidate index.

Example::

    >>> tree = load_tree({"start_token_id": 1, "end_token_id": 0, "prefix_dict": {"1": [5, 6], "1_5": [0]}})
    >>> [(k, c.tolist()) for k, c in tree.items()]
    [('1', [5, 6]), ('1_5', [0])]
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any


from processors.kinds.tree.treefile.scan import scan_tree_bytes, scan_tree_file

from processors.kinds.tree.treefile.builder import _TreeBuilder
from processors.kinds.tree.treefile.data import (  # noqa: F401  (DEFAULT_SEP, MAX_REPORTED_PROBLEMS, TreeData: this module's API too)
    DEFAULT_SEP, MAX_REPORTED_PROBLEMS, TOP_LEVEL_FIELDS, TreeData, TreeFileError, _is_int)

__all__ = ["DEFAULT_SEP", "MAX_REPORTED_PROBLEMS", "TreeData", "TreeFileError", "fits_vocab", "is_tree_path",
           "load_tree"]

logger = logging.getLogger(__name__)

_READ_CHUNK = 1 << 18

def _ijson_backend() -> Any:
    """The fastest ijson backend available (the C one when it was built), else ijson's default."""
    import ijson

    for name in ("yajl2_c", "yajl2_cffi"):
        try:
            return ijson.get_backend(name)
        except Exception:  # noqa: BLE001 - a missing native library shows up as various errors
            continue
    return ijson


def _json_error_text(error: Exception) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip() and "(right here)" not in line]
    return lines[0] + (f" near {lines[1]!r}" if len(lines) > 1 else "")


def _load_file(path: str | os.PathLike[str], builder: _TreeBuilder) -> str:
    source = f"tree file {os.fspath(path)!r}"
    with open(path, "rb") as handle:
        if os.fstat(handle.fileno()).st_size == 0:
            raise TreeFileError(["the file is empty"], source=source)
    scan = scan_tree_file(os.fspath(path))
    if scan is not None:  # the numpy scan read it; anything it does not handle goes to ijson below
        builder.add_scan(scan)
        return source
    with open(path, "rb") as handle:
        _parse_events(handle, builder, source)
    return source


def _load_bytes(data: bytes, builder: _TreeBuilder) -> None:
    """A tree file's text held in memory: the numpy scan, else the ijson parser (as :func:`_load_file`)."""
    import io

    scan = scan_tree_bytes(data)
    if scan is not None:
        builder.add_scan(scan)
        return
    if not data.strip():
        raise TreeFileError(["the tree is empty"], source="tree")
    _parse_events(io.BytesIO(data), builder, "tree")


def _parse_events(handle: Any, builder: _TreeBuilder, source: str) -> None:
    """The ijson event parser over ``handle`` into ``builder``; every problem raised as one :class:`TreeFileError`
    naming ``source``."""
    import ijson

    try:
        builder.add_events(iter(_ijson_backend().basic_parse(handle, buf_size=_READ_CHUNK)))
    except TreeFileError as error:
        raise TreeFileError(error.problems, error.total, source) from None
    except ijson.JSONError as error:
        builder.problems.add(f"invalid JSON: {_json_error_text(error)}")
        raise builder.problems.error(source) from None


def load_tree(source: Any, *, vocab_size: int | None = None, strict: bool = False) -> TreeData:
    """Load and validate a tree.

    Args:
        source: a path (``str`` or ``os.PathLike``) to a JSON tree file, the bytes of one, a dict in the tree file
            format, or a :class:`processors.kinds.tree.spec.TreeSpec` (any object with ``start_token_id``, ``end_token_id``,
            ``sep`` and ``prefix_dict`` attributes). Files are streamed: memory grows with the tree, not with the
            JSON text.
        vocab_size: when given, every id (start, end, candidates, ids inside keys) must be below it.
        strict: refuse what RTP-LLM's loader accepts and a lenient load takes with a warning: keys that do not
            start with the root (kept, never reached), unknown top-level fields (ignored), a ``sep`` with ``-``,
            negative or beyond-int32 candidate ids (skipped). Digits in ``sep``, malformed keys under the root,
            non-integer candidates and ids at or above ``vocab_size`` are refused either way.

    Returns:
        The tree as a :class:`TreeData`. A missing root entry and what a lenient load accepted are warnings (in
        ``warnings`` and logged).

    Raises:
        TreeFileError: listing every problem found (the first :data:`MAX_REPORTED_PROBLEMS`, then a count).
        FileNotFoundError: the path does not exist.
    """
    if vocab_size is not None and (not _is_int(vocab_size) or vocab_size < 1):
        raise ValueError(f"vocab_size must be a positive integer, got {vocab_size!r}")
    builder = _TreeBuilder(strict=strict)
    if isinstance(source, (str, os.PathLike)):
        label = _load_file(source, builder)
    elif isinstance(source, (bytes, bytearray)):
        label = "tree"
        _load_bytes(bytes(source), builder)
    elif isinstance(source, Mapping):
        label = "tree"
        builder.add_mapping(source)
    elif all(hasattr(source, name) for name in TOP_LEVEL_FIELDS):
        label = "tree"
        extra = getattr(source, "ignored_fields", None) or {}  # unknown fields a TreeSpec set aside
        builder.add_mapping({**{name: getattr(source, name) for name in TOP_LEVEL_FIELDS}, **extra})
    else:
        raise TypeError(f"load_tree() expects a path, a dict or a TreeSpec, got {type(source).__name__}")
    return builder.finish(vocab_size, label)


def fits_vocab(tree: TreeData, vocab_size: int) -> bool:
    """Whether every id of a loaded tree is below ``vocab_size`` (so loading it again with that ``vocab_size`` would
    give the same tree): lets a tree validated without a vocabulary be compiled without a second load. False also
    when it cannot tell (``max_id`` -1)."""
    return 0 <= tree.max_id < vocab_size


def is_tree_path(tree: Mapping[str, Any], ids: list[int]) -> bool:
    """Whether ``ids`` is a complete path of a tree in the file format, by the spec's string rules.

    Walks ``prefix_dict`` with string keys exactly as the tree-decode spec states it (a missing or
    empty state allows only the end token), independently of the compiled tables: an oracle for
    tests and benchmarks. True when every token was allowed and the path ends with the end token.
    """
    sep = tree.get("sep", DEFAULT_SEP)
    end = tree["end_token_id"]
    key = str(tree["start_token_id"])
    for token in ids:
        if token not in (tree["prefix_dict"].get(key) or [end]):
            return False
        if token == end:
            return True
        key = f"{key}{sep}{token}"
    return False
