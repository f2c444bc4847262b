"""The catalog: message types, contracts, queues, services, routes, priorities and grants.

Definitions are pydantic models with unknown fields refused, and cross-references are checked after
parsing, so a typo in a YAML file is refused with the field's path named instead of being dropped.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from ksb.catalog.priorities import BrokerPriority, PriorityTable
from ksb.errors import CatalogError, ValidationFailed

if TYPE_CHECKING:
    import yaml

# The validators (jsonschema, lxml through `ksb.catalog.xml_validation`) and the YAML parser are
# imported where a catalog is checked or read, not here: an application imports this module's
# names (END_DIALOG, ...) through the SDK, which installs without them (`pip install ksb`; the
# services and the CLI bring them, pyproject's extras).

__all__ = [
    "DEFAULT_CONTRACT",
    "DEFAULT_MESSAGE_TYPE",
    "DIALOG_TIMER",
    "END_DIALOG",
    "ERROR",
    "SYSTEM_MESSAGE_TYPES",
    "Activation",
    "Catalog",
    "CatalogView",
    "Contract",
    "ContractMessage",
    "DeadLetter",
    "EventNotification",
    "Grant",
    "MessageType",
    "Queue",
    "Route",
    "SentBy",
    "Service",
    "Validation",
    "XmlSchemaCollection",
    "load_catalog_file",
    "parse_catalog",
]

_SYS = "http://schemas.microsoft.com/SQL/ServiceBroker"
END_DIALOG = f"{_SYS}/EndDialog"
ERROR = f"{_SYS}/Error"
DIALOG_TIMER = f"{_SYS}/DialogTimer"
SYSTEM_MESSAGE_TYPES = frozenset({END_DIALOG, ERROR, DIALOG_TIMER})
DEFAULT_MESSAGE_TYPE = "DEFAULT"
DEFAULT_CONTRACT = "DEFAULT"


class Validation(str, Enum):
    """Service Broker's validations (NONE, EMPTY, WELL_FORMED_XML, VALID_XML) and KSB's JSON ones."""

    NONE = "NONE"
    EMPTY = "EMPTY"
    WELL_FORMED_XML = "WELL_FORMED_XML"
    VALID_XML = "VALID_XML"
    """Valid against the XML schema collection named by `xml_schema_collection`."""
    WELL_FORMED_JSON = "WELL_FORMED_JSON"
    SCHEMA = "SCHEMA"
    """Valid JSON against the JSON schema in `schema`."""


class SentBy(str, Enum):
    INITIATOR = "INITIATOR"
    TARGET = "TARGET"
    ANY = "ANY"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class XmlSchemaCollection(_Model):
    """CREATE XML SCHEMA COLLECTION: one self-contained XSD document under a name.

    The XSD is compiled when the catalog is validated (and cached by its text), so a broken schema
    is refused at apply time and the dispatcher never compiles one per message.
    """

    name: str = Field(min_length=1, max_length=128)
    xsd: str = Field(min_length=1)

    @model_validator(mode="after")
    def _compiles(self) -> XmlSchemaCollection:
        from ksb.catalog.xml_validation import compile_schema

        compile_schema(self.xsd)  # ValueError with libxml2's reason
        return self


class MessageType(_Model):
    name: str = Field(min_length=1, max_length=256)
    validation: Validation = Validation.NONE
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    xml_schema_collection: str | None = Field(default=None, min_length=1)
    """VALID_XML WITH SCHEMA COLLECTION: the catalog's `xml_schema_collections` entry to use."""
    _xsd: str | None = PrivateAttr(default=None)
    _json_validator: Any = PrivateAttr(default=None)
    """The schema compiled once, when the catalog is read: `jsonschema.validate` checks the
    schema itself again at every call (2.2 ms a SEND against 62 µs for the compiled one)."""

    @model_validator(mode="after")
    def _schema_matches_validation(self) -> MessageType:
        if self.validation is Validation.SCHEMA:
            import jsonschema

            if self.json_schema is None:
                raise ValueError("validation SCHEMA needs a 'schema'")
            try:
                jsonschema.Draft202012Validator.check_schema(self.json_schema)
                kind = jsonschema.validators.validator_for(
                    self.json_schema, default=jsonschema.Draft202012Validator
                )
                self._json_validator = kind(self.json_schema)
            except jsonschema.SchemaError as exc:  # not a ValueError: pydantic would let it out
                where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
                reason = exc.message if len(exc.message) <= 300 else exc.message[:300] + "..."
                raise ValueError(f"'schema' is not a JSON schema: at {where}: {reason}") from None
            except OverflowError as exc:  # `re`'s answer to a repetition past its limit
                raise ValueError(f"'schema' is not a JSON schema: a pattern: {exc}") from None
        elif self.json_schema is not None:
            raise ValueError("'schema' is only allowed with validation SCHEMA")
        if (self.validation is Validation.VALID_XML) != (self.xml_schema_collection is not None):
            raise ValueError(
                "validation VALID_XML goes with an 'xml_schema_collection', and only it"
            )
        return self

    def bind_xml_schema(self, xsd: str) -> None:
        """Attach the XSD text of this type's schema collection (done by `Catalog`'s checks)."""
        self._xsd = xsd

    def validate_body(self, body: bytes) -> None:
        """Raise ValidationFailed with the reason when ``body`` breaks this type's rule."""
        if self.validation is Validation.NONE:
            return
        if self.validation is Validation.EMPTY:
            if body:
                raise ValidationFailed(f"message type {self.name!r} requires an empty body")
            return
        if self.validation in (Validation.WELL_FORMED_XML, Validation.VALID_XML):
            self._validate_xml(body)
            return
        try:
            doc = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValidationFailed(f"body of {self.name!r} is not well-formed JSON: {exc}") from exc
        if self._json_validator is not None:
            from jsonschema.exceptions import best_match

            # The error `jsonschema.validate` would raise: the best match among them all.
            error = best_match(self._json_validator.iter_errors(doc))
            if error is not None:
                where = "/".join(str(p) for p in error.absolute_path) or "(root)"
                raise ValidationFailed(
                    f"body of {self.name!r} fails its schema at {where}: {error.message}"
                )

    def _validate_xml(self, body: bytes) -> None:
        from ksb.catalog.xml_validation import check_well_formed, compile_schema

        if self.validation is Validation.WELL_FORMED_XML:
            check_well_formed(self.name, body)
        else:
            if self._xsd is None:
                raise ValidationFailed(f"message type {self.name!r} has no schema collection bound")
            compile_schema(self._xsd).check(self.name, body)


