"""The admin routes (``/admin/scenarios/...``, bearer token) and the admin answers to a routing 404 / 405."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments.guards import route_path
from deployments.ingress.errors import _error_response
from deployments.ingress.models import (
    _ERROR_RESPONSES, DeletedOut, ErrorBody, IdempotencyKey, IfMatch, RollbackBody, ScenarioName, ScenarioOut,
    ScenarioPatchOut, ScenarioVersionOut, ScenarioVersionsOut,
)
from deployments.ingress.openapi import _patch_openapi_extra, _scenario_openapi_extra
from deployments.ingress.seams import AdminIngress
from deployments.json_body import ParsedJSONRoute
from deployments.ingress.uploads import is_catalog_upload, upload_catalog, upload_format_of
from deployments.protocol import ServiceError
from deployments.storage.store import validate_name
from deployments.storage.content import validate_idempotency_key
from deployments.storage.errors import InvalidRequest

# Serve configures this logger in every replica (its files and the `serve run` console); a module logger
# below WARNING would be dropped there.
logger = logging.getLogger("ray.serve")


def _if_match_version(value: str | None) -> int | None:
    """The version an ``If-Match`` header names (``"3"``, ``3``, ``W/"3"``; ``*`` names none); 422 for anything else."""
    if value is None or value.strip() == "*":  # '*': any current version
        return None
    text = value.strip()
    text = text[2:] if text.startswith("W/") else text
    text = text[1:-1] if len(text) >= 2 and text[0] == text[-1] == '"' else text
    # ASCII digits only (int() refuses some that isdigit() takes, e.g. '\xb2'), and few of them: int() refuses a
    # text of over 4300 digits, and no version has more than 18
    if not (text.isascii() and text.isdigit() and len(text) <= 18) or int(text) < 1:
        raise ServiceError(422, f"If-Match: expected a version as an entity tag (e.g. \"3\", from GET's ETag), got "
                                f"{value[:40]!r}", {"field": "If-Match"})
    return int(text)



def _admin_refusal(ingress: AdminIngress, request: Request) -> ServiceError | None:
    """The 401 for a request without the admin token (logged without the header), or None."""
    header = request.headers.get("authorization")
    if ingress.check_admin(header):
        return None
    client = request.client.host if request.client else "?"
    logger.warning("rejected admin request %s %r from %s (%s token)", request.method, request.url.path, client, "wrong" if header else "no")
    return ServiceError(401, "invalid admin token" if header else "missing admin token: send 'Authorization: Bearer <token>'")


_SCENARIOS_PREFIX = "/admin/scenarios/"


def _admin_not_found(ingress: AdminIngress, request: Request, status: int = 404) -> JSONResponse | None:
    """Answer a routing 404 or 405 under ``/admin``: 401 without the token (as on every admin route, so the
    admin routes cannot be probed without it); then, for a 404 under ``/admin/scenarios/``, a name no route
    could hold (one with a '/': ``../x``, ``a%2Fb``) is a 422 naming the naming rule, like any other bad name."""
    path = route_path(request.scope)
    if not (path == "/admin" or path.startswith("/admin/")):
        return None
    refused = _admin_refusal(ingress, request)
    if refused is not None:
        return _error_response(refused, headers={"WWW-Authenticate": "Bearer"})
    if status != 404 or not path.startswith(_SCENARIOS_PREFIX):
        return None
    name = path[len(_SCENARIOS_PREFIX):]
    head, _, tail = name.partition("/")
    try:
        validate_name(head if tail in ("versions", "rollback") else name)
    except ServiceError as error:
        return _error_response(error)
    return None


def checked_key(key: str) -> str:
    """An ``Idempotency-Key`` header as given (1 to 200 printable ASCII characters without spaces); a 400 naming the
    header otherwise. A header sent empty is such a 400, not a write without a key: the client asked for a retry-safe
    write and would get one that is not."""
    try:
        return validate_idempotency_key(key)
    except InvalidRequest as error:
        raise ServiceError(400, error.message,
                           {"field": "Idempotency-Key", "type": "invalid_request_error",
                            "param": "Idempotency-Key"}) from None


def mount_admin(app: FastAPI, ingress: AdminIngress) -> Any:
    """Include the admin router (every route behind the admin token) in ``app``; returns the token check, a
    dependency for other admin routes (the console's inspect)."""

    bearer = HTTPBearer(auto_error=False, description="The admin token (ADMIN_TOKEN, or the generated token file).")

    async def require_admin(request: Request, _: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        refused = _admin_refusal(ingress, request)
        if refused is not None:
            raise StarletteHTTPException(401, refused.message, headers={"WWW-Authenticate": "Bearer"})

    admin = APIRouter(prefix="/admin", tags=["admin"], route_class=ParsedJSONRoute, dependencies=[Depends(require_admin)], responses={401: {"model": ErrorBody}, **_ERROR_RESPONSES})

    def idempotent(args: tuple, key: str | None) -> tuple:
        return args if key is None else (*args, checked_key(key))

    def write_answer(result: Any) -> Any:
        """A retried write's first answer (the body is the first answer's), marked ``Idempotent-Replayed: true``."""
        if isinstance(result, dict) and result.pop("replayed", False):
            return JSONResponse(result, headers={"Idempotent-Replayed": "true"})
        return result

    @admin.put("/scenarios/{name}", response_model=ScenarioVersionOut, openapi_extra=_scenario_openapi_extra())
    async def put_scenario(request: Request, name: ScenarioName, idempotency_key: IdempotencyKey = None):
        """Create or replace a scenario; returns once every live replica serves the new version. A JSON body is a
        scenario; a ``Content-Type: application/x-ndjson`` body is a catalog (a tree given as its items: a header
        line, then one JSON array of token ids per line; see the README), an ``application/vnd.apache.parquet``
        body the same catalog as a Parquet file (an ``ids`` column, metadata columns, the header in the file's
        metadata under ``catalog``). The body goes to the config manager as
        bytes, which parses and validates it once; a catalog (up to ``max_upload_bytes``) is streamed to it in
        parts of 16 MiB as it arrives (never whole in one process's memory)."""
        content_type = request.headers.get("content-type") or ""
        if is_catalog_upload(content_type):
            key = checked_key(idempotency_key) if idempotency_key is not None else None
            result = await upload_catalog(ingress, request, name, key, upload_format_of(content_type))
        else:
            raw = await request.body()
            result = await ingress.call(ingress.manager.put, *idempotent((name, raw), idempotency_key))
        return write_answer(result)

    @admin.patch("/scenarios/{name}", response_model=ScenarioPatchOut, openapi_extra=_patch_openapi_extra())
    async def patch_scenario(request: Request, name: ScenarioName, idempotency_key: IdempotencyKey = None,
                             if_match: IfMatch = None):
        """Add and remove tree items (token ids after the root, without the end token) or labels: ``{"add": [...],
        "remove": [...]}``, as a new version (history, rollback, acks, Idempotency-Key as for a PUT). No-ops (adds
        already there, removes not there) are applied as nothing and listed in the answer; a PATCH that changes
        nothing makes no version. ``If-Match: "<version>"`` or ``base_version``: a 409 unless that version is
        current, nothing stored."""
        raw = await request.body()
        base = _if_match_version(if_match)
        key = checked_key(idempotency_key) if idempotency_key is not None else None
        result = await ingress.call(ingress.manager.patch, name, raw, key, base)
        return write_answer(result)

    @admin.get("/scenarios/{name}", response_model=ScenarioOut)
    async def get_scenario(name: ScenarioName, version: int | None = Query(default=None, ge=1, description="A stored version (default: current).")):
        """A stored version (the current one by default); its ``ETag`` is ``"<version>"`` (for a PATCH's If-Match).
        410 for a version whose body the bounded history dropped (setting history_bodies)."""
        record = await ingress.call(ingress.manager.get, name, version)
        if isinstance(record, dict) and isinstance(record.get("version"), int):
            return JSONResponse(jsonable_encoder(record), headers={"ETag": f'"{record["version"]}"'})
        return record

    @admin.delete("/scenarios/{name}", response_model=DeletedOut)
    async def delete_scenario(name: ScenarioName, idempotency_key: IdempotencyKey = None):
        result = await ingress.call(ingress.manager.delete, *idempotent((name,), idempotency_key))
        return write_answer({"name": name, "deleted": True, **(result if isinstance(result, dict) else {})})

    @admin.get("/scenarios/{name}/versions", response_model=ScenarioVersionsOut)
    async def scenario_versions(name: ScenarioName):
        return {"name": name, "versions": await ingress.call(ingress.manager.versions, name)}

    @admin.post("/scenarios/{name}/rollback", response_model=ScenarioVersionOut)
    async def rollback_scenario(body: RollbackBody, name: ScenarioName, idempotency_key: IdempotencyKey = None):
        return write_answer(await ingress.call(ingress.manager.rollback, *idempotent((name, body.version), idempotency_key)))

    app.include_router(admin)
    return require_admin
