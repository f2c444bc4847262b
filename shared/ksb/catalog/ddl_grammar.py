"""The grammar of the Service Broker DDL `ksb sql` reads, and errors that point at the token.

Kept apart from the tree-to-statement code in `ksb.catalog.ddl` so that the grammar reads as one piece
against the T-SQL reference. Clauses KSB cannot carry out (MIRROR_ADDRESS, WITH GRANT OPTION,
a named filegroup, ...) are in the grammar on purpose: the statement builder then refuses them
by name at their token, instead of a bare "unexpected token". Statements KSB does not have at all
(certificates, endpoints, remote service bindings, ...) are recognised from the token a syntax error
stops at, and reported with the reason.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import cache
from typing import Final

from lark import Lark, Token
from lark.exceptions import UnexpectedCharacters, UnexpectedInput, UnexpectedToken

from ksb.errors import DdlError

__all__ = ["at_token", "blank_go_lines", "located", "parser", "syntax_error"]

# Keywords are regexes with a word-boundary look-ahead and a higher priority than NAME, so that
# `ANYTHING` is a name while `ANY` is the keyword, and a keyword the grammar does not expect at
# that point (the contextual lexer only tries expected ones) can still be an ordinary name.
# fmt: off
_KEYWORDS: Final = (
    "CREATE", "ALTER", "DROP", "USE", "SET", "WITH", "ON", "OFF", "ANY", "DEFAULT", "AS", "TO",
    "FROM", "ADD", "AUTHORIZATION", "DATABASE", "HONOR_BROKER_PRIORITY",
    "BROKER", "PRIORITY", "FOR", "CONVERSATION", "CONTRACT_NAME", "LOCAL_SERVICE_NAME",
    "REMOTE_SERVICE_NAME", "PRIORITY_LEVEL",
    "MESSAGE", "TYPE", "VALIDATION", "NONE", "EMPTY", "WELL_FORMED_XML", "VALID_XML",
    "WELL_FORMED_JSON", "VALID_JSON", "SCHEMA", "COLLECTION", "XML",
    "CONTRACT", "SENT", "BY", "INITIATOR", "TARGET",
    "QUEUE", "STATUS", "RETENTION", "ACTIVATION", "PROCEDURE_NAME", "MAX_QUEUE_READERS",
    "EXECUTE", "SELF", "OWNER", "POISON_MESSAGE_HANDLING", "PARTITIONS", "COMMAND",
    "DEAD_LETTER", "MAX_ROLLBACKS", "ERROR_CODE",
    "SERVICE", "ROUTE", "SERVICE_NAME", "BROKER_INSTANCE", "LIFETIME", "ADDRESS",
    "MIRROR_ADDRESS", "VIA",
    "GRANT", "REVOKE", "OPTION", "CASCADE",
)
# fmt: on

_GRAMMAR: Final = r"""
start: (_statement | ";")*
_statement: create_priority | alter_priority | create_message_type | alter_message_type
          | create_contract | create_queue | alter_queue | create_service | alter_service
          | create_route | alter_route | create_xml_schema_collection | drop
          | grant | revoke | use_database | alter_database

authorization: AUTHORIZATION name

create_priority: CREATE BROKER PRIORITY name FOR CONVERSATION [SET priority_items]
alter_priority: ALTER BROKER PRIORITY name FOR CONVERSATION SET priority_items
priority_items: "(" priority_item (","? priority_item)* ")"
priority_item: CONTRACT_NAME "=" name_or_any
             | LOCAL_SERVICE_NAME "=" name_or_any
             | REMOTE_SERVICE_NAME "=" name_or_any
             | PRIORITY_LEVEL "=" (INT | DEFAULT)
?name_or_any: name | ANY

create_message_type: CREATE MESSAGE TYPE name [authorization] [VALIDATION "=" validation]
alter_message_type: ALTER MESSAGE TYPE name VALIDATION "=" validation
validation: NONE | EMPTY | WELL_FORMED_XML | WELL_FORMED_JSON
          | VALID_XML WITH SCHEMA COLLECTION name
          | VALID_JSON WITH SCHEMA STRING

create_contract: CREATE CONTRACT name [authorization] "(" contract_item ("," contract_item)* ")"
contract_item: name SENT BY (INITIATOR | TARGET | ANY)

create_queue: CREATE QUEUE name [WITH queue_option (","? queue_option)*] [ON name]
alter_queue: ALTER QUEUE name WITH queue_option (","? queue_option)*
queue_option: STATUS "=" on_off
            | RETENTION "=" on_off
            | ACTIVATION "(" activation_items ")"
            | POISON_MESSAGE_HANDLING "(" STATUS "=" on_off ")"
            | PARTITIONS "=" INT
            | DEAD_LETTER "(" dead_letter_items ")"