class ContractMessage(_Model):
    type: str
    sent_by: SentBy


class Contract(_Model):
    name: str = Field(min_length=1, max_length=256)
    messages: tuple[ContractMessage, ...] = Field(min_length=1)

    def allows(self, message_type: str, *, from_initiator: bool) -> bool:
        for m in self.messages:
            if m.type != message_type:
                continue
            if m.sent_by is SentBy.ANY:
                return True
            if (m.sent_by is SentBy.INITIATOR) == from_initiator:
                return True
        return False

    def knows(self, message_type: str) -> bool:
        return any(m.type == message_type for m in self.messages)


class Activation(_Model):
    """Internal activation: a Python callable (``module:function``) or a shell command."""

    status: Literal["ON", "OFF"] = "OFF"
    procedure: str | None = None
    command: str | None = None
    max_queue_readers: int = Field(1, ge=0, le=32767)
    execute_as: str = "SELF"

    @model_validator(mode="after")
    def _one_program(self) -> Activation:
        if self.procedure is not None and self.command is not None:
            raise ValueError("give either procedure or command, not both")
        if self.status == "ON" and self.procedure is None and self.command is None:
            raise ValueError("activation STATUS ON needs a procedure or a command")
        return self


class EventNotification(_Model):
    """A QUEUE_ACTIVATION event notification: the monitor publishes events instead of starting readers."""

    name: str = Field(min_length=1)
    queue: str
    event: Literal["QUEUE_ACTIVATION"] = "QUEUE_ACTIVATION"
    timeout_s: int = Field(60, ge=1)


class DeadLetter(_Model):
    """Beyond Service Broker: after ``max_rollbacks`` rollbacks of one message, move it aside.

    The message goes to the queue's dead-letter topic with the reason and its conversation is ended
    WITH ERROR, so one bad message does not disable the whole queue.
    """

    max_rollbacks: int = Field(3, ge=1)
    error_code: int = -1


