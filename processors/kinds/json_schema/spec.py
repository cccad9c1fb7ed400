"""The ``json_schema`` and ``json`` kinds' specs: a JSON Schema (field ``schema``), or any JSON value.

Torch-free (pydantic only): ``processors/scenarios.py`` finds it to build the ``Scenario`` union, and the ingress
validates bodies with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import ConfigDict, Field, model_validator

from config.echo import shown_message, shown_path
from config.scenario_base import ScenarioBase

if TYPE_CHECKING:
    from config.settings import Limits

__all__ = ['JsonSchemaScenario', 'JsonScenario']


class JsonSchemaScenario(ScenarioBase):
    """Constrain output to JSON documents valid under a JSON Schema (field ``schema``)."""

    model_config = ConfigDict(populate_by_name=True, serialize_by_alias=True)

    type: Literal["json_schema"] = Field(description="Scenario kind.")
    json_schema: dict[str, Any] = Field(alias="schema", description="The JSON Schema the output must satisfy.")

    union_order: ClassVar[int] = 30
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
            where = shown_path(error.absolute_path, "/") or "<root>"
            raise ValueError(f"schema: invalid JSON Schema at {where}: {shown_message(error.message)}") from None
        except RecursionError:  # the checker recurses per level; servers bound the depth first (Limits)
            raise ValueError("schema: nested too deeply to check") from None
        return self


class JsonScenario(ScenarioBase):
    """Constrain output to any JSON value."""

    type: Literal["json"] = Field(description="Scenario kind.")

    union_order: ClassVar[int] = 31
