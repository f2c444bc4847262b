"""`python -m apps.orders`: the demo's order application, as docker-compose runs it on the KSB image.

Two halves of infra/compose/catalog.yaml's order conversation:

* `accept_order_lines`, the order service, is an activation procedure: the external activator
  starts readers on OrderServiceQueue (infra/demo/external-activator.yaml) that hand it each batch
  inside its RECEIVE's transaction; it replies to every line and ends its side once the client has.
* `main`, the order client (compose's ``orders`` container): every round it opens dialogs of
  order lines, takes the replies from its own queue and, once a dialog has all its replies, ends
  it. It checks what KSB promises a conversation: every line replied to exactly once, in the order
  sent. Only what a committed transaction received counts (a transaction that did not commit
  gives its messages back, and they come again); a failed RECEIVE or commit is tried again. It
  logs one line per round and serves its running totals as JSON on /stats, and /healthz, on
  ``--port``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from ksb.catalog.model import END_DIALOG, ERROR
from ksb.errors import KsbError
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
    """Rounds whose every dialog had all its replies within the round's time, with no problem."""
    dialogs_opened: int = 0
    dialogs_complete: int = 0
    lines_sent: int = 0
    replies: int = 0
    duplicates: int = 0
    out_of_order: int = 0
    strays: int = 0
    """Replies on a dialog this client did not open."""
    missing: int = 0
    """Replies still awaited on the dialogs of rounds that have ended."""
    errors: int = 0
    retries: int = 0
    """RECEIVEs or commits that failed and were tried again (Redis restarting, a dispatcher
    gone): the messages of a transaction that did not commit come again."""
    unknown_outcomes: int = 0
    """Commits whose outcome did not come back in time: applied or not, the client cannot say."""
    problems: list[str] = field(default_factory=list)
    last_round_s: float = 0.0


class Ledger:
    """Every dialog the client opened and the replies it took: each line must come back once,
    in the order sent. Pure bookkeeping, fed only with what committed transactions received.
    """

    def __init__(self) -> None:
        self.expected: dict[str, int] = {}
        self.got: dict[str, list[int]] = {}
        self.duplicates = self.out_of_order = self.strays = 0
        self.problems: list[str] = []

    def open(self, handle: str, lines: int) -> None:
        self.expected[handle] = lines
        self.got[handle] = []

    def record(self, handle: str, line: int) -> None:
        seen = self.got.get(handle)
        if seen is None:
            self.strays += 1
            self.problems.append(f"a reply on a dialog this client did not open: {handle}")
        elif line in seen:
            self.duplicates += 1
            self.problems.append(f"line {line} of {handle} replied to twice")
        else:
            if seen and line < seen[-1]:
                self.out_of_order += 1
                self.problems.append(f"line {line} of {handle} came after line {seen[-1]}")
            seen.append(line)

    def complete(self, handle: str) -> bool:
        return len(self.got.get(handle, ())) >= self.expected.get(handle, 1)

    def missing(self, handles: Iterable[str]) -> int:
        return sum(self.expected[h] - len(self.got[h]) for h in handles)


