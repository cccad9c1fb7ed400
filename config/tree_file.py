"""Loading and validating token trees in the tree file format.

A tree file maps decoding states to the token ids allowed next::

    {"start_token_id": 225, "end_token_id": 2, "sep": "_",
     "prefix_dict": {"225": [64000, 64003], "225_64000": [64001], "225_64000_64001": [2]}}

The state starts at ``str(start_token_id)``; after token ``t`` it becomes ``state + sep + str(t)``. A state that is
missing or has an empty list allows only ``end_token_id``.

:func:`load_tree` reads such a tree from a file (streamed with ``ijson``, never loaded whole), from a plain dict,
or from a :class:`config.scenarios.TreeSpec`, checks every rule at once and returns a compact :class:`TreeData`
(keys in a list, candidates in one flat ``int64`` array with CSR offsets). All problems found are reported
together in one :class:`TreeFileError`, each naming the exact key and candidate index.

Example::

    >>> tree = load_tree({"start_token_id": 1, "end_token_id": 0, "prefix_dict": {"1": [5, 6], "1_5": [0]}})
    >>> [(k, c.tolist()) for k, c in tree.items()]
    [('1', [5, 6]), ('1_5', [0])]
"""

from __future__ import annotations

import json
import logging
import os
import re
from array import array
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import numpy as np

__all__ = ["DEFAULT_SEP", "MAX_REPORTED_PROBLEMS", "TreeData", "TreeFileError", "is_tree_path", "load_tree"]

logger = logging.getLogger(__name__)

DEFAULT_SEP = "_"
MAX_REPORTED_PROBLEMS = 20
TOP_LEVEL_FIELDS = ("start_token_id", "end_token_id", "sep", "prefix_dict")
_REQUIRED_FIELDS = ("start_token_id", "end_token_id", "prefix_dict")
_READ_CHUNK = 1 << 18
# Stored in place of a rejected candidate so later positions keep their index in messages; never returned,
# since any rejected candidate makes loading fail.
_PLACEHOLDER = 0


class TreeFileError(ValueError):
    """A tree (file, dict or inline spec) breaks the format rules.

    Attributes:
        problems: the first :data:`MAX_REPORTED_PROBLEMS` problems, each naming the offending field or key.
        total: how many problems were found in all.
        source: what was being loaded (a file path, or ``"tree"`` for in-memory input).
    """

    def __init__(self, problems: list[str], total: int | None = None, source: str = "tree") -> None:
        self.problems = list(problems)
        self.total = len(self.problems) if total is None else total
        self.source = source
        super().__init__(self._format())

    def __reduce__(self) -> tuple[Any, ...]:  # keep the structured fields when pickled (e.g. across Ray workers)
        return (type(self), (self.problems, self.total, self.source))

    def _format(self) -> str:
        noun = "problem" if self.total == 1 else "problems"
        lines = [f"invalid {self.source}: {self.total} {noun}:"]
        lines += [f"  - {p}" for p in self.problems]
        if self.total > len(self.problems):
            lines.append(f"  ... and {self.total - len(self.problems)} more")
        return "\n".join(lines)


@dataclass(frozen=True, eq=False)
class TreeData:
    """A validated tree in compact form.

    Attributes:
        start_token_id: the root token; the first state is ``str(start_token_id)``.
        end_token_id: the token that ends a sequence (the only one allowed where a state has no candidates).
        sep: separator between ids in keys.
        keys: the states, in file order, unique.
        offsets: ``int64`` array of ``len(keys) + 1`` entries; the candidates of ``keys[i]`` are
            ``candidates[offsets[i]:offsets[i + 1]]``.
        candidates: ``int64`` array of all candidate ids, in file order.
        warnings: non-fatal findings (e.g. no entry for the root key).
    """

    start_token_id: int
    end_token_id: int
    sep: str
    keys: list[str]
    offsets: np.ndarray
    candidates: np.ndarray
    warnings: tuple[str, ...] = ()

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def root_key(self) -> str:
        """The first-step state, ``str(start_token_id)``."""
        return str(self.start_token_id)

    def items(self) -> Iterator[tuple[str, np.ndarray]]:
        """Yield ``(key, candidates)`` pairs in file order (candidates are read-only array views)."""
        offsets = self.offsets.tolist()
        for i, key in enumerate(self.keys):
            yield key, self.candidates[offsets[i] : offsets[i + 1]]

    def to_dict(self) -> dict[str, Any]:
        """Return the tree in the tree file format (builds Python lists: meant for small trees and tests)."""
        return {
            "start_token_id": self.start_token_id,
            "end_token_id": self.end_token_id,
            "sep": self.sep,
            "prefix_dict": {key: cands.tolist() for key, cands in self.items()},
        }


