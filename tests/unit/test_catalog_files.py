"""Catalog files and records that are not catalogs are refused with a CatalogError, quickly.

Regression tests for what the decoder fuzzers (tests/fuzz) found: a message type whose schema is
not a JSON schema, or is nested too deeply, escaped as a foreign exception.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ksb.catalog.model import load_catalog_file, parse_catalog
from ksb.errors import CatalogError

ROOT = Path(__file__).resolve().parents[2]


def _schema_type(schema: Any) -> dict[str, Any]:
    return {"message_types": [{"name": "m", "validation": "SCHEMA", "schema": schema}]}


def test_a_schema_that_is_not_a_json_schema_is_named() -> None:
    with pytest.raises(CatalogError, match=r"message_types\.0: .*not a JSON schema: at type"):
        parse_catalog(_schema_type({"type": 5}))


def test_a_schema_nested_hundreds_deep_is_refused_not_a_recursion_error() -> None:
    schema: dict[str, Any] = {"type": "object"}
    for _ in range(400):
        schema = {"allOf": [schema]}
    with pytest.raises(CatalogError, match="nested too deeply"):
        parse_catalog(_schema_type(schema))


@pytest.mark.parametrize("name", ["catalog.yaml", "catalog-b.yaml"])
def test_the_demo_catalogs_load(name: str) -> None:
    assert load_catalog_file(ROOT / "infra" / "demo" / name).services
