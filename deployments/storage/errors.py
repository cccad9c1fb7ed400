"""The scenario store's failures, by kind: what went wrong, never an HTTP status.

Every failure of :mod:`deployments.storage.store` is one of these classes. Their HTTP statuses are chosen in one place,
:data:`deployments.scenario_errors.STORE_ERROR_STATUS` (a store error is a :class:`~deployments.protocol.ServiceError`
carrying that status, so the routes answer it as it comes): :class:`InvalidRequest` (a name, key or body the store
refuses), :class:`NotFound`, :class:`VersionConflict` (a delete entry where a body is needed; :class:`BaseChanged`, a
conditional write that found another version in force), :class:`Gone` (a body dropped by the bounded history),
:class:`StoreUnavailable` (Redis unreachable, read-only, too late) and :class:`StoreCorrupt` (a record this module
would not have written, content that does not match its hash).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import redis

from deployments.protocol import ServiceError

__all__ = ["BaseChanged", "Gone", "InvalidRequest", "NotFound", "StoreCorrupt", "StoreError", "StoreUnavailable",
           "VersionConflict", "key_reused", "pruned_error", "redis_errors"]


class StoreError(ServiceError):
    """A failure of the scenario store; its kind is its class, its status that kind's in ``STORE_ERROR_STATUS``."""

    def __init__(self, message: str, detail: dict[str, Any] | None = None):
        from deployments.scenario_errors import store_error_status

        super().__init__(store_error_status(self), message, detail)


class InvalidRequest(StoreError):
    """A name, idempotency key, body or content reference the store refuses."""


class NotFound(StoreError):
    """No such scenario or version."""


class VersionConflict(StoreError):
    """The version asked for cannot be used so: a delete entry has no body."""


class Gone(StoreError):
    """The version's body was dropped by the bounded history (``history_bodies``)."""


class StoreUnavailable(StoreError):
    """Redis unreachable, read-only, or it ran a write too late (not applied)."""


class StoreCorrupt(StoreError):
    """A stored record this module would not have written, or content that does not match its hash."""


class BaseChanged(VersionConflict):
    """A conditional write (``expect_current``) found another version in force: nothing was written.
    ``current`` is the version in force (None when the scenario is deleted)."""

    def __init__(self, name: str, expected: int | None, current: int | None):
        self.current = current
        super().__init__(f"scenario {name!r} changed underneath: the write was based on version {expected}, "
                         f"the current version is {current if current is not None else 'none (deleted)'}; "
                         "nothing was written: read the current version and send the change again",
                         {"name": name, "field": "base_version", "base_version": expected, "current_version": current})


def pruned_error(name: str, version: int) -> Gone:
    """The error for a version whose body was dropped by the bounded history (``history_bodies``)."""
    return Gone(f"version {version} of scenario {name!r} no longer has its body: the history keeps "
                "the newest bodies only (setting history_bodies); its metadata is still listed",
                {"name": name, "version": version, "pruned": True})


def key_reused(key: str | None) -> InvalidRequest:
    """The error for an idempotency key already used for a different request."""
    return InvalidRequest(f"Idempotency-Key {key!r} was already used for a different request (another "
                          "scenario, action or body); use a new key for a new request", {"field": "Idempotency-Key"})


def redis_errors(method):
    """Turn Redis failures into store errors: :class:`StoreUnavailable` when unreachable, else :class:`StoreCorrupt`."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        # Redis's own texts name its socket path or host: they go to the log, clients get what happened.
        except (redis.ConnectionError, redis.TimeoutError, redis.ReadOnlyError) as exc:
            logging.getLogger("ray.serve").warning("scenario store unavailable: %s: %s", type(exc).__name__, exc)
            what = ("Redis did not answer in time" if isinstance(exc, redis.TimeoutError) else
                    "Redis is read-only" if isinstance(exc, redis.ReadOnlyError) else "cannot connect to Redis")
            raise StoreUnavailable(f"scenario store unavailable: {what}; retry later") from exc
        except redis.RedisError as exc:
            logging.getLogger("ray.serve").error("scenario store error: %s: %s", type(exc).__name__, exc)
            raise StoreCorrupt(f"scenario store error ({type(exc).__name__}; the manager's log has the detail)") from exc

    return wrapper