class _Problems:
    """Collects problem messages, keeping the first few and counting the rest."""

    def __init__(self) -> None:
        self.messages: list[str] = []
        self.count = 0

    def add(self, message: str) -> None:
        self.count += 1
        if len(self.messages) < MAX_REPORTED_PROBLEMS:
            self.messages.append(message)

    def error(self, source: str) -> TreeFileError:
        return TreeFileError(self.messages, self.count, source)


class _Container:
    """Stands for a JSON object or array whose content was skipped while streaming."""

    def __init__(self, kind: str) -> None:
        self.kind = kind


def _describe(value: Any) -> str:
    """Describe a JSON value for an error message."""
    if isinstance(value, _Container):
        return f"an {value.kind}"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean {'true' if value else 'false'}"
    if _is_int(value):
        return f"number {value}"
    if isinstance(value, (float, Decimal)):
        return f"number {value} (not an integer)"
    if isinstance(value, str):
        return f"string {json.dumps(value)}"
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, (list, tuple)):
        return "an array"
    return f"{type(value).__name__} {value!r}"


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _kref(key: Any) -> str:
    """``prefix_dict["225_1"]``: how messages name a key."""
    return f"prefix_dict[{json.dumps(key) if isinstance(key, str) else repr(key)}]"


def _sep_problem(sep: Any) -> str | None:
    if not isinstance(sep, str):
        return f"sep: must be a string, got {_describe(sep)}"
    if not sep:
        return "sep: must not be empty"
    if any(ch.isdigit() or ch == "-" for ch in sep):
        return f"sep: {json.dumps(sep)} must not contain digits or '-' (keys would be ambiguous)"
    return None


def _part_problem(part: str) -> str | None:
    if not (part.isascii() and part.isdigit()):
        return f"part {part!r} is not a non-negative integer"
    if str(int(part)) != part:
        return f"part {part!r} is not a canonical non-negative integer (leading zero)"
    return None