class OrderClient:
    """Opens a round of dialogs, then receives until each is complete or the round times out.
    A RECEIVE or commit that fails is tried again within the round; a dialog the round leaves
    incomplete still completes when its replies come."""

    def __init__(self, client: KsbClient, dialogs: int, lines: int, round_timeout_s: float) -> None:
        self.client = client
        self.dialogs, self.lines, self.round_timeout_s = dialogs, lines, round_timeout_s
        self.ledger = Ledger()
        self.totals = Totals()
        self.lock = threading.Lock()
        self.ended: set[str] = set()

    def stats(self) -> dict[str, object]:
        with self.lock:
            return asdict(self.totals)

    def run_round(self, stop: threading.Event) -> None:
        started = time.monotonic()
        n = self.totals.rounds
        handles = []
        for d in range(self.dialogs):
            handle = self.client.begin_dialog(CLIENT_SERVICE, ORDER_SERVICE, CONTRACT)
            with self.lock:
                self.ledger.open(handle, self.lines)
            handles.append(handle)
            for line in range(self.lines):
                self.client.send(handle, ORDER_LINE, line_body(f"round-{n}-order-{d}", line))
        self.client.flush()
        deadline = started + self.round_timeout_s
        while not all(h in self.ended for h in handles):
            if time.monotonic() > deadline or stop.is_set():
                break
            try:
                self._receive_once()
            except (KsbError, TimeoutError) as exc:
                unknown = isinstance(exc, TimeoutError)
                with self.lock:
                    self.totals.retries += 1
                    self.totals.unknown_outcomes += unknown
                log.info(
                    "%s (%s): trying again", "commit outcome unknown" if unknown else "failed", exc
                )
                stop.wait(0.5)
        self._close_round(handles, time.monotonic() - started)

    def _receive_once(self) -> None:
        """One transaction: RECEIVE, END the dialogs it completes, commit. Its replies count
        once the commit has applied (a commit not applied gives them back)."""
        tx = self.client.transaction()
        try:
            self._handle(tx, tx.receive(CLIENT_QUEUE, waitfor_ms=RECEIVE_WAIT_MS))
        except BaseException:
            # Not committed: give the group back now (its messages come again) rather than
            # hold it, renewed, until the process ends. A rollback that fails too (the queue
            # service unreachable) leaves the lock to lapse by its lease.
            if not tx.done:
                with contextlib.suppress(KsbError):
                    tx.rollback()
            raise

    def _handle(self, tx: Transaction, msgs: list[QueueMessage]) -> None:
        if not msgs:
            tx.rollback()
            return
        replies: list[tuple[str, int]] = []
        ending: set[str] = set()
        errors = 0
        for m in msgs:
            if m.message_type_name == LINE_ACCEPTED:
                replies.append((m.conversation_handle, int(json.loads(m.message_body)["line"])))
            elif m.message_type_name in (END_DIALOG, ERROR):
                if m.message_type_name == ERROR:
                    errors += 1
                    log.warning("an Error on %s: %s", m.conversation_handle, m.message_body)
                ending.add(m.conversation_handle)
        with self.lock:
            for handle in {h for h, _ in replies} - self.ended:
                have = {*self.ledger.got.get(handle, ()), *(ln for h, ln in replies if h == handle)}
                if len(have) >= self.ledger.expected.get(handle, self.lines):
                    ending.add(handle)
        for handle in sorted(ending - self.ended):
            tx.end_conversation(handle)
        tx.commit()
        with self.lock:
            for handle, line in replies:
                self.ledger.record(handle, line)
            self.ended |= ending
            self.totals.errors += errors

    def _close_round(self, handles: list[str], seconds: float) -> None:
        with self.lock:
            t, ledger = self.totals, self.ledger
            complete = sum(1 for h in handles if ledger.complete(h))
            t.rounds += 1
            t.dialogs_opened += len(handles)
            t.lines_sent += len(handles) * self.lines
            t.dialogs_complete = sum(1 for h in ledger.expected if ledger.complete(h))
            t.replies = sum(len(v) for v in ledger.got.values())
            t.duplicates, t.out_of_order, t.strays = (
                ledger.duplicates, ledger.out_of_order, ledger.strays,
            )  # fmt: skip
            t.missing = ledger.missing(ledger.expected)
            t.problems = ledger.problems[-20:]
            clean = complete == len(handles) and not ledger.problems
            t.rounds_complete += clean
            t.last_round_s = round(seconds, 3)
        log.info(
            "round %d: %d/%d dialogs complete in %.2f s; so far %d replies, %d duplicates, "
            "%d out of order, %d strays, %d missing, %d errors, %d retries",
            t.rounds, complete, len(handles), seconds, t.replies, t.duplicates, t.out_of_order,
            t.strays, t.missing, t.errors, t.retries,
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
    stop = threading.Event()
    settings = ClientSettings.from_env()
    with stop_on_signals(stop), KsbClient(settings) as client:
        app = OrderClient(client, args.dialogs, args.lines, args.round_timeout_s)
        serve_metrics(args.port, {"/stats": app.stats}, host="0.0.0.0", instance=settings.instance)
        while not stop.is_set() and (args.rounds == 0 or app.totals.rounds < args.rounds):
            try:
                app.run_round(stop)
            except KsbError as exc:
                log.warning("round failed: %s", exc)
            stop.wait(args.interval_s)
    t = app.totals
    clean = not (t.duplicates or t.out_of_order or t.strays or t.missing or t.errors)
    return 0 if clean and t.rounds_complete == t.rounds else 1


if __name__ == "__main__":
    raise SystemExit(main())
