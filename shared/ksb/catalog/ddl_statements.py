"""The statements `ksb sql` understands, as typed values in catalog terms, each with where it stood.

An ALTER says only what the text said (what it leaves out stays as it is), so `ksb.catalog.ddl_apply`
can change exactly the clauses given; `Where` keeps the line, column and head of the statement for
every error about it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

__all__ = [
    "Alter",
    "Create",
    "DatabaseOption",
    "Drop",
    "Kind",
    "Permission",
    "Statement",
    "UseDatabase",
    "Where",
]

Kind = Literal[
    "MESSAGE TYPE", "CONTRACT", "QUEUE", "SERVICE", "ROUTE", "BROKER PRIORITY",
    "XML SCHEMA COLLECTION",
]  # fmt: skip


@dataclass(frozen=True)
class Where:
    """Where a statement starts, and its head (`CREATE QUEUE ExpenseQueue`) for messages."""

    line: int = 0
    column: int = 0
    statement: str = ""


_NOWHERE: Final = Where()


@dataclass(frozen=True)
class Create:
    """CREATE of one object; `fields` are the catalog fields the statement gave."""

    kind: Kind
    name: str
    fields: Mapping[str, Any] = field(default_factory=dict)
    at: Where = field(default=_NOWHERE, compare=False)


@dataclass(frozen=True)
class Alter:
    """ALTER of one object; `fields` holds only what changes.

    A dict value (a queue's `activation`, `dead_letter`) is merged into the current one and None
    puts the default back. ALTER SERVICE adds `add_contracts` / `drop_contracts`.
    """

    kind: Kind
    name: str
    fields: Mapping[str, Any] = field(default_factory=dict)
    at: Where = field(default=_NOWHERE, compare=False)


@dataclass(frozen=True)
class Drop:
    kind: Kind
    name: str
    at: Where = field(default=_NOWHERE, compare=False)


@dataclass(frozen=True)
class Permission:
    """GRANT or REVOKE of SEND on a service or RECEIVE on a queue, to each principal."""

    action: Literal["GRANT", "REVOKE"]
    permission: Literal["SEND", "RECEIVE"]
    target: str
    principals: tuple[str, ...]
    at: Where = field(default=_NOWHERE, compare=False)


@dataclass(frozen=True)
class UseDatabase:
    """USE db; kept so a script covering two databases is not merged into one catalog."""

    name: str
    at: Where = field(default=_NOWHERE, compare=False)


@dataclass(frozen=True)
class DatabaseOption:
    """ALTER DATABASE ... SET HONOR_BROKER_PRIORITY ON|OFF (value) or ENABLE_BROKER (None)."""

    database: str
    option: str
    value: bool | None = None
    at: Where = field(default=_NOWHERE, compare=False)


Statement = Create | Alter | Drop | Permission | UseDatabase | DatabaseOption
