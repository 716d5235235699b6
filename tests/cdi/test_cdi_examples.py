"""The table of example specs in tests/data/cdi/cases.yaml against the official JSON
schema and our validator."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml
from support.cdischema import SCHEMA_COPY, official_validator
from support.paths import TEST_DATA

import cdi

DATA = TEST_DATA / "cdi"
CASES = yaml.safe_load((DATA / "cases.yaml").read_text())


@pytest.fixture(scope="module")
def schema_validator() -> jsonschema.Draft7Validator:
    return official_validator()


def _document(path: Path) -> object:
    text = path.read_text()
    return json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)


def _ids(cases: list[dict]) -> list[str]:
    return [c["file"] for c in cases]


def test_schema_copy_refers_only_to_definitions_it_has():
    # The copy in tests/data/cdi/schema is the one schema the tests use: its two
    # files must be whole, with every $ref in either landing on a definition.
    schema = json.loads((SCHEMA_COPY / "schema.json").read_text())
    defs = json.loads((SCHEMA_COPY / "defs.json").read_text())
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"

    def refs(node: object) -> list[str]:
        if isinstance(node, dict):
            own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
            return own + [r for value in node.values() for r in refs(value)]
        if isinstance(node, list):
            return [r for value in node for r in refs(value)]
        return []

    from_schema, from_defs = refs(schema), refs(defs)
    assert from_schema, "schema.json should use defs.json"
    for ref in from_schema + from_defs:
        document, _, pointer = ref.partition("#/definitions/")
        assert document in ("defs.json", ""), ref
        assert pointer in defs["definitions"], ref


def test_schema_validator_is_not_vacuous(schema_validator):
    # Guard against a registry mistake that would make every document pass.
    bad = {"cdiVersion": "0.5.0", "kind": "a/b",
           "devices": [{"name": "x", "containerEdits": {"deviceNodes": [{"hostPath": "/x"}]}}]}
    assert not schema_validator.is_valid(bad)
    assert not schema_validator.is_valid({**bad, "annotations": {"a": 1}})


def test_table_covers_both_formats_and_every_file():
    listed = {c["file"] for c in CASES["valid"] + CASES["invalid"]}
    on_disk = {str(p.relative_to(DATA)) for p in DATA.glob("*valid/*") if p.is_file()}
    assert listed == on_disk
    assert {Path(f).suffix for f in listed} == {".yaml", ".json"}


@pytest.mark.parametrize("case", CASES["valid"], ids=_ids(CASES["valid"]))
def test_valid_example_passes_schema_and_validator(case, schema_validator):
    path = DATA / case["file"]
    errors = [e.message for e in schema_validator.iter_errors(_document(path))]
    assert errors == []
    spec = cdi.read_spec(path)
    assert cdi.spec_problems(spec) == []
    assert cdi.minimum_version(spec) == case["minimum"]


@pytest.mark.parametrize("case", CASES["valid"], ids=_ids(CASES["valid"]))
def test_valid_example_round_trips_to_the_same_document(case):
    path = DATA / case["file"]
    spec = cdi.read_spec(path)
    assert spec.to_dict() == _document(path)
    for fmt in cdi.FORMATS:
        assert cdi.parse_spec(cdi.dump_spec(spec, fmt), fmt) == spec


@pytest.mark.parametrize("case", CASES["invalid"], ids=_ids(CASES["invalid"]))
def test_invalid_example_is_rejected_naming_the_field(case):
    path = DATA / case["file"]
    with pytest.raises(cdi.SpecFileError) as caught:
        cdi.read_spec(path)
    message = str(caught.value)
    assert str(path) in message
    assert case["field"] in message
    cause = caught.value.cause
    if isinstance(cause, cdi.InvalidSpecError):
        assert case["field"] in [p.field for p in cause.problems]
    elif isinstance(cause, cdi.SpecError) and cause.field:
        assert cause.field == case["field"]


@pytest.mark.parametrize("case", CASES["invalid"], ids=_ids(CASES["invalid"]))
def test_schema_column_of_invalid_example_is_true(case, schema_validator):
    valid = schema_validator.is_valid(_document(DATA / case["file"]))
    assert case["schema"] in ("accepts", "rejects")
    assert valid == (case["schema"] == "accepts")
    if valid:
        assert case.get("why"), "say why the schema cannot express this rule"
