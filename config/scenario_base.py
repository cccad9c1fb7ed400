"""The base of every scenario config model (:class:`ScenarioBase`, :class:`ThinkConfig`), the one error type of
the scenario pipeline (:class:`ScenarioError`) and the error of a refused request field (:class:`ConstraintError`).
Each kind's package holds its model (``processors/kinds/<kind>/spec.py``), ``processors/scenarios.py`` their union
and the parse functions."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import (
    BaseModel, ConfigDict, Field, model_validator,
)


if TYPE_CHECKING:
    from config.settings import Limits


class ConfigModel(BaseModel):
    """Base of every config model: unknown fields are errors."""

    model_config = ConfigDict(extra="forbid")


class ThinkConfig(ConfigModel):
    """Thinking budget: the answer starts inside a think block, free text until the budget or the end marker."""

    max_thinking_tokens: int = Field(ge=1, strict=True, description="Most tokens the model may spend inside the think block.")
    begin: str = Field(default="<think>\n", min_length=1, description="Marker that opens the think block.")
    end: str = Field(default="</think>\n\n", min_length=1, description="Marker that closes the think block.")

    @model_validator(mode="after")
    def _markers_differ(self) -> ThinkConfig:
        if self.begin == self.end:
            raise ValueError(f"think.begin and think.end must differ (both are {self.begin!r})")
        return self


class ScenarioBase(ConfigModel):
    """Fields every scenario kind may carry."""

    description: str | None = Field(default=None, description="Free text for people reading the scenario list.")
    think: ThinkConfig | None = Field(default=None, description="Optional thinking budget before the constraint.")
    system_prompt: str | None = Field(default=None, description="System message prepended to chat requests.")
    # strict: true is not 1 and "3" is not 3; floats must be finite (a default of Infinity broke every batch)
    max_new_tokens: int | None = Field(default=None, ge=1, strict=True, description="Default limit on generated tokens.")
    temperature: float | None = Field(default=None, ge=0, strict=True, allow_inf_nan=False,
                                      description="Default sampling temperature (0 = greedy).")
    top_p: float | None = Field(default=None, gt=0, le=1, strict=True, allow_inf_nan=False,
                                description="Default nucleus sampling mass, in (0, 1].")
    top_k: int | None = Field(default=None, ge=0, strict=True, description="Default top-k cutoff (0 = no cutoff).")
    strict: bool | None = Field(  # None (left out when stored) reads as false
        default=None, strict=True,
        description="Refuse the scenario instead of serving an approximation of it: a JSON schema with keywords "
                    "the grammar cannot enforce (they are otherwise checked after generation, and the output "
                    "regenerated) is refused, naming them.",
    )

    #: the field holding the constraint itself (``labels``, ``schema``, ...), for naming it in messages; None: none
    constraint_field: ClassVar[str | None] = None
    #: this model's place in the ``Scenario`` union (``processors/scenarios.py``): the order of the published
    #: schema's ``oneOf`` and of ``SCENARIO_TYPES`` (models of equal order keep their packages' name order)
    union_order: ClassVar[int] = 1000
    #: the key of vLLM's ``structured_outputs`` (and of its older ``guided_<key>`` field) that asks for this kind
    #: with the value of ``constraint_field`` (``choice`` -> labels, ``regex`` -> pattern); None: none does. JSON
    #: (``json``: a schema as an object or text) is read by the OpenAI routes themselves.
    structured_output: ClassVar[str | None] = None

    @classmethod
    def check_limits(cls, body: Mapping[str, Any], limits: Limits) -> Any:
        """The cheap limit checks of this kind on a raw body (before validation; wrongly typed fields are left to
        validation). Raises ``config.settings.LimitExceeded`` naming the field. Called by
        ``processors.scenarios.check_limits``. Returns what it built on the way that the validation of the same
        body may reuse (its validators read it as ``info.context["prepared"]``), or None (the default)."""
        return None

    @classmethod
    def check_one_off(cls, body: Mapping[str, Any]) -> None:
        """Refuse (:class:`ScenarioError`) what a one-off constraint, compiled on a model replica for one
        request, may not use (a server file). Default: anything a stored scenario may use."""

    @classmethod
    def check_one_off_limits(cls, body: Mapping[str, Any], limits: Limits) -> None:
        """The limits a one-off constraint has beyond :meth:`check_limits` (smaller ones: it is compiled on a model
        replica for one request). Raises ``config.settings.LimitExceeded`` naming the field. Default: none."""

    def resolve_paths(self, directory: Path) -> ScenarioBase:
        """This scenario with the relative file paths it holds resolved against ``directory`` (that of the
        scenario file it was read from). Default: it holds none, itself."""
        return self


def read_scenario_file(path: Path) -> dict[str, Any]:
    """The mapping a JSON or YAML (``.yaml``, ``.yml``) scenario file holds.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: the file cannot be read or parsed, or does not hold a mapping.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"scenario file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"cannot read scenario file {path}: {error}") from None
    if not text.strip():
        raise ValueError(f"scenario file {path} is empty")
    if path.suffix.lower() in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as error:
            raise ValueError(f"scenario file {path} is not valid YAML: {error}") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"scenario file {path} is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"scenario file {path} must hold a mapping at the top level, got {type(data).__name__}")
    return data


