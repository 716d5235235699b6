"""The official CDI JSON schema (../shared/reference, or the copy in tests/data/cdi/schema)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
from conftest import SHARED_REFERENCE
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT7

SCHEMA_COPY = Path(__file__).parent / "data" / "cdi" / "schema"


def schema_dir() -> Path:
    shared = SHARED_REFERENCE / "cdi-schema"
    return shared if (shared / "schema.json").exists() else SCHEMA_COPY


def official_validator() -> jsonschema.Draft7Validator:
    directory = schema_dir()
    schema = json.loads((directory / "schema.json").read_text())
    defs = json.loads((directory / "defs.json").read_text())
    # schema.json refers to "defs.json#/definitions/..." relative to itself.
    registry = Registry().with_resource("defs.json", Resource.from_contents(defs, default_specification=DRAFT7))
    return jsonschema.Draft7Validator(schema, registry=registry)
