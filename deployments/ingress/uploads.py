"""A catalog upload streamed to the config manager: the body of ``PUT /admin/scenarios/{name}`` with a catalog
``Content-Type`` (NDJSON or Parquet) is read as it arrives and sent on in parts (``ConfigManager.upload_part``, then
``put_upload``; the manager's side is ``deployments/manager/uploads.py``), so neither the ingress nor the manager
holds it whole. An upload that fits in one part is sent whole (``put_items``), as any body. Its bound is
``max_upload_bytes`` (the body size middleware checks a ``Content-Length`` against it; a chunked body is counted
here). Each part (an upload of one part or less: its whole body) must arrive within ``upload_part_timeout_s``, the
time the manager takes with the part before it not counted: past it the upload is a 408, so a client that stalls
holds one of the manager's uploads under way (``MAX_OPEN_UPLOADS``) for that long at most. A client that goes away
mid-upload, a part too slow, or any failure before the last part removes the manager's spool file.
"""

from __future__ import annotations

import asyncio
import contextvars
import ctypes
import logging
import uuid
from typing import Any

from starlette.requests import Request

from deployments.manager.uploads import UPLOAD_PART_BYTES
from deployments.protocol import ServiceError, body_too_large
from processors.kinds.tree.catalog.catalog import CATALOG_CONTENT_TYPES
from processors.kinds.tree.catalog.parquet import PARQUET_CONTENT_TYPES

__all__ = ["is_catalog_upload", "release_freed_memory", "upload_catalog", "upload_format_of"]

logger = logging.getLogger(__name__)


def _media_type(content_type: str) -> str:
    return (content_type or "").split(";")[0].strip().lower()


def is_catalog_upload(content_type: str) -> bool:
    """Whether a PUT body of this ``Content-Type`` is a catalog upload (NDJSON or Parquet)."""
    kind = _media_type(content_type)
    return kind in CATALOG_CONTENT_TYPES or kind in PARQUET_CONTENT_TYPES


def release_freed_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim``; nothing elsewhere). Serve's proxy
    passes a request body on as fast as the client sends it, in messages of about 64 KiB, whatever this process has
    consumed; freed, they stay in the heap's arenas, and without this the ingress kept about twice a streamed
    upload's size resident after it (1.2 GB for a 475 MB Parquet catalog) while the manager compiled it."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def upload_format_of(content_type: str) -> str:
    """The manager's ``upload_format`` of a catalog upload's ``Content-Type``."""
    return "parquet" if _media_type(content_type) in PARQUET_CONTENT_TYPES else "ndjson"


async def upload_catalog(ingress: Any, request: Request, name: str, key: str | None, upload_format: str,
                         part_bytes: int = UPLOAD_PART_BYTES) -> Any:
    """Store the catalog in ``request``'s body as a new version of ``name`` (what ``ConfigManager.put_items``
    answers), streaming it to the manager in parts of ``part_bytes`` once it is larger than one; each part read
    within ``upload_part_timeout_s`` (a 408 past it)."""
    limit = int(ingress.limits.max_upload_bytes)
    timeout_s = float(ingress.limits.upload_part_timeout_s)
    manager = ingress.manager
    loop = asyncio.get_running_loop()
    held: list[bytes] = []
    held_bytes = sent = 0
    upload_id: str | None = None
    handed = False
    try:
        try:
            async with asyncio.timeout_at(loop.time() + timeout_s) as reading:
                async for chunk in request.stream():
                    if sent + held_bytes + len(chunk) > limit:
                        raise body_too_large("max_upload_bytes", limit)
                    if chunk:
                        held.append(chunk)
                        held_bytes += len(chunk)
                    if held_bytes >= part_bytes:
                        if upload_id is None:
                            upload_id = uuid.uuid4().hex
                        part = b"".join(held)
                        held, held_bytes = [], 0
                        reading.reschedule(None)  # (the manager's time with a part is not the client's)
                        await ingress.call(manager.upload_part, upload_id, sent, part)
                        sent += len(part)
                        reading.reschedule(loop.time() + timeout_s)
        except TimeoutError:
            if not reading.expired():
                raise
            raise _part_too_slow(held_bytes, part_bytes, timeout_s) from None
        rest = b"".join(held)
        if upload_id is None:  # (one part or less: sent whole, as any body)
            return await ingress.call(manager.put_items, name, rest, key, upload_format)
        if rest:
            await ingress.call(manager.upload_part, upload_id, sent, rest)
            sent += len(rest)
        held = []
        await asyncio.to_thread(release_freed_memory)
        handed = True  # (from here the manager removes the spool file, whatever happens)
        return await ingress.call(manager.put_upload, name, upload_id, sent, key, upload_format)
    finally:
        if upload_id is not None and not handed:  # the client went away, a part was too slow or was refused
            # In a context of its own, not this request's: Serve cancels the calls a request made, those not yet
            # assigned to a replica too, when its client goes away, and this call is made just then.
            task = loop.create_task(_drop(manager, upload_id), context=contextvars.Context())
            _drops.add(task)  # (held until done: the event loop keeps only a weak reference)
            task.add_done_callback(_drops.discard)


_drops: set[asyncio.Future] = set()


async def _drop(manager: Any, upload_id: str) -> None:
    try:
        await manager.drop_upload.remote(upload_id)
    except Exception:  # noqa: BLE001 - the manager sweeps idle uploads anyway
        logger.warning("dropping catalog upload %s failed", upload_id, exc_info=True)


def _part_too_slow(arrived: int, part_bytes: int, timeout_s: float) -> ServiceError:
    """The 408 of a catalog upload whose part of ``part_bytes`` did not arrive within ``timeout_s`` (``arrived``
    bytes of it did)."""
    return ServiceError(408, f"request body: {arrived} bytes of the catalog upload arrived in the {timeout_s:g} s "
                             f"since it started or since its last part of {part_bytes} bytes; each part must "
                             f"arrive within the limit upload_part_timeout_s={timeout_s:g}; nothing was stored",
                        {"field": "body", "limit_name": "upload_part_timeout_s", "limit": timeout_s})
