"""The pure rules as the services make them: every number from the settings model's defaults.

The rules take their numbers as required arguments (their one home is `ksb.settings`); tests that
do not care about a number build the rule here, with what a service would pass it by default,
and name only the numbers they test.
"""

from __future__ import annotations

from typing import Any

from ksb.backoff import Backoff
from ksb.settings import TransmitterSettings, TransportSettings
from ksb.transmission.links import Links
from ksb.transmission.queue import TransmissionQueue
from ksb.transmission.retransmit import Retransmitter
from ksb.transmission.suppression import Suppression

TRANSMITTER = TransmitterSettings()
TRANSPORT = TransportSettings()


def retry_backoff() -> Backoff:
    """The transmitter's retransmission curve."""
    return Backoff(initial_ms=TRANSMITTER.retry_initial_ms, max_ms=TRANSMITTER.retry_max_ms)


def retransmitter(backoff: Backoff | None = None) -> Retransmitter:
    return Retransmitter(backoff or retry_backoff())


def transmission_queue(**overrides: Any) -> TransmissionQueue:
    args: dict[str, Any] = {"max_wait_ms": TRANSMITTER.max_wait_ms, "backoff": retry_backoff()}
    return TransmissionQueue(**{**args, **overrides})


def links(**overrides: int) -> Links:
    args = {
        "suppress_after_disconnect_ms": TRANSPORT.suppress_after_disconnect_ms,
        "suppress_after_failed_connect_ms": TRANSPORT.suppress_after_failed_connect_ms,
        "idle_connection_ms": TRANSPORT.idle_connection_ms,
    }
    return Links(**{**args, **overrides})


def suppression(**overrides: int) -> Suppression:
    args = {
        "after_disconnect_ms": TRANSPORT.suppress_after_disconnect_ms,
        "after_failed_connect_ms": TRANSPORT.suppress_after_failed_connect_ms,
    }
    return Suppression(**{**args, **overrides})
