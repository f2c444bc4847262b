"""Remembered logins: a principal's password that Kafka accepted is not asked about again for a
while, one it refused is refused again for a shorter while.

The queue service authenticates its callers with their principals' own Kafka credentials, checked
by logging in to Kafka with them (the service holds no copy of anyone's password). A login costs
a connection and a SCRAM exchange, tens of milliseconds; every call carries the credentials, so
the answer is remembered, by a hash of principal and password (never the password itself), for
`QueueServiceSettings.login_cache_ms`. A refused password is remembered for a tenth of that, so a
client with a wrong one cannot make the service hammer Kafka, and a rotated one works soon.
Pure: the caller asks Kafka and tells the answer.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from ksb.clock import Clock

__all__ = ["LoginMemory"]

_MAX_REMEMBERED = 10_000
"""Logins remembered at most (the oldest go first): a bound, not a tuning knob."""


def _digest(principal: str, password: str) -> bytes:
    return hashlib.sha256(f"{principal}\0{password}".encode()).digest()


class LoginMemory:
    """What Kafka said of each (principal, password) lately."""

    def __init__(self, clock: Clock, *, accepted_ms: int) -> None:
        self._clock = clock
        self._accepted_ms = accepted_ms
        self._refused_ms = accepted_ms // 10
        self._answers: OrderedDict[bytes, tuple[bool, int]] = OrderedDict()

    def known(self, principal: str, password: str) -> bool | None:
        """True (accepted) or False (refused) while remembered; None: ask Kafka."""
        key = _digest(principal, password)
        answer = self._answers.get(key)
        if answer is None:
            return None
        ok, until_ms = answer
        if self._clock.now_ms() >= until_ms:
            del self._answers[key]
            return None
        return ok

    def note(self, principal: str, password: str, accepted: bool) -> None:
        keep_ms = self._accepted_ms if accepted else self._refused_ms
        key = _digest(principal, password)
        self._answers[key] = (accepted, self._clock.now_ms() + keep_ms)
        self._answers.move_to_end(key)
        while len(self._answers) > _MAX_REMEMBERED:
            self._answers.popitem(last=False)
