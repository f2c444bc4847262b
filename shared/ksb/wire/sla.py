"""The records of ``ksb.<instance>.sla``: the Spark audit job's figures, one row per record.

Each row is a window of SLA figures (`ksb.spark.sla`) or of the priority-ordering audit
(`ksb.spark.ordering`), tagged with its ``type`` and the micro-batch that computed it. The rows
are the job's own columns (docs/audit.md lists them), so the record is a JSON object of them
rather than a fixed struct; a replayed micro-batch writes the same rows again under the same keys.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ksb.errors import ProtocolError

__all__ = ["encode_sla_row", "parse_sla_row"]

_ENCODER = msgspec.json.Encoder(enc_hook=str)
"""Values JSON has no type for (a timestamp Spark hands over) travel as their text."""
_DECODER = msgspec.json.Decoder(dict[str, Any])


def encode_sla_row(kind: str, batch_id: int, row: dict[str, Any]) -> bytes:
    """One row of `kind` ("sla" or "ordering") from micro-batch `batch_id`."""
    return _ENCODER.encode({"type": kind, "batch_id": batch_id, **row})


def parse_sla_row(raw: bytes | None) -> dict[str, Any]:
    """A record's row (with its ``type`` and ``batch_id``), or `ProtocolError` naming the fault."""
    if raw is None:
        raise ProtocolError("empty record value (a tombstone is not an SLA row)")
    try:
        row = _DECODER.decode(raw)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"malformed SLA row: {exc}") from None
    if not isinstance(row.get("type"), str):
        raise ProtocolError("SLA row without a type")
    return row
