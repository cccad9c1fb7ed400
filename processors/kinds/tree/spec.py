"""The ``tree`` kind's spec: a token tree inline (``tree``, the tree file format) or a tree file (``path``).

Torch-free (pydantic only): ``processors/scenarios.py`` finds it to build the ``Scenario`` union, and the ingress
validates bodies with it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import Field, PrivateAttr, StrictInt, WithJsonSchema, model_validator

from processors.kinds.tree.treefile.load import DEFAULT_SEP, TreeData, fits_vocab, load_tree
from config.scenario_base import ConfigModel, ScenarioBase, ScenarioError

if TYPE_CHECKING:
    from config.settings import Limits

__all__ = ['TreeScenario', 'TreeSpec']


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

    filter: dict[str, Any] | None = Field(
        default=None,
        description="A catalog with item metadata: the default filter of its requests (the vector databases' filter "
                    "language, as a request's filter). A request's own filter narrows it (both must hold), never "
                    "widens it. Checked against the catalog's fields at the PUT.",
    )

    union_order: ClassVar[int] = 10
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

    def resolve_paths(self, directory: Path) -> TreeScenario:
        if self.path is None or Path(self.path).is_absolute():
            return self
        return self.model_copy(update={"path": os.path.normpath(directory / self.path)})

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
