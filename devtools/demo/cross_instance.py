"""The cross-instance scenario of `make run`: dialogs from instance demo to instance demo-b.

A stock client on "demo" opens dialogs to the warehouse on "demo-b" through a catalog route: its
messages cross from ``ksb.demo.*`` to ``ksb.demo-b.*`` and the replies come back. The check is
exactly-once and in-order delivery, every endpoint CLOSED, both transmission queues drained and
the connection up.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from devtools.demo.common import (
    INSTANCE,
    INSTANCE_B,
    RECEIVE_WAIT_MS,
    SETTLE_TIMEOUT_S,
    Outcome,
    error_records,
    guarded,
    say,
    settled_states,
    should_stop,
)
from devtools.demo.options import DemoOptions
from devtools.deployment import Deployment
from devtools.runner import ServiceProcess
from ksb.catalog.model import END_DIALOG, ERROR
from ksb.errors import KsbError
from ksb.names import Names
from ksb.runtime.redis_client import redis_client
from ksb.runtime.redis_view import read_transmission_view
from ksb.sdk.client import KsbClient

__all__ = [
    "RESERVE_STOCK",
    "STOCK_CLIENT",
    "STOCK_CONTRACT",
    "STOCK_RESERVED",
    "WAREHOUSE",
    "CrossStats",
    "run_cross_instance",
]

# The cross-instance part: the stock client is on INSTANCE, the warehouse on INSTANCE_B.
STOCK_CLIENT = "//demo/warehouse/StockClient"
WAREHOUSE = "//demo/warehouse/Warehouse"
STOCK_CONTRACT = "//demo/warehouse/StockContract"
RESERVE_STOCK = "//demo/warehouse/ReserveStock"
STOCK_RESERVED = "//demo/warehouse/StockReserved"
CROSS_LINES = 3  # ReserveStock messages per cross-instance dialog
CROSS_TIMEOUT_S = 60.0  # how long the cross-instance dialogs may take
DRAIN_TIMEOUT_S = 30.0  # how long the transmission queues may take to empty afterwards


@dataclass
class CrossStats:
    """What crossed between the instances, from both sides' threads, under one lock."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    lines_received: dict[str, list[int]] = field(default_factory=dict)
    """On B: each conversation's ReserveStock lines, in the order committed RECEIVEs took them."""
    message_ids: Counter[str] = field(default_factory=Counter)
    replies: Counter[str] = field(default_factory=Counter)
    """On A: StockReserved replies per conversation handle."""
    ended: set[str] = field(default_factory=set)
    failures: list[str] = field(default_factory=list)

    def fail(self, what: str) -> None:
        with self.lock:
            self.failures.append(what)

    def received(self, got: list[tuple[str, str, int]]) -> None:
        with self.lock:
            for conversation_id, message_id, line in got:
                self.lines_received.setdefault(conversation_id, []).append(line)
                self.message_ids[message_id] += 1

    def replied(self, handles: list[str], ended: list[str]) -> None:
        with self.lock:
            self.replies.update(handles)
            self.ended.update(ended)

    def n_ended(self) -> int:
        with self.lock:
            return len(self.ended)


def warehouse(client: KsbClient, queue: str, stats: CrossStats, stop: threading.Event) -> None:
    """The target on instance B: RECEIVE reservations; once a dialog's last line is in, reply
    StockReserved and END it in the same transaction. Counts only what a commit applied."""
    while not stop.is_set():
        tx = client.transaction()
        msgs = tx.receive(queue, waitfor_ms=RECEIVE_WAIT_MS)
        if not msgs:
            tx.rollback()
            continue
        got: list[tuple[str, str, int]] = []
        for m in msgs:
            if m.message_type_name == RESERVE_STOCK:
                line = json.loads(m.message_body)
                got.append((m.conversation_id, m.message_id, int(line["line"])))
                if line["line"] == CROSS_LINES - 1:
                    reply = {"order_id": line["order_id"], "lines": CROSS_LINES}
                    tx.send(m.conversation_handle, STOCK_RESERVED, json.dumps(reply))
                    tx.end_conversation(m.conversation_handle)
            elif m.message_type_name in (END_DIALOG, ERROR):
                if m.message_type_name == ERROR:
                    stats.fail(f"warehouse got an Error: {m.message_body.decode(errors='replace')}")
                tx.end_conversation(m.conversation_handle)
        try:
            tx.commit()
        except KsbError as exc:  # not applied: the messages are received again
            stats.fail(f"warehouse: commit not applied: {exc}")
            continue
        stats.received(got)


