"""Stored records read back: a scenario version's hash (:func:`parse_version_record`) and an idempotency record
(:func:`parse_idempotency_record`), each checked field by field; a record that does not hold together is a
:class:`~deployments.storage.errors.StoreCorrupt` naming its key. The write side is :mod:`deployments.storage.store`."""

from __future__ import annotations

import json
from typing import Any, Callable

from deployments.storage.errors import StoreCorrupt

__all__ = ["parse_idempotency_record", "parse_version_record"]


def parse_version_record(raw: dict[str, str], name: str, version: int, key: str,
                         read_body: Callable[[str], bytes | None]) -> dict[str, Any]:
    """The record of version ``version`` of ``name`` from its hash ``raw`` (stored under ``key``); ``read_body``
    gives a body kept as content by its SHA-256 (None when not stored)."""
    try:
        action = raw["action"]
        stored_version = int(raw["version"])
        if stored_version != int(version) or action not in ("put", "patch", "rollback", "delete"):
            raise ValueError(f"version field {raw.get('version')!r}, action {action!r}")
        if action == "delete" or raw.get("pruned"):
            scenario = None
        else:
            text = raw.get("scenario")
            if text is None and raw.get("body_sha256"):
                data = read_body(raw["body_sha256"])
                if data is None:
                    raise ValueError(f"its body {raw['body_sha256'][:12]} is not stored")
                text = data.decode("utf-8", "surrogatepass")
            if text is None:
                raise KeyError("scenario")
            scenario = json.loads(text)
            if not isinstance(scenario, dict):
                raise ValueError(f"the scenario is a {type(scenario).__name__}, not an object")
    except (KeyError, ValueError, TypeError) as exc:
        problem = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
        raise StoreCorrupt(f"stored record {key} is corrupt: {problem}",
                           {"name": name, "version": int(version)}) from None
    record = {
        "name": name,
        "version": stored_version,
        "scenario": scenario,
        "created_at": raw.get("created_at"),
        "action": action,
    }
    if raw.get("from_version"):
        record["from_version"] = int(raw["from_version"])
    if raw.get("pruned"):
        record["pruned"] = True
        record["type"] = raw.get("type") or None
    return record


def parse_idempotency_record(raw: dict[str, str], key: str) -> dict[str, Any]:
    """``{"action", "name", "version"}`` (plus ``from_version``, ``answer`` where kept) of the idempotency record
    ``raw`` stored under ``key``."""
    try:
        result: dict[str, Any] = {"action": raw["action"], "name": raw["name"], "version": int(raw["version"])}
        if raw.get("from_version"):
            result["from_version"] = int(raw["from_version"])
        if raw.get("answer"):
            result["answer"] = json.loads(raw["answer"])
    except (KeyError, ValueError) as exc:
        raise StoreCorrupt(f"stored idempotency record {key} is corrupt: {exc}") from None
    return result
