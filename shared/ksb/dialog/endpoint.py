"""Conversation endpoints and their state machine, named as Service Broker names them.

The transitions are pure functions over an `Endpoint` so the dispatcher's rules are unit-tested without
Kafka; the dispatcher persists each changed endpoint to the compacted endpoints topic.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass
from enum import Enum
from typing import Any

from ksb.errors import ConversationError, ProtocolError

__all__ = [
    "Endpoint",
    "State",
    "after_end",
    "after_peer_ended",
    "after_peer_error",
    "after_peer_received_end",
    "after_receive",
    "after_send",
    "check_can_send",
    "decode_endpoint",
    "encode_endpoint",
]


class State(str, Enum):
    STARTED_OUTBOUND = "SO"
    STARTED_INBOUND = "SI"
    CONVERSING = "CO"
    DISCONNECTED_INBOUND = "DI"
    DISCONNECTED_OUTBOUND = "DO"
    ERROR = "ER"
    CLOSED = "CD"


_CAN_SEND = {State.STARTED_OUTBOUND, State.STARTED_INBOUND, State.CONVERSING}


@dataclass
class Endpoint:
    handle: str
    conversation_id: str
    is_initiator: bool
    state: State
    local_service: str
    remote_service: str
    contract: str
    queue: str
    group: str
    priority: int
    far_handle: str | None
    created_ms: int
    updated_ms: int
    send_seq: int = 0
    lifetime_deadline_ms: int | None = None
    timer_deadline_ms: int | None = None
    outstanding: int = 0
    error_code: int | None = None
    error_description: str | None = None
    far_instance: str | None = None
    """The broker instance of the far side when it is not this one (None: a local dialog)."""
    recv_seq: int = 0
    """Remote dialogs: the next sequence number expected from the far side. Persisted with the
    endpoint so a restarted dispatcher still drops duplicates; early arrivals are not persisted
    (the sender retransmits them, as it never saw them acknowledged)."""

    def copy(self) -> Endpoint:
        return dataclasses.replace(self)


def check_can_send(ep: Endpoint) -> None:
    if ep.state not in _CAN_SEND:
        raise ConversationError(
            f"cannot SEND on conversation {ep.handle}: it is {ep.state.name}",
            code="conversation_closed",
        )


def after_send(ep: Endpoint) -> State:
    """The first message makes a started conversation CONVERSING."""
    check_can_send(ep)
    return State.CONVERSING


def after_receive(ep: Endpoint) -> State:
    """A target is STARTED_INBOUND until its application has received its first message."""
    return State.CONVERSING if ep.state is State.STARTED_INBOUND else ep.state


def after_end(ep: Endpoint) -> State:
    """END CONVERSATION: closed if the far side already ended or failed, else waiting for it.

    Ending twice is refused: a second END would tell the far side a second time."""
    if ep.state in (State.CLOSED, State.DISCONNECTED_OUTBOUND):
        raise ConversationError(
            f"conversation {ep.handle} has already ended: it is {ep.state.name}",
            code="conversation_closed",
        )
    if ep.state in (State.DISCONNECTED_INBOUND, State.ERROR):
        return State.CLOSED
    return State.DISCONNECTED_OUTBOUND


def after_peer_ended(ep: Endpoint) -> State:
    """An EndDialog arrived: if we had ended too, the conversation is over."""
    if ep.state in (State.DISCONNECTED_OUTBOUND, State.CLOSED):
        return State.CLOSED
    return State.DISCONNECTED_INBOUND


def after_peer_received_end(ep: Endpoint) -> State:
    """The far side received our EndDialog or Error: the acknowledgement that closes us."""
    return State.CLOSED if ep.state is State.DISCONNECTED_OUTBOUND else ep.state


def after_peer_error(ep: Endpoint) -> State:
    return State.CLOSED if ep.state is State.CLOSED else State.ERROR


_FIELDS = tuple(f.name for f in dataclasses.fields(Endpoint))


def encode_endpoint(ep: Endpoint) -> bytes:
    """Flat fields only, so a plain attribute walk beats ``dataclasses.asdict``'s deep copy."""
    d: dict[str, Any] = {"v": 1}
    for name in _FIELDS:
        value = getattr(ep, name)
        if value is not None:
            d[name] = value
    d["state"] = ep.state.name
    return json.dumps(d, separators=(",", ":")).encode()


def decode_endpoint(raw: bytes) -> Endpoint:
    """An endpoint record read back (a rebuild, `ksb endpoints`), or ProtocolError naming what is
    wrong with it.

    The record comes from a topic anyone can write to, and the engine does arithmetic and look-ups
    on every field, so each field is checked against its declared type here rather than failing
    later, far from the record. Fields this version does not know are ignored (a newer writer may
    add some); a missing field that may be null reads as null, as `encode_endpoint` leaves nulls out.
    """
    try:
        d = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"endpoint record is not JSON: {exc}") from None
    if not isinstance(d, dict):
        raise ProtocolError("endpoint record is not a JSON object")
    values: dict[str, Any] = {}
    for f in dataclasses.fields(Endpoint):
        if f.name in d:
            values[f.name] = _field_value(f.name, d[f.name])
        elif f.name in _NULLABLE:
            values[f.name] = None
        elif f.default is dataclasses.MISSING:
            raise ProtocolError(f"endpoint record lacks {f.name!r}")
    return Endpoint(**values)


def _field_value(name: str, value: Any) -> Any:
    if name == "state":
        if isinstance(value, str) and value in State.__members__:
            return State[value]
        raise ProtocolError(f"endpoint record: state {value!r} is not a state name")
    allowed = _TYPES[name]
    if any(value is None if t is type(None) else type(value) is t for t in allowed):
        return value
    names = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
    raise ProtocolError(f"endpoint record: {name} is {value!r}, not {names}")


_TYPES: dict[str, tuple[type, ...]] = {
    name: typing.get_args(hint) or (hint,) for name, hint in typing.get_type_hints(Endpoint).items()
}
"""Each field's declared types (``int | None`` gives int and NoneType); bool is not an int here."""
_NULLABLE = frozenset(name for name, types in _TYPES.items() if type(None) in types)
