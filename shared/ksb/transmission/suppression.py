"""Suppression: which destinations the transport must not try to connect to yet.

A destination is suppressed for a while after a disconnect and for longer after each failed
connection attempt (`TransportSettings.suppress_after_disconnect_ms`, 15 s, and
`suppress_after_failed_connect_ms`, 60 s), so a dead peer costs one attempt per back-off instead of
one per tick. The deadlines are kept in Redis by the transport, so a restart does not forget them.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["Suppression"]


class Suppression:
    """Which remote destinations the transport must not try to connect to yet.

    Backing off after a disconnect or a failed attempt keeps a dead peer from costing a connection
    attempt on every tick.
    """

    def __init__(
        self,
        *,
        after_disconnect_ms: int,
        after_failed_connect_ms: int,
    ) -> None:
        self._after_disconnect_ms = after_disconnect_ms
        self._after_failed_connect_ms = after_failed_connect_ms
        self._until_ms: dict[str, int] = {}

    def on_disconnect(self, dest: str, now_ms: int) -> None:
        self._extend(dest, now_ms + self._after_disconnect_ms)

    def on_failed_connect(self, dest: str, now_ms: int) -> None:
        """Every failed attempt restarts the full back-off, not only the first one."""
        self._extend(dest, now_ms + self._after_failed_connect_ms)

    def on_connected(self, dest: str) -> None:
        self._until_ms.pop(dest, None)

    def restore(self, dest: str, until_ms: int) -> None:
        """Take back a deadline kept elsewhere (Redis), e.g. after the transport restarted."""
        self._extend(dest, until_ms)

    def deadlines(self) -> dict[str, int]:
        """Every destination's suppression deadline, expired ones included until next checked."""
        return dict(self._until_ms)

    def suppressed_until(self, dest: str) -> int | None:
        return self._until_ms.get(dest)

    def is_suppressed(self, dest: str, now_ms: int) -> bool:
        until = self._until_ms.get(dest)
        if until is None:
            return False
        if now_ms >= until:
            del self._until_ms[dest]
            return False
        return True

    def due(self, pending_dests: Iterable[str], now_ms: int) -> list[str]:
        """Destinations worth a connection attempt now: with pending messages, not suppressed."""
        return [dest for dest in pending_dests if not self.is_suppressed(dest, now_ms)]

    def _extend(self, dest: str, until_ms: int) -> None:
        # A short disconnect back-off must not cut short a longer failed-connect one.
        self._until_ms[dest] = max(until_ms, self._until_ms.get(dest, until_ms))
