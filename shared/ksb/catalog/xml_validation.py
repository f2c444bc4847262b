"""XML message bodies: WELL_FORMED_XML and VALID_XML WITH SCHEMA COLLECTION.

Bodies come from any Kafka producer, so the parser is locked down: lxml (libxml2) with entity
expansion off, no DTD loading and no network, and a document that carries a DOCTYPE at all is
refused, as SQL Server's xml type refuses an internal subset by default. A billion-laughs body then
costs one parse of its bytes and an external entity is never fetched. Schemas are compiled once per
distinct XSD text (an LRU cache), not per message: the dispatcher validates every SEND.
"""

from __future__ import annotations

import re
import threading
from functools import lru_cache
from typing import Any, Final

from lxml import etree

from ksb.errors import ValidationFailed

__all__ = ["XmlSchema", "check_well_formed", "compile_schema"]

_XSD_NS: Final = "http://www.w3.org/2001/XMLSchema"
# An XML declaration ahead of text that is already decoded (an N'...' literal is UTF-16 in SQL
# Server and says so); lxml refuses a str that still declares an encoding.
_DECLARATION: Final = re.compile(r"^\s*<\?xml[^>]*\?>")
_EXTERNAL: Final = ("include", "import", "redefine", "override")


def _parser() -> Any:
    """A parser that resolves no entity, loads no DTD and touches no network or file."""
    return etree.XMLParser(
        resolve_entities=False,
        load_dtd=False,
        no_network=True,
        dtd_validation=False,
        huge_tree=False,
        remove_comments=False,
    )


_PARSER: Final = threading.local()


def _thread_parser() -> Any:
    """One parser per thread: lxml parsers are not to be shared across threads."""
    parser = getattr(_PARSER, "parser", None)
    if parser is None:
        parser = _parser()
        _PARSER.parser = parser
    return parser


def _parse(body: bytes | str) -> Any:
    """The parsed document, or ValueError with libxml2's reason; a DOCTYPE is refused."""
    source = _DECLARATION.sub("", body, count=1) if isinstance(body, str) else body
    try:
        root = etree.fromstring(source, _thread_parser())
    except etree.XMLSyntaxError as exc:
        raise ValueError(str(exc)) from None
    if root is None:
        raise ValueError("no root element")
    if root.getroottree().docinfo.doctype:
        raise ValueError("a DOCTYPE (DTD) is not allowed")
    return root


def check_well_formed(name: str, body: bytes) -> Any:
    """The body's root element; ValidationFailed naming message type `name` when it is not XML."""
    try:
        return _parse(body)
    except ValueError as exc:
        raise ValidationFailed(f"body of {name!r} is not well-formed XML: {exc}") from None


class XmlSchema:
    """One compiled XSD document; validation holds a lock because lxml keeps one error log."""

    def __init__(self, xsd: str) -> None:
        root = _parse(xsd)
        if root.tag != f"{{{_XSD_NS}}}schema":
            raise ValueError("the root element is not xsd:schema")
        for word in _EXTERNAL:
            for element in root.iter(f"{{{_XSD_NS}}}{word}"):
                if word != "import" or element.get("schemaLocation") is not None:
                    raise ValueError(
                        f"xsd:{word} of another document is not supported: "
                        "a schema collection must be self-contained"
                    )
        try:
            self._schema = etree.XMLSchema(root)
        except etree.XMLSchemaParseError as exc:
            raise ValueError(f"not a valid XML schema: {exc}") from None
        self._lock = threading.Lock()

    def check(self, name: str, body: bytes) -> None:
        """Raise ValidationFailed naming message type `name` unless the body is valid."""
        doc = check_well_formed(name, body)
        with self._lock:
            if self._schema.validate(doc):
                return
            error = self._schema.error_log.last_error
        where = f"line {error.line}: " if error is not None else ""
        reason = error.message if error is not None else "invalid"
        raise ValidationFailed(f"body of {name!r} fails its XML schema at {where}{reason}")


@lru_cache(maxsize=256)
def compile_schema(xsd: str) -> XmlSchema:
    """The compiled schema for this XSD text; ValueError with the reason when it is not one."""
    return XmlSchema(xsd)
