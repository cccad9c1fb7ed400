"""The config model of each scenario kind (tree, labels, json_schema, json, regex, grammar, tools): what a stored
scenario of that kind may say, its cheap limit checks and its one-off rules. ``config/scenarios.py`` joins them in
the :data:`~config.scenarios.Scenario` union."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import (
    ConfigDict, Field, PrivateAttr, StrictInt, ValidationError, WithJsonSchema,
    field_validator, model_validator,
)

from config.tree_file import DEFAULT_SEP, TreeData, fits_vocab, load_tree

if TYPE_CHECKING:
    from config.settings import Limits


from config.scenario_base import ConfigModel, ScenarioBase, ScenarioError

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