class Queue(_Model):
    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.-]+$")
    status: Literal["ON", "OFF"] = "ON"
    retention: Literal["ON", "OFF"] = "OFF"
    partitions: int = Field(1, ge=1, le=64)
    poison_message_handling: Literal["ON", "OFF"] = "ON"
    activation: Activation = Activation()
    dead_letter: DeadLetter | None = None

    @property
    def disabled(self) -> bool:
        """STATUS = OFF: nothing is received from it, and nothing local is delivered into it."""
        return self.status == "OFF"


class Service(_Model):
    name: str = Field(min_length=1, max_length=256)
    queue: str
    contracts: tuple[str, ...] = ()
    owner: str | None = Field(default=None, min_length=1, max_length=64)
    """AUTHORIZATION: a principal that may act as the service without RECEIVE on its queue
    (`ksb.dialog.permissions`)."""


class Route(_Model):
    name: str = Field(min_length=1)
    service_name: str
    broker_instance: str
    address: str = "LOCAL"
    lifetime_s: int | None = Field(default=None, ge=1)
    """LIFETIME: the route expires this long after the catalog version declaring it was applied."""
    via: str | None = Field(default=None, min_length=1)
    """The next hop's broker instance when it is not `broker_instance` (a forwarder); `address`
    is then that hop's cluster."""

    def expires_ms(self, applied_ms: int | None) -> int | None:
        """When this route stops being usable (Unix ms), or None if it never does."""
        if self.lifetime_s is None or applied_ms is None:
            return None
        return applied_ms + self.lifetime_s * 1000

    @property
    def next_hop(self) -> str:
        """The instance whose ``inbound`` topic takes the messages sent on this route."""
        return self.via or self.broker_instance


class Grant(_Model):
    """GRANT SEND ON SERVICE::s / GRANT RECEIVE ON queue, to one principal.

    Stored and shown only: the dispatcher is the one to enforce them.
    """

    permission: Literal["SEND", "RECEIVE"]
    target: str = Field(min_length=1)
    """The service (SEND) or queue (RECEIVE) the permission is on."""
    principal: str = Field(min_length=1, max_length=128)


class Catalog(_Model):
    """A whole catalog as declared; ``version`` is assigned when it is applied."""

    version: int = 0
    applied_ms: int | None = None
    """When this version was applied (Unix ms; set by `apply_catalog`): route lifetimes count from it."""
    message_types: tuple[MessageType, ...] = ()
    contracts: tuple[Contract, ...] = ()
    queues: tuple[Queue, ...] = ()
    services: tuple[Service, ...] = ()
    routes: tuple[Route, ...] = ()
    priorities: tuple[BrokerPriority, ...] = ()
    event_notifications: tuple[EventNotification, ...] = ()
    xml_schema_collections: tuple[XmlSchemaCollection, ...] = ()
    grants: tuple[Grant, ...] = ()
    honor_broker_priority: bool = True
    sla_targets_ms: dict[int, int] = Field(default_factory=dict)
    """Time-in-queue target per priority level (1-10), in ms: the Spark SLA job counts breaches."""

    @model_validator(mode="after")
    def _references_resolve(self) -> Catalog:
        for level, target in self.sla_targets_ms.items():
            if not 1 <= level <= 10 or target < 0:
                raise ValueError(
                    f"sla_targets_ms.{level}: a level 1-10 with a target >= 0 ms, got {target}"
                )
        _unique("message_types", [m.name for m in self.message_types])
        _unique("contracts", [c.name for c in self.contracts])
        _unique("queues", [q.name for q in self.queues])
        _unique("services", [s.name for s in self.services])
        _unique("routes", [r.name for r in self.routes])
        _unique("priorities", [p.name for p in self.priorities])
        _unique("event_notifications", [n.name for n in self.event_notifications])
        _unique("xml_schema_collections", [x.name for x in self.xml_schema_collections])
        bound = _bind_xml_schemas(self.message_types, self.xml_schema_collections)
        object.__setattr__(self, "message_types", bound)  # frozen: set once, while validating
        types = {m.name for m in self.message_types} | {DEFAULT_MESSAGE_TYPE}
        for i, c in enumerate(self.contracts):
            for j, m in enumerate(c.messages):
                if m.type not in types:
                    raise ValueError(
                        f"contracts[{i}].messages[{j}].type: unknown message type {m.type!r}"
                    )
        contracts = {c.name for c in self.contracts} | {DEFAULT_CONTRACT}
        queues = {q.name for q in self.queues}
        for i, n in enumerate(self.event_notifications):
            if n.queue not in queues:
                raise ValueError(f"event_notifications[{i}].queue: unknown queue {n.queue!r}")
        for i, s in enumerate(self.services):
            if s.queue not in queues:
                raise ValueError(f"services[{i}].queue: unknown queue {s.queue!r}")
            for j, cname in enumerate(s.contracts):
                if cname not in contracts:
                    raise ValueError(f"services[{i}].contracts[{j}]: unknown contract {cname!r}")
        _check_grants(self.grants, {s.name for s in self.services}, queues)
        return self


