"""The official CDI JSON schema, from the copy in tests/data/cdi/schema
(see tests/data/reference/README.md for where it comes from)."""

from __future__ import annotations

import json

import jsonschema
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT7

from support.paths import TEST_DATA

SCHEMA_COPY = TEST_DATA / "cdi" / "schema"


def official_validator() -> jsonschema.Draft7Validator:
    directory = SCHEMA_COPY
    schema = json.loads((directory / "schema.json").read_text())
    defs = json.loads((directory / "defs.json").read_text())
    # schema.json refers to "defs.json#/definitions/..." relative to itself.
    registry = Registry().with_resource("defs.json", Resource.from_contents(defs, default_specification=DRAFT7))
    return jsonschema.Draft7Validator(schema, registry=registry)