def stock_client(
    client: KsbClient, queue: str, dialogs: int, stats: CrossStats, stop: threading.Event
) -> None:
    """The initiator's reader on instance A: take the reply, END its side on the EndDialog."""
    while not stop.is_set() and stats.n_ended() < dialogs:
        tx = client.transaction()
        msgs = tx.receive(queue, waitfor_ms=RECEIVE_WAIT_MS)
        if not msgs:
            tx.rollback()
            continue
        replies: list[str] = []
        ended: list[str] = []
        for m in msgs:
            if m.message_type_name == STOCK_RESERVED:
                replies.append(m.conversation_handle)
            elif m.message_type_name in (END_DIALOG, ERROR):
                if m.message_type_name == ERROR:
                    body = m.message_body.decode(errors="replace")
                    stats.fail(f"stock client got an Error: {body}")
                tx.end_conversation(m.conversation_handle)
                ended.append(m.conversation_handle)
        try:
            tx.commit()
        except KsbError as exc:
            stats.fail(f"stock client: commit not applied: {exc}")
            continue
        stats.replied(replies, ended)


def open_stock_dialog(client: KsbClient, order_no: int) -> str:
    """BEGIN DIALOG to the warehouse on the other instance and SEND one line per message."""
    handle = client.begin_dialog(STOCK_CLIENT, WAREHOUSE, STOCK_CONTRACT)
    for line in range(CROSS_LINES):
        body = {"order_id": f"order-{order_no:06d}", "line": line, "sku": f"SKU-{line:04d}"}
        client.send(handle, RESERVE_STOCK, json.dumps(body))
    return handle


def delivery_problems(stats: CrossStats, handles: list[str]) -> list[str]:
    """Exactly once and in order: each dialog's lines arrived 0, 1, 2 ... once each, nothing
    else arrived, no message id twice, and each dialog got one reply and one end."""
    expected = list(range(CROSS_LINES))
    wrong = [h for h in handles if stats.lines_received.get(h) != expected]
    problems = [
        f"dialog {h}: warehouse received lines {stats.lines_received.get(h, [])}, "
        f"expected {expected}"
        for h in wrong[:5]
    ]
    strangers = set(stats.lines_received) - set(handles)
    if strangers:
        problems.append(f"warehouse received {len(strangers)} dialog(s) nobody opened")
    twice = [mid for mid, n in stats.message_ids.items() if n > 1]
    if twice:
        problems.append(f"{len(twice)} message id(s) received more than once")
    no_reply = [h for h in handles if stats.replies[h] != 1]
    if no_reply:
        problems.append(f"{len(no_reply)} dialog(s) without exactly one StockReserved reply")
    if len(stats.ended) < len(handles):
        problems.append(f"{len(handles) - len(stats.ended)} dialog(s) not ended by the client")
    return problems


def wait_transmission_drained(
    settings: Deployment, since_ms: int, timeout_s: float = DRAIN_TIMEOUT_S
) -> dict[str, Any]:
    """The instance's transmission queue view once it is empty in a snapshot taken after
    `since_ms` (an older one could predate the last sends), or the last view after the wait."""
    r = redis_client(settings)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            view = read_transmission_view(r, Names(settings.instance))
            fresh = (view["updated_ms"] or 0) >= since_ms
            if (fresh and not view["messages"]) or time.monotonic() > deadline:
                return view
            time.sleep(0.1)
    finally:
        r.close()


def connection_state(view: dict[str, Any], destination: str) -> str:
    """The transport's connection row to `destination` (like sys.dm_broker_connections)."""
    rows = [c for c in view["connections"] if c.get("destination") == destination]
    return str(rows[0].get("state")) if rows else "no connection"


def run_cross_instance(
    opts: DemoOptions,
    sa: Deployment,
    sb: Deployment,
    queues: tuple[str, str],
    services: list[ServiceProcess],
) -> Outcome:
    """Dialogs from the stock client on A to the warehouse on B, then check what crossed.
    `queues` are the stock client's queue on A and the warehouse's on B."""
    stock_queue, warehouse_queue = queues
    errors_before = len(error_records(sa))
    stats = CrossStats()
    stop = threading.Event()
    client_a, client_b = KsbClient(sa), KsbClient(sb)
    threads: list[threading.Thread] = []
    handles: list[str] = []
    interrupted = False
    elapsed = 0.0
    try:
        threads = [
            threading.Thread(
                target=guarded,
                args=(stats, "warehouse", warehouse, client_b, warehouse_queue, stats, stop),
                name="demo-warehouse",
                daemon=True,
            ),
            threading.Thread(
                target=guarded,
                args=(
                    stats,
                    "stock client",
                    stock_client,
                    client_a,
                    stock_queue,
                    opts.cross_dialogs,
                    stats,
                    stop,
                ),
                name="demo-stock-client",
                daemon=True,
            ),
        ]
        for t in threads:
            t.start()
        say(
            f"running {opts.cross_dialogs} dialogs x {CROSS_LINES} reservations across instances, "
            f"{STOCK_CLIENT} on {INSTANCE} -> {WAREHOUSE} on {INSTANCE_B}"
        )
        started = time.perf_counter()
        handles = [open_stock_dialog(client_a, n) for n in range(opts.cross_dialogs)]
        client_a.flush()
        _await_cross(stats, opts.cross_dialogs, services)
        elapsed = time.perf_counter() - started
    except KeyboardInterrupt:
        interrupted = True
    finally:
        stop.set()
        for t in threads:
            t.join(15)
        client_a.close()
        client_b.close()
        del client_a, client_b  # as in run_dialogs: nothing may keep a producer alive past here
    if interrupted:
        raise KeyboardInterrupt
    return _check_cross(sa, sb, stats, handles, elapsed, errors_before)


