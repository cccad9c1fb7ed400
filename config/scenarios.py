"""Scenario models: what a stored scenario may say, validated with pydantic.

A scenario is discriminated by ``type``:

=============== =================================================================================
``tree``        a token tree, inline as ``tree`` (the tree file format) or as a ``path`` to a tree file
``labels``      a label set (single or multi label)
``json_schema`` a JSON Schema in ``schema``
``json``        any JSON value
``regex``       a regular expression in ``pattern``
``grammar``     a context-free grammar in ``grammar`` (Lark syntax, as llguidance reads it)
``tools``       a stored tool set: OpenAI function ``tools`` and the default ``tool_choice`` (a call's JSON schema)
=============== =================================================================================

Every kind may also carry ``think`` (a thinking budget), a ``system_prompt``, a ``description`` and generation
defaults (``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``).

The union :data:`Scenario` is the one map from a ``type`` name to its config model (:func:`scenario_model`); each
model carries what is specific to its kind on the config side: the cheap limit checks of a raw body
(:meth:`ScenarioBase.check_limits`), whether a one-off (unstored) body may use it as given
(:meth:`ScenarioBase.check_one_off`) and the field that holds the constraint (``constraint_field``). The compile
side of each kind is in ``processors/kinds/``.

:func:`parse_scenario` is the first stage of the scenario pipeline (shape -> limits -> validation), pure Python so
that the ingress can run it too; every failure is one :class:`ScenarioError`. ``processors.pipeline`` adds the
compile stage.

Example::

    >>> s = load_scenario({"type": "labels", "labels": ["positive", "negative"]})
    >>> type(s).__name__, s.multi_label
    ('LabelsScenario', False)
    >>> scenario_to_dict(s)
    {'type': 'labels', 'labels': ['positive', 'negative'], 'multi_label': False, 'separator': ','}
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, Union, get_args

from pydantic import (
    BaseModel, ConfigDict, Field, PrivateAttr, StrictInt, TypeAdapter, ValidationError, WithJsonSchema,
    field_validator, model_validator,
)

from config.tree_file import DEFAULT_SEP, TreeData, fits_vocab, load_tree

if TYPE_CHECKING:
    from config.settings import Limits

__all__ = [
    "GrammarScenario",
    "JsonScenario",
    "JsonSchemaScenario",
    "LabelsScenario",
    "RegexScenario",
    "SCENARIO_TYPES",
    "Scenario",
    "ScenarioAdapter",
    "ScenarioBase",
    "ScenarioError",
    "ThinkConfig",
    "ToolsScenario",
    "TreeScenario",
    "TreeSpec",
    "check_scenario_body",
    "load_scenario",
    "parse_scenario",
    "scenario_model",
    "scenario_to_dict",
    "validate_scenario_body",
]


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

    @classmethod
    def check_limits(cls, body: Mapping[str, Any], limits: Limits) -> None:
        """The cheap limit checks of this kind on a raw body (before validation; wrongly typed fields are left to
        validation). Raises ``config.settings.LimitExceeded`` naming the field. Called by
        :meth:`config.Limits.check_scenario`."""

    @classmethod
    def check_one_off(cls, body: Mapping[str, Any]) -> None:
        """Refuse (:class:`ScenarioError`) what a one-off constraint, compiled on a model replica for one
        request, may not use (a server file). Default: anything a stored scenario may use."""

    @classmethod
    def check_one_off_limits(cls, body: Mapping[str, Any], limits: Limits) -> None:
        """The limits a one-off constraint has beyond :meth:`check_limits` (smaller ones: it is compiled on a model
        replica for one request). Raises ``config.settings.LimitExceeded`` naming the field. Default: none."""

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> ScenarioBase:
        """Load a scenario of this kind from a JSON or YAML file (see :func:`load_scenario`)."""
        scenario = load_scenario(path)
        if not isinstance(scenario, cls):
            raise ValueError(f"{os.fspath(path)}: expected a {cls.__name__}, got type {scenario.type!r}")
        return scenario


_PREFIX_DICT_SCHEMA = {
    "type": "object",
    "additionalProperties": {"type": "array", "items": {"type": "integer", "minimum": 0}},
}


class _LoadCache:
    """The tree a TreeSpec's validation loaded, kept for its compile; a cache, not part of the spec's value (every
    instance compares equal)."""

    __slots__ = ("tree",)

    def __init__(self) -> None:
        self.tree: TreeData | None = None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _LoadCache)

    __hash__ = object.__hash__


class TreeSpec(ConfigModel):
    """An inline token tree, in the tree file format (checked by the same rules as tree files)."""

    start_token_id: StrictInt = Field(ge=0, description="Root token id; the first state is str(start_token_id).")
    end_token_id: StrictInt = Field(ge=0, description="Token id that ends the sequence.")
    sep: str = Field(default=DEFAULT_SEP, description="Separator between ids in keys; no digits (nor '-' with strict).")
    # The values are typed loosely on purpose: the shared tree checker reports bad entries with the same
    # messages as for files, capped at MAX_REPORTED_PROBLEMS, instead of one pydantic error per bad id.
    prefix_dict: Annotated[dict[str, Any], WithJsonSchema(_PREFIX_DICT_SCHEMA)] = Field(
        description="State key -> allowed next token ids; a missing or empty entry allows only the end token."
    )

    ignored_fields: dict[str, Any] = Field(
        default_factory=dict, exclude=True,
        description="Unknown top-level fields of the tree, set aside when it was read: the tree loader ignores them "
                    "with a warning, as RTP-LLM's does, and refuses them under strict: true. Not stored.",
    )
    _loaded: _LoadCache = PrivateAttr(default_factory=lambda: _LoadCache())

    @model_validator(mode="before")
    @classmethod
    def _set_aside_unknown_fields(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and any(name not in cls.model_fields for name in data):
            known = {k: v for k, v in data.items() if k in cls.model_fields and k != "ignored_fields"}
            return {**known, "ignored_fields": {k: v for k, v in data.items() if k not in cls.model_fields}}
        return data

    @model_validator(mode="after")
    def _check_tree(self) -> TreeSpec:
        self._loaded.tree = load_tree(self)  # raises TreeFileError (a ValueError) naming every bad key
        return self

    def loaded(self, vocab_size: int, strict: bool = False) -> TreeData:
        """The tree loaded for ``vocab_size``: the one validation loaded when every id fits and it was loaded with
        the same ``strict`` (a large inline tree is then read once, not twice), else a new load (which names any
        id past the vocabulary)."""
        tree = self._loaded.tree
        if tree is not None and tree.strict == strict and fits_vocab(tree, vocab_size):
            return tree
        return load_tree(self, vocab_size=vocab_size, strict=strict)


class TreeScenario(ScenarioBase):
    """Constrain output to the paths of a token tree."""

    type: Literal["tree"] = Field(description="Scenario kind.")
    tree: TreeSpec | None = Field(default=None, description="The tree inline (exclusive with path).")
    path: str | None = Field(
        default=None, description="Path to a tree file (exclusive with tree); relative to the scenario file."
    )
    append_start_token: bool = Field(
        default=True, strict=True, description="Append start_token_id to the prompt when it does not already end with it."
    )
    max_items: int = Field(
        default=1, ge=1, le=1024, strict=True,
        description="Most items per output: after an item's end a row may emit separator_token_id and start again at "
                    "the root (no item twice in one output).",
    )
    separator_token_id: int | None = Field(
        default=None, ge=0, strict=True,
        description="Token between the items of a multi-item output; null with max_items > 1: items back to back "
                    "(the fixed-width form: every item must end where nothing but the end token follows).",
    )

    constraint_field: ClassVar[str | None] = "tree"

    @classmethod
    def check_limits(cls, body: Mapping[str, Any], limits: Limits) -> None:
        # A tree given as a path is counted once loaded (processors.kinds.tree checks the compiled tables).
        tree = body.get("tree")
        if isinstance(tree, Mapping) and isinstance(tree.get("prefix_dict"), Mapping):
            limits.check_tree_keys(len(tree["prefix_dict"]), "tree.prefix_dict")

    @classmethod
    def check_one_off(cls, body: Mapping[str, Any]) -> None:
        if body.get("path") is not None:
            raise ScenarioError("invalid", "a one-off tree must be given inline ('tree'), not as a server file "
                                           "('path'); store a scenario to use a tree file", field="path")

    @model_validator(mode="after")
    def _strict_tree(self) -> TreeScenario:
        if self.strict and self.tree is not None:  # what a lenient load accepts with a warning is refused
            load_tree(self.tree, strict=True)
        return self

    @model_validator(mode="after")
    def _tree_or_path(self) -> TreeScenario:
        if (self.tree is None) == (self.path is None):
            raise ValueError("a tree scenario needs exactly one of 'tree' (inline) or 'path' (a tree file)")
        if self.path is not None and not self.path.strip():
            raise ValueError("path: must not be empty")
        return self


class LabelsScenario(ScenarioBase):
    """Constrain output to one label, or to several joined by a separator."""

    type: Literal["labels"] = Field(description="Scenario kind.")
    labels: list[str] = Field(min_length=1, description="The allowed labels: unique, non-empty, not padded.")
    multi_label: bool = Field(default=False, strict=True, description="Allow several labels joined by separator.")
    separator: str = Field(default=",", min_length=1, description="Joins labels when multi_label is true.")
    max_labels: int | None = Field(default=None, ge=1, strict=True, description="Most labels per answer (multi_label only).")

    constraint_field: ClassVar[str | None] = "labels"

    @classmethod
    def check_limits(cls, body: Mapping[str, Any], limits: Limits) -> None:
        labels = body.get("labels")
        if isinstance(labels, list):
            limits.check_labels(len(labels), "labels")

    @classmethod
    def check_one_off_limits(cls, body: Mapping[str, Any], limits: Limits) -> None:
        labels = body.get("labels")
        if isinstance(labels, list):
            limits.check_inline_labels(labels, "labels")

    @model_validator(mode="after")
    def _check_labels(self) -> LabelsScenario:
        seen: set[str] = set()
        for i, label in enumerate(self.labels):
            if not label:
                raise ValueError(f"labels[{i}]: a label must not be empty")
            if label != label.strip():
                raise ValueError(f"labels[{i}]: label {label!r} has leading or trailing whitespace")
            if label in seen:
                raise ValueError(f"labels[{i}]: duplicate label {label!r}")
            if self.multi_label and self.separator in label:
                raise ValueError(
                    f"labels[{i}]: label {label!r} contains the separator {self.separator!r}, "
                    "so a multi-label answer could not be split unambiguously"
                )
            seen.add(label)
        if self.max_labels is not None and not self.multi_label:
            raise ValueError("max_labels is only meaningful with multi_label: true")
        return self


class JsonSchemaScenario(ScenarioBase):
    """Constrain output to JSON documents valid under a JSON Schema (field ``schema``)."""

    model_config = ConfigDict(populate_by_name=True, serialize_by_alias=True)

    type: Literal["json_schema"] = Field(description="Scenario kind.")
    json_schema: dict[str, Any] = Field(alias="schema", description="The JSON Schema the output must satisfy.")

    constraint_field: ClassVar[str | None] = "schema"

    @classmethod
    def check_limits(cls, body: Mapping[str, Any], limits: Limits) -> None:
        if "schema" in body:
            limits.check_schema(body["schema"], "schema")

    @model_validator(mode="after")
    def _check_schema(self) -> JsonSchemaScenario:
        from jsonschema.exceptions import SchemaError
        from jsonschema.validators import validator_for

        try:
            validator_for(self.json_schema).check_schema(self.json_schema)
        except SchemaError as error:
            where = "/".join(str(p) for p in error.absolute_path) or "<root>"
            raise ValueError(f"schema: invalid JSON Schema at {where}: {error.message}") from None
        except RecursionError:  # the checker recurses per level; servers bound the depth first (Limits)
            raise ValueError("schema: nested too deeply to check") from None
        return self


class JsonScenario(ScenarioBase):
    """Constrain output to any JSON value."""

    type: Literal["json"] = Field(description="Scenario kind.")


class RegexScenario(ScenarioBase):
    """Constrain output to full matches of a regular expression."""

    type: Literal["regex"] = Field(description="Scenario kind.")
    pattern: str = Field(min_length=1, description="The regular expression the whole output must match.")

    constraint_field: ClassVar[str | None] = "pattern"

    @classmethod
    def check_limits(cls, body: Mapping[str, Any], limits: Limits) -> None:
        pattern = body.get("pattern")
        if isinstance(pattern, str):
            limits.check_regex(pattern, "pattern")


class GrammarScenario(ScenarioBase):
    """Constrain output to the sentences of a context-free grammar (field ``grammar``).

    The grammar is Lark text as llguidance reads it (``start: "yes" | "no" | NUMBER`` with ``NUMBER: /[0-9]+/``;
    its ``start`` rule is the whole output; ``/regex/`` terminals in Rust syntax; ``%ignore``, ``%import common``
    and llguidance's extensions as documented there). It is checked and built by the grammar library when the
    scenario compiles (a syntax error is a ``compile`` error naming ``grammar``); here only its size and its
    regexes are bounded (``limits.max_grammar_bytes``, ``max_regex_length``, ``max_regex_repeat``).
    """

    type: Literal["grammar"] = Field(description="Scenario kind.")
    grammar: str = Field(min_length=1, description="The Lark grammar the whole output must be a sentence of.")

    constraint_field: ClassVar[str | None] = "grammar"

    @classmethod
    def check_limits(cls, body: Mapping[str, Any], limits: Limits) -> None:
        grammar = body.get("grammar")
        if isinstance(grammar, str):
            limits.check_grammar(grammar, "grammar")

    @field_validator("grammar")
    @classmethod
    def _not_blank(cls, grammar: str) -> str:
        if not grammar.strip():
            raise ValueError("must not be blank (a Lark grammar with a start rule)")
        if "\x00" in grammar:
            raise ValueError("must not contain NUL characters")
        return grammar


class ToolsScenario(ScenarioBase):
    """A stored tool set: OpenAI function ``tools`` and how they are called (``tool_choice``,
    ``parallel_tool_calls``), served by name on the chat and Responses routes as tool calls.

    Validated like the request-level tools (``deployments.tool_calls.tool_setup``: distinct names, a named
    ``tool_choice`` one of the tools, each ``parameters`` a valid JSON schema of an object within the JSON-schema
    limits) and compiled into the same constraint that function builds for a request. ``tool_choice`` is
    ``auto`` (the default: a call or a text answer), ``required`` or a named function; ``"none"`` is refused (a
    scenario that never calls is a plain one).
    """

    type: Literal["tools"] = Field(description="Scenario kind.")
    tools: list[dict[str, Any]] = Field(
        min_length=1, description="OpenAI function tools: {type: function, function: {name, description, parameters}}.")
    tool_choice: Literal["auto", "required"] | dict[str, Any] = Field(
        default="auto", description="auto, required, or {type: function, function: {name}} (exactly one call of it).")
    parallel_tool_calls: bool | None = Field(
        default=None, strict=True, description="false: at most one call per answer (default: several may come).")

    constraint_field: ClassVar[str | None] = "tools"

    @classmethod
    def check_limits(cls, body: Mapping[str, Any], limits: Limits) -> None:
        tools = body.get("tools")
        if not isinstance(tools, list):
            return
        for i, tool in enumerate(tools):
            function = tool.get("function") if isinstance(tool, Mapping) else None
            params = function.get("parameters") if isinstance(function, Mapping) else None
            if isinstance(params, Mapping):
                limits.check_schema(params, f"tools[{i}].function.parameters")
        try:  # the call schema they make together (several tools within the limits each may not be)
            plan, _ = cls._setup(body)
        except Exception:  # noqa: BLE001 - what is wrong with the body is named by validation
            return
        if plan is not None:
            limits.check_schema(plan.scenario["schema"], "tools")

    @staticmethod
    def _setup(body: Mapping[str, Any]):
        from deployments.tool_calls import tool_setup

        return tool_setup(body.get("tools"), body.get("tool_choice", "auto"), body.get("parallel_tool_calls"))

    def plan(self):
        """``(ToolPlan, prompt_tools)`` of this tool set (``deployments.tool_calls.tool_setup``)."""
        return self._setup(self.model_dump())

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _choice(cls, choice: Any) -> Any:
        if choice == "none":
            raise ValueError("'none' is not a stored default (a scenario that never calls a tool is a plain "
                             "scenario); give auto, required or a named function")
        if isinstance(choice, str) and choice not in ("auto", "required"):
            raise ValueError(f"{choice!r} is not one of 'auto', 'required' or a named function "
                             "{type: function, function: {name}}")
        return choice

    @model_validator(mode="after")
    def _check_tools(self) -> ToolsScenario:
        from deployments.protocol import ServiceError
        from deployments.tool_calls import NamedToolChoice, Tool

        def first(exc: ValidationError) -> str:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err.get("loc", ()))
            return f"{where}: {err.get('msg')}" if where else str(err.get("msg"))

        for i, tool in enumerate(self.tools):
            try:
                Tool.model_validate(tool)
            except ValidationError as exc:
                raise ValueError(f"tools[{i}].{first(exc)}") from None
        if isinstance(self.tool_choice, dict):
            try:
                NamedToolChoice.model_validate(self.tool_choice)
            except ValidationError as exc:
                raise ValueError(f"tool_choice.{first(exc)}") from None
        try:
            self.plan()
        except ServiceError as exc:
            raise ValueError(exc.message) from None
        return self


Scenario = Annotated[
    Union[TreeScenario, LabelsScenario, JsonSchemaScenario, JsonScenario, RegexScenario, GrammarScenario,
          ToolsScenario],
    Field(discriminator="type"),
]
ScenarioAdapter: TypeAdapter[Scenario] = TypeAdapter(Scenario, config=ConfigDict(title="Scenario"))
#: ``type`` name -> config model, from the union (the only place the names are written down)
_MODELS: dict[str, type[ScenarioBase]] = {
    get_args(model.model_fields["type"].annotation)[0]: model for model in get_args(get_args(Scenario)[0])
}
#: the values of ``type``, in the order of the union
SCENARIO_TYPES: tuple[str, ...] = tuple(_MODELS)


def scenario_model(type_name: Any) -> type[ScenarioBase] | None:
    """The config model of the scenario kind ``type_name`` (None for anything else)."""
    return _MODELS.get(type_name) if isinstance(type_name, str) else None


def _read_mapping(path: Path) -> dict[str, Any]:
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


def load_scenario(source: dict[str, Any] | str | os.PathLike[str]) -> Scenario:
    """Validate a scenario given as a dict, or read it from a JSON / YAML (``.yaml``, ``.yml``) file.

    A tree scenario read from a file with a relative ``path`` gets that path resolved against the scenario
    file's directory.

    Raises:
        pydantic.ValidationError: the body breaks a rule (the message names the field).
        FileNotFoundError: the file does not exist.
        ValueError: the file cannot be read or parsed, or does not hold a mapping.
    """
    if isinstance(source, dict):
        return ScenarioAdapter.validate_python(source)
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"load_scenario() expects a dict or a path, got {type(source).__name__}")
    path = Path(source)
    scenario = ScenarioAdapter.validate_python(_read_mapping(path))
    if isinstance(scenario, TreeScenario) and scenario.path is not None:
        tree_path = Path(scenario.path)
        if not tree_path.is_absolute():
            resolved = path.resolve().parent / tree_path
            scenario = scenario.model_copy(update={"path": os.path.normpath(resolved)})
    return scenario


def scenario_to_dict(scenario: ScenarioBase) -> dict[str, Any]:
    """A JSON-ready dict of the scenario (aliases such as ``schema``, no ``None`` fields), for storage."""
    return scenario.model_dump(mode="json", by_alias=True, exclude_none=True)


# --------------------------------------------------------------------------------------------- the pipeline's first stage


class ScenarioError(ValueError):
    """A scenario body that cannot be served, with the one message that names the failure.

    Raised by every stage of the scenario pipeline (:func:`parse_scenario` here, the compile stage in
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


def _join(parts: list[str]) -> str:
    """Up to five messages, then a count of the rest."""
    return "; ".join(parts[:5]) + (f"; and {len(parts) - 5} more" if len(parts) > 5 else "")


def _invalid(body: Mapping[str, Any], error: ValidationError) -> ScenarioError:
    """One :class:`ScenarioError` for pydantic's errors: each names its field inside the body."""
    errors: list[dict[str, Any]] = []
    locs: list[tuple] = []
    parts: list[str] = []
    for err in error.errors():
        loc = tuple(err.get("loc", ()))
        if loc and loc[0] == body.get("type"):  # the discriminated union puts the tag first
            loc = loc[1:]
        where = ".".join(str(p) for p in loc)
        if not where and str(err.get("type", "")).startswith("union_tag"):
            where = "type"
        msg = str(err.get("msg", "")).removeprefix("Value error, ")
        if err.get("type") == "union_tag_not_found":
            msg = (f"missing: a scenario body needs \"type\", one of {', '.join(SCENARIO_TYPES)} (a bare tree file "
                   "goes under \"tree\": {\"type\": \"tree\", \"tree\": {...}}; cs-admin put --tree does that)")
        errors.append({"field": where or None, "message": msg})
        locs.append(loc)
        parts.append(f"{where}: {msg}" if where else msg)
    return ScenarioError("invalid", _join(parts), detail={"errors": errors}, locs=locs)


def check_scenario_body(body: Any, limits: Limits | None = None, *, one_off: bool = False,
                        field: str = "body") -> None:
    """The cheap checks of a raw scenario body, before anything walks it recursively: a JSON object, the
    ``limits`` (:meth:`config.Limits.check_scenario`, then the nesting depth, named ``field``; with ``one_off`` the
    smaller bounds of a one-off constraint, :meth:`ScenarioBase.check_one_off_limits`), and with ``one_off`` what a
    one-off constraint may not use (:meth:`ScenarioBase.check_one_off`).

    Raises:
        ScenarioError: ``invalid`` or ``limit``.
    """
    from config.settings import LimitExceeded

    if not isinstance(body, Mapping):
        raise ScenarioError("invalid", f"a scenario body must be a JSON object, got {type(body).__name__}")
    if limits is not None:
        try:
            limits.check_scenario(body)  # first: it names the limit of the field (schema depth, ...)
            limits.check_json_depth(body, field)
            if one_off and (kind := scenario_model(body.get("type"))) is not None:
                kind.check_one_off_limits(body, limits)
        except LimitExceeded as exc:
            raise ScenarioError("limit", str(exc), field=exc.field, reason=exc.reason, detail=exc.detail()) from None
    if one_off:
        model = scenario_model(body.get("type"))
        if model is not None:
            model.check_one_off(body)


def parse_scenario(body: Any, limits: Limits | None = None, *, one_off: bool = False, field: str = "body",
                   from_json: bool = False) -> Scenario:
    """Stage one of the scenario pipeline: :func:`check_scenario_body`, then validation into its config model.
    ``from_json``: the body was just parsed from JSON text (the config manager's bodies, from HTTP or Redis), so the
    check that it serializes as JSON (a full ``json.dumps``, seconds for a large inline tree) is skipped.

    Raises:
        ScenarioError: ``invalid`` (the message names each bad field, ``errors`` in its detail) or ``limit``.
    """
    check_scenario_body(body, limits, one_off=one_off, field=field)
    if not from_json:
        try:
            json.dumps(body)
        except (TypeError, ValueError) as exc:
            raise ScenarioError("invalid", f"the scenario body is not JSON: {exc}") from None
    return validate_scenario_body(body)


def validate_scenario_body(body: Mapping[str, Any]) -> Scenario:
    """Validate a checked body (see :func:`parse_scenario`) into its config model; :class:`ScenarioError`
    (``invalid``) naming each bad field."""
    try:
        return ScenarioAdapter.validate_python(body if isinstance(body, dict) else dict(body))
    except ValidationError as exc:
        raise _invalid(body, exc) from None
