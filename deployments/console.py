"""The web console: a page under ``/console`` and the admin route it needs to show allowed token sets.

The page (``deployments/console-ui/``: one HTML file, one script, one stylesheet; no build step, nothing loaded
from outside the service) talks only to the service's own HTTP API:

* the scenario list (``GET /v1/scenarios``) and each scenario's history (``GET /admin/scenarios/{name}/versions``);
* a tree view: for a scenario and a prefix of token ids, the allowed next tokens with their text, clickable to
  walk deeper (``POST /admin/scenarios/{name}/inspect``, below);
* a playground: ``POST /v1/generate``, then ``inspect`` with the returned ``token_ids`` and ``version`` to show
  the allowed set at every step. The replay is exact: a row's allowed set is a function of its scenario version
  and the tokens it emitted so far, nothing else (not the prompt, not the sampler);
* rollback to a chosen version (``POST /admin/scenarios/{name}/rollback``).

The admin token is typed into the page, kept in the page script's memory only (not in ``sessionStorage``,
``localStorage`` or a cookie, which any page of this origin could read; a reload forgets it) and sent as
``Authorization: Bearer``; the server checks it on every ``/admin`` route as always (the page itself and its files
are public and hold no data). The page's link to ``/docs`` opens a new tab without an opener, and ``/docs`` is
served by this service under its own CSP (``deployments/docs.py``).

``inspect`` is an admin route because the allowed sets spell out the scenario (every path of a tree, every
label), which only admins may read (``GET /admin/scenarios/{name}``).

:func:`replay` is the work behind :meth:`deployments.manager.ConfigManager.inspect`: a fresh
:class:`processors.RowCursor` (the same chain the replicas run: think mode, constraint, finished guard) is
stepped through the given tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, Sequence

import numpy as np
from fastapi import APIRouter, Depends, FastAPI
from fastapi import Path as PathParam
from fastapi.responses import RedirectResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from deployments.protocol import ServiceError
from deployments.storage.store import NAME_PATTERN

__all__ = ["InspectBody", "InspectResponse", "STATIC_DIR", "build_console_router", "mount_console", "replay"]

STATIC_DIR = Path(__file__).with_name("console-ui")  # not an identifier: a data directory, never a package
#: the files the page is made of, and their media types; nothing else under /console is served
_FILES = {
    "index.html": "text/html; charset=utf-8",
    "console.js": "text/javascript; charset=utf-8",
    "console.css": "text/css; charset=utf-8",
}
# Everything the page needs comes from this origin; no inline script, no framing.
_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
#: most allowed (or banned) tokens listed per step
MAX_LIMIT = 1000

ScenarioName = Annotated[str, PathParam(pattern=NAME_PATTERN, description="Scenario name (the store's naming rule).")]


# --------------------------------------------------------------------------------------------- replay


def _ids_of(step, vocab_size: int) -> np.ndarray:
    """The allowed ids of an ``ALLOW`` or ``BITMASK`` step, as the mask applies them (the fallback when empty)."""
    from processors.masks import ALLOW, bitmask_to_ids

    if step.kind == ALLOW:
        ids = np.asarray(step.payload if step.payload is not None else (), dtype=np.int64)
    else:
        ids = bitmask_to_ids(step.payload, vocab_size)
    ids = ids[(ids >= 0) & (ids < vocab_size)]
    if ids.size == 0:
        ids = np.asarray([step.fallback], dtype=np.int64)
    return np.unique(ids)


def replay(
    compiled, tokenizer, token_ids: Sequence[int], *, limit: int = 100, last_only: bool = False
) -> dict[str, Any]:
    """Step a fresh row of ``compiled`` through ``token_ids`` and report what it allowed at each step.

    Returns ``{"vocab_size", "end_token_id", "steps", "error", "finished"}``. ``steps[i]`` describes the
    step before ``token_ids[i]`` (and one more step after the last token: what may come next)::

        {"index", "phase": "thinking" | "answer" | "finished",
         "any": bool,               # free text (thinking, or no constraint): every token but the banned ones
         "count": int,              # how many tokens are allowed
         "allowed": [{"id", "text"}], "truncated": bool,    # the first ``limit`` allowed ids, ascending
         "banned": [{"id", "text"}],                         # for an "any" step: the exceptions
         "token": {"id", "text"} | None, "token_allowed": bool | None}

    The replay stops at the first token the step did not allow (``error`` names it, and that step is the last
    one reported). ``last_only`` reports only the last step (the tree view's question: what comes next).
    Raises ``ServiceError(422)`` for an id outside the vocabulary. ``tokenizer``: a tokenizer or its
    ``processors.TokenizerInfo``.
    """
    from processors import RowCursor, TokenizerInfo
    from processors.masks import ALLOW, BAN, BITMASK

    info = TokenizerInfo.of(tokenizer)

    vocab = int(compiled.vocab_size)
    tokens = [int(t) for t in token_ids]
    for i, token in enumerate(tokens):
        if not 0 <= token < vocab:
            raise ServiceError(422, f"token_ids.{i}: id {token} is outside the vocabulary (0..{vocab - 1})",
                               {"field": f"token_ids.{i}"})
    texts: dict[int, str] = {}

    def entry(token: int) -> dict[str, Any]:
        text = texts.get(token)
        if text is None:
            text = texts[token] = info.token_text(token)
        return {"id": token, "text": text}

    from deployments.replica.answer import form_for_tokens

    compiled = form_for_tokens(compiled, tokens)  # a label answer after a chat prompt has no leading space
    cursor = RowCursor(compiled, info)
    steps: list[dict[str, Any]] = []
    error = None
    for index in range(len(tokens) + 1):
        token = tokens[index] if index < len(tokens) else None
        phase = "finished" if cursor.finished else "thinking" if cursor.thinking else "answer"
        step = cursor.step()
        banned: list[int] = []
        if step.kind in (ALLOW, BITMASK):
            ids = _ids_of(step, vocab)
            count, any_token = int(ids.size), False
            allowed = token is None or bool(np.isin(token, ids))
        else:
            if step.kind == BAN and step.payload is not None:
                banned = sorted({int(t) for t in step.payload if 0 <= int(t) < vocab})
            ids = np.empty(0, dtype=np.int64)
            count, any_token = vocab - len(banned), True
            allowed = token is None or token not in banned
        if token is not None and not allowed:
            why = "it is banned here" if any_token else f"it is not one of the {count} allowed token(s)"
            error = {"index": index, "token_id": token,
                     "message": f"token {token} ({entry(token)['text']!r}) is not allowed at step {index} ({phase}): {why}"}
        if not last_only or token is None or error is not None:
            shown = ids[:limit].tolist()
            steps.append({
                "index": index,
                "phase": phase,
                "any": any_token,
                "count": count,
                "allowed": [entry(t) for t in shown],
                "truncated": count > len(shown) and not any_token,
                "banned": [entry(t) for t in banned[:limit]],
                "token": None if token is None else entry(token),
                "token_allowed": None if token is None else allowed,
            })
        if token is None or error is not None:
            break
        cursor.advance(token)
        if cursor.error:  # an allowed token the constraint still refused (should not happen): say so
            error = {"index": index, "token_id": token, "message": f"step {index}: {cursor.error}"}
            break
    return {
        "vocab_size": vocab,
        "end_token_id": int(compiled.end_token_id),
        "steps": steps,
        "error": error,
        "finished": bool(cursor.finished),
    }


# --------------------------------------------------------------------------------------------- HTTP models


class InspectBody(BaseModel):
    """Body of ``POST /admin/scenarios/{name}/inspect``."""

    model_config = ConfigDict(extra="forbid")

    token_ids: list[Annotated[int, Field(ge=0, strict=True)]] = Field(
        default_factory=list,
        description="The prefix to replay: token ids a row of this scenario emitted (e.g. an output's token_ids). "
                    "At most limits.max_new_tokens ids, each inside the vocabulary.",
    )
    version: int | None = Field(default=None, ge=1, strict=True, description="A stored version (default: the one served now).")
    limit: int = Field(default=100, ge=1, le=MAX_LIMIT, strict=True, description="Most allowed token ids listed per step.")
    steps: Literal["all", "last"] = Field(
        default="all", description="all: one entry per token plus the next step; last: only what may come next."
    )


class TokenOut(BaseModel):
    id: int
    text: str = Field(description="The token decoded on its own (special tokens kept).")


class InspectStep(BaseModel):
    index: int = Field(description="Step number: the step before token_ids[index].")
    phase: Literal["thinking", "answer", "finished"]
    any: bool = Field(description="Free text: every token is allowed except those in 'banned'.")
    count: int = Field(description="How many tokens are allowed at this step.")
    allowed: list[TokenOut] = Field(description="The allowed tokens, ascending by id, at most 'limit' of them.")
    truncated: bool = Field(description="More tokens are allowed than listed.")
    banned: list[TokenOut] = Field(description="For an 'any' step: the tokens banned (e.g. EOS while thinking).")
    token: TokenOut | None = Field(description="The token given at this step (null for the last step).")
    token_allowed: bool | None = Field(description="Whether that token was allowed here.")


class InspectError(BaseModel):
    index: int
    token_id: int
    message: str


class InspectResponse(BaseModel):
    name: str
    version: int
    type: str = Field(description="The scenario type.")
    vocab_size: int
    end_token_id: int = Field(description="The token that ends a row of this scenario.")
    steps: list[InspectStep]
    error: InspectError | None = Field(description="The first token that was not allowed (the replay stops there).")
    finished: bool = Field(description="The row emitted its end token.")


# --------------------------------------------------------------------------------------------- routes


def _page_file(name: str) -> Response:
    media_type = _FILES.get(name)
    path = STATIC_DIR / name
    if media_type is None or not path.is_file():
        raise ServiceError(404, f"no console file {name!r}")
    return Response(path.read_bytes(), media_type=media_type, headers=_HEADERS)


def build_console_router(ingress: Any, require_admin: Any, error_body: type[BaseModel]) -> APIRouter:
    """The console's routes: the page and its files (public, not in the OpenAPI schema) and the admin inspect
    route (``require_admin``: the ingress's bearer-token dependency; ``error_body``: the ingress's error answer
    model, documented for the route's errors)."""
    router = APIRouter()

    @router.get("/console", include_in_schema=False)
    async def console_page():
        return _page_file("index.html")

    @router.get("/console/", include_in_schema=False)
    async def console_slash():
        return RedirectResponse("/console", status_code=308)

    @router.get("/console/{file}", include_in_schema=False)
    async def console_file(file: str):
        return _page_file(file)

    errors = {code: {"model": error_body} for code in (401, 404, 409, 422, 503)}

    @router.post("/admin/scenarios/{name}/inspect", response_model=InspectResponse, tags=["admin"],
                 dependencies=[Depends(require_admin)], responses=errors)
    async def inspect_scenario(body: InspectBody, name: ScenarioName):
        """The allowed next tokens of a scenario after a prefix of token ids, per step (for the web console).

        A fresh row of the scenario version replays ``token_ids``; each step lists the allowed tokens with their
        text (``limit`` of them, and the total count), or ``any`` for free text such as thinking. A token that
        was not allowed ends the replay with ``error``. Read-only.
        """
        limit = ingress.limits.max_new_tokens
        if len(body.token_ids) > limit:
            raise ServiceError(
                422, f"token_ids: {len(body.token_ids)} ids exceed the limit max_new_tokens={limit}",
                {"field": "token_ids", "limit_name": "max_new_tokens", "limit": limit},
            )
        return await ingress.call(ingress.manager.inspect, name, body.version, body.token_ids, body.limit,
                                  body.steps == "last")

    return router


def mount_console(app: FastAPI, ingress: Any, require_admin: Any, error_body: type[BaseModel]) -> None:
    """Add the console to the ingress's app (``build_http_app`` calls this with its error answer model)."""
    app.include_router(build_console_router(ingress, require_admin, error_body))
