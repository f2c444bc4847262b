"""Parse the Service Broker DDL a team already runs on SQL Server.

Accepting the T-SQL text as pasted (GO lines, N'...' literals, [bracketed] names, optional commas)
is what lets a migration keep one source of truth for priorities and queue settings. Only the
statements KSB acts on are understood; anything else is an error that points at the token,
because silently skipping a line would leave a rule out without anyone noticing.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cache
from typing import Final

from lark import Lark, Token, Tree
from lark.exceptions import UnexpectedCharacters, UnexpectedInput, UnexpectedToken
from pydantic import ValidationError

from ksb.catalog.priorities import (
    ANY,
    DEFAULT_LEVEL,
    MAX_LEVEL,
    MIN_LEVEL,
    BrokerPriority,
    PriorityTable,
)
from ksb.errors import CatalogError, DdlError

__all__ = [
    "AlterPriority",
    "AlterQueue",
    "CreatePriority",
    "DropPriority",
    "Statement",
    "UseDatabase",
    "apply_priority_statements",
    "parse",
]

# Keywords are regexes with a word-boundary look-ahead and a higher priority than NAME, so that
# `ANYTHING` is a name while `ANY` is the keyword, and a keyword the grammar does not expect at
# that point (the contextual lexer only tries expected ones) can still be an ordinary name.
_KEYWORDS: Final = (
    "CREATE",
    "ALTER",
    "DROP",
    "USE",
    "BROKER",
    "PRIORITY",
    "FOR",
    "CONVERSATION",
    "SET",
    "CONTRACT_NAME",
    "LOCAL_SERVICE_NAME",
    "REMOTE_SERVICE_NAME",
    "PRIORITY_LEVEL",
    "ANY",
    "DEFAULT",
    "QUEUE",
    "WITH",
    "STATUS",
    "ON",
    "OFF",
    "ACTIVATION",
    "PROCEDURE_NAME",
    "MAX_QUEUE_READERS",
    "EXECUTE",
    "AS",
    "SELF",
    "OWNER",
    "POISON_MESSAGE_HANDLING",
)

_GRAMMAR: Final = r"""
start: (_statement | ";")*
_statement: create_priority | alter_priority | drop_priority | alter_queue | use_database

create_priority: CREATE BROKER PRIORITY name FOR CONVERSATION [SET priority_items]
alter_priority: ALTER BROKER PRIORITY name FOR CONVERSATION SET priority_items
drop_priority: DROP BROKER PRIORITY name
use_database: USE name

priority_items: "(" priority_item (","? priority_item)* ")"
priority_item: CONTRACT_NAME "=" name_or_any
             | LOCAL_SERVICE_NAME "=" name_or_any
             | REMOTE_SERVICE_NAME "=" name_or_any
             | PRIORITY_LEVEL "=" (INT | DEFAULT)
?name_or_any: name | ANY

alter_queue: ALTER QUEUE name WITH queue_option (","? queue_option)*
queue_option: STATUS "=" on_off
            | ACTIVATION "(" activation_items ")"
            | POISON_MESSAGE_HANDLING "(" STATUS "=" on_off ")"
activation_items: activation_item (","? activation_item)* | DROP
activation_item: STATUS "=" on_off
               | PROCEDURE_NAME "=" name
               | MAX_QUEUE_READERS "=" INT
               | EXECUTE AS (SELF | OWNER | STRING)
?on_off: ON | OFF

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
}
_DESCRIBED: Final = {
    "NAME": "a name",
    "BRACKETED": "a name",
    "STRING": "a name",
    "INT": "a number",
    "$END": "end of input",
}

_FIELD_BY_KEYWORD: Final = {
    "CONTRACT_NAME": "contract",
    "LOCAL_SERVICE_NAME": "local_service",
    "REMOTE_SERVICE_NAME": "remote_service",
    "PRIORITY_LEVEL": "level",
}


@dataclass(frozen=True)
class CreatePriority:
    """CREATE BROKER PRIORITY; criteria left out are ANY and a missing level is 5."""

    rule: BrokerPriority


@dataclass(frozen=True)
class AlterPriority:
    """ALTER BROKER PRIORITY; `changes` holds only the items given, keyed by rule field."""

    name: str
    changes: dict[str, str | int] = field(default_factory=dict)


@dataclass(frozen=True)
class DropPriority:
    """DROP BROKER PRIORITY."""

    name: str


@dataclass(frozen=True)
class AlterQueue:
    """ALTER QUEUE ... WITH; None or an absent key means the statement leaves that setting alone.

    `activation` keys: status (bool), procedure_name (str), max_queue_readers (int),
    execute_as ('SELF', 'OWNER' or a user name), or drop (True) for ACTIVATION (DROP).
    """

    name: str
    status: bool | None = None
    activation: dict[str, object] = field(default_factory=dict)
    poison_message_handling: bool | None = None


@dataclass(frozen=True)
class UseDatabase:
    """USE db; kept so a script covering two databases is not merged into one rule set."""

    name: str


