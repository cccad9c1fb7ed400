"""The admin bearer token: where it comes from, how it is checked, how it may appear in logs.

The token is ``settings.admin_token`` (the ``admin_token`` builder argument or ``ADMIN_TOKEN``) when set.
Otherwise it lives in ``<data_dir>/admin_token``: the first process to start creates that file with a
random token (mode 0600, ``O_EXCL``, so concurrent starters agree on one token) and every later start
reads it. Only the file's location is logged, never the token.

Example::

    >>> check_bearer("Bearer s3cret", "s3cret"), check_bearer("Bearer nope", "s3cret"), check_bearer(None, "s3cret")
    (True, False, False)
    >>> mask_token("s3cret-token")
    's3cr…'
"""

from __future__ import annotations

import errno
import hmac
import logging
import os
import secrets
import time
from pathlib import Path
from typing import Any

__all__ = ["TOKEN_FILE_NAME", "check_bearer", "mask_token", "resolve_admin_token", "token_file_path"]

# Serve configures this logger in every replica (its files and the `serve run` console); a module logger
# below WARNING would be dropped there.
logger = logging.getLogger("ray.serve")

TOKEN_FILE_NAME = "admin_token"
_READ_RETRIES = 50  # another process may have created the file but not written it yet
_READ_RETRY_S = 0.02


def _setting(settings: Any, name: str) -> Any:
    return settings.get(name) if isinstance(settings, dict) else getattr(settings, name)


def token_file_path(settings: Any) -> Path:
    """Where the generated token is kept: ``<data_dir>/admin_token`` (absolute)."""
    return Path(_setting(settings, "data_dir") or ".").expanduser().resolve() / TOKEN_FILE_NAME


def _read_token(path: Path) -> str:
    for _ in range(_READ_RETRIES):
        token = path.read_text(encoding="utf-8").strip()
        if token:
            return token
        time.sleep(_READ_RETRY_S)
    raise RuntimeError(f"admin token file {path} is empty; delete it to generate a new token, or set ADMIN_TOKEN")


def resolve_admin_token(settings: Any) -> str:
    """The admin bearer token for these settings (a ``ServerSettings`` or its ``model_dump()``).

    Uses ``admin_token`` when set; else reads ``<data_dir>/admin_token``, creating it with a fresh
    ``secrets.token_urlsafe(32)`` (mode 0600) when it does not exist yet.

    Raises:
        RuntimeError: the token file exists but stays empty, or cannot be created or read.
    """
    configured = _setting(settings, "admin_token")
    if configured:
        return str(configured)

    path = token_file_path(settings)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        token = _read_token(path)
        logger.info("admin token: using the one stored in %s", path)
        return token
    except OSError as error:
        raise RuntimeError(f"cannot create the admin token file {path}: {error.strerror or error}") from None

    token = secrets.token_urlsafe(32)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(token + "\n")
    except OSError as error:
        try:
            path.unlink()
        except OSError as unlink_error:
            if unlink_error.errno != errno.ENOENT:
                logger.warning("could not remove the half-written admin token file %s", path)
        raise RuntimeError(f"cannot write the admin token file {path}: {error.strerror or error}") from None
    logger.warning(
        "ADMIN_TOKEN is not set: generated an admin token and stored it in %s (mode 0600); "
        "send it as 'Authorization: Bearer <token>' to /admin endpoints",
        path,
    )
    return token


def check_bearer(header_value: str | None, token: str) -> bool:
    """Whether an ``Authorization`` header value carries ``token`` as a bearer token (constant-time compare)."""
    if not header_value or not token:
        return False
    scheme, _, credentials = header_value.strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(credentials.strip().encode("utf-8"), token.encode("utf-8"))


def mask_token(token: str | None) -> str:
    """A form of ``token`` safe for logs: its first 4 characters and an ellipsis."""
    if not token:
        return "<none>"
    return token[:4] + "…"
