"""The ingress's own request and response models, path/header parameters and documented error answers (OpenAPI)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import Header
from fastapi import Path as PathParam
from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.json_schema import SkipJsonSchema

from deployments.protocol import GenerateRequest
from deployments.storage.store import NAME_PATTERN

ScenarioName = Annotated[str, PathParam(pattern=NAME_PATTERN, description="Scenario name (the store's naming rule).")]
IfMatch = Annotated[str | None, Header(
    alias="If-Match",
    description="Optional, on PATCH: the version the change is based on, as GET's ETag (\"3\"): a 409 unless it is current.")]
IdempotencyKey = Annotated[str | None, Header(
    alias="Idempotency-Key",
    description="Optional, on admin writes: a key of the client's choosing (e.g. a UUID) per intended write. A retry with "
                "the same key and request gets the first answer (header Idempotent-Replayed: true) instead of a second "
                "write; the same key with another request is a 422. Remembered 24 h.")]


class GenerateBody(GenerateRequest):
    """Body of ``POST /v1/generate``: a :class:`GenerateRequest` without ``inline_scenario``.

    Give exactly one of ``prompt`` or ``messages``; ``scenario`` names a stored scenario (none = unconstrained).
    """

    model_config = ConfigDict(extra="forbid", title="GenerateBody")

    inline_scenario: SkipJsonSchema[None] = Field(
        default=None, exclude=True, description="Not accepted here (one-off constraints go through the OpenAI routes)."
    )

    def to_request(self) -> GenerateRequest:
        """This body as the :class:`GenerateRequest` the replicas take, without validating it again (it is valid)."""
        fields = {name: getattr(self, name) for name in GenerateRequest.model_fields}
        return GenerateRequest.model_construct(_fields_set=set(self.model_fields_set), **fields)

    @field_validator("messages")
    @classmethod
    def _some_messages(cls, value: Any) -> Any:
        if value is not None and not value:
            raise ValueError("give at least one message")
        return value

    @field_validator("inline_scenario", mode="before")
    @classmethod
    def _no_inline(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError(
                "not accepted by /v1/generate: store the scenario (PUT /admin/scenarios/{name}) and name it in "
                "'scenario', or use response_format / structured_outputs on /v1/chat/completions"
            )
        return value


class ScenarioSummary(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    type: str
    version: int


class ScenarioList(BaseModel):
    scenarios: list[ScenarioSummary] = Field(description="The scenarios being served, by name.")


class HealthResponse(BaseModel):
    """The health report; when ``status`` is ``unavailable`` (HTTP 503) it also has ``model``: why no model replica
    can generate."""

    model_config = ConfigDict(extra="allow")

    status: Literal["ok", "degraded", "unavailable"] = Field(
        description="degraded: the manager or its Redis reports a problem (generation works); unavailable (HTTP 503): "
                    "no model replica is alive or registered, generation requests are answered 503.")
    ingress: Literal["ok"] = "ok"
    manager: dict[str, Any] = Field(description="The config manager's own health report (or why it is unreachable).")
    replicas: dict[str, Any] = Field(description="Per model replica: the scenario versions it serves.")
    replicas_error: str | None = Field(default=None, description="Why the replica versions could not be read.")


class ScenarioVersionOut(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    version: int


class ScenarioPatchOut(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    version: int = Field(description="The new version (the current one when changed is false).")
    base_version: int | None = Field(default=None, description="The version the delta was applied to.")
    changed: bool | None = Field(default=None, description="False: every add was there and no remove was: no new version.")
    added: int | None = None
    removed: int | None = None
    already_present: list[Any] | None = Field(default=None, description="Adds that were there already (no-ops).")
    not_present: list[Any] | None = Field(default=None, description="Removes that were not there (no-ops).")
    updated: int | None = Field(default=None, exclude_if=lambda value: value is None,
                                description="Items whose metadata the PATCH's update replaced (only when it had an "
                                            "update).")


class ScenarioOut(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    version: int
    scenario: dict[str, Any] | None = Field(description="The stored scenario body (null for a delete entry).")
    created_at: float | str | None = Field(default=None, description="When this version was stored.")
    action: str | None = Field(default=None, description="What produced this version (put, rollback, ...).")


class ScenarioVersionsOut(BaseModel):
    name: str
    versions: list[dict[str, Any]]


class DeletedOut(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    deleted: bool = True


class RollbackBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int = Field(ge=1, strict=True, description="The stored version to make current again.")


class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="allow")

    status: int
    message: str


class ErrorBody(BaseModel):
    error: ErrorDetail


_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody, "description": what}
    for code, what in (
        (404, "Unknown scenario (``known`` lists the stored names)"),
        (413, "Body too large"),
        (422, "Invalid request; the message names the field"),
        (500, "Internal error"),
        (503, "Overloaded or a backend replica is unavailable"),
    )
}
_SSE_RESPONSE = {200: {"content": {"text/event-stream": {}}, "description": "JSON body, or SSE when stream is true"}}