def _await_cross(stats: CrossStats, dialogs: int, services: list[ServiceProcess]) -> None:
    """Until the client has ended every dialog, a reader crashed, a service died or time is up."""
    deadline = time.monotonic() + CROSS_TIMEOUT_S
    timed_out = f"cross-instance dialogs timed out after {CROSS_TIMEOUT_S:.0f}s"
    while stats.n_ended() < dialogs:
        if should_stop(stats, services, deadline, timed_out):
            return
        time.sleep(0.02)


@dataclass(frozen=True)
class CrossFacts:
    """What Kafka and Redis say about the cross-instance dialogs once they have settled."""

    states_a: Counter[str]
    states_b: Counter[str]
    waiting: dict[str, int]
    """Unacknowledged messages in each instance's transmission queue view."""
    links: dict[tuple[str, str], str]
    """Connection state by (from instance, to instance), from each transport's view."""
    errors: list[dict[str, Any]]

    @property
    def closed(self) -> int:
        return self.states_a.get("CLOSED", 0) + self.states_b.get("CLOSED", 0)

    @property
    def all_closed(self) -> bool:
        return self.closed == sum(self.states_a.values()) + sum(self.states_b.values())


def _observe_cross(
    sa: Deployment, sb: Deployment, handles: list[str], settled: bool, errors_before: int
) -> CrossFacts:
    """Endpoints CLOSED on both sides first, then both transmission queues in views taken after
    that: once both ends are CLOSED nothing is still on its way, so an empty view means drained.
    Dialogs that did not all end (`settled` False) will not settle: read once, do not wait."""
    settle_s, drain_s = (SETTLE_TIMEOUT_S, DRAIN_TIMEOUT_S) if settled else (0.0, 1.0)
    states_a = settled_states(sa, len(handles), set(handles), settle_s)
    states_b = settled_states(sb, len(handles), timeout_s=settle_s)
    settled_ms = int(time.time() * 1000)
    view_a = wait_transmission_drained(sa, settled_ms, drain_s)
    view_b = wait_transmission_drained(sb, settled_ms, drain_s)
    return CrossFacts(
        states_a=states_a,
        states_b=states_b,
        waiting={INSTANCE: len(view_a["messages"]), INSTANCE_B: len(view_b["messages"])},
        links={
            (INSTANCE, INSTANCE_B): connection_state(view_a, INSTANCE_B),
            (INSTANCE_B, INSTANCE): connection_state(view_b, INSTANCE),
        },
        errors=error_records(sa)[errors_before:] + error_records(sb),
    )


def _check_cross(
    sa: Deployment,
    sb: Deployment,
    stats: CrossStats,
    handles: list[str],
    elapsed: float,
    errors_before: int,
) -> Outcome:
    """Exactly once and in order, every endpoint CLOSED, both transmission queues drained, both
    connections up and no new error records; the summary line says which held."""
    n = len(handles)
    facts = _observe_cross(sa, sb, handles, stats.n_ended() >= n > 0, errors_before)
    delivery = delivery_problems(stats, handles)
    problems = list(stats.failures) + delivery
    if facts.closed != 2 * n or not facts.all_closed:
        problems.append(
            f"cross-instance endpoints not all CLOSED: {INSTANCE} {dict(facts.states_a)}, "
            f"{INSTANCE_B} {dict(facts.states_b)} (expected CLOSED {n} on each)"
        )
    drained = not any(facts.waiting.values())
    if not drained:
        problems.append(f"transmission queues not drained: {facts.waiting} unacknowledged")
    problems += [
        f"connection {src} -> {dst}: {state}"
        for (src, dst), state in facts.links.items()
        if state != "CONNECTED"
    ]
    problems += [f"error record: {r.get('code')}: {r.get('reason')}" for r in facts.errors[:5]]

    links = ", ".join(f"{src} -> {dst} {state}" for (src, dst), state in facts.links.items())
    say(f"  connections: {links}; `ksb transmission` shows them, as each instance's operator")
    received = sum(len(lines) for lines in stats.lines_received.values())
    summary = (
        f"cross-instance: {n} dialogs {INSTANCE} -> {INSTANCE_B}, {received} messages and "
        f"{sum(stats.replies.values())} replies in {elapsed:.2f}s, "
        f"{'exactly once and in order' if not delivery else 'NOT exactly once and in order'}, "
        f"endpoints {facts.closed}/{2 * n} CLOSED, "
        f"transmission queues {'drained' if drained else 'NOT drained'}, "
        f"connection {INSTANCE} -> {INSTANCE_B} {facts.links[(INSTANCE, INSTANCE_B)]}, "
        f"{len(facts.errors)} errors"
    )
    for p in problems:
        say(f"PROBLEM: {p}")
    return Outcome(ok=not problems, summary=summary)
