"""Activation procedures the activation tests name by dotted path (run in activated tasks)."""

from __future__ import annotations

import errno
import json
import os
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


def inventory(tx: Transaction, messages: list[QueueMessage]) -> None:
    """What an attacker's procedure would try: its environment's secrets, and the files the
    request names (its host's password files, the admin's, its own). The reply says what it
    could read, by path: ``"read"``, or the error's name."""
    for m in messages:
        wanted = json.loads(m.message_body).get("read", [])
        found: dict[str, str] = {}
        for path in wanted:
            try:
                with open(path) as f:
                    f.read()
                found[path] = "read"
            except OSError as exc:
                found[path] = errno.errorcode.get(exc.errno or 0, str(exc))
        secrets = {k: v for k, v in os.environ.items() if "PASSWORD" in k}
        reply = {"env": secrets, "user": os.environ.get("KSB_KAFKA_USERNAME"), "files": found}
        tx.send(m.conversation_handle, "//t/Reply", json.dumps(reply))