class _TreeBuilder:
    """Accumulates keys and candidates from a stream or a dict, then checks the rules across fields."""

    def __init__(self) -> None:
        self.fields: dict[str, Any] = {}
        self.keys: list[str] = []
        self.offsets = array("q", [0])
        self.candidates = array("q")
        self.problems = _Problems()

    # -- input from a mapping ---------------------------------------------------------------------------------
    def add_mapping(self, data: Mapping[str, Any]) -> None:
        for name, value in data.items():
            if name not in TOP_LEVEL_FIELDS:
                self._unknown_field(name)
            elif name == "prefix_dict":
                self.fields[name] = True
                if isinstance(value, Mapping):
                    for key, cands in value.items():
                        self._add_entry(key, cands)
                else:
                    self.problems.add(f"prefix_dict: must be an object mapping keys to lists, got {_describe(value)}")
            else:
                self.fields[name] = value

    def _add_entry(self, key: Any, cands: Any) -> None:
        if not isinstance(key, str):
            self.problems.add(f"{_kref(key)}: key must be a string, got {_describe(key)}")
        self.keys.append(key)
        if isinstance(cands, (list, tuple, np.ndarray)):
            append = self.candidates.append
            for i, value in enumerate(cands):
                if _is_int(value):
                    try:
                        append(int(value))
                        continue
                    except OverflowError:
                        self.problems.add(f"{_kref(key)}[{i}]: id {value} is too large")
                else:
                    self.problems.add(f"{_kref(key)}[{i}]: candidate must be an integer, got {_describe(value)}")
                append(_PLACEHOLDER)
        else:
            self.problems.add(f"{_kref(key)}: candidates must be a list of integers, got {_describe(cands)}")
        self.offsets.append(len(self.candidates))

    def _unknown_field(self, name: Any) -> None:
        expected = ", ".join(TOP_LEVEL_FIELDS)
        self.problems.add(f"unknown top-level field {json.dumps(name)} (expected: {expected})")

    # -- input from an ijson event stream ---------------------------------------------------------------------
    def add_events(self, events: Iterator[tuple[str, Any]]) -> None:
        first = next(events, None)
        if first is None:
            raise TreeFileError(["the file contains no JSON value"])
        if first[0] != "start_map":
            got = _describe(_event_value(*first, events))
            raise TreeFileError([f"the top level must be a JSON object, got {got}"])
        for event, name in events:
            if event == "end_map":
                break
            if name in self.fields:
                self.problems.add(f"duplicate top-level field {json.dumps(name)}")
            if name == "prefix_dict":
                self.fields[name] = True
                self._stream_prefix_dict(events)
            else:
                value = _event_value(*next(events), events)
                if name in TOP_LEVEL_FIELDS:
                    self.fields[name] = value
                else:
                    self._unknown_field(name)
        if next(events, None) is not None:  # yajl raises on trailing data; this is a second guard
            self.problems.add("unexpected content after the top-level object")

    def _stream_prefix_dict(self, events: Iterator[tuple[str, Any]]) -> None:
        event, value = next(events)
        if event != "start_map":
            value = _event_value(event, value, events)
            self.problems.add(f"prefix_dict: must be an object mapping keys to lists, got {_describe(value)}")
            return
        keys_append = self.keys.append
        candidates = self.candidates
        cand_append = candidates.append
        offsets_append = self.offsets.append
        # Hot loop: one iteration per JSON event of a possibly huge file, so keep it free of function calls.
        for event, key in events:
            if event == "end_map":
                return
            keys_append(key)
            event, value = next(events)
            if event == "start_array":
                begin = len(candidates)
                for event, value in events:
                    if event == "number" and type(value) is int:
                        try:
                            cand_append(value)
                        except OverflowError:
                            self.problems.add(f"{_kref(key)}[{len(candidates) - begin}]: id {value} is too large")
                            cand_append(_PLACEHOLDER)
                    elif event == "end_array":
                        break
                    else:
                        value = _event_value(event, value, events)
                        index = len(candidates) - begin
                        self.problems.add(f"{_kref(key)}[{index}]: candidate must be an integer, got {_describe(value)}")
                        cand_append(_PLACEHOLDER)
            else:
                value = _event_value(event, value, events)
                self.problems.add(f"{_kref(key)}: candidates must be a list of integers, got {_describe(value)}")
            offsets_append(len(candidates))

    # -- rules across fields ----------------------------------------------------------------------------------
    def finish(self, vocab_size: int | None, source: str) -> TreeData:
        problems = self.problems
        for name in _REQUIRED_FIELDS:
            if name not in self.fields:
                problems.add(f"missing required field {json.dumps(name)}")
        ids = {name: self._check_id(name, vocab_size) for name in ("start_token_id", "end_token_id")}
        sep = self.fields.get("sep", DEFAULT_SEP)
        sep_problem = _sep_problem(sep)
        if sep_problem:
            problems.add(sep_problem)
        start = ids["start_token_id"]
        if start is not None and not sep_problem:
            self._check_keys(str(start), sep, vocab_size)
        self._check_duplicates()
        offsets = np.frombuffer(self.offsets, dtype=np.int64)
        candidates = np.frombuffer(self.candidates, dtype=np.int64)
        self._check_candidates(offsets, candidates, vocab_size)
        if problems.count:
            raise problems.error(source)
        warnings: list[str] = []
        root = str(start)
        if root not in self.keys:
            warnings.append(f"no entry for the root key {root!r}: the first step will force the end token")
        for message in warnings:
            logger.warning("%s: %s", source, message)
        offsets.flags.writeable = False
        candidates.flags.writeable = False
        end = ids["end_token_id"]
        assert start is not None and end is not None  # a missing id was reported as a problem above
        return TreeData(start, end, sep, self.keys, offsets, candidates, tuple(warnings))

    def _check_duplicates(self) -> None:
        # Sorting 8-byte hashes costs a fraction of the memory of a set of a million keys; only keys whose
        # hash repeats are compared as strings.
        hashes = np.fromiter(map(hash, self.keys), dtype=np.int64, count=len(self.keys))
        hashes.sort()
        repeated = hashes[1:][hashes[1:] == hashes[:-1]]
        if not repeated.size:
            return
        suspects = set(repeated.tolist())
        counts = Counter(key for key in self.keys if hash(key) in suspects)
        for key, count in counts.items():
            if count > 1:
                self.problems.add(f"{_kref(key)}: duplicate key (appears {count} times)")

    def _check_id(self, name: str, vocab_size: int | None) -> int | None:
        if name not in self.fields:
            return None
        value = self.fields[name]
        if not _is_int(value):
            self.problems.add(f"{name}: must be an integer, got {_describe(value)}")
        elif value < 0:
            self.problems.add(f"{name}: id {value} is negative")
        elif vocab_size is not None and value >= vocab_size:
            self.problems.add(f"{name}: id {value} is out of range for vocab_size {vocab_size}")
        else:
            return int(value)
        return None

    def _check_keys(self, root: str, sep: str, vocab_size: int | None) -> None:
        shape = re.compile(re.escape(root) + "(?:" + re.escape(sep) + "(?:0|[1-9][0-9]*))*", re.ASCII)
        matches = shape.fullmatch
        prefix = root + sep
        for key in self.keys:
            if not isinstance(key, str) or matches(key):
                continue
            if key != root and not key.startswith(prefix):
                self.problems.add(f"{_kref(key)}: key must be {root!r} or start with {prefix!r}")
                continue
            for part in key.split(sep)[1:]:
                problem = _part_problem(part)
                if problem:
                    self.problems.add(f"{_kref(key)}: malformed key: {problem}")
                    break
        if vocab_size is None or self.problems.count:
            return
        # Keys are well formed here, so only parts with at least as many digits as the largest id can be out of
        # range; a regex finds those in C and int() runs on them alone.
        long_parts = re.compile(re.escape(sep) + "([0-9]{%d,})" % len(str(vocab_size - 1))).findall
        for key in self.keys:
            for part in long_parts(key):
                if int(part) >= vocab_size:
                    problem = f"token id {part} in the key is out of range for vocab_size {vocab_size}"
                    self.problems.add(f"{_kref(key)}: {problem}")
                    break

    def _check_candidates(self, offsets: np.ndarray, candidates: np.ndarray, vocab_size: int | None) -> None:
        checks = [(candidates < 0, "is negative")]
        if vocab_size is not None:
            checks.append((candidates >= vocab_size, f"is out of range for vocab_size {vocab_size}"))
        for bad, reason in checks:
            positions = np.flatnonzero(bad)
            if not positions.size:
                continue
            for pos in positions[:MAX_REPORTED_PROBLEMS].tolist():
                row = int(np.searchsorted(offsets, pos, side="right")) - 1
                where = f"{_kref(self.keys[row])}[{pos - int(offsets[row])}]"
                self.problems.add(f"{where}: id {int(candidates[pos])} {reason}")
            self.problems.count += max(0, positions.size - MAX_REPORTED_PROBLEMS)


