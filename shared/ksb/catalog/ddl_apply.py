"""Apply parsed Service Broker DDL to a catalog, the way SQL Server runs the script.

Each statement runs in order against an in-memory copy and is checked as SQL Server checks it:
CREATE of a name that exists, ALTER or DROP of one that does not, and DROP of an object something
still uses (a message type in a contract, a contract or queue of a service, a schema collection of
a message type) are refused, naming both. The result is validated once as a whole catalog; the
caller stores it as one new version, so a script applies completely or not at all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final

from pydantic import BaseModel, ValidationError

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
from ksb.catalog.model import (
    DEFAULT_CONTRACT,
    DEFAULT_MESSAGE_TYPE,
    Activation,
    Catalog,
    Contract,
    MessageType,
    Queue,
    Route,
    Service,
    XmlSchemaCollection,
    parse_catalog,
)
from ksb.catalog.priorities import BrokerPriority, PriorityTable
from ksb.errors import CatalogError, DdlError

__all__ = ["apply_script"]

# Per kind: the catalog field holding the objects, how a message names one, and its model.
_KINDS: Final[dict[str, tuple[str, str, type[BaseModel]]]] = {
    "MESSAGE TYPE": ("message_types", "message type", MessageType),
    "CONTRACT": ("contracts", "contract", Contract),
    "QUEUE": ("queues", "queue", Queue),
    "SERVICE": ("services", "service", Service),
    "ROUTE": ("routes", "route", Route),
    "BROKER PRIORITY": ("priorities", "broker priority", BrokerPriority),
    "XML SCHEMA COLLECTION": (
        "xml_schema_collections",
        "XML schema collection",
        XmlSchemaCollection,
    ),
}
_BUILT_IN: Final = {"MESSAGE TYPE": DEFAULT_MESSAGE_TYPE, "CONTRACT": DEFAULT_CONTRACT}

Draft = dict[str, Any]
"""The catalog being changed, as the JSON-shaped dict pydantic dumps and validates."""


class _Refused(Exception):
    """A statement SQL Server would refuse; re-raised as a DdlError at that statement."""


def apply_script(catalog: Catalog, statements: Sequence[Statement]) -> Catalog:
    """The catalog after every statement, validated once; `catalog` itself is not changed."""
    _one_database(statements)
    draft: Draft = catalog.model_dump(mode="json", by_alias=True)
    for statement in statements:
        try:
            _APPLY[type(statement)](draft, statement)
        except _Refused as exc:
            raise _error(statement.at, str(exc)) from None
    try:
        return parse_catalog(draft)
    except CatalogError as exc:  # every statement passed its own checks; the whole still must
        last = statements[-1].at if statements else Where()
        raise _error(last, f"the script leaves an invalid catalog: {exc.reason}") from None


def _error(at: Where, reason: str) -> DdlError:
    return DdlError(
        f"line {at.line}, column {at.column}: {at.statement}: {reason}",
        line=at.line,
        column=at.column,
    )


def _one_database(statements: Iterable[Statement]) -> None:
    """A script defining objects in two databases would merge two catalogs: refuse it.

    Only statements that change objects count, so `USE master; ALTER DATABASE ... SET
    ENABLE_BROKER; USE AppDb;` ahead of the definitions (as SQL Server's tutorials begin) is fine.
    """
    current: str | None = None
    first: str | None = None
    for statement in statements:
        if isinstance(statement, UseDatabase):
            current = statement.name
        elif isinstance(statement, (Create, Alter, Drop, Permission)) and current is not None:
            if first is None:
                first = current
            elif current != first:
                raise _error(
                    statement.at,
                    f"the script defines objects in databases {first!r} and {current!r}; "
                    "apply one database's statements per instance",
                )


# --- looking objects up --------------------------------------------------------------------------


def _objects(draft: Draft, kind: Kind) -> list[dict[str, Any]]:
    objects: list[dict[str, Any]] = draft[_KINDS[kind][0]]
    return objects


def _find(draft: Draft, kind: Kind, name: str) -> dict[str, Any] | None:
    return next((o for o in _objects(draft, kind) if o["name"] == name), None)


def _require(draft: Draft, kind: Kind, name: str) -> dict[str, Any]:
    found = _find(draft, kind, name)
    if found is None:
        if _BUILT_IN.get(kind) == name:
            raise _Refused(f"{_KINDS[kind][1]} {name!r} is built in and cannot be changed")
        raise _Refused(f"{_KINDS[kind][1]} {name!r} does not exist")
    return found


def _exists(draft: Draft, kind: Kind, name: str) -> bool:
    return _BUILT_IN.get(kind) == name or _find(draft, kind, name) is not None


def _validated(kind: Kind, value: dict[str, Any]) -> dict[str, Any]:
    """The object as its model accepts it, so a bad field is reported at its statement."""
    model = _KINDS[kind][2]
    try:
        checked: dict[str, Any] = model.model_validate(value).model_dump(mode="json", by_alias=True)
    except ValidationError as exc:
        parts = [
            f"{'.'.join(str(p) for p in err['loc']) or _KINDS[kind][1]}: {err['msg']}"
            for err in exc.errors()
        ]
        raise _Refused("; ".join(parts)) from None
    return checked


# --- references: what must exist, what may not be dropped ----------------------------------------


def _check_references(draft: Draft, kind: Kind, value: dict[str, Any]) -> None:
    """The names an object uses must already exist, as SQL Server checks at CREATE and ALTER."""
    needs: list[tuple[Kind, str]] = []
    if kind == "MESSAGE TYPE" and value.get("xml_schema_collection") is not None:
        needs.append(("XML SCHEMA COLLECTION", value["xml_schema_collection"]))
    elif kind == "CONTRACT":
        needs.extend(("MESSAGE TYPE", m["type"]) for m in value["messages"])
    elif kind == "SERVICE":
        needs.append(("QUEUE", value["queue"]))
        needs.extend(("CONTRACT", c) for c in value["contracts"])
    for needed_kind, name in needs:
        if not _exists(draft, needed_kind, name):
            raise _Refused(f"{_KINDS[needed_kind][1]} {name!r} does not exist")


def _users(draft: Draft, kind: Kind, name: str) -> list[str]:
    """What still refers to object `name`: DROP of it is refused while this is not empty."""
    if kind == "MESSAGE TYPE":
        return [
            f"contract {c['name']!r}"
            for c in draft["contracts"]
            if any(m["type"] == name for m in c["messages"])
        ]
    if kind == "CONTRACT":
        return [f"service {s['name']!r}" for s in draft["services"] if name in s["contracts"]]
    if kind == "QUEUE":
        services = [f"service {s['name']!r}" for s in draft["services"] if s["queue"] == name]
        notes = [
            f"event notification {n['name']!r}"
            for n in draft["event_notifications"]
            if n["queue"] == name
        ]
        return services + notes
    if kind == "XML SCHEMA COLLECTION":
        return [
            f"message type {m['name']!r}"
            for m in draft["message_types"]
            if m.get("xml_schema_collection") == name
        ]
    return []


def _check_priorities(draft: Draft) -> None:
    """Two rules on the same contract and services would make the winner depend on load order."""
    try:
        PriorityTable(BrokerPriority.model_validate(p) for p in draft["priorities"])
    except CatalogError as exc:
        raise _Refused(exc.reason) from None


# --- statements ----------------------------------------------------------------------------------


def _create(draft: Draft, statement: Create) -> None:
    kind, what = statement.kind, _KINDS[statement.kind][1]
    if _exists(draft, kind, statement.name):
        raise _Refused(f"{what} {statement.name!r} already exists")
    value = _validated(kind, {"name": statement.name, **statement.fields})
    _check_references(draft, kind, value)
    _objects(draft, kind).append(value)
    if kind == "BROKER PRIORITY":
        _check_priorities(draft)


def _merged(current: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """ALTER: only the clauses given change; a nested dict is merged, None restores the default."""
    out = dict(current)
    for key, value in changes.items():
        if key == "activation":
            base = out.get(key) or {}
            out[key] = Activation().model_dump(mode="json") if value is None else {**base, **value}
        elif key == "dead_letter" and value is not None:
            out[key] = {**(out.get(key) or {}), **value}
        else:
            out[key] = value
    return out


def _service_changes(current: dict[str, Any], fields: dict[str, Any]) -> dict[str, Any]:
    """ALTER SERVICE ... (ADD CONTRACT c, DROP CONTRACT d) as the service's new contract list."""
    contracts = list(current["contracts"])
    for name in fields.pop("add_contracts", []):
        if name in contracts:
            raise _Refused(f"service {current['name']!r} already has contract {name!r}")
        contracts.append(name)
    for name in fields.pop("drop_contracts", []):
        if name not in contracts:
            raise _Refused(f"service {current['name']!r} has no contract {name!r}")
        contracts.remove(name)
    return {**fields, "contracts": contracts}


def _alter(draft: Draft, statement: Alter) -> None:
    kind = statement.kind
    current = _require(draft, kind, statement.name)
    fields = dict(statement.fields)
    if kind == "SERVICE":
        fields = _service_changes(current, fields)
    value = _validated(kind, _merged(current, fields))
    _check_references(draft, kind, value)
    objects = _objects(draft, kind)
    objects[objects.index(current)] = value
    if kind == "BROKER PRIORITY":
        _check_priorities(draft)


def _drop(draft: Draft, statement: Drop) -> None:
    kind = statement.kind
    current = _require(draft, kind, statement.name)
    users = _users(draft, kind, statement.name)
    if users:
        what = _KINDS[kind][1]
        raise _Refused(f"{what} {statement.name!r} is still used by {', '.join(users)}")
    _objects(draft, kind).remove(current)
    # SQL Server drops an object's permissions with it.
    permission = {"SERVICE": "SEND", "QUEUE": "RECEIVE"}.get(kind)
    draft["grants"] = [
        g
        for g in draft["grants"]
        if not (g["permission"] == permission and g["target"] == statement.name)
    ]


def _permission(draft: Draft, statement: Permission) -> None:
    """GRANT adds what is missing, REVOKE removes what is there; neither repeats nor fails on it."""
    kind: Kind = "SERVICE" if statement.permission == "SEND" else "QUEUE"
    _require(draft, kind, statement.target)
    for principal in statement.principals:
        entry = {
            "permission": statement.permission,
            "target": statement.target,
            "principal": principal,
        }
        present = entry in draft["grants"]
        if statement.action == "GRANT" and not present:
            draft["grants"].append(entry)
        elif statement.action == "REVOKE" and present:
            draft["grants"].remove(entry)


def _database_option(draft: Draft, statement: DatabaseOption) -> None:
    if statement.option == "HONOR_BROKER_PRIORITY":
        draft["honor_broker_priority"] = statement.value
    # ENABLE_BROKER: KSB's broker is always enabled, so there is nothing to change.


def _use(draft: Draft, statement: UseDatabase) -> None:
    """USE only selects the database; `_one_database` has already checked there is one."""


_APPLY: Final[dict[type, Callable[[Draft, Any], None]]] = {
    Create: _create,
    Alter: _alter,
    Drop: _drop,
    Permission: _permission,
    DatabaseOption: _database_option,
    UseDatabase: _use,
}
