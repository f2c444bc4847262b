"""A reader in its own process, for the tests that SIGKILL one.

``python -m tests.integration.reader_proc QUEUE OUT_FILE TOP``; settings come from ``KSB_*``
variables, as for a service. For each batch it writes one JSON line before committing (``"s": "R"``)
and one after the commit returns (``"C"``), or ``"X"`` when the commit was refused or its lock lost,
so the test knows what was committed even when the process dies between the two.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from typing import TextIO

from ksb.errors import CommitRefused, LockLost
from ksb.sdk.client import KsbClient
from ksb.settings import ClientSettings


def _write(out: TextIO, state: str, batch: list[list[str]], reason: str = "") -> None:
    out.write(json.dumps({"s": state, "m": batch, "reason": reason}) + "\n")
    out.flush()


def main(argv: list[str]) -> None:
    queue, out_path, top = argv[1], argv[2], int(argv[3])
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with KsbClient(ClientSettings.from_env()) as client, open(out_path, "a") as out:
        print("reader ready", flush=True)
        while not stop.is_set():
            tx = client.transaction()
            msgs = tx.receive(queue, top=top, waitfor_ms=200)
            if not msgs:
                tx.rollback()
                continue
            batch = [[m.message_id, m.message_body.decode()] for m in msgs]
            _write(out, "R", batch)
            try:
                tx.commit()
            except (CommitRefused, LockLost) as exc:
                _write(out, "X", batch, str(exc))
                continue
            _write(out, "C", batch)


if __name__ == "__main__":
    main(sys.argv)
