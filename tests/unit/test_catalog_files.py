"""Catalog files and records that are not catalogs are refused with a CatalogError, quickly.

Regression tests for what the decoder fuzzers (tests/fuzz) found: a message type whose schema is
not a JSON schema, a schema or a file nested too deeply, a file that is not UTF-8, and a file whose
aliases expand to millions of values each escaped as a foreign exception or ran for minutes.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from ksb.catalog.model import MAX_YAML_VALUES, load_catalog_file, parse_catalog
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


def test_a_pattern_repeating_past_the_regex_engines_limit_is_named() -> None:
    """Found by the catalog-file fuzzer: `re` raises OverflowError, not re.error, for it."""
    with pytest.raises(CatalogError, match="not a JSON schema: a pattern: the repetition number"):
        parse_catalog(_schema_type({"type": "string", "pattern": "^[A-Z]{9999999999999999}$"}))


@pytest.mark.parametrize(
    ("text", "words"),
    [
        (b"\xff\xfe queues: []", "not UTF-8"),
        (b"[" * 1000, "nested too deeply"),
        (b"message_types: [{name: m, validation: SCHEMA, schema: {type: 0}}]", "not a JSON schema"),
    ],
    ids=["not-utf8", "nested-too-deep", "not-a-json-schema"],
)
def test_a_file_that_is_not_a_catalog_is_refused_with_the_reason(
    tmp_path: Path, text: bytes, words: str
) -> None:
    path = tmp_path / "catalog.yaml"
    path.write_bytes(text)
    with pytest.raises(CatalogError, match=words):
        load_catalog_file(path)


def _laughs(levels: int) -> str:
    """Ten aliases of ten aliases ...: a few hundred bytes that stand for 10**levels values."""
    lines = ["defs:", "  - &a0 {type: object}"]
    for i in range(1, levels):
        lines.append(f"  - &a{i} {{allOf: [" + ", ".join([f"*a{i - 1}"] * 10) + "]}")
    lines += ["message_types:", f"  - {{name: m, validation: SCHEMA, schema: *a{levels - 1}}}"]
    return "\n".join(lines) + "\n"


def test_aliases_that_expand_past_the_limit_are_refused_at_once(tmp_path: Path) -> None:
    path = tmp_path / "catalog.yaml"
    path.write_text(_laughs(8))
    assert len(path.read_bytes()) < 1000
    started = time.process_time()
    with pytest.raises(CatalogError, match=f"over the limit of {MAX_YAML_VALUES}"):
        load_catalog_file(path)
    assert time.process_time() - started < 1.0


def test_a_few_aliases_are_still_fine(tmp_path: Path) -> None:
    path = tmp_path / "catalog.yaml"
    path.write_text(
        "contracts:\n"
        "  - {name: C1, messages: &both [{type: DEFAULT, sent_by: ANY}]}\n"
        "  - {name: C2, messages: *both}\n"
    )
    assert [c.name for c in load_catalog_file(path).contracts] == ["C1", "C2"]


@pytest.mark.parametrize("name", ["catalog.yaml", "catalog-b.yaml"])
def test_the_demo_catalogs_load(name: str) -> None:
    assert load_catalog_file(ROOT / "infra" / "demo" / name).services
