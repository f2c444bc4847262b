"""The forwarder: passes on messages that arrive for services this instance does not host.

See `services.forwarder.service` (the Kafka shell) and `ksb.transmission.forwarding` (its pure rules).
"""

from services.forwarder.service import Forwarder

__all__ = ["Forwarder"]
