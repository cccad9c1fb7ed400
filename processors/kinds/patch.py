"""The PATCH body every patchable kind takes (``{"add": [...], "remove": [...], "base_version": n}``), the report
of what a PATCH did, what a kind's PATCH gives back (:class:`PatchResult`) and what it may ask of the stored content
around it (:class:`PatchStore`, the config manager's side), and what the manager lends a kind that keeps stored content
(:class:`ContentHost`, :meth:`processors.kinds.base.ConstraintKind.stored_content`). Each kind applies its delta in its package
(:meth:`processors.kinds.base.ConstraintKind.apply_patch`: ``tree/catalog_delta.py``, ``labels/delta.py``)."""

from __future__ import annotations

import json
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Protocol

from config import ConstraintError

__all__ = ["ContentHost", "DeltaReport", "PatchResult", "PatchStore", "check_disjoint", "check_unique", "delta_updates", "parse_delta", "refused"]


def refused(message: str, field_name: str, **detail: Any) -> ConstraintError:
    """A 422 naming ``field_name``."""
    return ConstraintError(422, message, {"field": field_name, **detail})


class PatchStore(Protocol):
    """What a kind's PATCH may use of the stored content around it (the config manager's compiler implements it):
    the parsed stored catalogs and their tables kept in memory, local content copies, the stored form of a delta."""

    vocab_size: int
    limits: Any
    #: a PATCH of more items than the base's states / this compiles the new items in full
    patch_states_per_item: int

    def validate(self, name: str, body: dict[str, Any]) -> Any: ...

    def catalog(self, name: str, sha: str) -> Any: ...

    def catalog_tables(self, sha: str) -> Any: ...

    def remember_catalog(self, sha: str, catalog: Any) -> None: ...

    def remember_tables(self, sha: str, tables: Any, patched: bool = False) -> None: ...

    def filter_index(self, sha: str) -> Any: ...

    def remember_index(self, sha: str, index: Any) -> None: ...

    def keep_content(self, data: bytes) -> tuple[str, bool]: ...

    def content_delta(self, base_sha: str, removed_lines: list[bytes], added_lines: list[bytes], content: Any) -> Any:
        """The stored form of content that is ``base_sha``'s with lines removed and appended (``content``: a
        callable giving the whole bytes when the store needs them)."""
        ...


@dataclass(frozen=True)
class ContentHost:
    """What the config manager lends the stored content of a kind (:meth:`ConstraintKind.stored_content
    <processors.kinds.base.ConstraintKind.stored_content>`).

    Attributes:
        data_dir: the manager's data directory (local copies of stored content go under it).
        resolve_path: an admin's file path -> the file under the tree directory; ``ValueError`` when outside it.
        fetch: a content's bytes by SHA-256 from the scenario store (None: not stored).
        content_key: the store's key of a content (named in errors).
        vocab_size: the served vocabulary's size (known once the tokenizer is loaded).
        limits: the manager's :class:`config.Limits` (read at each use).
        pool: the compiler's threads (lower priority), for work the kind starts in the background.
        validate: a scenario body -> its validated scenario (the manager's ``validate``; refusals as the manager answers them).
        content_delta: :meth:`PatchStore.content_delta`.
        parse_body: a PUT body's bytes -> its strict JSON parse within the limits (raises when refused).
        stage_content: ``(sha, bytes) -> bool``: upload content ahead of the write that names it (a delta's base;
            ``ScenarioStore.stage_content``); None: nothing is staged.
        unstage_content: ``sha -> None``: drop staged content no write will name.
    """

    data_dir: str
    resolve_path: Callable[[str], str]
    fetch: Callable[[str], bytes | None]
    content_key: Callable[[str], str]
    vocab_size: Callable[[], int]
    limits: Callable[[], Any]
    pool: Executor
    validate: Callable[[str, Any], Any]
    content_delta: Callable[..., Any]
    parse_body: Callable[[bytes], Any]
    stage_content: Callable[[str, bytes], bool] | None = None
    unstage_content: Callable[[str], None] | None = None


