"""Prometheus metrics and Serve log routing for the deployments.

Metrics go through Ray Serve's own metrics API (``ray.serve.metrics``), which adds the ``deployment``,
``replica`` and ``application`` tags and exports everything on Ray's metrics endpoint with a ``ray_``
prefix (a counter also gets ``_total``; see the README's "Metrics" section for the exported names and
PromQL). Every tag value here is bounded: scenario names are the stored ones (or one of the
placeholders below), outcomes and actions are fixed words; nothing is tagged by request.

The metric objects only exist inside a Serve replica. Constructed anywhere else (unit and integration
tests, ``model.generate`` users), :class:`ReplicaMetrics` and :class:`ManagerMetrics` record nothing
and cost nothing, and Ray is not even imported.

Two Ray details shape the choices here:

* Ray exports a histogram's ``_sum`` from bucket midpoints, not from the observed values, so exact
  totals (step seconds, chain seconds) are counters next to the histogram.
* Recording is thread-safe and costs a few microseconds per call, so the decode thread records once
  per step (three calls), never per row; per-scenario counts are added once per request.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator, Mapping

from .protocol import ServiceError

__all__ = [
    "ManagerMetrics",
    "ReplicaMetrics",
    "SCENARIO_INLINE",
    "SCENARIO_NONE",
    "SCENARIO_UNKNOWN",
    "route_logs_to_serve",
    "scenario_tag",
]

logger = logging.getLogger(__name__)

# Tag values that can never be a stored scenario's name (names start with a letter or digit).
SCENARIO_NONE = "_none"  # unconstrained request
SCENARIO_INLINE = "_inline"  # a one-off constraint (OpenAI response_format / structured_outputs)
SCENARIO_UNKNOWN = "_unknown"  # a name this replica does not serve (a 404): never the client's string

# Seconds per decode step: a small model on CPU is 5-100 ms, a large batch on a GPU up to a second or two.
STEP_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]
# PUT received -> every replica acknowledged: tens of ms for a label set, seconds for a 10^5-key tree.
HOT_SWAP_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]


def _in_serve_replica() -> bool:
    """Whether this code runs inside a Ray Serve replica (without importing Ray when it is not loaded)."""
    if "ray" not in sys.modules:
        return False
    from ray import serve
    from ray.serve.exceptions import RayServeException

    try:
        serve.get_replica_context()
    except RayServeException:
        return False
    return True


def scenario_tag(request: Any, served: Mapping[str, Any]) -> str:
    """The ``scenario`` tag of a generate request: its stored name when ``served`` holds it, else a placeholder."""
    get = request.get if isinstance(request, dict) else lambda key: getattr(request, key, None)
    name = get("scenario")
    if name is not None:
        return name if isinstance(name, str) and name in served else SCENARIO_UNKNOWN
    return SCENARIO_INLINE if get("inline_scenario") is not None else SCENARIO_NONE


class RequestRecord:
    """What one generate request produced; filled by the replica, recorded when the request ends."""

    __slots__ = ("scenario", "tokens", "fallback_rows", "failed")

    def __init__(self, scenario: str):
        self.scenario = scenario
        self.tokens = 0
        self.fallback_rows = 0
        self.failed = False  # set by a stream that ended with an error event instead of raising

    def outputs(self, finished: Mapping[int, Any]) -> None:
        """Count the finished outputs (the engine's ``FinishedEvent``s, by output index)."""
        self.tokens = sum(len(ev.token_ids) for ev in finished.values())
        self.fallback_rows = sum(1 for ev in finished.values() if ev.fell_back)


class ReplicaMetrics:
    """The model replica's metrics: requests, tokens, fallbacks, decode steps, scenario versions.

    Args:
        enabled: create the Ray metrics (default: only when running inside a Serve replica).
    """

    def __init__(self, enabled: bool | None = None):
        self.enabled = _in_serve_replica() if enabled is None else enabled
        self._versions: set[str] = set()
        self._step_errors = 0
        if not self.enabled:
            return
        from ray.serve.metrics import Counter, Gauge, Histogram

        self.requests = Counter(
            "cs_requests", "Generate requests that reached a model replica, by scenario and outcome "
            "(ok, error, cancelled).", tag_keys=("scenario", "outcome"))
        self.tokens = Counter(
            "cs_generated_tokens", "Tokens generated for finished outputs, by scenario.", tag_keys=("scenario",))
        self.fallbacks = Counter(
            "cs_fallback_rows", "Outputs whose constraint fell back to the end token (a tree with no entry "
            "for a reached state), by scenario.", tag_keys=("scenario",))
        self.step_hist = Histogram(
            "cs_decode_step_seconds", "Seconds per continuous-batching decode step (processor chain, "
            "sampling and the forward pass of the batch).", boundaries=STEP_BUCKETS, tag_keys=())
        self.step_seconds = Counter(
            "cs_decode_seconds", "Total seconds in decode steps (exact, unlike the histogram's _sum, which Ray "
            "estimates from bucket midpoints).", tag_keys=())
        self.chain_seconds = Counter(
            "cs_chain_seconds", "Total seconds of decode steps spent in the processor chain (masking and "
            "cursor advance).", tag_keys=())
        self.version = Gauge(
            "cs_scenario_version", "Scenario version this replica serves (0: no longer served).",
            tag_keys=("scenario",))

    def record_step(self, step_seconds: float, chain_seconds: float) -> None:
        """One decode step (called from the engine thread; never raises into the decode loop)."""
        try:
            self.step_hist.observe(step_seconds)
            if step_seconds > 0:
                self.step_seconds.inc(step_seconds)
            if chain_seconds > 0:
                self.chain_seconds.inc(chain_seconds)
        except Exception:
            self._step_errors += 1
            if self._step_errors == 1:
                logger.warning("recording decode step metrics failed", exc_info=True)

    @contextmanager
    def request(self, request: Any, served: Mapping[str, Any]) -> Iterator[RequestRecord]:
        """Count one generate request with its outcome, tokens and fallbacks when it ends."""
        record = RequestRecord(scenario_tag(request, served))
        outcome = "error"
        try:
            yield record
            outcome = "error" if record.failed else "ok"
        except BaseException as exc:
            if not isinstance(exc, Exception):  # CancelledError, GeneratorExit: the client went away
                outcome = "cancelled"
            raise
        finally:
            if self.enabled:
                tags = {"scenario": record.scenario}
                self.requests.inc(1, tags={**tags, "outcome": outcome})
                if record.tokens:
                    self.tokens.inc(record.tokens, tags=tags)
                if record.fallback_rows:
                    self.fallbacks.inc(record.fallback_rows, tags=tags)

    def set_versions(self, versions: Mapping[str, int]) -> None:
        """The versions this replica serves now; scenarios it no longer serves drop to 0."""
        if not self.enabled:
            return
        for name in self._versions - set(versions):
            self.version.set(0, tags={"scenario": name})
        for name, version in versions.items():
            self.version.set(int(version), tags={"scenario": name})
        self._versions = set(versions)


class ManagerMetrics:
    """The config manager's metrics: how long a write takes to reach every replica."""

    def __init__(self, enabled: bool | None = None):
        self.enabled = _in_serve_replica() if enabled is None else enabled
        if not self.enabled:
            return
        from ray.serve.metrics import Histogram

        self.hot_swap = Histogram(
            "cs_hot_swap_seconds", "Seconds from an admin write (put, rollback, delete) reaching the manager "
            "to every live replica acknowledging it.", boundaries=HOT_SWAP_BUCKETS, tag_keys=("scenario", "action"))

    def swapped(self, scenario: str, action: str, started: float) -> None:
        """A write of ``scenario`` that began at ``time.monotonic() == started`` is served everywhere."""
        if self.enabled:
            self.hot_swap.observe(time.monotonic() - started, tags={"scenario": scenario, "action": action})


# --------------------------------------------------------------------------------------------- logs

_PROJECT_LOGGERS = ("deployments", "processors", "config")


class _ToServeLogger(logging.Handler):
    """Hands records to Serve's logger, whose handlers write the replica's log file with the request id."""

    def __init__(self, target: logging.Logger):
        super().__init__()
        self.target = target

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= self.target.getEffectiveLevel():  # Serve's level, also after a reconfigure
            self.target.handle(record)


class _QuietCalls(logging.Filter):
    """Drops Serve's access line of a call between deployments that succeeded (``CALL wait_for_update OK
    7500.3ms``): every model replica's long poll printed one every few seconds, and each request one more at its
    model replica. HTTP access lines (``POST /v1/generate 200``), failed calls and the project's own lines (with
    the request id) stay. Serve's ``enable_access_log: false`` would drop them too, but then Serve no longer
    writes the request id into the replica's log file."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "serve_access_log", False):
            return True
        message = record.getMessage()
        status = getattr(_LAST_CLIENT_ERROR, "status", None)
        _LAST_CLIENT_ERROR.status = None
        if message.startswith("CALL ") and " ERROR " in message and status is not None:
            # the call answered a client error (its one-line record just before): its status, at INFO
            record.msg, record.args = message.replace(" ERROR ", f" {status} ", 1), ()
            record.levelno, record.levelname = logging.INFO, "INFO"
            return True
        return not (message.startswith("CALL ") and " OK " in message)


#: the status of the client error (4xx) a replica method raised, noted by :class:`_ExpectedErrorFilter` for the
#: call's access line, which Serve writes next, on the same thread
_LAST_CLIENT_ERROR = threading.local()


class _ExpectedErrorFilter(logging.Filter):
    """One line instead of a traceback when a replica method raised a client error (a 4xx ServiceError).

    Serve logs every exception a replica method raises with its traceback; for an unknown scenario or an
    invalid body that is noise. Server errors (5xx) and everything else keep their traceback.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, ServiceError) and exc.status < 500:
            record.msg = f"{record.getMessage()} {exc.status}: {exc.message}"
            record.args = ()
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.INFO, "INFO"
            _LAST_CLIENT_ERROR.status = exc.status
        return True


