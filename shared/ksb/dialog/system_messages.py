"""The bodies of the Error messages the broker itself sends, and their codes.

Codes are negative, like Service Broker's system errors, so an application can tell them from the
codes it passes to END CONVERSATION ... WITH ERROR.
"""

from __future__ import annotations

import json

__all__ = [
    "CONTRACT_REFUSED",
    "LIFETIME_EXPIRED",
    "VALIDATION_CODE",
    "VALIDATION_ERROR",
    "error_body",
    "parse_error_body",
]

LIFETIME_EXPIRED = -8489
VALIDATION_ERROR = -9615
CONTRACT_REFUSED = -8408

VALIDATION_CODE = {
    "NONE": "N",
    "EMPTY": "E",
    "WELL_FORMED_XML": "X",
    "VALID_XML": "X",
    "WELL_FORMED_JSON": "J",
    "SCHEMA": "S",
}
"""A message type's validation as the one-letter `validation` column of a queue message."""


def error_body(code: int, description: str) -> bytes:
    return json.dumps({"code": code, "description": description}).encode()


def parse_error_body(body: bytes) -> tuple[int | None, str | None]:
    """The code and description of an Error message's body; a body that is not ours keeps its text."""
    try:
        d = json.loads(body)
        return int(d["code"]), str(d.get("description", ""))
    except (ValueError, KeyError, TypeError):
        return None, body.decode(errors="replace")
