"""A chaos reader: one process RECEIVEing from one queue and acting by the workload's rule.

``python -m devtools.chaos.reader ROLE QUEUE OUT_FILE`` (ROLE: ``target`` on B, ``initiator`` on
A), with its settings from ``KSB_*`` variables like any SDK application. For each transaction it
writes one JSON line before it commits (``"s": "R"``) and one after the outcome: ``C`` applied,
``X`` refused (with the reason), ``L`` lock lost before the commit, ``U`` no outcome in time,
``B`` rolled back (a poison request). The harness reads these lines for progress and checks them
against what the broker recorded; a line cut short by SIGKILL is ignored.

Every failure of one transaction (Redis or Kafka gone, a refused commit) is logged and the loop
goes on with a new transaction: a reader outlives the faults the harness injects, as an
application should.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
import time
from typing import Any, TextIO

from devtools.chaos.workload import (
    ERROR_CODE,
    REPLY,
    TIMER_S,
    Received,
    Step,
    initiator_step,
    target_step,
)
from ksb.errors import CommitRefused, LockLost
from ksb.sdk.client import KsbClient, Transaction
from ksb.settings import ClientSettings
from ksb.wire.protocol import QueueMessage

__all__ = ["main", "message_tag"]

log = logging.getLogger("devtools.chaos.reader")
COMMIT_TIMEOUT_S = 120.0


def message_tag(m: QueueMessage) -> list[Any]:
    """What a line records of a message: id, handle, type and body (short)."""
    return [m.message_id, m.conversation_handle, m.message_type_name, m.message_body.decode()]


def _write(out: TextIO, state: str, n: int, **fields: Any) -> None:
    out.write(json.dumps({"s": state, "t": n, **fields}) + "\n")
    out.flush()


def _act(tx: Transaction, step: Step) -> None:
    for handle, body in step.replies:
        tx.send(handle, REPLY, body)
    for handle in step.timers:
        tx.begin_conversation_timer(handle, TIMER_S)
    for handle, with_error in step.ends:
        if with_error:
            tx.end_conversation(handle, error_code=ERROR_CODE, error_description="chaos error end")
        else:
            tx.end_conversation(handle)


def _one(client: KsbClient, role: str, queue: str, out: TextIO, n: int) -> None:
    tx = client.transaction()
    try:
        msgs = tx.receive(queue, waitfor_ms=200)
    except Exception:
        log.exception("RECEIVE failed")
        _safe_rollback(tx)
        time.sleep(0.2)
        return
    if not msgs:
        _safe_rollback(tx)
        return
    got = [Received(m.conversation_handle, m.message_type_name, m.message_body) for m in msgs]
    step = target_step(got) if role == "target" else initiator_step(got)
    _write(out, "R", n, m=[message_tag(m) for m in msgs])
    if step.rollback:
        _safe_rollback(tx)
        _write(out, "B", n)
        return
    try:
        _act(tx, step)
        tx.commit(COMMIT_TIMEOUT_S)
    except CommitRefused as exc:
        _write(out, "X", n, reason=str(exc))
        return
    except LockLost as exc:
        _write(out, "L", n, reason=str(exc))
        return
    except Exception as exc:
        log.exception("commit failed")
        _write(out, "U", n, reason=f"{type(exc).__name__}: {exc}")
        return
    _write(out, "C", n)


def _safe_rollback(tx: Transaction) -> None:
    try:
        tx.rollback()
    except Exception:
        log.exception("rollback failed")


def main(argv: list[str]) -> None:
    role, queue, out_path = argv[1], argv[2], argv[3]
    if role not in ("target", "initiator"):
        raise SystemExit(f"role must be target or initiator, not {role!r}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s reader %(levelname)s %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with KsbClient(ClientSettings.from_env()) as client, open(out_path, "a") as out:
        print("reader ready", flush=True)
        n = 0
        while not stop.is_set():
            n += 1
            _one(client, role, queue, out, n)


if __name__ == "__main__":
    main(sys.argv)