def route_logs_to_serve() -> bool:
    """Inside a Serve replica, make the project's log lines reach the replica's log file.

    Serve writes only its own logger (``ray.serve``) to the replica's file, with the request id; a module
    logger's INFO lines would go nowhere. This forwards the ``deployments``, ``processors`` and ``config``
    loggers to it, at the level Serve's logger has (``LoggingConfig.log_level``), and shortens the logging
    of expected client errors (see :class:`_ExpectedErrorFilter`). Elsewhere it does nothing and returns False.
    """
    if not _in_serve_replica():
        return False
    serve_logger = logging.getLogger("ray.serve")
    if not any(isinstance(f, _ExpectedErrorFilter) for f in serve_logger.filters):
        serve_logger.addFilter(_ExpectedErrorFilter())
    if not any(isinstance(f, _QuietCalls) for f in serve_logger.filters):
        serve_logger.addFilter(_QuietCalls())
    for name in _PROJECT_LOGGERS:
        project = logging.getLogger(name)
        if not any(isinstance(h, _ToServeLogger) for h in project.handlers):
            project.addHandler(_ToServeLogger(serve_logger))
        project.setLevel(logging.DEBUG)  # the handler applies Serve's level, which a redeploy may change
        project.propagate = False  # the root logger's stderr would log them a second time
    return True
