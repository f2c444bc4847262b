"""Large bodies on the wire: splitting an ``inbound`` record into fragments and joining them again.

A Kafka record has a size limit (the broker's ``message.max.bytes``, 1 MB by default), so the
transport sends a serialized `InboundMessage` longer than the fragment size (``KSB_FRAGMENT_BYTES``)
as several `FragmentRecord`s, all keyed by the conversation. The receiving side (the dispatcher, or
a forwarder passing the message on) joins them by message id in a `Reassembler` before anything
else sees the message. Fragments may come twice or out of order (a retransmission overlaps the
first try); a partial message is kept in memory only and is forgotten when it goes stale or the
receiver restarts, which loses nothing: no fragment is acknowledged, only the whole message, so
the origin sends every fragment again.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field

from ksb.wire.protocol import FragmentRecord, InboundMessage, dumps, parse_record

__all__ = ["Reassembler", "wire_records"]


def wire_records(
    record: InboundMessage, fragment_bytes: int, whole: bytes | None = None
) -> list[bytes]:
    """The record values that carry `record`: itself, or its fragments when it is too long.

    `whole` is `record` already serialized (as read from a topic), so it is not serialized again.
    """
    whole = dumps(record) if whole is None else whole
    if len(whole) <= fragment_bytes:
        return [whole]
    pieces = [whole[i : i + fragment_bytes] for i in range(0, len(whole), fragment_bytes)]
    return [
        dumps(
            FragmentRecord(
                message_id=record.message_id,
                conversation_id=record.conversation_id,
                from_instance=record.from_instance,
                to_instance=record.to_instance,
                index=i,
                count=len(pieces),
                data_b64=base64.b64encode(piece).decode(),
            )
        )
        for i, piece in enumerate(pieces)
    ]


@dataclass
class _Partial:
    count: int
    first_ms: int
    pieces: dict[int, bytes] = field(default_factory=dict)


class Reassembler:
    """Partial messages by message id; `offer` returns the whole message once every piece is in."""

    def __init__(self) -> None:
        self._partial: dict[str, _Partial] = {}

    def __len__(self) -> int:
        return len(self._partial)

    def offer(self, fragment: FragmentRecord, now_ms: int) -> InboundMessage | None:
        p = self._partial.get(fragment.message_id)
        if p is None or p.count != fragment.count:  # a count that changed: start again
            p = self._partial[fragment.message_id] = _Partial(fragment.count, now_ms)
        p.pieces.setdefault(fragment.index, base64.b64decode(fragment.data_b64))
        if len(p.pieces) < p.count:
            return None
        del self._partial[fragment.message_id]
        joined = b"".join(p.pieces[i] for i in range(p.count))
        return parse_record(InboundMessage, joined, "inbound record")

    def purge(self, now_ms: int, stale_ms: int) -> int:
        """Forget partial messages older than `stale_ms`; returns how many."""
        stale = [mid for mid, p in self._partial.items() if now_ms - p.first_ms >= stale_ms]
        for mid in stale:
            del self._partial[mid]
        return len(stale)