activation_items: activation_item (","? activation_item)* | DROP
activation_item: STATUS "=" on_off
               | PROCEDURE_NAME "=" name
               | COMMAND "=" STRING
               | MAX_QUEUE_READERS "=" INT
               | EXECUTE AS (SELF | OWNER | STRING)
dead_letter_items: dead_letter_item (","? dead_letter_item)* | DROP
dead_letter_item: MAX_ROLLBACKS "=" INT | ERROR_CODE "=" INT
?on_off: ON | OFF

create_service: CREATE SERVICE name [authorization] ON QUEUE name ["(" name ("," name)* ")"]
alter_service: ALTER SERVICE name [ON QUEUE name] ["(" service_change ("," service_change)* ")"]
service_change: (ADD | DROP) CONTRACT name

create_route: CREATE ROUTE name [authorization] WITH route_option (","? route_option)*
alter_route: ALTER ROUTE name WITH route_option (","? route_option)*
route_option: (SERVICE_NAME | BROKER_INSTANCE | ADDRESS | MIRROR_ADDRESS | VIA) "=" STRING
            | LIFETIME "=" INT

create_xml_schema_collection: CREATE XML SCHEMA COLLECTION name AS STRING

drop: DROP object_kind name
object_kind: MESSAGE TYPE | CONTRACT | QUEUE | SERVICE | ROUTE | BROKER PRIORITY
           | XML SCHEMA COLLECTION

grant: GRANT permissions ON securable TO principals [WITH GRANT OPTION] [AS name]
revoke: REVOKE [GRANT OPTION FOR] permissions ON securable (TO | FROM) principals [CASCADE] [AS name]
permissions: permission ("," permission)*
permission: NAME+
securable: [securable_class "::"] name
securable_class: NAME+
principals: name ("," name)*

use_database: USE name
alter_database: ALTER DATABASE name SET (HONOR_BROKER_PRIORITY on_off | NAME)

name: name_part ("." name_part)* | STRING
?name_part: NAME | BRACKETED

NAME: /[A-Za-z_@#][A-Za-z0-9_@#$]*/
BRACKETED: /\[(?:[^\]]|\]\])*\]/
STRING.3: /N?'(?:[^']|'')*'/i
INT: /-?[0-9]+/

