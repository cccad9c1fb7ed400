"""The admin writes that change a scenario's items: a catalog upload (``put_items``) and a PATCH (``patch``), each
as the :class:`~deployments.manager.write_flow.Write` the config manager runs (``manager``: the
:class:`~deployments.manager.facade.ConfigManager`, whose compiler, store, settings and write flow they use)."""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

from deployments.json_body import parse_json_body
from deployments.protocol import ServiceError
from deployments.scenario_errors import refused_as_service_error
from deployments.storage.content import ContentDelta
from deployments.storage.store import BaseChanged, request_fingerprint
from processors.kinds.patch import delta_updates, parse_delta
from processors.kinds.tree.catalog.parquet import parquet_shape, parquet_strings

from .catalog_delta import apply_delta
from .memory_guard import PATCH_BYTES_PER_ITEM, PEAK_PER_BODY_BYTE, check_write_memory, parquet_need
from .write_flow import Draft, Write, as_version, body_fingerprint

__all__ = ["PATCH_ATTEMPTS", "patch_write", "put_items_write", "upload_draft"]

PATCH_ATTEMPTS = 5  # a PATCH without a base version re-applies its delta this often when writes race it


def upload_draft(manager: Any, name: str, data: Any, upload_format: str) -> Draft:
    """The draft of a catalog upload (``data``: its bytes, or a memory-mapped file's buffer; worker thread): its
    memory estimate checked first (507), then parsed, validated and its canonical bytes kept."""
    need, what = PEAK_PER_BODY_BYTE * len(data), f"a catalog upload of {len(data):,} bytes"
    shape = parquet_shape(data) if upload_format == "parquet" else None
    if shape is not None:  # (compressed bytes say little of a Parquet's items: its footer's counts instead)
        if shape.strings:  # the footer's first (the strings at their size in the file), then as they decode
            check_write_memory(manager.settings, parquet_need(shape) + len(data), _parquet_what(shape), name=name)
            with refused_as_service_error():  # (a row over the per-item metadata bound: 422)
                shape = parquet_strings(data, shape)
        need, what = parquet_need(shape) + len(data), _parquet_what(shape)
    check_write_memory(manager.settings, need, what, name=name)
    body, content, new_sha = manager.compiler.upload(data, upload_format)
    return Draft(body=body, content=content, new_content=new_sha, lookup_first=True)


def _parquet_what(shape: Any) -> str:
    text = f"; {shape.metadata_bytes:,} bytes of metadata as JSON" if shape.values else ""
    return f"a Parquet catalog of {shape.rows:,} items ({shape.ids:,} ids{text})"


def put_items_write(manager: Any, name: str, data: bytes, idempotency_key: str | None,
                    upload_format: str = "ndjson") -> Write:
    """The write of ``ConfigManager.put_items`` (what it does and answers: there)."""
    def fingerprint() -> str:
        return request_fingerprint("put_items", name, hashlib.sha256(memoryview(data)).hexdigest())  # (no copy)

    async def draft(_fingerprint: str | None) -> Draft:
        return await asyncio.to_thread(upload_draft, manager, name, data, upload_format)

    def store(d: Draft, fp: str | None):
        return manager.store.put(name, d.body, idempotency_key=idempotency_key, fingerprint=fp, content=d.content,
                                 action="put")

    def finish(d: Draft, answer: dict[str, Any], replayed: bool) -> dict[str, Any]:
        return {**answer, "items": d.body["items"]}

    return Write("put", name, draft, store, fingerprint=fingerprint, finish=finish, idempotency_key=idempotency_key)