def _event_value(event: str, value: Any, events: Iterator[tuple[str, Any]]) -> Any:
    """Turn one ijson event into a scalar, or skip a whole container and return a :class:`_Container`."""
    if event not in ("start_map", "start_array"):
        return value
    depth = 1
    for inner, _ in events:
        if inner in ("start_map", "start_array"):
            depth += 1
        elif inner in ("end_map", "end_array"):
            depth -= 1
            if depth == 0:
                break
    return _Container("object" if event == "start_map" else "array")


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
    import ijson

    source = f"tree file {os.fspath(path)!r}"
    backend = _ijson_backend()
    with open(path, "rb") as handle:
        if os.fstat(handle.fileno()).st_size == 0:
            raise TreeFileError(["the file is empty"], source=source)
        try:
            builder.add_events(iter(backend.basic_parse(handle, buf_size=_READ_CHUNK)))
        except TreeFileError as error:
            raise TreeFileError(error.problems, error.total, source) from None
        except ijson.JSONError as error:
            builder.problems.add(f"invalid JSON: {_json_error_text(error)}")
            raise builder.problems.error(source) from None
    return source


def load_tree(source: Any, *, vocab_size: int | None = None) -> TreeData:
    """Load and validate a tree.

    Args:
        source: a path (``str`` or ``os.PathLike``) to a JSON tree file, a dict in the tree file format, or a
            :class:`config.scenarios.TreeSpec` (any object with ``start_token_id``, ``end_token_id``, ``sep`` and
            ``prefix_dict`` attributes). Files are streamed: memory grows with the tree, not with the JSON text.
        vocab_size: when given, every id (start, end, candidates, ids inside keys) must be below it.

    Returns:
        The tree as a :class:`TreeData`. A missing root entry is a warning (in ``warnings`` and logged).

    Raises:
        TreeFileError: listing every problem found (the first :data:`MAX_REPORTED_PROBLEMS`, then a count).
        FileNotFoundError: the path does not exist.
    """
    if vocab_size is not None and (not _is_int(vocab_size) or vocab_size < 1):
        raise ValueError(f"vocab_size must be a positive integer, got {vocab_size!r}")
    builder = _TreeBuilder()
    if isinstance(source, (str, os.PathLike)):
        label = _load_file(source, builder)
    elif isinstance(source, Mapping):
        label = "tree"
        builder.add_mapping(source)
    elif all(hasattr(source, name) for name in TOP_LEVEL_FIELDS):
        label = "tree"
        builder.add_mapping({name: getattr(source, name) for name in TOP_LEVEL_FIELDS})
    else:
        raise TypeError(f"load_tree() expects a path, a dict or a TreeSpec, got {type(source).__name__}")
    return builder.finish(vocab_size, label)


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