class PatchResult(NamedTuple):
    """What a kind's PATCH gives the write: the whole new body, the content to store with it (bytes, the store's
    delta form from :meth:`PatchStore.content_delta`, or None), the report, and the SHA-256 of the content when its
    local copy is new (a refused write discards it); ``replica_delta``: the new version's tables were updated from
    the base's along the changed paths, so a replica serving the base may apply the delta itself."""

    body: dict[str, Any]
    stored: Any
    report: "DeltaReport"
    new_sha: str | None
    replica_delta: bool = False


@dataclass
class DeltaReport:
    """What a PATCH did: counts, and the no-ops (adds already there, removes not there)."""

    added: int = 0
    removed: int = 0
    updated: int = 0  # items whose metadata a PATCH's ``update`` replaced (a tree catalog's)
    already_present: list[Any] = field(default_factory=list)
    not_present: list[Any] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)  # seconds per step of a tree PATCH (the manager's log)

    @property
    def changed(self) -> bool:
        return bool(self.added or self.removed or self.updated)

    def applied(self, add: list[Any], remove: list[Any]) -> tuple[list[Any], list[Any]]:
        """``(added, removed)``: the items of ``add`` and ``remove`` this PATCH applied (the no-ops left out)."""
        present = {tuple(item) for item in self.already_present}
        absent = {tuple(item) for item in self.not_present}
        return ([item for item in add if tuple(item) not in present],
                [item for item in remove if tuple(item) not in absent])

    def to_json(self) -> dict[str, Any]:
        out = {"added": self.added, "removed": self.removed, "already_present": self.already_present,
               "not_present": self.not_present}
        if self.updated:
            out["updated"] = self.updated
        return out


def parse_delta(body: Any) -> tuple[list[Any], list[Any], int | None]:
    """``(add, remove, base_version)`` of a PATCH body ``{"add": [...], "remove": [...], "update": [...],
    "base_version": n}`` (422 naming the field for anything else; at least one of add/remove/update; the
    ``update`` list: :func:`delta_updates`)."""
    if not isinstance(body, dict):
        raise refused("body: expected a JSON object {\"add\": [...], \"remove\": [...]}", "body")
    unknown = sorted(set(body) - {"add", "remove", "update", "base_version"})
    if unknown:
        raise refused(f"{unknown[0]}: unknown field (a PATCH body has add, remove, update and base_version)",
                      unknown[0])
    add, remove, update = body.get("add", []), body.get("remove", []), body.get("update", [])
    for what, value in (("add", add), ("remove", remove), ("update", update)):
        if not isinstance(value, list):
            raise refused(f"{what}: expected a JSON array, got {type(value).__name__}", what)
    if not add and not remove and not update:
        raise refused("add: a PATCH needs at least one item to add, remove or update", "add")
    base = body.get("base_version")
    if base is not None and (type(base) is not int or base < 1):
        raise refused(f"base_version: expected a version number (an integer from 1), got {base!r}", "base_version")
    return add, remove, base


def delta_updates(body: Any) -> list[Any]:
    """The ``update`` list of a PATCH body that :func:`parse_delta` accepted (items whose metadata it replaces)."""
    return list(body.get("update", [])) if isinstance(body, dict) else []


def check_unique(values: list[Any], what: str) -> None:
    seen: dict[Any, int] = {}
    for i, value in enumerate(values):
        if value in seen:
            raise refused(f"{what}[{i}]: repeats {what}[{seen[value]}]", what)
        seen[value] = i


def check_disjoint(add: list[Any], remove: list[Any]) -> None:
    both = set(add) & set(remove)
    if both:
        first = next(i for i, value in enumerate(add) if value in both)
        raise refused(f"add[{first}]: {json.dumps(add[first] if not isinstance(add[first], tuple) else list(add[first]))} "
                   "is also in remove; an item is either added or removed", "add")
