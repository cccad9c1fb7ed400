"""Calls from the ingress into the model replicas: liveness checks (503 at once when none is alive), the retry
after a replica death (:class:`DeathMemory`), streams opened up to their first event, and rows held per client.

:class:`ReplicaCalls` is held by :class:`deployments.ingress.service.Ingress` (``ingress.replicas``); it keeps its
own state (the deaths, the rows per client, the last liveness checks). :func:`call` is any handle's call.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import sys
import time
from collections import OrderedDict
from typing import Any

from fastapi import Request

from deployments.guards import CLIENT_SCOPE_KEY, RELEASE_SCOPE_KEY, RowBudget
from deployments.ingress.errors import to_service_error
from deployments.protocol import GenerateRequest, GenerateResponse, ServiceError, unwrap_service_error

# Serve configures this logger in every replica (its files and the `serve run` console); a module logger
# below WARNING would be dropped there.
logger = logging.getLogger("ray.serve")

# A request whose model replica died (crash, lost node) is sent again this many times; generation has no side effects.
# A request that was already in flight at an earlier replica death is never sent again (see DeathMemory).
MODEL_RETRIES = 1
DEATH_MEMORY_SIZE = 4096  # request fingerprints remembered after a replica death
# How long the ingress waits for some model replica to answer a ping before it calls the service unavailable (503):
# after a replica died under a request (before its retry), while the last check found none, and in /healthz.
# Serve's router holds a call while no replica is alive until one is started (17 s and more), instead of failing.
REPLICA_PROBE_TIMEOUT_S = 5.0
# After a check that found no live replica, requests are answered 503 at once for this long, then checked again.
NO_REPLICA_HOLD_S = 1.0
# A generation call without an answer (its first event, for a stream) after this long has the ingress check that
# some replica is alive (one ping shared by all such calls, a success reused for ALIVE_REUSE_S): when none is, the
# call, held by Serve's router, is cancelled and answered 503.
REPLICA_CHECK_AFTER_S = 2.0
ALIVE_REUSE_S = 1.0
RETRY_AFTER_NO_REPLICA_S = 5
NO_REPLICA_MESSAGE = "no live model replica: the service is unavailable until one is running again; retry later"


def _replica_died(exc: BaseException) -> bool:
    """Whether ``exc`` says the replica process serving a call is gone (worth one more try elsewhere)."""
    if "ray" not in sys.modules or unwrap_service_error(exc) is not None:
        return False
    from ray import exceptions as ray_exc

    died = tuple(c for c in (getattr(ray_exc, "RayActorError", None), getattr(ray_exc, "ActorUnavailableError", None))
                 if isinstance(c, type))
    return isinstance(exc, died)


def request_fingerprint(payload: dict[str, Any]) -> str:
    """What identifies a generate request across retries and resends: its body (without ``stream``), hashed."""
    body = {k: v for k, v in payload.items() if k != "stream"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode("utf-8", "surrogatepass")).hexdigest()


class DeathMemory:
    """Fingerprints of requests that were in flight on a model replica when it died (the newest ``size``).

    A request is retried after a replica death only when its fingerprint was in no earlier death: the same
    request dying with a second replica (its retry, or the client sending it again) is answered 503, so a
    request that kills replicas cannot take them down one after another. Per ingress process.
    """

    def __init__(self, size: int = DEATH_MEMORY_SIZE):
        self.size = size
        self._seen: OrderedDict[str, None] = OrderedDict()

    def record(self, fingerprint: str) -> bool:
        """Note a death with this request in flight; whether the request was in an earlier death too."""
        seen = fingerprint in self._seen
        self._seen[fingerprint] = None
        self._seen.move_to_end(fingerprint)
        while len(self._seen) > self.size:
            self._seen.popitem(last=False)
        return seen


def _not_retried(exc: BaseException) -> ServiceError:
    logger.warning("model replica died (%s) with a request in flight that was in flight at an earlier replica "
                   "death too; not retried", type(exc).__name__)
    return ServiceError(503, "this request was in flight when a replica died; not retried", {"retried": False})



def _log_generated(response: Any) -> Any:
    """One INFO line per finished generation with its scenario and version (Serve adds the request id)."""
    if isinstance(response, GenerateResponse):
        logger.info("generate scenario=%s version=%s outputs=%d completion_tokens=%s", response.scenario,
                    response.version, len(response.outputs), response.usage.completion_tokens,
                    extra={"scenario": response.scenario, "scenario_version": response.version})
    elif isinstance(response, dict):
        usage = response.get("usage") or {}
        logger.info("generate scenario=%s version=%s outputs=%d completion_tokens=%s", response.get("scenario"),
                    response.get("version"), len(response.get("outputs") or ()), usage.get("completion_tokens"),
                    extra={"scenario": response.get("scenario"), "scenario_version": response.get("version")})
    return response


def _cancel(call: Any) -> None:
    cancel = getattr(call, "cancel", None)
    if callable(cancel):
        try:
            cancel()
        except Exception:  # best effort: the call may have finished already
            logger.debug("cancelling a backend call failed", exc_info=True)


async def call(method: Any, *args: Any) -> Any:
    """``await method.remote(*args)`` (a method of any handle) with any failure turned into a :class:`ServiceError`."""
    try:
        return await method.remote(*args)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        raise to_service_error(exc) from None


class ReplicaCalls:
    """The ingress's calls into the model replicas.

    Args:
        model: handle to the model replicas (``generate``, ``generate_stream``, ``ping``).
        beams: handle to the replicas that run beam requests beside vLLM replicas, or ``None``.
        slots: the requests the model replicas take at once, all of them (their ``max_ongoing_requests``).
        rows_per_client: ``max_inflight_rows_per_client`` (:class:`RowBudget`).
    """

    def __init__(self, model: Any, beams: Any, *, slots: int, rows_per_client: int):
        self.model = model
        self.beams = beams
        self.slots = slots
        self.deaths = DeathMemory()  # requests in flight at a model replica's death: retried once, never again
        self.rows = RowBudget(rows_per_client)  # work per client, in rows
        self._no_replica_at: float | None = None  # when a check last found no live model replica (None: none did)
        self._probe: asyncio.Future | None = None  # the check in progress, shared by the requests that wait on it
        self._alive_at: float | None = None  # when a check last found a live replica
        self._calls = 0  # generation requests of this ingress on the model replicas (held rows), streams included

    def model_for(self, request: GenerateRequest) -> Any:
        """The replicas that run ``request``: with ``engine: vllm`` and ``beam_replicas``, a beam request goes to the
        transformers-engine ones (``BeamReplica``, see deployments/app.py), everything else to the model replicas."""
        return self.beams if self.beams is not None and request.num_beams > 1 else self.model

    async def _ping_some_replica(self) -> bool:
        """Whether some model replica answers a ping within ``REPLICA_PROBE_TIMEOUT_S`` (a ping that reached a dead
        one is sent again: Serve's router leaves that replica out from then on)."""
        deadline = time.monotonic() + REPLICA_PROBE_TIMEOUT_S
        while (left := deadline - time.monotonic()) > 0:
            call = self.model.ping.remote()

            async def answer(call=call):
                return await call

            try:
                await asyncio.wait_for(answer(), left)
                return True
            except asyncio.TimeoutError:
                _cancel(call)
                if self._calls >= self.slots - 1:
                    # every replica may be full (max_ongoing_requests), so Serve's router queues the ping: a busy
                    # service, not a dead one; the calls keep waiting as before
                    logger.warning("no model replica answered a ping within %g s, with %d requests in flight (the "
                                   "replicas may be full); not treated as down", REPLICA_PROBE_TIMEOUT_S, self._calls)
                    return True
                return False
            except asyncio.CancelledError:
                _cancel(call)
                raise
            except Exception as exc:
                if not _replica_died(exc):
                    logger.warning("model replica ping failed: %s: %s", type(exc).__name__, exc)
                    return False
        return False

    async def replica_alive(self, *, fresh: bool = False) -> bool:
        """Whether a model replica is alive. Not checked (True) while nothing suggested otherwise, unless ``fresh``;
        after a check found none, False for ``NO_REPLICA_HOLD_S``, then checked again. Concurrent callers share
        one check."""
        if not fresh and self._no_replica_at is None:
            return True
        if not fresh and time.monotonic() - self._no_replica_at < NO_REPLICA_HOLD_S:
            return False
        if fresh and self._no_replica_at is None and self._alive_at is not None and \
                time.monotonic() - self._alive_at < ALIVE_REUSE_S:
            return True
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(self._ping_some_replica())
        alive = await asyncio.shield(self._probe)
        if alive:
            if self._no_replica_at is not None:
                logger.warning("a model replica answers again")
            self._no_replica_at, self._alive_at = None, time.monotonic()
        else:
            if self._no_replica_at is None:
                logger.warning("no model replica answered within %g s: generation requests are answered 503",
                               REPLICA_PROBE_TIMEOUT_S)
            self._no_replica_at = time.monotonic()
        return alive

    async def require_replica(self, *, fresh: bool = False) -> None:
        """503 (detail ``retry_after``) at once when no model replica is alive (:meth:`replica_alive`), instead of a
        request held by Serve's router until a new replica has started."""
        if not await self.replica_alive(fresh=fresh):
            raise ServiceError(503, NO_REPLICA_MESSAGE, {"retry_after": RETRY_AFTER_NO_REPLICA_S})

    async def checked(self, awaitable: Any, call: Any) -> Any:
        """``await awaitable`` (a generation call, or a stream's first event), except that when it has no answer
        after ``REPLICA_CHECK_AFTER_S`` and no model replica is alive (:meth:`replica_alive`), ``call`` is cancelled
        and the answer is a 503: Serve's router would hold it until a new replica has started."""

        async def wait() -> Any:
            return await awaitable

        task = asyncio.ensure_future(wait())
        try:
            done, _ = await asyncio.wait({task}, timeout=REPLICA_CHECK_AFTER_S)
            if not done:
                check = asyncio.ensure_future(self.replica_alive(fresh=True))
                done, _ = await asyncio.wait({task, check}, return_when=asyncio.FIRST_COMPLETED)
                if task not in done:
                    if not check.result():
                        task.cancel()
                        _cancel(call)
                        raise ServiceError(503, NO_REPLICA_MESSAGE, {"retry_after": RETRY_AFTER_NO_REPLICA_S})
                else:
                    check.cancel()
            return await task
        except asyncio.CancelledError:
            task.cancel()
            raise

    async def generate(self, request: GenerateRequest) -> Any:
        """``model.generate(request)``, sent again to another replica when the one that had it died; the answer is
        the replica's :class:`GenerateResponse` (the request goes as the model: the replica does not validate it
        again).

        Generation has no side effects, so a request whose replica process dies (a crash, a lost node)
        is retried up to ``MODEL_RETRIES`` times; a seeded request gives the same answer on any replica.
        A request that was in flight at an earlier death is not retried (503, see :class:`DeathMemory`), nor
        one after whose replica's death no replica answers a ping (503, :meth:`require_replica`).
        """
        await self.require_replica()
        for attempt in range(MODEL_RETRIES + 1):
            try:
                call = self.model_for(request).generate.remote(request)
                return _log_generated(await self.checked(call, call))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if _replica_died(exc) and self.deaths.record(request_fingerprint(request.model_dump())):
                    raise _not_retried(exc) from None
                if attempt < MODEL_RETRIES and _replica_died(exc):
                    await self.require_replica(fresh=True)
                    logger.warning("model replica died during a request (%s); retrying on another replica "
                                   "(attempt %d of %d)", type(exc).__name__, attempt + 1, MODEL_RETRIES)
                    continue
                raise to_service_error(exc) from None

    async def open_stream(self, request: GenerateRequest) -> tuple[dict[str, Any] | None, Any]:
        """Start a streamed generation and wait for its first event, so an early error is a plain HTTP error."""
        await self.require_replica()
        for attempt in range(MODEL_RETRIES + 1):
            stream = None
            try:
                stream = self.model_for(request).options(stream=True).generate_stream.remote(request)
                return await self.checked(stream.__anext__(), stream), stream
            except StopAsyncIteration:
                return None, stream
            except asyncio.CancelledError:
                _cancel(stream)
                raise
            except Exception as exc:
                _cancel(stream)
                if _replica_died(exc) and self.deaths.record(request_fingerprint(request.model_dump())):
                    raise _not_retried(exc) from None
                if attempt < MODEL_RETRIES and _replica_died(exc):  # nothing was sent to the client yet
                    await self.require_replica(fresh=True)
                    logger.warning("model replica died before the first event (%s); retrying", type(exc).__name__)
                    continue
                raise to_service_error(exc) from None
        raise AssertionError("unreachable")

    async def hold_rows(self, http: Request | None, request: GenerateRequest) -> Any:
        """Wait until the request's client may put ``max(n, num_beams)`` more rows on the model replicas
        (:class:`RowBudget`, ``max_inflight_rows_per_client``); returns the function that gives them back (once)."""
        if http is not None and CLIENT_SCOPE_KEY not in http.scope:
            # a generating route the per-client middleware does not count (not in GENERATE_PATHS): every client
            # of it would share one budget, so it is refused rather than served outside the bounds
            logger.error("route %s generates but is not in guards.GENERATE_PATHS", http.scope.get("path"))
            raise ServiceError(500, "internal error: this route is not counted per client")
        client = str(http.scope.get(CLIENT_SCOPE_KEY)) if http is not None else "unknown"
        request._client = client  # the engine shares its admission between clients (EngineRequest.client)
        rows = max(request.n, request.num_beams)
        await self.rows.acquire(client, rows)
        self._calls += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._calls -= 1
                self.rows.release(client, rows)

        if http is not None and isinstance(http.scope.get(RELEASE_SCOPE_KEY), list):
            http.scope[RELEASE_SCOPE_KEY].append(release)  # the middleware calls it when the request ends, at the latest
        return release
