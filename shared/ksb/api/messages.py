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


def to_api(m: QueueMessage) -> pb.Message:
    return pb.Message(
        message_id=m.message_id,
        queue=m.queue,
        status=m.status,
        priority=m.priority,
        queuing_order=m.queuing_order,
        conversation_group_id=m.conversation_group_id,
        conversation_handle=m.conversation_handle,
        conversation_id=m.conversation_id,
        message_sequence_number=m.message_sequence_number,
        service_name=m.service_name,
        service_contract_name=m.service_contract_name,
        message_type_name=m.message_type_name,
        validation=m.validation,
        enqueued_ms=m.enqueued_ms,
        message_body=m.message_body,
        sent_ms=m.sent_ms or 0,
    )


def from_api(m: pb.Message) -> QueueMessage:
    text, b64 = encode_body(m.message_body)
    return QueueMessage(
        message_id=m.message_id,
        queue=m.queue,
        status=m.status,
        priority=m.priority,
        queuing_order=m.queuing_order,
        conversation_group_id=m.conversation_group_id,
        conversation_handle=m.conversation_handle,
        conversation_id=m.conversation_id,
        message_sequence_number=m.message_sequence_number,
        service_name=m.service_name,
        service_contract_name=m.service_contract_name,
        message_type_name=m.message_type_name,
        validation=m.validation,
        enqueued_ms=m.enqueued_ms,
        body=text,
        body_b64=b64,
        sent_ms=m.sent_ms or None,
    )
