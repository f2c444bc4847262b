"""A queued message as the queue service's API carries it, and back as the wire record.

The service keeps each message as its queue record (`ksb.wire.protocol.QueueMessage`, JSON with
the body as text or base64); the API carries Service Broker's columns with the body as bytes, so a
client in any language gets the body as it was sent. The Python SDK turns them back into
`QueueMessage`, which is what its RECEIVE has always returned.
"""

from __future__ import annotations

from ksb.api.queue.v1 import queue_pb2 as pb
from ksb.wire.protocol import QueueMessage, encode_body

__all__ = ["from_api", "to_api"]


_COLUMNS = (
    "message_id",
    "queue",
    "status",
    "priority",
    "queuing_order",
    "conversation_group_id",
    "conversation_handle",
    "conversation_id",
    "message_sequence_number",
    "service_name",
    "service_contract_name",
    "message_type_name",
    "validation",
    "enqueued_ms",
)
"""The columns both forms carry as they are (the body and the send time differ in form)."""


def to_api(m: QueueMessage) -> pb.Message:
    return pb.Message(
        **{c: getattr(m, c) for c in _COLUMNS},
        message_body=m.message_body,
        sent_ms=m.sent_ms or 0,
    )


def from_api(m: pb.Message) -> QueueMessage:
    text, b64 = encode_body(m.message_body)
    return QueueMessage(
        **{c: getattr(m, c) for c in _COLUMNS},
        body=text,
        body_b64=b64,
        sent_ms=m.sent_ms or None,
    )