def _bind_xml_schemas(
    types: tuple[MessageType, ...], collections: tuple[XmlSchemaCollection, ...]
) -> tuple[MessageType, ...]:
    """Each VALID_XML type with its collection's XSD, so a SEND validates without a look-up.

    A type is copied before it is bound: an instance handed in may belong to another catalog.
    """
    by_name = {x.name: x.xsd for x in collections}
    bound: list[MessageType] = []
    for i, m in enumerate(types):
        if m.xml_schema_collection is not None:
            xsd = by_name.get(m.xml_schema_collection)
            if xsd is None:
                raise ValueError(
                    f"message_types[{i}].xml_schema_collection: unknown XML schema collection "
                    f"{m.xml_schema_collection!r}"
                )
            m = m.model_copy()
            m.bind_xml_schema(xsd)
        bound.append(m)
    return tuple(bound)


def _check_grants(grants: tuple[Grant, ...], services: set[str], queues: set[str]) -> None:
    """SEND names a catalog service, RECEIVE a catalog queue; one entry per grant."""
    seen: set[tuple[str, str, str]] = set()
    for i, g in enumerate(grants):
        targets, what = (services, "service") if g.permission == "SEND" else (queues, "queue")
        if g.target not in targets:
            raise ValueError(f"grants[{i}].target: {g.permission} on unknown {what} {g.target!r}")
        key = (g.permission, g.target, g.principal)
        if key in seen:
            raise ValueError(
                f"grants[{i}]: duplicate grant of {g.permission} on {g.target!r} to {g.principal!r}"
            )
        seen.add(key)


def _unique(field: str, names: list[str]) -> None:
    seen: set[str] = set()
    for i, n in enumerate(names):
        if n in seen:
            raise ValueError(f"{field}[{i}].name: duplicate name {n!r}")
        seen.add(n)


def parse_catalog(data: Mapping[str, Any]) -> Catalog:
    """Build a Catalog, turning pydantic's errors into one CatalogError that names each field."""
    try:
        return Catalog.model_validate(data)
    except ValidationError as exc:
        parts = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err["loc"]) or "(catalog)"
            parts.append(f"{loc}: {err['msg']}")
        raise CatalogError("invalid catalog: " + "; ".join(parts)) from exc
    except RecursionError:  # a JSON schema nested hundreds deep: the schema check recurses
        raise CatalogError("invalid catalog: nested too deeply") from None


MAX_YAML_VALUES = 100_000
"""Values a catalog file may hold once its aliases are expanded; real catalogs hold hundreds."""


def load_catalog_file(path: Path) -> Catalog:
    import yaml

    try:
        text = path.read_bytes().decode()
    except UnicodeDecodeError as exc:
        raise CatalogError(f"{path}: not UTF-8 text: {exc}") from None
    try:
        data = _yaml_document(text, path)
    except yaml.YAMLError as exc:
        raise CatalogError(f"{path}: not valid YAML: {exc}") from exc
    except RecursionError:
        raise CatalogError(f"{path}: not valid YAML: nested too deeply") from None
    if not isinstance(data, dict):
        raise CatalogError(f"{path}: the catalog must be a mapping at the top level")
    return parse_catalog(data)


