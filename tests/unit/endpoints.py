"""Endpoints for unit tests: every field an `Endpoint` requires, defaulted, so a test names only
what it is about."""

from __future__ import annotations

from typing import Any

from ksb.wire.endpoint import Endpoint, State

_DEFAULTS: dict[str, Any] = {
    "handle": "h",
    "conversation_id": "h",
    "is_initiator": True,
    "state": State.CONVERSING,
    "local_service": "Init",
    "remote_service": "Tgt",
    "contract": "C",
    "queue": "IQ",
    "group": "g",
    "priority": 5,
    "far_handle": "t",
    "created_ms": 1,
    "updated_ms": 2,
}


def make_endpoint(**fields: Any) -> Endpoint:
    """An endpoint with `fields` over the defaults (any `Endpoint` field)."""
    return Endpoint(**{**_DEFAULTS, **fields})
