"""Parse the Service Broker DDL a team already runs on SQL Server.

Accepting the T-SQL text as pasted (GO lines, N'...' literals, [bracketed] names, optional commas)
is what lets a migration keep one source of truth for message types, contracts, queues, services,
routes, priorities and permissions. Every statement becomes a typed value that says only what the
text said (an ALTER leaves out what it does not change), in catalog terms, with where it stood;
`ksb.catalog.ddl_apply` applies them to a catalog and `ksb.catalog.ddl_export` writes a catalog back as DDL.
Anything KSB cannot carry out is an error that points at the token and says why, because silently
skipping a clause would leave a rule out without anyone noticing (docs/ddl.md has the table).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Literal

from lark import Token, Tree
from lark.exceptions import UnexpectedInput

from ksb.catalog.ddl_grammar import at_token, blank_go_lines, parser, syntax_error
from ksb.catalog.ddl_statements import (
    Alter,
    Create,
    DatabaseOption,
    Drop,
    Kind,
    Permission,
    Statement,
    UseDatabase,
    Where,
)
from ksb.catalog.priorities import ANY, DEFAULT_LEVEL, MAX_LEVEL, MIN_LEVEL
from ksb.errors import DdlError

__all__ = ["parse"]


def parse(text: str) -> list[Statement]:
    """All statements in `text`, in order; the first bad one raises DdlError at its token."""
    try:
        tree = parser().parse(blank_go_lines(text))
    except UnexpectedInput as exc:
        raise syntax_error(text, exc) from None
    return [_BUILDERS[child.data](_Source(text, child)) for child in _subtrees(tree)]


# --- tree helpers --------------------------------------------------------------------------------


def _subtrees(tree: Tree[Token]) -> list[Tree[Token]]:
    return [child for child in tree.children if isinstance(child, Tree)]


def _tokens(tree: Tree[Token]) -> list[Token]:
    return [child for child in tree.children if isinstance(child, Token)]


def _children(tree: Tree[Token], data: str) -> list[Tree[Token]]:
    return [child for child in _subtrees(tree) if child.data == data]


def _child(tree: Tree[Token], data: str) -> Tree[Token] | None:
    return next(iter(_children(tree, data)), None)


def _token(tree: Tree[Token], kind: str) -> Token | None:
    return next((token for token in _tokens(tree) if token.type == kind), None)


def _unquote(token: Token) -> str:
    """The text a token spells, with T-SQL quoting undone (']]' and "''" are escapes)."""
    raw = str(token)
    if token.type == "BRACKETED":
        return raw[1:-1].replace("]]", "]")
    if token.type == "STRING":
        body = raw[2:-1] if raw[:1] in "Nn" else raw[1:-1]
        return body.replace("''", "'")
    return raw


_MAX_DIGITS: Final = 19
"""More digits than any bound a DDL number is checked against (a 64-bit integer has 19)."""


@dataclass(frozen=True)
class _Source:
    """One statement's subtree with the script text, so every error can point into it."""

    text: str
    tree: Tree[Token]

    def error(self, token: Token, message: str) -> DdlError:
        return at_token(self.text, token, f"{self.where().statement}: {message}")

    def first(self) -> Token:
        return self.tree.children[0]  # type: ignore[return-value]  # a statement starts with a verb

    def where(self) -> Where:
        words = [str(child).upper() for child in self.tree.children if isinstance(child, Token)]
        node = _child(self.tree, "name")
        named = node is not None and self.tree.data not in {"grant", "revoke"}
        name = self.name(node, check=False) if named else ""
        first = self.first()
        return Where(
            first.line or 0, first.column or 0, f"{_head(self.tree, words)} {name}".strip()
        )

    def name(self, node: Tree[Token] | None, *, check: bool = True) -> str:
        """A possibly multi-part name joined with '.'; an empty one is refused at its token."""
        assert node is not None
        parts = _tokens(node)
        if check:
            empty = next((part for part in parts if not _unquote(part)), None)
            if empty is not None:
                raise self.error(empty, f"empty name {str(empty)!r}")
        return ".".join(_unquote(part) for part in parts)

    def simple_name(self, node: Tree[Token] | None, what: str) -> str:
        """An object name SQL Server forbids to qualify by schema or database."""
        assert node is not None
        parts = _tokens(node)
        if len(parts) > 1:
            raise self.error(parts[0], f"a {what} name cannot be qualified by a schema or database")
        return self.name(node)

    def queue_name(self, node: Tree[Token] | None) -> str:
        """A queue is schema-owned in SQL Server; KSB has no schemas, so only the last part counts."""
        assert node is not None
        self.name(node)
        return _unquote(_tokens(node)[-1])

    def int_in(self, token: Token, low: int, high: int, what: str) -> int:
        """A number within bounds; one with more digits than any bound is refused unconverted
        (Python will not convert more than 4,300 digits, and has no need to)."""
        text = str(token)
        if len(text.lstrip("-")) > _MAX_DIGITS:
            raise self.error(token, f"{what} {text[:12]}... is outside {low}..{high}")
        value = int(text)
        if not low <= value <= high:
            raise self.error(token, f"{what} {value} is outside {low}..{high}")
        return value

    def once(self, seen: set[str], keyword: Token) -> None:
        """SQL Server rejects an option given twice; so do we, at the second occurrence."""
        if keyword.type in seen:
            raise self.error(keyword, f"{keyword.type} is given more than once")
        seen.add(keyword.type)