def _yaml_document(text: str, path: Path) -> Any:
    """The file's one YAML document, refused when its aliases expand it past `MAX_YAML_VALUES`.

    An alias repeats a node without copying it, so ten aliases of ten aliases of ... make a file
    of a few hundred bytes that everything after the parser (pydantic, the JSON-schema check)
    walks as millions of values, for minutes (a "billion laughs"). The expanded size is counted
    on the composed nodes, in time linear in the file, before anything is built from them.
    """
    import yaml

    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        size = _expanded_size(node, {})
        if size > MAX_YAML_VALUES:
            raise CatalogError(
                f"{path}: its aliases expand it to {size} values, over the limit of "
                f"{MAX_YAML_VALUES}: write the catalog out instead"
            )
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _expanded_size(node: yaml.Node, sizes: dict[int, int]) -> int:
    """How many values `node` stands for once every alias in it is expanded (memoised by node)."""
    known = sizes.get(id(node))
    if known is not None:
        return known
    sizes[id(node)] = 1  # a node that contains itself counts once
    import yaml

    total = 1
    if isinstance(node, yaml.SequenceNode):
        total += sum(_expanded_size(child, sizes) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        total += sum(_expanded_size(k, sizes) + _expanded_size(v, sizes) for k, v in node.value)
    sizes[id(node)] = total
    return total


_BUILTIN_TYPE = MessageType(name=DEFAULT_MESSAGE_TYPE)
_BUILTIN_CONTRACT = Contract(
    name=DEFAULT_CONTRACT,
    messages=(ContractMessage(type=DEFAULT_MESSAGE_TYPE, sent_by=SentBy.ANY),),
)


class CatalogView:
    """Fast look-ups over one catalog version, with Service Broker's built-ins added."""

    def __init__(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self.version = catalog.version
        self.message_types = {m.name: m for m in catalog.message_types}
        self.message_types.setdefault(DEFAULT_MESSAGE_TYPE, _BUILTIN_TYPE)
        self.contracts = {c.name: c for c in catalog.contracts}
        self.contracts.setdefault(DEFAULT_CONTRACT, _BUILTIN_CONTRACT)
        self.queues = {q.name: q for q in catalog.queues}
        self.services = {s.name: s for s in catalog.services}
        self.services_of_queue: dict[str, tuple[str, ...]] = {}
        """Each queue's services (what a sender names), in catalog order."""
        for svc in catalog.services:
            self.services_of_queue[svc.queue] = (
                *self.services_of_queue.get(svc.queue, ()),
                svc.name,
            )
        self.routes = {r.service_name: r for r in catalog.routes}
        carriers: dict[str, set[str]] = {}
        for r in catalog.routes:
            carriers.setdefault(r.broker_instance, set()).add(r.next_hop)
        self.carriers = {origin: frozenset(w) for origin, w in carriers.items()}
        """Each other broker instance our routes lead to -> the instances whose transport or
        forwarder may carry its messages to us: itself, or the forwarder the route goes through
        (routes are declared on both sides, and messages come back the way ours go)."""
        self.peers = frozenset(self.carriers)
        self.notifications = {n.queue: n for n in catalog.event_notifications}
        self.priorities = PriorityTable(catalog.priorities)

    def carries(self, writer: str, origin: str) -> bool:
        """Whether messages of broker instance `origin` may come to us through `writer`."""
        return writer in self.carriers.get(origin, ())

    def service(self, name: str) -> Service:
        try:
            return self.services[name]
        except KeyError:
            raise CatalogError(f"unknown service {name!r}", code="unknown_service") from None

    def contract(self, name: str) -> Contract:
        try:
            return self.contracts[name]
        except KeyError:
            raise CatalogError(f"unknown contract {name!r}", code="unknown_contract") from None

    def message_type(self, name: str) -> MessageType:
        try:
            return self.message_types[name]
        except KeyError:
            raise CatalogError(
                f"unknown message type {name!r}", code="unknown_message_type"
            ) from None

    def queue(self, name: str) -> Queue:
        try:
            return self.queues[name]
        except KeyError:
            raise CatalogError(f"unknown queue {name!r}", code="unknown_queue") from None