def scenario_to_dict(scenario: ScenarioBase) -> dict[str, Any]:
    """A JSON-ready dict of the scenario (aliases such as ``schema``, no ``None`` fields), for storage."""
    return scenario.model_dump(mode="json", by_alias=True, exclude_none=True)


class ScenarioError(ValueError):
    """A scenario body that cannot be served, with the one message that names the failure.

    Raised by every stage of the scenario pipeline (``processors.scenarios.parse_scenario``, the compile stage in
    ``processors.pipeline``). The HTTP edge picks the status from :attr:`kind` (``deployments.scenario_errors``);
    :meth:`describe` gives the text every caller shows.

    Attributes:
        kind: ``"invalid"`` (breaks a rule of its config model), ``"limit"`` (past a ``Limits`` field),
            ``"compile"`` (does not compile for the tokenizer, or past ``compile_memory_mb``) or ``"timeout"``
            (past ``compile_timeout_s``).
        message: the failure (``labels: 5 labels exceeds the limit max_labels=4``, ``does not compile for the
            served tokenizer: ...``).
        field: the offending field, when one is known.
        reason: the message without the field (limits).
        detail: structured detail for an error body (``field``, ``limit_name``, ``limit``, ``errors``).
        locs: for ``invalid``, the location of each validation error inside the body (the ``type`` tag left out).
    """

    KINDS = ("invalid", "limit", "compile", "timeout")
    #: kind -> the HTTP status of its answer: 422 for a body that is invalid or past a limit, 400 for one that
    #: does not compile (also past the compile limits); the edge (``deployments/scenario_errors.py``) answers it
    STATUS = {"invalid": 422, "limit": 422, "compile": 400, "timeout": 400}

    def __init__(self, kind: str, message: str, *, field: str | None = None, reason: str | None = None,
                 detail: dict[str, Any] | None = None, locs: list[tuple] | None = None):
        if kind not in self.KINDS:
            raise ValueError(f"kind must be one of {self.KINDS}, got {kind!r}")
        super().__init__(message)
        self.kind, self.message, self.field = kind, message, field
        self.reason = reason if reason is not None else message
        self.detail = dict(detail or {})
        if field is not None:
            self.detail.setdefault("field", field)
        self.locs = list(locs or [])

    def __reduce__(self):  # keep the fields when pickled across Ray processes
        return (_rebuild_error, (self.kind, self.message, self.field, self.reason, self.detail, self.locs))

    def describe(self, noun: str = "scenario", name: str | None = None) -> str:
        """The text to show: ``invalid scenario: <message>`` for a body that is invalid or past a limit,
        ``scenario 'x' <message>`` (or ``constraint <message>``, ``noun="constraint"``) for one that does not
        compile."""
        if self.kind in ("invalid", "limit"):
            return f"invalid {noun}: {self.message}"
        return f"{noun} {name!r} {self.message}" if name is not None else f"{noun} {self.message}"


def _rebuild_error(kind, message, field, reason, detail, locs) -> ScenarioError:
    return ScenarioError(kind, message, field=field, reason=reason, detail=detail, locs=locs)


class ConstraintError(ValueError):
    """A request field the service refuses, named as the client sent it (``tools[0].function.parameters: ...``),
    with the status and detail of the answer: raised by the domain's checks of a request's constraint fields (a
    tool set's plan, ``processors/kinds/tools/plan.py``); the HTTP edge answers it as it is
    (``deployments.scenario_errors.constraint_service_error``).

    Attributes:
        status: 400 (a request that contradicts itself: a ``tool_choice`` naming no tool) or 422 (a value past a
            rule or a limit), as :attr:`LimitExceeded.status <config.limit_checks.LimitExceeded>` gives one.
        message: the whole message, starting with the field.
        detail: structured detail for the error body (``field``, ``limit_name``, ``limit``, ...).
    """

    def __init__(self, status: int, message: str, detail: dict[str, Any] | None = None):
        super().__init__(message)
        self.status, self.message, self.detail = status, message, detail

    def __reduce__(self):  # keep the fields when pickled across Ray processes
        return (type(self), (self.status, self.message, self.detail))