Statement = CreatePriority | AlterPriority | DropPriority | AlterQueue | UseDatabase


@cache
def _parser() -> Lark:
    """Built on first use, not at import, so importing ksb stays cheap."""
    return Lark(_GRAMMAR, parser="lalr", lexer="contextual", maybe_placeholders=True)


def parse(text: str) -> list[Statement]:
    """All statements in `text`, in order; the first bad one raises DdlError at its token."""
    source = _GO_LINE.sub(lambda match: " " * len(match.group(0)), text)
    try:
        tree = _parser().parse(source)
    except UnexpectedInput as exc:
        raise _syntax_error(text, exc) from None
    return [_BUILDERS[child.data](text, child) for child in _subtrees(tree)]


# --- error reporting -----------------------------------------------------------------------------


def _located(text: str, line: int, column: int, message: str) -> DdlError:
    """A DdlError whose message carries the source line and a caret under the column."""
    lines = text.splitlines() or [""]
    source = lines[line - 1] if 0 < line <= len(lines) else ""
    pad = "".join("\t" if char == "\t" else " " for char in source[: max(column - 1, 0)])
    reason = f"line {line}, column {column}: {message}\n{source}\n{pad}^"
    return DdlError(reason, line=line, column=column)


def _at(text: str, token: Token, message: str) -> DdlError:
    return _located(text, token.line or 0, token.column or 0, message)


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


def _syntax_error(text: str, exc: UnexpectedInput) -> DdlError:
    if isinstance(exc, UnexpectedToken):
        token = exc.token
        expected = _describe_expected(exc.expected)
        if token.type == "$END":
            line, column = token.end_line or 1, token.end_column or 1
            return _located(text, line, column, f"unexpected end of input; {expected}")
        return _at(text, token, f"unexpected {str(token)!r}; {expected}")
    if isinstance(exc, UnexpectedCharacters):
        expected = _describe_expected(exc.allowed)
        return _located(text, exc.line, exc.column, f"unexpected {exc.char!r}; {expected}")
    return _located(text, exc.line, exc.column, "unexpected input")


# --- tree to statements --------------------------------------------------------------------------


def _subtrees(tree: Tree[Token]) -> list[Tree[Token]]:
    return [child for child in tree.children if isinstance(child, Tree)]


def _tokens(tree: Tree[Token]) -> list[Token]:
    return [child for child in tree.children if isinstance(child, Token)]


def _child_tree(tree: Tree[Token], data: str) -> Tree[Token] | None:
    return next((child for child in _subtrees(tree) if child.data == data), None)


def _unquote(token: Token) -> str:
    """The name a token spells, with T-SQL quoting undone (']]' and "''" are escapes)."""
    raw = str(token)
    if token.type == "BRACKETED":
        return raw[1:-1].replace("]]", "]")
    if token.type == "STRING":
        body = raw[2:-1] if raw[:1] in "Nn" else raw[1:-1]
        return body.replace("''", "'")
    return raw


def _name(text: str, tree: Tree[Token]) -> str:
    """A possibly multi-part name joined with '.'; an empty one is refused at its token."""
    parts = _tokens(tree)
    value = ".".join(_unquote(part) for part in parts)
    empty = next((part for part in parts if not _unquote(part)), None)
    if empty is not None:
        raise _at(text, empty, f"empty name {str(empty)!r}")
    return value


def _name_or_any(text: str, node: Tree[Token] | Token) -> str:
    if isinstance(node, Token):  # only the ANY keyword arrives bare
        return ANY
    return _name(text, node)


def _int(text: str, token: Token, low: int, high: int, what: str) -> int:
    value = int(token)
    if not low <= value <= high:
        raise _at(text, token, f"{what} {value} is outside {low}..{high}")
    return value


def _once(text: str, seen: set[str], keyword: Token) -> None:
    """SQL Server rejects an option given twice; so do we, at the second occurrence."""
    if keyword.type in seen:
        raise _at(text, keyword, f"{keyword.type} is given more than once")
    seen.add(keyword.type)


def _priority_value(text: str, item: Tree[Token]) -> tuple[Token, str | int]:
    keyword, value = item.children[0], item.children[1]
    assert isinstance(keyword, Token)
    if keyword.type != "PRIORITY_LEVEL":
        return keyword, _name_or_any(text, value)
    assert isinstance(value, Token)
    if value.type == "DEFAULT":
        return keyword, DEFAULT_LEVEL
    return keyword, _int(text, value, MIN_LEVEL, MAX_LEVEL, "PRIORITY_LEVEL")


def _priority_items(text: str, items: Tree[Token] | None) -> dict[str, str | int]:
    changes: dict[str, str | int] = {}
    seen: set[str] = set()
    for item in _subtrees(items) if items is not None else []:
        keyword, value = _priority_value(text, item)
        _once(text, seen, keyword)
        changes[_FIELD_BY_KEYWORD[keyword.type]] = value
    return changes


