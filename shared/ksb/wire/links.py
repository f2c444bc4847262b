"""The records of ``ksb.<instance>.links``: the transport tells the transmitter about connections.

One record per change of one destination's connection (`ksb.transmission.links.Links` makes
them), keyed by the destination; the transmitter folds them from the beginning
(`ksb.transmission.links.Peers`) to stop picking for a suppressed destination and to queue again
what a reconnected one has not acknowledged. ``kind`` names the change, not the record, as it
did before these records had a struct of their own: the topic has only this one record type.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from ksb.wire.protocol import dumps, parse_record

__all__ = ["LinkEvent", "LinkEventKind", "encode_link_event", "parse_link_event"]

LinkEventKind = Literal["connected", "failed", "disconnected", "closed"]


class LinkEvent(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    """A change of one connection."""

    destination: str
    kind: LinkEventKind
    address: str
    event_ms: int
    suppressed_until_ms: int | None = None
    """No attempt before this (failed, disconnected); None when nothing is suppressed."""
    reason: str | None = None
    v: Literal[1] = 1


def encode_link_event(event: LinkEvent) -> bytes:
    return dumps(event)


def parse_link_event(raw: bytes | None) -> LinkEvent:
    """Decode a record, or raise `ProtocolError` naming what is wrong with it."""
    return parse_record(LinkEvent, raw, "link event")
