"""The request bodies in the OpenAPI document (`GET /openapi.json`) of `pdserve serve` and `pdserve render`.

The routes read raw JSON and validate it themselves (`read_json` + `parse_model`), so that every mistake is
an OpenAI-style 400 rather than FastAPI's 422; FastAPI therefore cannot see their bodies. This puts the
pydantic models the routes validate with into the document, so clients (and the schema fuzz test) see the
real API.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

REF = "#/components/schemas/{model}"


def document_json_bodies(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """`bodies`: path of a POST route -> the model its JSON body is validated with."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for path, model in bodies.items():
            operation = schema.get("paths", {}).get(path, {}).get("post")
            if operation is None:  # route not mounted in this configuration
                continue
            body_schema = model.model_json_schema(ref_template=REF)
            components.update(body_schema.pop("$defs", {}))
            components[model.__name__] = body_schema
            operation["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}},
            }
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
