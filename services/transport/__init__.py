"""The transport: one connection per destination broker instance, fed by the transmitter over
the ``outbound`` topic. See `services.transport.service`."""

from services.transport.service import Transport

__all__ = ["Transport"]
