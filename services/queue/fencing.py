"""Fencing the locks the queue service lets go without a commit.

The dispatcher refuses a commit under a token older than the newest one applied for its group
(`ksb.dialog.fences`). A lock let go without a commit applies no token: a client that rolled
back could still commit under its old lease while the group's next holder has not committed yet,
and a holder whose lease ran out could commit after the group was taken. So the queue service
tells the dispatcher, with a ``fence`` request on its own requests topic (which only it may
write, `ksb.dialog.sources`): tokens below this one are stale. A ROLLBACK waits for the fence's
outcome before it frees the lock, so no commit under the rolled-back lease can apply once the
group is someone else's; a RECEIVE that takes a lock whose last holder neither committed nor
released it (its lease ran out, or Redis lost it) fences the old tokens without waiting.
"""

from __future__ import annotations

import logging

from confluent_kafka import Producer

from ksb.names import Names
from ksb.queue.outcomes import Outcomes
from ksb.settings import QueueServiceSettings
from ksb.wire.protocol import FenceRequest, dumps

__all__ = ["FENCE_WAIT_S", "Fencing"]

log = logging.getLogger("ksb.queue")

FENCE_WAIT_S = 10.0
"""How long a rollback waits for its fence to apply before it lets the lock go anyway (the
dispatcher of its shard failing over): the commit it fences off is then refused only once the
next holder commits."""


class Fencing:
    """Sends fence requests, and waits for their outcome when asked to."""

    def __init__(
        self, settings: QueueServiceSettings, producer: Producer, outcomes: Outcomes
    ) -> None:
        self._producer = producer
        self._outcomes = outcomes
        self._topic = Names(settings.instance).requests_for(settings.sender)

    def fence(self, queue: str, group: str, below: int, *, wait: bool) -> bool:
        """Tokens of `group` below `below` are stale from the fence's transaction on; with
        `wait`, returns once it applied (False when it did not in `FENCE_WAIT_S`)."""
        req = FenceRequest(queue=queue, group=group, below=below)
        self._producer.produce(self._topic, key=group.encode(), value=dumps(req))
        self._producer.poll(0)
        if not wait:
            return True
        self._producer.flush(FENCE_WAIT_S)
        if self._outcomes.wait(req.request_id, FENCE_WAIT_S) is None:
            log.warning("%s: the fence on group %s not applied in time", queue, group)
            return False
        return True