def _head(tree: Tree[Token], words: list[str]) -> str:
    """The statement's verb and object kind, as a user would name the statement."""
    kinds = {"MESSAGE": 2, "BROKER": 2, "XML": 3}
    if tree.data in {"grant", "revoke", "use_database"}:
        return words[0]
    if tree.data == "drop":
        kind = _child(tree, "object_kind")
        assert kind is not None
        return "DROP " + " ".join(str(token).upper() for token in _tokens(kind))
    return " ".join(words[: 1 + kinds.get(words[1], 1)])


# --- message types, contracts, schema collections ------------------------------------------------


def _validation(src: _Source, node: Tree[Token]) -> dict[str, Any]:
    """VALIDATION = ... as the catalog's three fields, all given so an ALTER replaces all three."""
    word = _tokens(node)[0]
    fields: dict[str, Any] = {
        "validation": word.type,
        "schema": None,
        "xml_schema_collection": None,
    }
    if word.type == "VALID_XML":
        fields["xml_schema_collection"] = src.simple_name(_child(node, "name"), "schema collection")
    elif word.type == "VALID_JSON":
        literal = _tokens(node)[-1]
        try:
            schema = json.loads(_unquote(literal))
        except ValueError as exc:
            raise src.error(literal, f"the JSON schema is not JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise src.error(literal, "the JSON schema must be a JSON object")
        fields.update(validation="SCHEMA", schema=schema)
    return fields


def _message_type(src: _Source) -> Create | Alter:
    name = src.simple_name(_child(src.tree, "name"), "message type")
    node = _child(src.tree, "validation")
    fields = _validation(src, node) if node is not None else {}
    if src.tree.data == "alter_message_type":
        return Alter("MESSAGE TYPE", name, fields, src.where())
    return Create("MESSAGE TYPE", name, fields, src.where())


def _contract(src: _Source) -> Create:
    name = src.simple_name(_child(src.tree, "name"), "contract")
    messages: list[dict[str, str]] = []
    seen: set[str] = set()
    for item in _children(src.tree, "contract_item"):
        node = _child(item, "name")
        message_type = src.simple_name(node, "message type")
        if message_type in seen:
            raise src.error(_tokens(node)[0], f"message type {message_type!r} is listed twice")  # type: ignore[arg-type]
        seen.add(message_type)
        messages.append({"type": message_type, "sent_by": _tokens(item)[-1].type})
    if not any(m["sent_by"] != "TARGET" for m in messages):
        raise src.error(
            src.first(), "a contract must let the initiator send (SENT BY INITIATOR or ANY)"
        )
    return Create("CONTRACT", name, {"messages": messages}, src.where())


def _xml_schema_collection(src: _Source) -> Create:
    name = src.simple_name(_child(src.tree, "name"), "schema collection")
    literal = _tokens(src.tree)[-1]
    return Create("XML SCHEMA COLLECTION", name, {"xsd": _unquote(literal)}, src.where())


# --- queues --------------------------------------------------------------------------------------


def _on(token: Tree[Token] | Token) -> str:
    assert isinstance(token, Token)
    return "ON" if token.type == "ON" else "OFF"


def _activation(src: _Source, items: Tree[Token], creating: bool) -> dict[str, Any] | None:
    """ACTIVATION (...) as catalog fields; None for ACTIVATION (DROP)."""
    if _tokens(items):
        return None
    fields: dict[str, Any] = {}
    seen: set[str] = set()
    for item in _subtrees(items):
        keyword, value = item.children[0], item.children[-1]
        assert isinstance(keyword, Token)
        src.once(seen, keyword)
        if keyword.type == "STATUS":
            fields["status"] = _on(value)
        elif keyword.type == "PROCEDURE_NAME":
            assert isinstance(value, Tree)
            fields.update(procedure=src.name(value), command=None)
        elif keyword.type == "COMMAND":
            assert isinstance(value, Token)
            fields.update(command=_unquote(value), procedure=None)
        elif keyword.type == "MAX_QUEUE_READERS":
            assert isinstance(value, Token)
            fields["max_queue_readers"] = src.int_in(value, 0, 32767, "MAX_QUEUE_READERS")
        else:
            assert isinstance(value, Token)
            fields["execute_as"] = _unquote(value) if value.type == "STRING" else value.type
        if {"PROCEDURE_NAME", "COMMAND"} <= seen:
            raise src.error(keyword, "give PROCEDURE_NAME or COMMAND, not both")
    if creating:
        fields.setdefault("status", "ON")  # SQL Server: STATUS defaults to ON inside ACTIVATION
    return fields


def _dead_letter(src: _Source, items: Tree[Token]) -> dict[str, Any] | None:
    """DEAD_LETTER (MAX_ROLLBACKS = n, ERROR_CODE = n), a KSB extension; None for (DROP)."""
    if _tokens(items):
        return None
    fields: dict[str, Any] = {}
    seen: set[str] = set()
    for item in _subtrees(items):
        keyword, value = _tokens(item)
        src.once(seen, keyword)
        if keyword.type == "MAX_ROLLBACKS":
            fields["max_rollbacks"] = src.int_in(value, 1, 2**31 - 1, "MAX_ROLLBACKS")
        else:
            fields["error_code"] = src.int_in(value, -(2**31), 2**31 - 1, "ERROR_CODE")
    return fields


def _queue_option(src: _Source, option: Tree[Token], creating: bool) -> dict[str, Any]:
    keyword = option.children[0]
    assert isinstance(keyword, Token)
    value = option.children[-1]
    if keyword.type in {"STATUS", "RETENTION", "POISON_MESSAGE_HANDLING"}:
        return {keyword.type.lower(): _on(value)}
    if keyword.type == "PARTITIONS":
        assert isinstance(value, Token)
        if not creating:
            raise src.error(
                keyword, "PARTITIONS is fixed when a queue is created (groups map onto partitions)"
            )
        return {"partitions": src.int_in(value, 1, 64, "PARTITIONS")}
    assert isinstance(value, Tree)
    if keyword.type == "ACTIVATION":
        return {"activation": _activation(src, value, creating)}
    return {"dead_letter": _dead_letter(src, value)}


def _queue(src: _Source) -> Create | Alter:
    creating = src.tree.data == "create_queue"
    names = _children(src.tree, "name")
    name = src.queue_name(names[0])
    fields: dict[str, Any] = {}
    seen: set[str] = set()
    for option in _children(src.tree, "queue_option"):
        keyword = option.children[0]
        assert isinstance(keyword, Token)
        src.once(seen, keyword)
        fields.update(_queue_option(src, option, creating))
    if not creating:
        return Alter("QUEUE", name, fields, src.where())
    if len(names) > 1 and src.name(names[1]).upper() != "DEFAULT":
        raise src.error(
            _tokens(names[1])[0],
            "a filegroup cannot be chosen: KSB keeps a queue in its Kafka topic (ON [DEFAULT] is fine)",
        )
    if fields.get("activation") is None:
        fields.pop("activation", None)
    if fields.get("dead_letter") is None:
        fields.pop("dead_letter", None)
    return Create("QUEUE", name, fields, src.where())


# --- services and routes -------------------------------------------------------------------------


def _contract_names(src: _Source, nodes: list[Tree[Token]]) -> list[str]:
    names: list[str] = []
    for node in nodes:
        name = src.simple_name(node, "contract")
        if name in names:
            raise src.error(_tokens(node)[0], f"contract {name!r} is listed twice")
        names.append(name)
    return names


def _service(src: _Source) -> Create | Alter:
    names = _children(src.tree, "name")
    name = src.simple_name(names[0], "service")
    has_queue = _token(src.tree, "ON") is not None
    fields: dict[str, Any] = {"queue": src.queue_name(names[1])} if has_queue else {}
    if src.tree.data == "create_service":
        fields["contracts"] = _contract_names(src, names[2:])
        authorization = _child(src.tree, "authorization")
        if authorization is not None:  # its owner acts as it (`ksb.dialog.permissions`)
            owner = src.simple_name(_child(authorization, "name"), "principal")
            if owner.lower() != "dbo":  # the database's owner: KSB's owners act as any service
                fields["owner"] = owner
        return Create("SERVICE", name, fields, src.where())
    changes = _children(src.tree, "service_change")
    for verb in ("ADD", "DROP"):
        chosen = [c for c in changes if _tokens(c)[0].type == verb]
        listed = _contract_names(src, [node for c in chosen for node in _children(c, "name")])
        if listed:
            fields[f"{verb.lower()}_contracts"] = listed
    return Alter("SERVICE", name, fields, src.where())


_ROUTE_FIELDS: Final = {
    "SERVICE_NAME": "service_name",
    "BROKER_INSTANCE": "broker_instance",
    "ADDRESS": "address",
    "VIA": "via",
    "LIFETIME": "lifetime_s",
}


def _address(src: _Source, token: Token) -> str:
    """'LOCAL', or another Kafka cluster: 'TCP://host:port' names its bootstrap server."""
    address = _unquote(token).strip()
    if address.upper() == "LOCAL":
        return "LOCAL"
    if address.upper() == "TRANSPORT":
        raise src.error(token, "ADDRESS 'TRANSPORT' is not supported: name the cluster or 'LOCAL'")
    if address[:6].upper() == "TCP://":
        address = address[6:]
    if not address:
        raise src.error(token, "ADDRESS is empty")
    return address


def _route_value(src: _Source, keyword: Token, value: Token) -> Any:
    if keyword.type == "MIRROR_ADDRESS":
        raise src.error(keyword, "MIRROR_ADDRESS is not supported: KSB has no database mirroring")
    if keyword.type == "LIFETIME":
        return src.int_in(value, 1, 2**31 - 1, "LIFETIME")
    if keyword.type == "ADDRESS":
        return _address(src, value)
    text = _unquote(value)
    if not text:
        raise src.error(value, f"{keyword.type} is empty")
    return text


def _route(src: _Source) -> Create | Alter:
    name = src.simple_name(_child(src.tree, "name"), "route")
    fields: dict[str, Any] = {}
    seen: set[str] = set()
    for option in _children(src.tree, "route_option"):
        keyword, value = _tokens(option)
        src.once(seen, keyword)
        fields[_ROUTE_FIELDS.get(keyword.type, "")] = _route_value(src, keyword, value)
    if src.tree.data == "alter_route":
        return Alter("ROUTE", name, fields, src.where())
    for needed, why in (
        ("SERVICE_NAME", "a KSB route names the one service it leads to"),
        (
            "BROKER_INSTANCE",
            "a KSB route names the instance (its KSB_INSTANCE) hosting the service",
        ),
        ("ADDRESS", "a route needs an ADDRESS"),
    ):
        if needed not in seen:
            raise src.error(src.first(), f"{needed} is missing: {why}")
    return Create("ROUTE", name, fields, src.where())


# --- broker priorities ---------------------------------------------------------------------------

_PRIORITY_FIELDS: Final = {
    "CONTRACT_NAME": "contract",
    "LOCAL_SERVICE_NAME": "local_service",
    "REMOTE_SERVICE_NAME": "remote_service",
    "PRIORITY_LEVEL": "level",
}


def _priority_items(src: _Source) -> dict[str, Any]:
    items = _child(src.tree, "priority_items")
    changes: dict[str, Any] = {}
    seen: set[str] = set()
    for item in _subtrees(items) if items is not None else []:
        keyword, value = item.children[0], item.children[1]
        assert isinstance(keyword, Token)
        src.once(seen, keyword)
        if keyword.type != "PRIORITY_LEVEL":
            is_any = isinstance(value, Token)  # only the ANY keyword arrives bare
            changes[_PRIORITY_FIELDS[keyword.type]] = ANY if is_any else src.name(value)  # type: ignore[arg-type]
            continue
        assert isinstance(value, Token)
        level = (
            DEFAULT_LEVEL
            if value.type == "DEFAULT"
            else src.int_in(value, MIN_LEVEL, MAX_LEVEL, "PRIORITY_LEVEL")
        )
        changes["level"] = level
    return changes


def _priority(src: _Source) -> Create | Alter:
    name = src.name(_child(src.tree, "name"))
    changes = _priority_items(src)
    if src.tree.data == "alter_priority":
        return Alter("BROKER PRIORITY", name, changes, src.where())
    return Create("BROKER PRIORITY", name, changes, src.where())


# --- DROP, GRANT / REVOKE, USE, ALTER DATABASE ---------------------------------------------------


def _drop(src: _Source) -> Drop:
    kind_node = _child(src.tree, "object_kind")
    assert kind_node is not None
    kind: Kind = " ".join(str(t).upper() for t in _tokens(kind_node))  # type: ignore[assignment]
    node = _child(src.tree, "name")
    if kind == "QUEUE":
        name = src.queue_name(node)
    elif kind == "BROKER PRIORITY":
        name = src.name(node)
    else:
        name = src.simple_name(node, kind.lower())
    return Drop(kind, name, src.where())


def _words(tree: Tree[Token]) -> str:
    return " ".join(str(token).upper() for token in _tokens(tree))


def _target(src: _Source, permission: Tree[Token]) -> tuple[Literal["SEND", "RECEIVE"], str]:
    """The permission and what it is on: SEND on SERVICE::s, RECEIVE on a queue ([OBJECT::]q)."""
    securable = _child(src.tree, "securable")
    assert securable is not None
    kind_node = _child(securable, "securable_class")
    kind = _words(kind_node) if kind_node is not None else "OBJECT"
    word = _words(permission)
    node = _child(securable, "name")
    if word == "SEND" and kind == "SERVICE":
        return "SEND", src.simple_name(node, "service")
    if word == "RECEIVE" and kind == "OBJECT":
        return "RECEIVE", src.queue_name(node)
    raise src.error(
        _tokens(permission)[0],
        f"{word} ON {kind} is not supported: KSB keeps SEND on a SERVICE and RECEIVE on a queue",
    )


def _permission(src: _Source) -> Permission:
    action: Literal["GRANT", "REVOKE"] = "GRANT" if src.tree.data == "grant" else "REVOKE"
    tokens = _tokens(src.tree)
    option = _token(src.tree, "OPTION")
    if option is not None:  # WITH GRANT OPTION, or REVOKE GRANT OPTION FOR
        start = tokens[tokens.index(option) - (2 if action == "GRANT" else 1)]
        raise src.error(start, "the grant option is not supported: KSB grants are not delegated")
    grantor = _token(src.tree, "AS")
    if grantor is not None:
        raise src.error(grantor, "AS grantor is not supported: KSB records no grantor")
    # CASCADE is accepted: with no grant option there is nothing it could reach (docs/ddl.md).
    permissions = _child(src.tree, "permissions")
    assert permissions is not None
    first, *more = _subtrees(permissions)
    if more:
        raise src.error(_tokens(more[0])[0], "give one permission per statement")
    permission, target = _target(src, first)
    principals_node = _child(src.tree, "principals")
    assert principals_node is not None
    principals: list[str] = []
    for node in _subtrees(principals_node):
        principal = src.simple_name(node, "principal")
        if principal in principals:
            raise src.error(_tokens(node)[0], f"principal {principal!r} is listed twice")
        principals.append(principal)
    return Permission(action, permission, target, tuple(principals), src.where())


def _use_database(src: _Source) -> UseDatabase:
    return UseDatabase(src.name(_child(src.tree, "name")), src.where())


def _alter_database(src: _Source) -> DatabaseOption:
    database = src.name(_child(src.tree, "name"))
    option = _tokens(src.tree)[-2] if len(_tokens(src.tree)) > 4 else _tokens(src.tree)[-1]
    if option.type == "HONOR_BROKER_PRIORITY":
        value = _tokens(src.tree)[-1].type == "ON"
        return DatabaseOption(database, option.type, value, src.where())
    if str(option).upper() == "ENABLE_BROKER":
        # KSB's broker is always on: the statement asks for what is already so (docs/ddl.md).
        return DatabaseOption(database, "ENABLE_BROKER", None, src.where())
    raise src.error(
        option,
        f"SET {str(option).upper()} is not supported: only HONOR_BROKER_PRIORITY and ENABLE_BROKER",
    )


_BUILDERS: Final[dict[str, Callable[[_Source], Statement]]] = {
    "create_priority": _priority,
    "alter_priority": _priority,
    "create_message_type": _message_type,
    "alter_message_type": _message_type,
    "create_contract": _contract,
    "create_queue": _queue,
    "alter_queue": _queue,
    "create_service": _service,
    "alter_service": _service,
    "create_route": _route,
    "alter_route": _route,
    "create_xml_schema_collection": _xml_schema_collection,
    "drop": _drop,
    "grant": _permission,
    "revoke": _permission,
    "use_database": _use_database,
    "alter_database": _alter_database,
}
