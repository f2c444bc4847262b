"""The wire protocol (version 1): the records any Kafka client reads and writes.

Values are UTF-8 JSON objects with a ``kind``; docs/protocol.md is the reference for other languages.
Parsing is strict (unknown fields refused) so that a misspelt field becomes a clear error record
instead of a silently ignored option.

The records are msgspec structs: every request and every queue message is decoded and encoded on
the dispatcher's and the readers' hot paths, and msgspec does both, with the same strictness, in a
fraction of the time a general-purpose validator takes. Requests may leave out ``v`` (it defaults
to 1); the records KSB writes always carry it, and leave out fields that are null.
"""

from __future__ import annotations

import base64
import itertools
import uuid
from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar

import msgspec

from ksb.errors import ProtocolError
from ksb.wire.partitioning import target_handle

__all__ = [
    "PROTOCOL_VERSION",
    "AckRecord",
    "Action",
    "AnyRequest",
    "BcnEvent",
    "BeginRequest",
    "BrokerNotification",
    "CommitOutcome",
    "CommitRequest",
    "DeadLetterRecord",
    "DeadLetterRequest",
    "EndRequest",
    "ErrorRecord",
    "FenceRequest",
    "FragmentRecord",
    "InboundMessage",
    "QueueMessage",
    "Receipt",
    "ReplayRequest",
    "SendRequest",
    "TimerRequest",
    "Wire",
    "decode_body",
    "dumps",
    "encode_body",
    "new_id",
    "parse_bcn",
    "parse_inbound",
    "parse_queue_record",
    "parse_record",
    "parse_request",
    "replace",
    "to_dict",
]

PROTOCOL_VERSION = 1

_PROCESS_ID = uuid.uuid4().hex
_SEQUENCE = itertools.count()


def new_id() -> str:
    """A request or message id unique across processes and time: this process's random id and a
    counter (a UUID per id would cost a system call each, on the hot path)."""
    return f"{_PROCESS_ID}-{next(_SEQUENCE)}"


NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Level = Annotated[int, msgspec.Meta(ge=1, le=10)]
Handle = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
Name = Annotated[str, msgspec.Meta(min_length=1)]


class Wire(
    msgspec.Struct,
    forbid_unknown_fields=True,
    omit_defaults=True,
    kw_only=True,
    tag_field="kind",
):
    """A version-1 record: strict, ``kind`` first.

    Records KSB writes declare every field they always carry without a default, so it is always
    written; only optional fields (null when absent) are left out, and ``v`` (always 1, written by
    `dumps`).
    """

    v: Literal[1] = 1
    """The protocol version; `dumps` always writes it, parsing takes its absence as 1."""

    @property
    def kind(self) -> str:
        """The record's ``kind`` on the wire (msgspec's tag)."""
        return str(self.__struct_config__.tag)


def _body_bytes(body: str | None, body_b64: str | None) -> bytes:
    if body_b64 is not None:
        try:
            return base64.b64decode(body_b64, validate=True)
        except ValueError as exc:
            raise ProtocolError(f"body_b64 is not valid base64: {exc}") from exc
    return (body or "").encode()


def _one_body(body: str | None, body_b64: str | None) -> None:
    if body is not None and body_b64 is not None:
        raise ValueError("give either body or body_b64, not both")


# --------------------------------------------------------------------------- requests


class BeginRequest(Wire, tag="begin"):
    handle: Handle
    from_service: Name
    to_service: Name
    request_id: str = msgspec.field(default_factory=new_id)
    to_broker_instance: str | None = None
    contract: str = "DEFAULT"
    lifetime_s: Annotated[int, msgspec.Meta(ge=1)] | None = None
    related_conversation: str | None = None
    conversation_group_id: str | None = None


class SendRequest(Wire, tag="send"):
    handles: Annotated[tuple[str, ...], msgspec.Meta(min_length=1)]
    request_id: str = msgspec.field(default_factory=new_id)
    message_type: str = "DEFAULT"
    body: str | None = None
    body_b64: str | None = None
    group: str | None = None
    """The conversation's group when it is not the handle (a conversation begun in a named or
    related group): lets a commit's action reach the dispatcher that owns that group."""

    def __post_init__(self) -> None:
        _one_body(self.body, self.body_b64)

    def body_bytes(self) -> bytes:
        return _body_bytes(self.body, self.body_b64)


