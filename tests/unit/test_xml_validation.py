"""XML bodies: well-formedness and XSD validity, with a parser that fetches and expands nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from ksb.catalog.model import MessageType, parse_catalog
from ksb.catalog.xml_validation import check_well_formed, compile_schema
from ksb.errors import ValidationFailed

XSD = (
    "<?xml version='1.0' encoding='UTF-16'?>"
    "<xsd:schema xmlns:xsd='http://www.w3.org/2001/XMLSchema'>"
    "<xsd:element name='qty' type='xsd:positiveInteger'/></xsd:schema>"
)


def typed() -> MessageType:
    catalog = parse_catalog(
        {
            "xml_schema_collections": [{"name": "S", "xsd": XSD}],
            "message_types": [
                {"name": "Q", "validation": "VALID_XML", "xml_schema_collection": "S"}
            ],
        }
    )
    return catalog.message_types[0]


def test_well_formed_xml_accepts_xml_in_any_declared_encoding() -> None:
    well_formed = MessageType(name="W", validation="WELL_FORMED_XML")
    well_formed.validate_body(b"<a><b/></a>")
    well_formed.validate_body('<?xml version="1.0" encoding="UTF-16"?><a>é</a>'.encode("utf-16"))
    for body in (b"", b"<a>", b"not xml", b"<a/><b/>"):
        with pytest.raises(ValidationFailed, match="'W' is not well-formed XML"):
            well_formed.validate_body(body)


def test_entities_and_dtds_are_never_expanded_or_fetched(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret")
    bomb = (
        b'<!DOCTYPE z [<!ENTITY a "aaaaaaaaaa"><!ENTITY b "&a;&a;&a;&a;&a;&a;&a;&a;&a;&a;">'
        b'<!ENTITY c "&b;&b;&b;&b;&b;&b;&b;&b;&b;&b;">]><z>&c;&c;&c;</z>'
    )
    external = f'<!DOCTYPE z [<!ENTITY x SYSTEM "file://{secret}">]><z>&x;</z>'.encode()
    remote = b'<!DOCTYPE z SYSTEM "http://127.0.0.1:9/z.dtd"><z/>'
    for body in (bomb, external, remote):
        with pytest.raises(ValidationFailed, match="DOCTYPE") as caught:
            check_well_formed("T", body)
        assert "s3cret" not in caught.value.reason


def test_valid_xml_checks_the_bound_schema() -> None:
    message_type = typed()
    message_type.validate_body(b"<qty>3</qty>")
    with pytest.raises(ValidationFailed, match=r"fails its XML schema at line 1: .*qty"):
        message_type.validate_body(b"<qty>0</qty>")
    with pytest.raises(ValidationFailed, match="not well-formed"):
        message_type.validate_body(b"<qty>")
    unbound = MessageType(name="U", validation="VALID_XML", xml_schema_collection="S")
    with pytest.raises(ValidationFailed, match="no schema collection bound"):
        unbound.validate_body(b"<qty>3</qty>")


def test_schemas_compile_once_per_text() -> None:
    assert compile_schema(XSD) is compile_schema(XSD)
    assert typed() == typed()  # two catalogs with the same collection hold equal types


@pytest.mark.parametrize(
    ("xsd", "reason"),
    [
        ("<notaschema/>", "not xsd:schema"),
        ("<a><b></a>", "mismatch"),
        (
            "<xsd:schema xmlns:xsd='http://www.w3.org/2001/XMLSchema'>"
            "<xsd:include schemaLocation='other.xsd'/></xsd:schema>",
            "xsd:include of another document",
        ),
        (
            "<xsd:schema xmlns:xsd='http://www.w3.org/2001/XMLSchema'>"
            "<xsd:import namespace='urn:x' schemaLocation='http://127.0.0.1:9/x.xsd'/></xsd:schema>",
            "xsd:import of another document",
        ),
        (
            "<xsd:schema xmlns:xsd='http://www.w3.org/2001/XMLSchema'>"
            "<xsd:element name='a' type='nope'/></xsd:schema>",
            "not a valid XML schema",
        ),
    ],
)
def test_bad_schema_collections_are_refused_with_the_reason(xsd: str, reason: str) -> None:
    with pytest.raises(Exception, match=reason):
        parse_catalog({"xml_schema_collections": [{"name": "S", "xsd": xsd}]})


def test_validation_and_its_schema_go_together() -> None:
    for fields in (
        {"validation": "VALID_XML"},
        {"validation": "WELL_FORMED_XML", "xml_schema_collection": "S"},
    ):
        with pytest.raises(Exception, match="xml_schema_collection"):
            MessageType.model_validate({"name": "M", **fields})
    with pytest.raises(Exception, match="unknown XML schema collection 'S'"):
        parse_catalog(
            {
                "message_types": [
                    {"name": "M", "validation": "VALID_XML", "xml_schema_collection": "S"}
                ]
            }
        )
