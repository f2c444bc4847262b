"""The local stack's ports: free, and out of the kernel's range for outgoing connections, which
could otherwise take a port between its choice and the server's bind."""

from __future__ import annotations

import socket

from devtools.processes import _ephemeral_low, free_port


def test_a_free_port_is_bindable_and_below_the_ephemeral_range() -> None:
    low = _ephemeral_low()
    ports = {free_port() for _ in range(20)}
    assert all(10_000 <= p < low for p in ports), (ports, low)
    assert len(ports) > 1  # at random: parallel runs rarely pick alike
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))
