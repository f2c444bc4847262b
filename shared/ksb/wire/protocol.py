"""The wire protocol (version 1): the records any Kafka client reads and writes.

Values are UTF-8 JSON objects carrying ``"v": 1`` and a ``kind``; docs/protocol.md is the reference for
other languages. Parsing is strict (unknown fields refused) so that a misspelt field becomes a clear
error record instead of a silently ignored option.
"""

from __future__ import annotations

import base64
import json
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from ksb.errors import ProtocolError

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
    "FragmentRecord",
    "InboundMessage",
    "InboundRecord",
    "QueueMessage",
    "Receipt",
    "ReplayRequest",
    "Request",
    "SendRequest",
    "TimerRequest",
    "decode_body",
    "encode_body",
    "new_id",
    "parse_bcn",
    "parse_inbound",
    "parse_queue_record",
    "parse_request",
]

PROTOCOL_VERSION = 1


def new_id() -> str:
    return str(uuid.uuid4())


class _Wire(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    v: Literal[1] = 1


class _Body(_Wire):
    """A text ``body`` or a binary ``body_b64``, never both."""

    body: str | None = None
    body_b64: str | None = None

    @model_validator(mode="after")
    def _one_body(self) -> _Body:
        if self.body is not None and self.body_b64 is not None:
            raise ValueError("give either body or body_b64, not both")
        return self

    def body_bytes(self) -> bytes:
        if self.body_b64 is not None:
            try:
                return base64.b64decode(self.body_b64, validate=True)
            except ValueError as exc:
                raise ProtocolError(f"body_b64 is not valid base64: {exc}") from exc
        return (self.body or "").encode()


class BeginRequest(_Wire):
    kind: Literal["begin"]
    request_id: str = Field(default_factory=new_id)
    handle: str = Field(min_length=1, max_length=64)
    from_service: str = Field(min_length=1)
    to_service: str = Field(min_length=1)
    to_broker_instance: str | None = None
    contract: str = "DEFAULT"
    lifetime_s: int | None = Field(default=None, ge=1)
    related_conversation: str | None = None
    conversation_group_id: str | None = None


class SendRequest(_Body):
    kind: Literal["send"]
    request_id: str = Field(default_factory=new_id)
    handles: tuple[str, ...] = Field(min_length=1)
    message_type: str = "DEFAULT"


class EndRequest(_Wire):
    kind: Literal["end"]
    request_id: str = Field(default_factory=new_id)
    handle: str
    error_code: int | None = None
    error_description: str | None = None
    cleanup: bool = False


class TimerRequest(_Wire):
    kind: Literal["timer"]
    request_id: str = Field(default_factory=new_id)
    handle: str
    timeout_s: float = Field(ge=0)


Action = Annotated[
    BeginRequest | SendRequest | EndRequest | TimerRequest, Field(discriminator="kind")
]


class Receipt(_Wire):
    """What a reader received under one group lock; applied at most once by the dispatcher."""

    queue: str
    group: str
    token: int = 0
    message_ids: tuple[str, ...]


class CommitRequest(_Wire):
    """A reader's transaction: its receipt and the actions it took, applied all or nothing."""

    kind: Literal["commit"]
    request_id: str = Field(default_factory=new_id)
    reader: str = ""
    receipt: Receipt | None = None
    actions: tuple[Action, ...] = ()


class QueueMessage(_Wire):
    """A message in a queue topic, as RECEIVE returns it (Service Broker's column names)."""

    kind: Literal["message"] = "message"
    message_id: str
    queue: str
    status: int = 1
    priority: int
    queuing_order: int = 0
    conversation_group_id: str
    conversation_handle: str
    conversation_id: str
    message_sequence_number: int
    service_name: str
    service_contract_name: str
    message_type_name: str
    validation: str = "N"
    body: str | None = None
    body_b64: str | None = None
    enqueued_ms: int
    sent_ms: int | None = None

    @property
    def message_body(self) -> bytes:
        if self.body_b64 is not None:
            return base64.b64decode(self.body_b64)
        return (self.body or "").encode()


class DeadLetterRequest(_Wire):
    """Move one waiting message to its queue's dead-letter topic and end its conversation WITH ERROR."""

    kind: Literal["dead_letter"]
    request_id: str = Field(default_factory=new_id)
    message: QueueMessage
    reason: str


class ReplayRequest(_Wire):
    """Put a dead letter back into its queue, ready to RECEIVE again."""

    kind: Literal["replay"]
    request_id: str = Field(default_factory=new_id)
    message: QueueMessage


class DeadLetterRecord(_Wire):
    """A record of the dead-letter topic ``ksb.<instance>.dlq.<queue>`` (key: message id)."""

    kind: Literal["dead_letter"] = "dead_letter"
    message: QueueMessage
    reason: str
    dead_lettered_ms: int


class InboundMessage(_Body):
    """One message of a dialog crossing broker instances (topic ``inbound`` and ``transmission``).

    The sending dispatcher writes it to its own ``transmission`` topic; the transport copies it,
    unchanged, to the receiving instance's ``inbound`` topic, which that instance's dispatcher reads
    in the same transaction as its requests. ``seq`` counts one direction of the conversation from 0
    (``from_initiator`` names the direction), so the receiver can drop duplicates and restore order.
    ``priority`` is the *sending* endpoint's level, kept for the sender's transmission order and
    views only: the receiver assigns its own level from its own catalog, as Service Broker does.
    """

    kind: Literal["inbound"]
    request_id: str = Field(default_factory=new_id)
    message_id: str
    conversation_id: str
    from_instance: str
    to_instance: str
    from_service: str
    to_service: str
    contract: str
    message_type: str
    from_initiator: bool
    seq: int = Field(ge=0)
    priority: int = Field(5, ge=1, le=10)
    enqueued_ms: int


class AckRecord(_Wire):
    """Cumulative acknowledgement of one conversation direction (topic ``ksb.<sender>.acks``).

    ``ack_seq`` is the highest sequence number delivered with no gap before it (-1: none yet); an
    older acknowledgement arriving late changes nothing, so the topic needs no ordering guarantees.
    """

    kind: Literal["ack"] = "ack"
    conversation_id: str
    from_initiator: bool
    """The direction acknowledged: True for messages the initiator sent."""
    ack_seq: int
    from_instance: str
    to_instance: str


class FragmentRecord(_Wire):
    """One piece of an ``inbound`` record too large for one Kafka record (topic ``inbound``).

    The transport splits the serialized `InboundMessage` into ``count`` pieces of at most the
    fragment size; ``data_b64`` is piece ``index`` (from 0). The receiving side joins them by
    ``message_id`` before its dispatcher sees the message; ``to_instance`` lets a forwarder tell
    pieces passing through from its own.
    """

    kind: Literal["fragment"] = "fragment"
    message_id: str
    conversation_id: str
    from_instance: str
    to_instance: str
    index: int = Field(ge=0)
    count: int = Field(ge=1)
    data_b64: str

    @model_validator(mode="after")
    def _index_in_range(self) -> FragmentRecord:
        if self.index >= self.count:
            raise ValueError(f"fragment index {self.index} is not below count {self.count}")
        return self


InboundRecord = Annotated[InboundMessage | FragmentRecord, Field(discriminator="kind")]
_INBOUND = TypeAdapter(InboundRecord)


def parse_inbound(raw: bytes | None) -> InboundMessage | FragmentRecord:
    """Decode an ``inbound`` topic record: a whole message or one fragment of one."""
    if raw is None:
        raise ProtocolError("empty record value (a tombstone is not an inbound record)")
    try:
        return _INBOUND.validate_json(raw)
    except ValidationError as exc:
        parts = []
        for err in exc.errors()[:5]:
            loc = ".".join(str(p) for p in err["loc"]) or "(record)"
            parts.append(f"{loc}: {err['msg']}")
        raise ProtocolError("malformed inbound record: " + "; ".join(parts)) from exc


Request = Annotated[
    BeginRequest
    | SendRequest
    | EndRequest
    | TimerRequest
    | CommitRequest
    | DeadLetterRequest
    | ReplayRequest
    | InboundMessage,
    Field(discriminator="kind"),
]
_REQUEST = TypeAdapter(Request)


AnyRequest = (
    BeginRequest
    | SendRequest
    | EndRequest
    | TimerRequest
    | CommitRequest
    | DeadLetterRequest
    | ReplayRequest
    | InboundMessage
)


def parse_request(raw: bytes | None) -> AnyRequest:
    """Decode a request record's value, or raise ProtocolError naming what is wrong."""
    if raw is None:
        raise ProtocolError("empty record value (a tombstone is not a request)")
    try:
        return _REQUEST.validate_json(raw)
    except ValidationError as exc:
        parts = []
        for err in exc.errors()[:5]:
            loc = ".".join(str(p) for p in err["loc"]) or "(record)"
            parts.append(f"{loc}: {err['msg']}")
        raise ProtocolError("malformed request: " + "; ".join(parts)) from exc


class CommitOutcome(_Wire):
    """Written to the queue topic (key ``commit/<request_id>``) so the committing reader learns."""

    kind: Literal["commit_outcome"] = "commit_outcome"
    request_id: str
    group: str
    token: int
    applied: bool
    reason: str = ""


class ErrorRecord(_Wire):
    """A record on the error topic: a request that could not be carried out, with the reason."""

    kind: Literal["error"] = "error"
    request_id: str | None
    code: str
    reason: str
    handle: str | None = None
    source_topic: str | None = None
    source_partition: int | None = None
    source_offset: int | None = None
    raw: str | None = None


BcnEvent = Literal["start_failed", "started", "catalog_changed"]


class BrokerNotification(_Wire):
    """A broker configuration notification (BCN) on ``ksb.<instance>.bcn`` (key: the instance).

    Subscribers learn from it that the broker could not start and why (``code``, ``reason``; one per
    failed attempt, retried every 5th tick), that it started, and which catalog version it runs.
    """

    kind: Literal["bcn"] = "bcn"
    event: BcnEvent
    instance: str
    service: str = "dispatcher"
    catalog_version: int = Field(0, ge=0)
    attempt: int = Field(0, ge=0)
    """Start attempts so far (1 for the first); 0 on ``catalog_changed``."""
    code: str | None = None
    """Why the start failed, machine-readable: ``no_catalog``, ``invalid_catalog``, ...."""
    reason: str | None = None
    at_ms: int


def parse_bcn(raw: bytes | None) -> BrokerNotification:
    """Decode a ``bcn`` topic record, or raise ProtocolError naming what is wrong."""
    if raw is None:
        raise ProtocolError("empty record value (a tombstone is not a BCN)")
    try:
        return BrokerNotification.model_validate_json(raw)
    except ValidationError as exc:
        raise ProtocolError(f"malformed BCN record: {exc.errors()[0]['msg']}") from exc


def encode_body(body: bytes) -> dict[str, str]:
    """Text bodies travel as ``body`` (readable with kcat); anything else as ``body_b64``."""
    try:
        return {"body": body.decode()}
    except UnicodeDecodeError:
        return {"body_b64": base64.b64encode(body).decode()}


def decode_body(fields: dict[str, Any]) -> bytes:
    if fields.get("body_b64") is not None:
        return base64.b64decode(fields["body_b64"])
    return str(fields.get("body") or "").encode()


def dumps(model: BaseModel) -> bytes:
    """Compact JSON without nulls, so records stay small and readable."""
    return model.model_dump_json(exclude_none=True, by_alias=True).encode()


def loads(raw: bytes) -> dict[str, Any]:
    value = json.loads(raw)
    if not isinstance(value, dict):
        raise ProtocolError("record value is not a JSON object")
    return value


_QUEUE_RECORD = TypeAdapter(Annotated[QueueMessage | CommitOutcome, Field(discriminator="kind")])


def parse_queue_record(raw: bytes | None) -> QueueMessage | CommitOutcome | None:
    """A queue topic record: a message, a commit outcome, or None for a receipt (tombstone)."""
    if raw is None:
        return None
    try:
        return _QUEUE_RECORD.validate_json(raw)
    except ValidationError as exc:
        raise ProtocolError(f"malformed queue record: {exc.errors()[0]['msg']}") from exc
