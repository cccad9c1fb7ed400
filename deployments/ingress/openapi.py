"""OpenAPI patches: the scenario and PATCH request bodies (read as bytes by their routes, so FastAPI cannot
describe them) and the scenario schema's ``$defs`` moved into ``components``."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from processors.scenarios import ScenarioAdapter
from processors.kinds.tree.catalog.catalog import CATALOG_CONTENT_TYPES
from processors.kinds.tree.catalog.parquet import PARQUET_CONTENT_TYPES


def _scenario_openapi_extra() -> dict[str, Any]:
    schema = ScenarioAdapter.json_schema(ref_template="#/components/schemas/{model}")
    catalog = {"type": "string", "description": "A catalog: a header line {\"start_token_id\": ..., \"end_token_id\": "
               "...} then one item per line: a JSON array of token ids (after the root, without the end token), or "
               "{\"ids\": [...], \"metadata\": {...}}."}
    parquet = {"type": "string", "format": "binary",
               "description": "The catalog as a Parquet file: an `ids` column (a list of integers per item), any other "
                              "column an item metadata field, the header as JSON in the file's metadata under `catalog`."}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema},
                                                           CATALOG_CONTENT_TYPES[0]: {"schema": catalog},
                                                           PARQUET_CONTENT_TYPES[0]: {"schema": parquet}}}}


def _patch_openapi_extra() -> dict[str, Any]:
    ids = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
    item = {"oneOf": [ids, {"type": "string"}]}
    with_metadata = {"type": "object", "required": ["ids"], "additionalProperties": False,
                     "properties": {"ids": ids, "metadata": {"type": "object"}}}
    schema = {"type": "object", "additionalProperties": False, "properties": {
        "add": {"type": "array", "items": {"oneOf": [ids, {"type": "string"}, with_metadata]},
                "description": "Tree items (token ids after the root, or {ids, metadata}) or labels."},
        "remove": {"type": "array", "items": item},
        "update": {"type": "array", "items": with_metadata,
                   "description": "Tree catalog items whose metadata is replaced (the items stay)."},
        "base_version": {"type": "integer", "minimum": 1, "description": "409 unless this version is current."}}}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}



def _with_scenario_components(app: FastAPI) -> None:
    """Move the scenario schema's ``$defs`` into ``components`` so ``/docs`` resolves them."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    body = (operation.get("requestBody") or {}).get("content", {}).get("application/json", {})
                    defs = (body.get("schema") or {}).pop("$defs", None)
                    if defs:
                        components.update(defs)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
