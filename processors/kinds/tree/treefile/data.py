"""The loaded form of a token tree (:class:`TreeData`), its error type, and the tree file format's constants and
per-key rules (``processors/kinds/tree/treefile/load.py`` loads trees; ``processors/kinds/tree/treefile/builder.py`` checks and assembles them)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import numpy as np


DEFAULT_SEP = "_"
MAX_REPORTED_PROBLEMS = 20
TOP_LEVEL_FIELDS = ("start_token_id", "end_token_id", "sep", "prefix_dict")
_REQUIRED_FIELDS = ("start_token_id", "end_token_id", "prefix_dict")
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
        offsets: ``int64`` array of ``len(keys) + 1`` entries; the candidates of ``keys[i]`` are
            ``candidates[offsets[i]:offsets[i + 1]]``.
        candidates: ``int64`` array of all candidate ids, in file order (skipped ids left out).
        warnings: non-fatal findings (no entry for the root key; what a lenient load accepted or skipped).
        key_list / key_blob: the keys, as a list of strings or as UTF-8 bytes each ended by ``\\x00``
            (a scanned file); :attr:`keys` gives the list either way, built on first use.
        key_h1, key_h2: two 64-bit hashes of each key's parts (``processors.kinds.tree.treefile.scan``), 0 for keys that cannot
            be a decode state; None when the keys were not hashed (a separator holding control characters).
        targetable: which keys a decode step can reach by their parts (well formed, starting at the root).
        root_index: the index of the root key, or -1.
        max_id: the largest id in the tree (start, end, candidates, parts of keys under the root), or -1 when a
            key could not be read as numbers (then :func:`fits_vocab` cannot tell).
        strict: whether it was loaded with ``strict``.
    """

    start_token_id: int
    end_token_id: int
    sep: str
    offsets: np.ndarray
    candidates: np.ndarray
    warnings: tuple[str, ...] = ()
    key_list: list[str] | None = None
    key_blob: bytes | None = None
    key_h1: np.ndarray | None = None
    key_h2: np.ndarray | None = None
    targetable: np.ndarray | None = None
    root_index: int = -1
    max_id: int = -1
    strict: bool = False

    def __len__(self) -> int:
        return int(self.offsets.size - 1)

    @property
    def keys(self) -> list[str]:
        """The states, in file order, unique (materialized from the scanned bytes on first use)."""
        if self.key_list is None:
            assert self.key_blob is not None
            object.__setattr__(self, "key_list", self.key_blob.decode("utf-8", "surrogatepass").split("\x00")[:-1])
        assert self.key_list is not None
        return self.key_list

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


def _sep_problem(sep: Any, strict: bool) -> str | None:
    if not isinstance(sep, str):
        return f"sep: must be a string, got {_describe(sep)}"
    if not sep:
        return "sep: must not be empty"
    if any(ch.isdigit() for ch in sep) or (strict and "-" in sep):
        return f"sep: {json.dumps(sep)} must not contain digits or '-' (keys would be ambiguous)"
    return None


def _part_problem(part: str) -> str | None:
    if not (part.isascii() and part.isdigit()):
        return f"part {part!r} is not a non-negative integer"
    if str(int(part)) != part:
        return f"part {part!r} is not a canonical non-negative integer (leading zero)"
    return None


_FOREIGN = "foreign"


def _key_problem(key: Any, root: str, sep: str, vocab_size: int | None) -> str | None:
    """The exact per-key check: None (well formed), :data:`_FOREIGN` (does not start with the root), or a
    message (malformed, or a part past the vocabulary)."""
    if not isinstance(key, str):
        return None  # reported when it was read
    if key != root and not key.startswith(root + sep):
        return _FOREIGN
    parts = key.split(sep)[1:]
    for part in parts:
        problem = _part_problem(part)
        if problem:
            return f"malformed key: {problem}"
    if vocab_size is not None:
        for part in parts:
            if int(part) >= vocab_size:
                return f"token id {part} in the key is out of range for vocab_size {vocab_size}"
    return None


_INT32_MAX = (1 << 31) - 1
