"""Poison-message handling: what repeated rollbacks on a queue lead to.

A message that makes every reader roll back would be received again and again forever. Service
Broker's answer: after five rollbacks in a row on a queue, disable the queue (STATUS = OFF) and fire
BROKER_QUEUE_DISABLED, unless the queue says POISON_MESSAGE_HANDLING (STATUS = OFF), in which case
the application handles it. A commit ends the run of rollbacks.

KSB adds dead-letter policies: a queue with one never gets disabled; instead a message rolled back
``max_rollbacks`` times is moved to the queue's dead-letter topic (and its conversation ends with
an error), so the queue goes on serving everything else. The rules are pure; the activation
service counts rollbacks (from Redis) and acts on the answer: a disabled queue gets a record of
its own (`ksb.wire.queue_status`), not a catalog version.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum

from ksb.catalog.model import Queue

__all__ = ["PoisonAction", "on_rollbacks", "to_dead_letter"]


class PoisonAction(str, Enum):
    NOTHING = "nothing"
    DEAD_LETTER = "dead_letter"
    """Move the messages past the queue's dead-letter limit aside."""
    DISABLE = "disable"
    """Disable the queue (STATUS = OFF) and fire BROKER_QUEUE_DISABLED."""


def on_rollbacks(queue: Queue, rollbacks_in_a_row: int, threshold: int) -> PoisonAction:
    """What a new rollback on `queue` leads to, with `rollbacks_in_a_row` counted so far."""
    if queue.dead_letter is not None:
        return PoisonAction.DEAD_LETTER
    if rollbacks_in_a_row < threshold:
        return PoisonAction.NOTHING
    if queue.poison_message_handling != "ON" or queue.status != "ON":
        return PoisonAction.NOTHING
    return PoisonAction.DISABLE


def to_dead_letter(rollbacks_per_message: Mapping[str, int], max_rollbacks: int) -> list[str]:
    """The messages rolled back at least `max_rollbacks` times."""
    return [mid for mid, n in rollbacks_per_message.items() if n >= max_rollbacks]