class EndRequest(Wire, tag="end"):
    handle: str
    request_id: str = msgspec.field(default_factory=new_id)
    error_code: int | None = None
    error_description: str | None = None
    cleanup: bool = False
    group: str | None = None
    """The conversation's group when it is not the handle (a conversation begun in a named or
    related group): lets a commit's action reach the dispatcher that owns that group."""


class TimerRequest(Wire, tag="timer"):
    handle: str
    timeout_s: Annotated[float, msgspec.Meta(ge=0)]
    request_id: str = msgspec.field(default_factory=new_id)
    group: str | None = None
    """The conversation's group when it is not the handle (a conversation begun in a named or
    related group): lets a commit's action reach the dispatcher that owns that group."""


Action = BeginRequest | SendRequest | EndRequest | TimerRequest


class Receipt(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """What a reader received under one group lock; applied at most once by the dispatcher."""

    queue: str
    group: str
    message_ids: tuple[str, ...]
    token: int = 0
    lease: str | None = None
    """The lock's lease, as the queue service issued it (`ksb.security.leases`): on a secured
    stack the dispatcher applies the receipt only under a lease sealed for this principal, this
    queue and this group, and fences with the token inside it."""
    v: Literal[1] = 1


class CommitRequest(Wire, tag="commit"):
    """A reader's transaction: its receipt and the actions it took, applied all or nothing."""

    request_id: str = msgspec.field(default_factory=new_id)
    reader: str = ""
    receipt: Receipt | None = None
    actions: tuple[Action, ...] = ()


# --------------------------------------------------------------------------- queue records


class QueueMessage(Wire, tag="message"):
    """A message in a queue topic, as RECEIVE returns it (Service Broker's column names).

    Every field is written (``sent_ms`` and the body fields only when set), so a reader in
    another language never has to know a default.
    """

    message_id: str
    queue: str
    status: int
    priority: int
    queuing_order: int
    conversation_group_id: str
    conversation_handle: str
    conversation_id: str
    message_sequence_number: int
    service_name: str
    service_contract_name: str
    message_type_name: str
    validation: str
    enqueued_ms: int
    body: str | None = None
    body_b64: str | None = None
    sent_ms: int | None = None

    @property
    def message_body(self) -> bytes:
        if self.body_b64 is not None:
            return base64.b64decode(self.body_b64)
        return (self.body or "").encode()


class CommitOutcome(Wire, tag="commit_outcome"):
    """A commit's outcome, in its group's partition of the queue topic, keyed ``commit/<group>``.

    The committing reader learns from it whether its commit applied. Keyed by the group, the
    newest outcome of each group survives compaction, and with it ``fence``: the newest lock token
    applied for the group, which is how the fencing rule outlives a dispatcher restart
    (`ksb.dialog.fences`). The key is tombstoned when the group's last conversation ends.
    """

    request_id: str
    group: str
    token: int
    applied: bool
    reason: str
    fence: int = 0
    """The newest token applied for the group after this commit (0: none)."""


# --------------------------------------------------------------------------- records of the broker


class DeadLetterRequest(Wire, tag="dead_letter"):
    """Move one waiting message to its queue's dead-letter topic and end its conversation WITH ERROR."""

    message: QueueMessage
    reason: str
    request_id: str = msgspec.field(default_factory=new_id)


class FenceRequest(Wire, tag="fence"):
    """The queue service let a lock go without a commit (a rollback, or a lease that ran out):
    from now on a commit under a token below `below` is stale (`ksb.dialog.fences`)."""

    queue: Name
    group: Name
    below: NonNegative
    request_id: str = msgspec.field(default_factory=new_id)


class ReplayRequest(Wire, tag="replay"):
    """Put a dead letter back into its queue, ready to RECEIVE again: the one stored at `offset`
    of the queue's dead-letter topic, under `message_id`. The dispatcher reads the message from
    there; nothing of it is the client's word."""

    queue: Name
    message_id: str
    offset: NonNegative
    request_id: str = msgspec.field(default_factory=new_id)


class DeadLetterRecord(Wire, tag="dead_letter"):
    """A record of the dead-letter topic ``ksb.<instance>.dlq.<queue>`` (key: message id)."""

    message: QueueMessage
    reason: str
    dead_lettered_ms: int


class InboundMessage(Wire, tag="inbound"):
    """One message of a dialog crossing broker instances (topic ``inbound`` and ``transmission``).

    The sending dispatcher writes it to its own ``transmission`` topic; the transport copies it,
    unchanged, to the receiving instance's ``inbound`` topic, which that instance's dispatcher reads
    in the same transaction as its requests. ``seq`` counts one direction of the conversation from 0
    (``from_initiator`` names the direction), so the receiver can drop duplicates and restore order.
    ``priority`` is the *sending* endpoint's level, kept for the sender's transmission order and
    views only: the receiver assigns its own level from its own catalog, as Service Broker does.
    """

    message_id: str
    conversation_id: str
    from_instance: str
    to_instance: str
    from_service: str
    to_service: str
    contract: str
    message_type: str
    from_initiator: bool
    seq: NonNegative
    priority: Level
    enqueued_ms: int
    request_id: str = msgspec.field(default_factory=new_id)
    from_group: str | None = None
    """The sending endpoint's conversation group, when it is not its handle."""
    to_group: str | None = None
    """The receiving endpoint's conversation group, when the sender knows it and it is not the
    receiver's handle: the record's key, so it reaches the dispatcher that owns that group."""
    body: str | None = None
    body_b64: str | None = None

    def __post_init__(self) -> None:
        _one_body(self.body, self.body_b64)

    def body_bytes(self) -> bytes:
        return _body_bytes(self.body, self.body_b64)

    @property
    def receiver_handle(self) -> str:
        """The receiving endpoint: the target (derived) for the initiator's messages."""
        if self.from_initiator:
            return target_handle(self.conversation_id)
        return self.conversation_id

    @property
    def key(self) -> str:
        """The receiving endpoint's group: what the record is keyed (and partitioned) by."""
        return self.to_group or self.receiver_handle


class AckRecord(Wire, tag="ack"):
    """Cumulative acknowledgement of one conversation direction (topic ``ksb.<sender>.acks``).

    ``ack_seq`` is the highest sequence number delivered with no gap before it (-1: none yet); an
    older acknowledgement arriving late changes nothing, so the topic needs no ordering guarantees.
    """

    conversation_id: str
    from_initiator: bool
    """The direction acknowledged: True for messages the initiator sent."""
    ack_seq: int
    from_instance: str
    to_instance: str


class FragmentRecord(Wire, tag="fragment"):
    """One piece of an ``inbound`` record too large for one Kafka record (topic ``inbound``).

    The transport splits the serialized `InboundMessage` into ``count`` pieces of at most the
    fragment size; ``data_b64`` is piece ``index`` (from 0). The receiving side joins them by
    ``message_id`` before its dispatcher sees the message; ``to_instance`` lets a forwarder tell
    pieces passing through from its own.
    """

    message_id: str
    conversation_id: str
    from_instance: str
    to_instance: str
    index: NonNegative
    count: Annotated[int, msgspec.Meta(ge=1)]
    data_b64: str

    def __post_init__(self) -> None:
        if self.index >= self.count:
            raise ValueError(f"fragment index {self.index} is not below count {self.count}")


class ErrorRecord(Wire, tag="error"):
    """A record on the error topic: a request that could not be carried out, with the reason."""

    request_id: str | None
    code: str
    reason: str
    handle: str | None = None
    source_topic: str | None = None
    source_partition: int | None = None
    source_offset: int | None = None
    raw: str | None = None


BcnEvent = Literal["start_failed", "started", "catalog_changed"]


class BrokerNotification(Wire, tag="bcn"):
    """A broker configuration notification (BCN) on ``ksb.<instance>.bcn`` (key: the instance).

    Subscribers learn from it that the broker could not start and why (``code``, ``reason``; one per
    failed attempt, retried every 5th tick), that it started, and which catalog version it runs.
    """

    event: BcnEvent
    instance: str
    at_ms: int
    service: str
    catalog_version: NonNegative
    attempt: NonNegative
    """Start attempts so far (1 for the first); 0 on ``catalog_changed``."""
    code: str | None = None
    """Why the start failed, machine-readable: ``no_catalog``, ``invalid_catalog``, ...."""
    reason: str | None = None


AnyRequest = (
    BeginRequest
    | SendRequest
    | EndRequest
    | TimerRequest
    | CommitRequest
    | DeadLetterRequest
    | FenceRequest
    | ReplayRequest
    | InboundMessage
)

# --------------------------------------------------------------------------- decoding

_REQUEST: msgspec.json.Decoder[AnyRequest] = msgspec.json.Decoder(AnyRequest)
_INBOUND: msgspec.json.Decoder[InboundMessage | FragmentRecord] = msgspec.json.Decoder(
    InboundMessage | FragmentRecord
)
_QUEUE_RECORD: msgspec.json.Decoder[QueueMessage | CommitOutcome] = msgspec.json.Decoder(
    QueueMessage | CommitOutcome
)
_BCN: msgspec.json.Decoder[BrokerNotification] = msgspec.json.Decoder(BrokerNotification)
_ENCODER = msgspec.json.Encoder()

T = TypeVar("T")


_DECODERS: dict[Any, Callable[[bytes], Any]] = {}


def _decoder(kind: type[T]) -> Callable[[bytes], T]:
    """One decoder per record type, made on first use (making one costs far more than using it)."""
    decode = _DECODERS.get(kind)
    if decode is None:
        decode = _DECODERS[kind] = msgspec.json.Decoder(kind).decode
    return decode


def parse_record(kind: type[T], raw: bytes | None, what: str) -> T:
    """Decode one record of type `kind`, or raise ProtocolError naming what is wrong."""
    if raw is None:
        raise ProtocolError(f"empty record value (a tombstone is not {what})")
    try:
        return _decoder(kind)(raw)
    except (msgspec.DecodeError, ValueError) as exc:
        raise ProtocolError(f"malformed {what}: {exc}") from None


def _parse(decode: Callable[[bytes], T], raw: bytes | None, what: str) -> T:
    if raw is None:
        raise ProtocolError(f"empty record value (a tombstone is not {what})")
    try:
        return decode(raw)
    except (msgspec.DecodeError, ValueError) as exc:
        raise ProtocolError(f"malformed {what}: {exc}") from None


def parse_request(raw: bytes | None) -> AnyRequest:
    """Decode a request record's value, or raise ProtocolError naming what is wrong."""
    return _parse(_REQUEST.decode, raw, "request")


def parse_inbound(raw: bytes | None) -> InboundMessage | FragmentRecord:
    """Decode an ``inbound`` topic record: a whole message or one fragment of one."""
    return _parse(_INBOUND.decode, raw, "inbound record")


def parse_queue_record(raw: bytes | None) -> QueueMessage | CommitOutcome | None:
    """A queue topic record: a message, a commit outcome, or None for a receipt (tombstone)."""
    if raw is None:
        return None
    return _parse(_QUEUE_RECORD.decode, raw, "queue record")


def parse_bcn(raw: bytes | None) -> BrokerNotification:
    """Decode a ``bcn`` topic record, or raise ProtocolError naming what is wrong."""
    return _parse(_BCN.decode, raw, "BCN record")


# --------------------------------------------------------------------------- encoding


def dumps(record: msgspec.Struct) -> bytes:
    """Compact JSON without nulls, so records stay small and readable, ``{"v":1,"kind":...}``
    first (msgspec writes the tag first and leaves out the default ``v``; it is put back here)."""
    encoded = _ENCODER.encode(record)
    if isinstance(record, Wire):
        return b'{"v":1,' + encoded[1:]
    return encoded


S = TypeVar("S", bound=msgspec.Struct)


def replace(record: S, **changes: Any) -> S:
    """A copy of `record` with `changes` (records are immutable)."""
    return msgspec.structs.replace(record, **changes)


def to_dict(record: msgspec.Struct) -> dict[str, Any]:
    """The record as plain JSON-able data, as it travels (for views and ``--json`` output)."""
    data = msgspec.json.decode(dumps(record))
    assert isinstance(data, dict)
    return data


def encode_body(body: bytes) -> tuple[str | None, str | None]:
    """(body, body_b64): text travels as ``body`` (readable with kcat), anything else as
    ``body_b64``."""
    try:
        return body.decode(), None
    except UnicodeDecodeError:
        return None, base64.b64encode(body).decode()


def decode_body(fields: dict[str, Any]) -> bytes:
    if fields.get("body_b64") is not None:
        return base64.b64decode(fields["body_b64"])
    return str(fields.get("body") or "").encode()
