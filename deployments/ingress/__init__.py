"""The HTTP ingress: one FastAPI app in front of the model replicas and the config manager.

:class:`Ingress` is a plain class: ``Ingress(settings, model_handle, manager_handle)`` builds its FastAPI
app (``ingress.http_app``) with routes bound to that instance, so it can be served by Ray Serve or tested
in-process with ``fastapi.testclient.TestClient``. Ray Serve gets the app through the late-bound hook
``__serve_build_asgi_app__`` (see ``deployments/app.py``: ``serve.deployment(serve.ingress()(Ingress))``).

Routes:

========================================= ===========================================================
``POST /v1/generate``                     native API (:class:`GenerateBody` -> ``GenerateResponse``), SSE when ``stream``
``POST /v1/completions``                  OpenAI completions; extra fields ``scenario``, ``structured_outputs``, ``top_k``
``POST /v1/chat/completions``             OpenAI chat completions; also ``response_format``
``POST /v1/responses``                    OpenAI Responses API, mapped onto chat (``deployments/openai/responses.py``)
``GET /v1/models``                        the served model
``GET /v1/scenarios``                     stored scenarios: name, type, current version
``GET /healthz``                          liveness, the manager's health, per-replica scenario versions
``PUT|GET|DELETE /admin/scenarios/{name}`` admin (bearer token): create/replace, read, delete
``GET /admin/scenarios/{name}/versions``  admin: history
``POST /admin/scenarios/{name}/rollback`` admin: roll back to ``{"version": int}``
``POST /admin/scenarios/{name}/inspect``  admin: allowed next tokens after a prefix (``deployments/console.py``)
``GET /console``                          the web console (a page over the routes above)
========================================= ===========================================================

Every error is JSON ``{"error": {"status": int, "message": str, ...detail}}``. The OpenAI request and response
bodies, and their mapping to and from the native API, are in ``deployments/openai/api.py`` (the Responses API's in
``deployments/openai/responses.py`` and ``deployments/openai/responses_stream.py``).

Modules, one job each:

================= ==========================================================================================
``service.py``    :class:`Ingress`: settings, handles, admin token, limits, the OpenAI flow; it holds the parts below
``app.py``        :func:`build_http_app`: the FastAPI app, its middlewares and the public routes
``seams.py``      what the app and the admin routes use of an ingress (Protocols)
``admin.py``      the admin routes, and the admin answers to a routing 404 / 405
``models.py``     the ingress's request/response models and documented error answers
``errors.py``     any exception -> :class:`~deployments.protocol.ServiceError`; the JSON error handlers
``replicas.py``   calls into the model replicas (``ingress.replicas``): liveness (503), the retry after a replica
                  death, held rows
``sse.py``        server-sent event streams (``ingress.streams``: native, OpenAI chunks, Responses API events)
``health.py``     ``GET /healthz`` (``ingress.health_check``)
``middleware.py`` body size limit, ``X-Request-Id`` check
``openapi.py``    OpenAPI patches for the bodies the admin routes read as bytes
================= ==========================================================================================
"""

from deployments.ingress.admin import _if_match_version
from deployments.ingress.app import build_http_app
from deployments.ingress.errors import redact_json, to_service_error
from deployments.ingress.health import HEALTH_TIMEOUT_S
from deployments.ingress.middleware import BodySizeLimit, RequestIdCheck
from deployments.ingress.models import (
    DeletedOut, ErrorBody, ErrorDetail, GenerateBody, HealthResponse, RollbackBody, ScenarioList, ScenarioOut,
    ScenarioPatchOut, ScenarioSummary, ScenarioVersionOut, ScenarioVersionsOut,
)
from deployments.ingress.replicas import (
    ALIVE_REUSE_S, DEATH_MEMORY_SIZE, MODEL_RETRIES, NO_REPLICA_HOLD_S, NO_REPLICA_MESSAGE, REPLICA_CHECK_AFTER_S,
    REPLICA_PROBE_TIMEOUT_S, RETRY_AFTER_NO_REPLICA_S, DeathMemory, request_fingerprint,
)
from deployments.ingress.service import Ingress
from deployments.ingress.sse import sse

__all__ = [
    "ALIVE_REUSE_S",
    "DEATH_MEMORY_SIZE",
    "HEALTH_TIMEOUT_S",
    "MODEL_RETRIES",
    "NO_REPLICA_HOLD_S",
    "NO_REPLICA_MESSAGE",
    "REPLICA_CHECK_AFTER_S",
    "REPLICA_PROBE_TIMEOUT_S",
    "RETRY_AFTER_NO_REPLICA_S",
    "BodySizeLimit",
    "DeathMemory",
    "DeletedOut",
    "ErrorBody",
    "ErrorDetail",
    "GenerateBody",
    "HealthResponse",
    "Ingress",
    "RequestIdCheck",
    "RollbackBody",
    "ScenarioList",
    "ScenarioOut",
    "ScenarioPatchOut",
    "ScenarioSummary",
    "ScenarioVersionOut",
    "ScenarioVersionsOut",
    "_if_match_version",
    "build_http_app",
    "redact_json",
    "request_fingerprint",
    "sse",
    "to_service_error",
]