def _statement_name(text: str, tree: Tree[Token]) -> str:
    node = _child_tree(tree, "name")
    assert node is not None
    return _name(text, node)


def _create_priority(text: str, tree: Tree[Token]) -> CreatePriority:
    name = _statement_name(text, tree)
    changes = _priority_items(text, _child_tree(tree, "priority_items"))
    try:
        rule = BrokerPriority.model_validate({"name": name, **changes})
    except ValidationError as exc:  # the token checks above should make this unreachable
        raise _at(text, _tokens(tree)[0], f"invalid broker priority {name!r}: {exc}") from None
    return CreatePriority(rule)


def _alter_priority(text: str, tree: Tree[Token]) -> AlterPriority:
    changes = _priority_items(text, _child_tree(tree, "priority_items"))
    return AlterPriority(_statement_name(text, tree), changes)


def _drop_priority(text: str, tree: Tree[Token]) -> DropPriority:
    return DropPriority(_statement_name(text, tree))


def _use_database(text: str, tree: Tree[Token]) -> UseDatabase:
    return UseDatabase(_statement_name(text, tree))


def _on(node: Tree[Token] | Token) -> bool:
    assert isinstance(node, Token)
    return node.type == "ON"


def _activation(text: str, items: Tree[Token]) -> dict[str, object]:
    if _tokens(items):  # ACTIVATION (DROP)
        return {"drop": True}
    settings: dict[str, object] = {}
    seen: set[str] = set()
    for item in _subtrees(items):
        keyword = item.children[0]
        assert isinstance(keyword, Token)
        _once(text, seen, keyword)
        settings.update(_activation_item(text, keyword, item.children[-1]))
    return settings


def _activation_item(text: str, keyword: Token, value: Tree[Token] | Token) -> dict[str, object]:
    if keyword.type == "STATUS":
        return {"status": _on(value)}
    if keyword.type == "PROCEDURE_NAME":
        assert isinstance(value, Tree)
        return {"procedure_name": _name(text, value)}
    assert isinstance(value, Token)
    if keyword.type == "MAX_QUEUE_READERS":
        return {"max_queue_readers": _int(text, value, 0, 32767, "MAX_QUEUE_READERS")}
    user = _unquote(value) if value.type == "STRING" else value.type
    return {"execute_as": user}


def _alter_queue(text: str, tree: Tree[Token]) -> AlterQueue:
    status: bool | None = None
    poison: bool | None = None
    activation: dict[str, object] = {}
    seen: set[str] = set()
    for option in (node for node in _subtrees(tree) if node.data == "queue_option"):
        keyword = option.children[0]
        assert isinstance(keyword, Token)
        _once(text, seen, keyword)
        if keyword.type == "STATUS":
            status = _on(option.children[1])
        elif keyword.type == "ACTIVATION":
            items = option.children[1]
            assert isinstance(items, Tree)
            activation = _activation(text, items)
        else:
            poison = _on(option.children[-1])
    return AlterQueue(_statement_name(text, tree), status, activation, poison)


_BUILDERS: Final[dict[str, Callable[[str, Tree[Token]], Statement]]] = {
    "create_priority": _create_priority,
    "alter_priority": _alter_priority,
    "drop_priority": _drop_priority,
    "alter_queue": _alter_queue,
    "use_database": _use_database,
}


# --- applying statements -------------------------------------------------------------------------


def apply_priority_statements(
    rules: list[BrokerPriority], statements: Iterable[Statement]
) -> list[BrokerPriority]:
    """The rule set after the priority statements, in order; `rules` itself is not changed.

    Queue and USE statements are skipped: the caller decides which database a script is for.
    Every step is checked against a PriorityTable so a clash is reported at the statement that
    caused it, not later when a conversation begins.
    """
    current = list(rules)
    for statement in statements:
        current = _apply_one(current, statement)
    return current


def _apply_one(rules: list[BrokerPriority], statement: Statement) -> list[BrokerPriority]:
    if isinstance(statement, CreatePriority):
        if _find(rules, statement.rule.name) is not None:
            raise DdlError(f"broker priority {statement.rule.name!r} already exists")
        return _checked([*rules, statement.rule])
    if isinstance(statement, AlterPriority):
        old = _require(rules, statement.name)
        new = BrokerPriority.model_validate({**old.model_dump(), **statement.changes})
        return _checked([new if rule is old else rule for rule in rules])
    if isinstance(statement, DropPriority):
        old = _require(rules, statement.name)
        return [rule for rule in rules if rule is not old]
    return rules


def _find(rules: list[BrokerPriority], name: str) -> BrokerPriority | None:
    return next((rule for rule in rules if rule.name == name), None)


def _require(rules: list[BrokerPriority], name: str) -> BrokerPriority:
    found = _find(rules, name)
    if found is None:
        raise DdlError(f"broker priority {name!r} does not exist")
    return found


def _checked(rules: list[BrokerPriority]) -> list[BrokerPriority]:
    try:
        PriorityTable(rules)
    except CatalogError as exc:
        raise DdlError(exc.reason) from None
    return rules