def patch_write(manager: Any, name: str, delta: Any, idempotency_key: str | None, base_version: int | None) -> Write:
    """The write of ``ConfigManager.patch`` (what it does and answers: there)."""
    add: list[Any] = []
    remove: list[Any] = []
    update: list[Any] = []
    base: int | None = None

    async def request() -> None:
        nonlocal delta, add, remove, update, base, base_version
        if isinstance(delta, (bytes, bytearray)):
            delta = await asyncio.to_thread(parse_json_body, bytes(delta), manager.settings.limits,
                                      scenario=False)
        with refused_as_service_error():
            add, remove, body_base = parse_delta(delta)
            update = delta_updates(delta)
        if base_version is not None:
            base_version = as_version(base_version)
            if body_base is not None and body_base != base_version:
                raise ServiceError(422, f"base_version: {body_base} in the body and {base_version} in If-Match "
                                        "differ", {"field": "base_version"})
        base = base_version if base_version is not None else body_base

    def fingerprint() -> str:
        return body_fingerprint("patch", name, {"add": add, "remove": remove, "base_version": base,
                                                **({"update": update} if update else {})})

    async def draft(fp: str | None) -> Draft:
        held = await asyncio.to_thread(manager.compiler.held_base, manager.store, name)  # HeldBase or None
        record = None if held else await asyncio.to_thread(manager.store.get, name)
        if held is None and record is None:
            await manager._not_found(name, None)
        current, stored = (held.version, None) if record is None else (int(record["version"]), record["scenario"])
        if base is not None and current != base:
            raise BaseChanged(name, base, current)
        items = held.items if held else (stored or {}).get("items")
        if isinstance(items, int):  # (a tree not patched yet: its PUT was checked, its PATCH makes a catalog)
            # a held catalog's PATCH leaves its result pending on the held items (or writes a new base out) and makes
            # an overlay of its tables: their bytes; else the PATCH compiles in full (per item)
            need = None if stored is None else await asyncio.to_thread(
                manager.compiler.patch_need, stored, len(add) + len(remove) + len(update))
            check_write_memory(manager.settings, PATCH_BYTES_PER_ITEM * items if need is None else need,
                               f"a PATCH of {items:,} items", name=name)
        result = await asyncio.to_thread(apply_delta, manager.compiler, name, stored, add, remove,
                                         held and (held.kind, held.base), update)
        body, content, report, new_sha = result.body, result.stored, result.report, result.new_sha
        # the answer besides name and version: kept with the Idempotency-Key, a retry gets it exactly
        answer = {"base_version": current, **report.to_json(), "changed": report.changed}
        if not report.changed:
            if idempotency_key is not None and fp is not None:  # a retry must not write later either
                first = await asyncio.to_thread(manager.store.remember_result, idempotency_key, fp,
                                                "patch", name, current, answer)
                if first is not None:  # the same request, answered meanwhile: its answer
                    return Draft(result=await manager._writes.replay(first))
            return Draft(result={"name": name, **answer, "version": current})
        delta = None
        if result.replica_delta:
            added, removed = report.applied(add, remove)  # for replicas serving `current` (they apply the delta)
            delta = {"base": current, "add": added, "remove": removed}
            if report.updated and not (report.added or report.removed):  # a metadata delta: the entries as given
                delta["update"] = update
        note = "".join(f", {step} {took:.3f} s" for step, took in report.timings.items())
        return Draft(body=body, content=content, new_content=new_sha, answer=answer, expect_current=current,
                     redraft_on_conflict=base is None, lookup_first=True, replica_delta=delta, note=note)

    def store(d: Draft, fp: str | None):
        whole = not isinstance(d.content, ContentDelta)  # (a ContentDelta: a stored catalog's PATCH)
        return manager.store.put(name, d.body, idempotency_key=idempotency_key, fingerprint=fp,
                                 content=d.content if whole else None, content_delta=None if whole else d.content,
                                 expect_current=d.expect_current, action="patch", answer=d.answer)

    def finish(d: Draft, answer: dict[str, Any], replayed: bool) -> dict[str, Any]:
        return answer if replayed else {"name": name, **(d.answer or {}), "version": answer["version"]}

    def exhausted() -> ServiceError:
        return ServiceError(503, f"scenario {name!r} kept changing during the PATCH ({PATCH_ATTEMPTS} attempts); "
                                 "nothing was stored by it; retry", {"name": name})

    return Write("patch", name, draft, store, fingerprint=fingerprint, request=request, finish=finish,
                 attempts=PATCH_ATTEMPTS, exhausted=exhausted, idempotency_key=idempotency_key)
