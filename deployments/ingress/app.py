"""The FastAPI app of an :class:`~deployments.ingress.service.Ingress`: public routes, the admin router, error
handlers, middlewares, the console and ``/docs``. Typed against what it uses of the ingress
(:class:`~deployments.ingress.seams.IngressApp`)."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse, StreamingResponse

from deployments.console import mount_console
from deployments.docs import mount_docs, plain_openapi
from deployments.guards import InflightPerClient, ProxyHeaderCheck, _header, route_path
from deployments.ingress.admin import _SCENARIOS_PREFIX, _admin_not_found, mount_admin
from deployments.ingress.errors import _install_error_handlers
from deployments.ingress.middleware import BodySizeLimit, RequestIdCheck
from deployments.ingress.uploads import is_catalog_upload
from deployments.ingress.models import (
    _ERROR_RESPONSES, _SSE_RESPONSE, ErrorBody, GenerateBody, HealthResponse, ScenarioList,
)
from deployments.ingress.openapi import _with_scenario_components
from deployments.ingress.seams import AdminIngress, IngressApp
from deployments.ingress.sse import _SSE_HEADERS
from deployments.json_body import ParsedJSONRoute, StrictJSONBody
from deployments.openai.api import ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse, ModelList
from deployments.protocol import GenerateResponse
from deployments.openai.responses import ResponseObject, ResponsesRequest


def _scenario_write(scope: dict, methods: tuple[str, ...]) -> bool:
    """Whether the request is one of ``methods`` on ``/admin/scenarios/{name}`` itself."""
    path = route_path(scope)
    return scope.get("method") in methods and path.startswith(_SCENARIOS_PREFIX) and \
        "/" not in path[len(_SCENARIOS_PREFIX):]


def _parse_body_here(ingress: AdminIngress, scope: dict) -> bool:
    """Whether the strict JSON check reads this request's body: not for an admin route without the admin token
    (it gets its 401 without its body being read, as before)."""
    path = route_path(scope)
    if _scenario_write(scope, ("PUT", "PATCH")):
        return False  # a scenario write goes to the manager as bytes and is parsed there, once (as strictly)
    if path == "/admin" or path.startswith("/admin/"):
        header = next((v.decode("latin-1") for k, v in scope.get("headers") or [] if k == b"authorization"), None)
        return ingress.check_admin(header)
    return True


def _streamed_upload_limit(ingress: AdminIngress, scope: dict) -> int | None:
    """``max_upload_bytes`` for a catalog upload (a scenario PUT with a catalog Content-Type): its route streams the
    body to the manager in parts (``ingress/uploads.py``) and counts it; None for any other request."""
    if not _scenario_write(scope, ("PUT",)):
        return None
    kind = (_header(scope, b"content-type") or b"").decode("latin-1")
    return ingress.limits.max_upload_bytes if is_catalog_upload(kind) else None


def build_http_app(ingress: IngressApp) -> FastAPI:
    """The FastAPI app for ``ingress``: public routes, the admin router, error handlers, the body limit."""
    app = FastAPI(
        title="constrained-serve",
        description="An LLM with hard output constraints (token trees, label sets, JSON schema, regex, think budget).",
        version="0.1.0",
        # No 307 from '/admin/scenarios/a/' to '/admin/scenarios/a' (a client that follows it would write a
        # scenario it did not name, and before any token check): a trailing slash is a 404, or a 422 for a name.
        redirect_slashes=False,
        # FastAPI's /docs and /redoc load their scripts from a CDN: /docs is served from deployments/docs-ui/
        # instead (deployments/docs.py), under a Content-Security-Policy; there is no /redoc.
        docs_url=None,
        redoc_url=None,
        swagger_ui_oauth2_redirect_url=None,
    )
    app.router.route_class = ParsedJSONRoute  # the body StrictJSONBody parsed is validated, not parsed again
    _install_error_handlers(app, not_found=lambda request, status: _admin_not_found(ingress, request, status),
                            redact=ingress.settings.redact_paths)
    # Outermost last: request id, proxy timeout headers, in-flight bound per client, body size, strict JSON.
    app.add_middleware(StrictJSONBody, admits=lambda scope: _parse_body_here(ingress, scope))
    app.add_middleware(BodySizeLimit, max_bytes=ingress.limits.max_body_bytes,
                       streamed=lambda scope: _streamed_upload_limit(ingress, scope))
    settings = ingress.settings
    app.add_middleware(InflightPerClient, limit=settings.max_inflight_per_client, client_ip_header=settings.client_ip_header)
    app.add_middleware(ProxyHeaderCheck, request_timeout_s=settings.request_timeout_s)
    app.add_middleware(RequestIdCheck)

    @app.post("/v1/generate", response_model=GenerateResponse, responses={**_SSE_RESPONSE, **_ERROR_RESPONSES}, tags=["generate"])
    async def generate(body: GenerateBody, http: Request):
        """Generate under a stored scenario (or unconstrained). ``stream: true`` gives SSE ``data: {event}`` lines."""
        request = body.to_request()  # validated once (as GenerateBody), here and on the replica
        await asyncio.to_thread(ingress.check_limits, request)  # linear in the request, off the event loop
        release = await ingress.replicas.hold_rows(http, request)
        try:
            if request.stream:
                first, stream = await ingress.replicas.open_stream(request)
                response = StreamingResponse(ingress.streams.native_sse(first, stream, release), media_type="text/event-stream",
                                             headers=_SSE_HEADERS)
                release = None  # the stream gives the rows back when it ends
                return response
            return await ingress.replicas.generate(request)  # a GenerateResponse: FastAPI serializes it without validating it again
        finally:
            if release is not None:
                release()

    @app.post("/v1/completions", response_model=CompletionResponse, responses={**_SSE_RESPONSE, **_ERROR_RESPONSES}, tags=["openai"])
    async def completions(body: CompletionRequest, http: Request):
        """OpenAI-compatible completions; ``scenario`` / ``response_format`` / ``structured_outputs`` constrain."""
        return await ingress.openai_generate(body, chat=False, http=http)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses={**_SSE_RESPONSE, **_ERROR_RESPONSES}, tags=["openai"])
    async def chat_completions(body: ChatCompletionRequest, http: Request):
        """OpenAI-compatible chat completions; ``scenario`` / ``response_format`` / ``structured_outputs`` constrain."""
        return await ingress.openai_generate(body, chat=True, http=http)

    @app.post("/v1/responses", response_model=ResponseObject, responses={**_SSE_RESPONSE, **_ERROR_RESPONSES}, tags=["openai"])
    async def responses(body: ResponsesRequest, http: Request):
        """OpenAI Responses API (``client.responses.create`` / ``parse`` / ``stream``); ``text.format`` or
        ``scenario`` constrain; nothing is stored (``previous_response_id`` is a 400)."""
        return await ingress.responses_generate(body, http=http)

    @app.get("/v1/models", response_model=ModelList, tags=["openai"])
    async def models():
        return {"data": [{"id": ingress.model_name, "created": ingress.created}]}

    @app.get("/v1/scenarios", response_model=ScenarioList, tags=["scenarios"])
    async def scenarios():
        return {"scenarios": await ingress.call(ingress.manager.list)}

    @app.get("/healthz", response_model=HealthResponse, tags=["health"],
             responses={503: {"model": HealthResponse, "description": "No model replica is alive or registered"}})
    async def healthz():
        """200 while generation works (``status: degraded`` when the manager or Redis is not well); 503 with
        ``status: unavailable`` when no model replica answers or none is registered."""
        report = await ingress.health_check.health()
        if report.get("status") == "unavailable":
            return JSONResponse(jsonable_encoder(HealthResponse.model_validate(report)), status_code=503)
        return report

    require_admin = mount_admin(app, ingress)
    mount_console(app, ingress, require_admin, ErrorBody)  # /console and POST /admin/scenarios/{name}/inspect
    mount_docs(app)  # /docs: Swagger UI from this service
    _with_scenario_components(app)
    plain_openapi(app)  # Markdown, not Sphinx markup, in the descriptions /docs shows
    return app
