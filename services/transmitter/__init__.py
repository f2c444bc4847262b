"""The transmitter (with the transport): sends messages for other broker instances and retransmits
what they have not acknowledged. See `services.transmitter.service`."""

from services.transmitter.service import Transmitter

__all__ = ["Transmitter"]
