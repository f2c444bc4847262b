"""`python -m apps.orders`: the demo's order application, as docker-compose runs it on the KSB image.

Two halves of infra/compose/catalog.yaml's order conversation:

* `accept_order_lines`, the order service, is an activation procedure: the external activator
  starts readers on OrderServiceQueue (infra/demo/external-activator.yaml) that hand it each batch
  inside its RECEIVE's transaction; it replies to every line and ends its side once the client has.
* `main`, the order client (compose's ``orders`` container): every round it opens dialogs of
  order lines, takes the replies from its own queue and, once a dialog has all its replies, ends
  it. It checks what KSB promises a conversation: every line replied to exactly once, in the order
  sent. Only what a committed transaction received counts (a transaction that did not commit
  gives its messages back, and they come again). It logs one line per round and serves its
  running totals as JSON on /stats, and /healthz, on ``--port``.
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
from dataclasses import asdict, dataclass, field

from ksb.catalog.model import END_DIALOG, ERROR
from ksb.errors import CommitRefused, KsbError, LockLost
from ksb.runtime.metrics import serve_metrics
from ksb.runtime.service import configure_logging, stop_on_signals
from ksb.sdk.client import KsbClient, Transaction
from ksb.settings import ClientSettings
from ksb.wire.protocol import QueueMessage

__all__ = [
    "CLIENT_QUEUE",
    "CLIENT_SERVICE",
    "CONTRACT",
    "LINE_ACCEPTED",
    "ORDER_LINE",
    "ORDER_SERVICE",
    "Ledger",
    "Totals",
    "accept_order_lines",
    "line_body",
    "main",
]

log = logging.getLogger("apps.orders")

# Names from infra/demo/catalog.yaml (and infra/compose/catalog.yaml, which repeats them).
CLIENT_SERVICE = "//demo/orders/OrderClient"
ORDER_SERVICE = "//demo/orders/OrderService"
CONTRACT = "//demo/orders/OrderContract"
ORDER_LINE = "//demo/orders/OrderLine"
LINE_ACCEPTED = "//demo/orders/LineAccepted"
CLIENT_QUEUE = "OrderClientQueue"
RECEIVE_WAIT_MS = 500


def accept_order_lines(tx: Transaction, messages: list[QueueMessage]) -> None:
    """The order service as an activation procedure: accept each line in the same transaction,
    and end conversations the client has ended."""
    for m in messages:
        if m.message_type_name == ORDER_LINE:
            line = json.loads(m.message_body)
            reply = {"order_id": line["order_id"], "line": line["line"], "status": "accepted"}
            tx.send(m.conversation_handle, LINE_ACCEPTED, json.dumps(reply))
        elif m.message_type_name in (END_DIALOG, ERROR):
            tx.end_conversation(m.conversation_handle)


def line_body(order_id: str, line: int) -> str:
    """One order line, as infra/demo/catalog.yaml's schema for OrderLine wants it."""
    return json.dumps({"order_id": order_id, "line": line, "sku": f"SKU-{line:04d}", "qty": 1})


@dataclass
class Totals:
    """What the client has seen since it started (its /stats)."""

    rounds: int = 0
    rounds_complete: int = 0
    dialogs_opened: int = 0
    dialogs_complete: int = 0
    lines_sent: int = 0
    replies: int = 0
    duplicates: int = 0
    out_of_order: int = 0
    missing: int = 0
    errors: int = 0
    problems: list[str] = field(default_factory=list)
    last_round_s: float = 0.0


class Ledger:
    """Replies per dialog of one round: each line must come back once, in the order sent.

    Pure bookkeeping: `record` takes the replies of a committed transaction, `complete` says
    which dialogs have all their lines.
    """

    def __init__(self, lines: int) -> None:
        self.lines = lines
        self.got: dict[str, list[int]] = {}
        self.duplicates = 0
        self.out_of_order = 0
        self.problems: list[str] = []

    def open(self, handle: str) -> None:
        self.got[handle] = []

    def record(self, handle: str, line: int) -> None:
        seen = self.got.get(handle)
        if seen is None:
            self.problems.append(f"a reply on a dialog this round did not open: {handle}")
            return
        if line in seen:
            self.duplicates += 1
            self.problems.append(f"line {line} of {handle} replied to twice")
        elif seen and line < seen[-1]:
            self.out_of_order += 1
            self.problems.append(f"line {line} of {handle} came after line {seen[-1]}")
        seen.append(line)

    def complete(self, handle: str) -> bool:
        return len(set(self.got.get(handle, ()))) >= self.lines

    def missing(self) -> int:
        return sum(self.lines - len(set(seen)) for seen in self.got.values())


