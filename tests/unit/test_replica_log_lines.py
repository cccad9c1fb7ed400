"""The replica's log filters on Serve's logger (``deployments/metrics.py``): a client error (a 4xx ServiceError a
replica method raised) is one INFO line, and the call's access line that Serve writes next says its status at INFO,
not ``CALL generate ERROR`` (which read as a failure of the service); server errors keep ERROR and the traceback."""

from __future__ import annotations

import logging
import sys

from deployments.metrics import _ExpectedErrorFilter, _QuietCalls
from deployments.protocol import ServiceError


def _through(records: list[logging.LogRecord]) -> list[logging.LogRecord]:
    filters = [_ExpectedErrorFilter(), _QuietCalls()]
    return [r for r in records if all(f.filter(r) for f in filters)]


def _failed(exc: BaseException) -> logging.LogRecord:
    try:
        raise exc
    except BaseException:
        info = sys.exc_info()
    return logging.LogRecord("ray.serve", logging.ERROR, __file__, 1, "Request failed.", (), info)


def _access(message: str) -> logging.LogRecord:
    record = logging.LogRecord("ray.serve", logging.INFO, __file__, 1, message, (), None)
    record.serve_access_log = True
    return record


def test_a_client_error_is_logged_at_info_with_its_status():
    failed, access = _through([_failed(ServiceError(400, "stop: bad")), _access("CALL generate ERROR 3.1ms")])
    assert failed.levelno == logging.INFO and "400: stop: bad" in failed.getMessage() and failed.exc_info is None
    assert access.levelno == logging.INFO and access.getMessage() == "CALL generate 400 3.1ms"


def test_a_server_error_keeps_error_and_the_next_call_is_not_mislabelled():
    failed, access = _through([_failed(RuntimeError("boom")), _access("CALL generate ERROR 3.1ms")])
    assert failed.levelno == logging.ERROR and failed.exc_info is not None
    assert access.levelno == logging.INFO and access.getMessage() == "CALL generate ERROR 3.1ms"
    # a client error's status is used by its own access line only
    kept = _through([_failed(ServiceError(404, "unknown")), _access("CALL generate ERROR 1.0ms"),
                     _access("CALL generate ERROR 2.0ms")])
    assert [r.getMessage() for r in kept[1:]] == ["CALL generate 404 1.0ms", "CALL generate ERROR 2.0ms"]
    assert _through([_access("CALL generate OK 1.0ms")]) == []  # successful calls stay quiet
