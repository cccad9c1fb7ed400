"""Catalog uploads streamed to the config manager in parts: :class:`UploadSpool`.

A catalog upload larger than one part (:data:`UPLOAD_PART_BYTES`) never sits whole in one process's memory: the
ingress reads the HTTP body as it arrives and sends it here a part at a time (``ConfigManager.upload_part``), each
appended to a spool file under ``<data_dir>/uploads``; the last call (``ConfigManager.put_upload``) checks the
file's size, maps it (pages of the file, not the heap) and stores it as a catalog upload, then removes it. A file
whose upload stopped (the client went away, the ingress died) is removed by ``drop`` or, once idle for
``idle_s``, by the next upload's sweep; a manager start removes them all.

Bounds, checked before any byte is written: the upload id's form, the part's offset (parts come in order; a part
sent again, a retry, is taken once), the total against ``max_upload_bytes`` (413) and the number of uploads under
way (:data:`MAX_OPEN_UPLOADS`, 429).
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from typing import Callable

from deployments.protocol import ServiceError, body_too_large

__all__ = ["MAX_OPEN_UPLOADS", "UPLOAD_ID_PATTERN", "UPLOAD_IDLE_S", "UPLOAD_PART_BYTES", "UploadSpool"]

#: the ingress sends a streamed upload in parts of this many bytes (an upload no larger is sent whole, as before)
UPLOAD_PART_BYTES = 16 << 20
#: uploads under way at once (each holds a spool file on the manager's disk)
MAX_OPEN_UPLOADS = 4
#: seconds without a part after which an unfinished upload's file is removed
UPLOAD_IDLE_S = 600.0
UPLOAD_ID_PATTERN = re.compile(r"^[0-9a-f]{32}$")


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):  # (gone already, or not ours to remove: nothing to do)
        os.unlink(path)


class UploadSpool:
    """The spool files of streamed uploads (methods run on worker threads).

    Args:
        directory: where the files go (created; every file left there by an earlier run is removed).
        limit: the largest upload in bytes (``max_upload_bytes``, read at each part).
        idle_s: an unfinished upload without a part for this long is removed.
    """

    def __init__(self, directory: str, limit: Callable[[], int], idle_s: float = UPLOAD_IDLE_S):
        self.directory = directory
        self._limit = limit
        self.idle_s = idle_s
        self._lock = threading.Lock()
        self._open: dict[str, float] = {}  # upload id -> last part's instant (monotonic)
        # upload id -> when it was dropped: a part still in flight then (a cancelled call goes on here) is refused,
        # never a new file that nothing would remove
        self._dropped: dict[str, float] = {}
        os.makedirs(directory, exist_ok=True)
        for entry in os.listdir(directory):  # (a restarted manager: no upload of the old one can finish)
            if entry.endswith(".part"):
                _unlink(os.path.join(directory, entry))

    def _path(self, upload_id: str) -> str:
        if not isinstance(upload_id, str) or not UPLOAD_ID_PATTERN.fullmatch(upload_id):
            raise ServiceError(422, "upload id: 32 lowercase hex digits expected", {"field": "upload_id"})
        return os.path.join(self.directory, f"{upload_id}.part")

    def append(self, upload_id: str, offset: int, data: bytes) -> int:
        """Append ``data`` at ``offset`` of upload ``upload_id`` (its first part opens it); returns the upload's size.
        A part already appended (a retry) is taken once; any other offset is a 409."""
        path = self._path(upload_id)
        limit = int(self._limit())
        if offset + len(data) > limit:
            raise body_too_large("max_upload_bytes", limit)
        with self._lock:
            self._sweep()
            if upload_id in self._dropped:
                raise ServiceError(404, f"upload {upload_id}: it was dropped; upload again", {"upload_id": upload_id})
            if upload_id not in self._open:
                if offset != 0:
                    raise ServiceError(404, f"upload {upload_id}: no such upload under way (it was dropped, or "
                                            f"idle for {self.idle_s:g} s); upload again", {"upload_id": upload_id})
                if len(self._open) >= MAX_OPEN_UPLOADS:
                    raise ServiceError(429, f"{MAX_OPEN_UPLOADS} catalog uploads are under way; retry once one "
                                            "ended", {"limit_name": "MAX_OPEN_UPLOADS", "limit": MAX_OPEN_UPLOADS})
                with open(path, "wb"):
                    pass
            self._open[upload_id] = time.monotonic()
        try:
            out = open(path, "r+b")  # (never created here: a file dropped meanwhile stays gone)
        except FileNotFoundError:
            raise ServiceError(404, f"upload {upload_id}: it was dropped; upload again",
                               {"upload_id": upload_id}) from None
        with out:
            size = out.seek(0, os.SEEK_END)
            if offset + len(data) == size and offset < size:  # (sent again: it is there)
                return size
            if offset != size:
                raise ServiceError(409, f"upload {upload_id}: a part at byte {offset}, the upload has {size}",
                                   {"upload_id": upload_id, "size": size})
            out.write(data)
        return size + len(data)

    def finished(self, upload_id: str, size: int) -> str:
        """The file of upload ``upload_id`` once all ``size`` bytes are there (409 if not; 404 if no such upload):
        no part is taken for it from now on."""
        path = self._path(upload_id)
        with self._lock:
            if self._open.pop(upload_id, None) is None:
                raise ServiceError(404, f"upload {upload_id}: no such upload under way; upload again",
                                   {"upload_id": upload_id})
        try:
            have = os.path.getsize(path)
        except FileNotFoundError:
            raise ServiceError(404, f"upload {upload_id}: its file is gone; upload again",
                               {"upload_id": upload_id}) from None
        if have != size:
            self.drop(upload_id)
            raise ServiceError(409, f"upload {upload_id}: {have} bytes arrived, {size} were sent",
                               {"upload_id": upload_id, "size": have})
        return path

    def drop(self, upload_id: str) -> None:
        """Remove upload ``upload_id``'s file (a finished one too, once stored or refused)."""
        path = self._path(upload_id)
        with self._lock:
            self._open.pop(upload_id, None)
            self._dropped[upload_id] = time.monotonic()
        _unlink(path)

    def _sweep(self) -> None:  # (under the lock) uploads that stopped sending; drops old enough to forget
        now = time.monotonic()
        self._dropped = {k: t for k, t in self._dropped.items() if now - t <= self.idle_s}
        for upload_id, last in list(self._open.items()):
            if now - last > self.idle_s:
                del self._open[upload_id]
                _unlink(self._path(upload_id))

    def under_way(self) -> int:
        with self._lock:
            return len(self._open)