class OrderClient:
    """Opens a round of dialogs, then receives until each is complete or the round times out."""

    def __init__(self, client: KsbClient, dialogs: int, lines: int, round_timeout_s: float) -> None:
        self.client = client
        self.dialogs, self.lines, self.round_timeout_s = dialogs, lines, round_timeout_s
        self.totals = Totals()
        self.lock = threading.Lock()

    def stats(self) -> dict[str, object]:
        with self.lock:
            return asdict(self.totals)

    def run_round(self, stop: threading.Event) -> None:
        started = time.monotonic()
        n = self.totals.rounds
        ledger = Ledger(self.lines)
        open_handles: set[str] = set()
        for d in range(self.dialogs):
            handle = self.client.begin_dialog(CLIENT_SERVICE, ORDER_SERVICE, CONTRACT)
            ledger.open(handle)
            open_handles.add(handle)
            for line in range(self.lines):
                self.client.send(handle, ORDER_LINE, line_body(f"round-{n}-order-{d}", line))
        self.client.flush()
        errors = 0
        deadline = started + self.round_timeout_s
        while open_handles and time.monotonic() < deadline and not stop.is_set():
            errors += self._receive_once(ledger, open_handles)
        self._close_round(ledger, errors, time.monotonic() - started)

    def _receive_once(self, ledger: Ledger, open_handles: set[str]) -> int:
        """One transaction: RECEIVE, END the dialogs that are complete, commit; returns the
        errors seen. The replies count only once the commit has applied."""
        tx = self.client.transaction()
        msgs = tx.receive(CLIENT_QUEUE, waitfor_ms=RECEIVE_WAIT_MS)
        if not msgs:
            tx.rollback()
            return 0
        replies: list[tuple[str, int]] = []
        errors, ended = 0, []
        for m in msgs:
            if m.message_type_name == LINE_ACCEPTED:
                replies.append((m.conversation_handle, int(json.loads(m.message_body)["line"])))
            elif m.message_type_name == ERROR:
                errors += 1
                log.warning("an Error on %s: %s", m.conversation_handle, m.message_body)
                tx.end_conversation(m.conversation_handle)
                ended.append(m.conversation_handle)
            elif m.message_type_name == END_DIALOG:
                tx.end_conversation(m.conversation_handle)
                ended.append(m.conversation_handle)
        ledger_after = {h: list(v) for h, v in ledger.got.items()}
        for handle, line in replies:
            ledger_after.setdefault(handle, []).append(line)
        for handle in {h for h, _ in replies}:
            if handle in open_handles and len(set(ledger_after[handle])) >= ledger.lines:
                tx.end_conversation(handle)
                ended.append(handle)
        try:
            tx.commit()
        except (CommitRefused, LockLost) as exc:
            log.info("commit not applied (%s): the messages come again", exc)
            return 0
        for handle, line in replies:
            ledger.record(handle, line)
        open_handles.difference_update(ended)
        return errors

    def _close_round(self, ledger: Ledger, errors: int, seconds: float) -> None:
        complete = sum(1 for h in ledger.got if ledger.complete(h))
        missing = ledger.missing()
        with self.lock:
            t = self.totals
            t.rounds += 1
            t.dialogs_opened += self.dialogs
            t.dialogs_complete += complete
            t.lines_sent += self.dialogs * self.lines
            t.replies += sum(len(v) for v in ledger.got.values())
            t.duplicates += ledger.duplicates
            t.out_of_order += ledger.out_of_order
            t.missing += missing
            t.errors += errors
            t.problems = (t.problems + ledger.problems)[-20:]
            t.rounds_complete += complete == self.dialogs and not ledger.problems
            t.last_round_s = round(seconds, 3)
        log.info(
            "round %d: %d/%d dialogs complete, %d replies, %d duplicates, %d out of order, "
            "%d missing, %d errors in %.2f s",
            self.totals.rounds, complete, self.dialogs, sum(len(v) for v in ledger.got.values()),
            ledger.duplicates, ledger.out_of_order, missing, errors, seconds,
        )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m apps.orders", description=__doc__)
    parser.add_argument("--dialogs", type=int, default=10, help="dialogs per round")
    parser.add_argument("--lines", type=int, default=5, help="order lines per dialog")
    parser.add_argument("--interval-s", type=float, default=2.0, help="pause between rounds")
    parser.add_argument("--round-timeout-s", type=float, default=60.0)
    parser.add_argument("--rounds", type=int, default=0, help="stop after this many (0: never)")
    parser.add_argument("--port", type=int, default=9100, help="/stats and /healthz (0: none)")
    args = parser.parse_args(argv)
    configure_logging("orders")
    stop = stop_on_signals()
    with KsbClient(ClientSettings.from_env()) as client:
        app = OrderClient(client, args.dialogs, args.lines, args.round_timeout_s)
        serve_metrics(args.port, {"/stats": app.stats}, host="0.0.0.0")
        client.reader(CLIENT_QUEUE)  # follow the queue before the first reply can arrive
        while not stop.is_set() and (args.rounds == 0 or app.totals.rounds < args.rounds):
            try:
                app.run_round(stop)
            except KsbError as exc:
                log.warning("round failed: %s", exc)
            stop.wait(args.interval_s)
    t = app.totals
    ok = t.rounds_complete == t.rounds and not (t.duplicates or t.out_of_order or t.missing)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
