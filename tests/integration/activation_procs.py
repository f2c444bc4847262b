"""Activation procedures the activation tests name by dotted path (run in activated tasks)."""

from __future__ import annotations

import time

from ksb.sdk.client import Transaction
from ksb.wire.protocol import QueueMessage


def reply(tx: Transaction, messages: list[QueueMessage]) -> None:
    """Answer every request on its own conversation, in the same transaction."""
    for m in messages:
        if m.message_type_name == "//t/Request":
            tx.send(m.conversation_handle, "//t/Reply", m.message_body)


def slow_reply(tx: Transaction, messages: list[QueueMessage]) -> None:
    time.sleep(0.3)
    reply(tx, messages)


def always_fail(tx: Transaction, messages: list[QueueMessage]) -> None:
    raise RuntimeError("this procedure cannot handle its messages")