%ignore /\s+/
%ignore /--[^\n]*/
%ignore /\/\*(?:.|\n)*?\*\//
""" + "\n".join(f"{word}.2: /{word}(?![A-Za-z0-9_@#$])/i" for word in _KEYWORDS)

# A GO line is a client batch separator, not T-SQL; blanking it keeps every line and column
# of the rest of the text where the user sees it.
_GO_LINE: Final = re.compile(r"^[ \t]*GO(?:[ \t]+[0-9]+)?[ \t]*(?:--[^\n]*)?$", re.I | re.M)

_PUNCTUATION: Final = {
    "LPAR": "'('",
    "RPAR": "')'",
    "COMMA": "','",
    "EQUAL": "'='",
    "SEMICOLON": "';'",
    "DOT": "'.'",
    "__ANON_0": "'::'",
}
_DESCRIBED: Final = {
    "NAME": "a name",
    "BRACKETED": "a name",
    "STRING": "a string",
    "INT": "a number",
    "$END": "end of input",
}

_SECURITY: Final = "KSB has no dialog or transport security of its own: secure Kafka and Redis"
# Statements KSB does not have, recognised where a syntax error stops: (pattern, reason). The
# pattern must start at the unexpected token, or at the CREATE/ALTER/DROP just before it.
_UNSUPPORTED: Final = (
    (r"(?:CREATE|ALTER|DROP)\s+CERTIFICATE\b", _SECURITY),
    (r"(?:CREATE|ALTER|DROP)\s+(?:MASTER|SYMMETRIC|ASYMMETRIC)\s+KEY\b", _SECURITY),
    (
        r"(?:CREATE|ALTER|DROP)\s+REMOTE\s+SERVICE\s+BINDING\b",
        "KSB has no dialog security; a service on another instance is reached through a route",
    ),
    (
        r"(?:CREATE|ALTER|DROP)\s+ENDPOINT\b",
        "KSB instances talk over Kafka: a route's ADDRESS names the cluster, there is no endpoint",
    ),
    (
        r"(?:CREATE|ALTER|DROP)\s+EVENT\s+NOTIFICATION\b",
        "declare event_notifications in the YAML catalog (ksb catalog apply)",
    ),
    (
        r"(?:CREATE|ALTER|DROP)\s+(?:USER|LOGIN|ROLE)\b",
        "KSB has no principals to create: GRANT names them as they are",
    ),
    (
        r"(?:CREATE|ALTER|DROP)\s+PROC(?:EDURE)?\b",
        "an activation procedure is a Python callable 'module:function' or a COMMAND",
    ),
    (
        r"ALTER\s+CONTRACT\b",
        "SQL Server has no ALTER CONTRACT (a contract never changes): DROP it and CREATE it again",
    ),
    (
        r"ALTER\s+XML\s+SCHEMA\s+COLLECTION\b",
        "KSB keeps one schema document per collection: DROP it and CREATE it again",
    ),
    (r"ALTER\s+AUTHORIZATION\b", "KSB has no object owners"),
    (r"DENY\b", "KSB stores SEND and RECEIVE grants only, so a DENY could not be kept"),
    (
        r"(?:BEGIN\s+(?:DIALOG|CONVERSATION)|SEND|RECEIVE|END\s+CONVERSATION|MOVE\s+CONVERSATION"
        r"|GET\s+CONVERSATION|WAITFOR)\b",
        "it is not DDL: hold conversations with the SDK or the wire protocol",
    ),
)
_VERB_BEFORE: Final = re.compile(r"(CREATE|ALTER|DROP)\s+$", re.I)
# Strings, bracketed names and comments, blanked before looking for statement words in the text.
_OPAQUE: Final = re.compile(r"N?'(?:[^']|'')*'|\[(?:[^\]]|\]\])*\]|--[^\n]*|/\*.*?\*/", re.I | re.S)


@cache
def parser() -> Lark:
    """Built on first use, not at import, so importing ksb stays cheap."""
    return Lark(_GRAMMAR, parser="lalr", lexer="contextual", maybe_placeholders=True)


def blank_go_lines(text: str) -> str:
    """The text with GO separator lines turned into spaces of the same length."""
    return _GO_LINE.sub(lambda match: " " * len(match.group(0)), text)


def located(text: str, line: int, column: int, message: str) -> DdlError:
    """A DdlError whose message carries the source line and a caret under the column."""
    lines = text.splitlines() or [""]
    source = lines[line - 1] if 0 < line <= len(lines) else ""
    pad = "".join("\t" if char == "\t" else " " for char in source[: max(column - 1, 0)])
    reason = f"line {line}, column {column}: {message}\n{source}\n{pad}^"
    return DdlError(reason, line=line, column=column)


def at_token(text: str, token: Token, message: str) -> DdlError:
    return located(text, token.line or 0, token.column or 0, message)


def _describe_expected(names: Iterable[str]) -> str:
    """Terminal names as a user reads them: keywords bare, punctuation quoted, the rest in words."""
    keywords: set[str] = set()
    others: set[str] = set()
    for name in names:
        if name in _PUNCTUATION:
            others.add(_PUNCTUATION[name])
        elif name in _DESCRIBED:
            others.add(_DESCRIBED[name])
        else:
            keywords.add(name.lstrip("_"))
    shown = sorted(keywords) + sorted(others)
    if len(shown) == 1:
        return f"expected {shown[0]}"
    return "expected one of " + ", ".join(shown)


def _offset(text: str, line: int, column: int) -> int:
    lines = text.splitlines(keepends=True)
    return sum(len(part) for part in lines[: line - 1]) + column - 1


def _unsupported(text: str, offset: int) -> DdlError | None:
    """The error for a statement KSB does not have, when the text at `offset` starts one."""
    plain = _OPAQUE.sub(lambda match: " " * len(match.group(0)), text)
    verb = _VERB_BEFORE.search(plain[max(0, offset - 40) : offset])
    start = offset - (len(verb.group(0)) if verb else 0)
    for pattern, reason in _UNSUPPORTED:
        match = re.compile(pattern, re.I).match(plain, start)
        if match is not None:
            statement = " ".join(match.group(0).upper().split())
            line = text.count("\n", 0, start) + 1
            column = start - (text.rfind("\n", 0, start) + 1) + 1
            return located(text, line, column, f"{statement} is not supported: {reason}")
    return None


def syntax_error(text: str, exc: UnexpectedInput) -> DdlError:
    """The DdlError for a parse failure: an unsupported statement by name, else the bad token."""
    line, column = exc.line, exc.column
    if isinstance(exc, UnexpectedToken) and exc.token.type != "$END":
        line, column = exc.token.line or line, exc.token.column or column
    if line > 0 and column > 0:
        unsupported = _unsupported(text, _offset(text, line, column))
        if unsupported is not None:
            return unsupported
    if isinstance(exc, UnexpectedToken):
        token = exc.token
        expected = _describe_expected(exc.expected)
        if token.type == "$END":
            end_line, end_column = token.end_line or 1, token.end_column or 1
            return located(text, end_line, end_column, f"unexpected end of input; {expected}")
        return at_token(text, token, f"unexpected {str(token)!r}; {expected}")
    if isinstance(exc, UnexpectedCharacters):
        expected = _describe_expected(exc.allowed)
        return located(text, exc.line, exc.column, f"unexpected {exc.char!r}; {expected}")
    return located(text, exc.line, exc.column, "unexpected input")
