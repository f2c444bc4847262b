"""KSB end to end: BEGIN + SEND through the dispatcher, RECEIVE + commit by reader threads.

The sender BEGINs every dialog and SENDs round-robin over them, so many conversation groups are
ready at once. Receiver threads share one `KsbClient` (one queue index, one request producer) and
each keeps up to ``window`` commits in flight with `Transaction.commit_async`; a message counts as
delivered when its commit's outcome says applied, and its latency is measured at that moment.
Every message carries (dialog, sequence) so the run also checks exactly-once and per-dialog order.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Any

from bench.stats import LatencySummary, Rate, make_body, now_ns, parse_body, summarize
from bench.stuck import stuck_report
from devtools.deployment import Deployment
from ksb.catalog.model import Catalog, parse_catalog
from ksb.errors import KsbError
from ksb.sdk.client import KsbClient, Transaction
from ksb.wire.protocol import QueueMessage

__all__ = [
    "INITIATOR",
    "TARGET",
    "TARGET_QUEUE",
    "KsbResult",
    "Tally",
    "bench_catalog",
    "check_run",
    "fault_at",
    "receive_batch",
    "run_ksb",
    "start_receivers",
]

log = logging.getLogger("bench.e2e")

INITIATOR, TARGET, CONTRACT = "//bench/Initiator", "//bench/Target", "//bench/Contract"
MESSAGE_TYPE = "//bench/Payload"
_WARMUP = 5
_RETRY_S = 0.05
"""A receiver waits this long after a failed RECEIVE before the next."""
INITIATOR_QUEUE, TARGET_QUEUE = "BenchInitiatorQueue", "BenchTargetQueue"


def bench_catalog(target_partitions: int) -> Catalog:
    return parse_catalog(
        {
            "message_types": [{"name": MESSAGE_TYPE, "validation": "NONE"}],
            "contracts": [
                {"name": CONTRACT, "messages": [{"type": MESSAGE_TYPE, "sent_by": "INITIATOR"}]}
            ],
            "queues": [
                {"name": INITIATOR_QUEUE, "partitions": 1},
                {"name": TARGET_QUEUE, "partitions": target_partitions},
            ],
            "services": [
                {"name": INITIATOR, "queue": INITIATOR_QUEUE},
                {"name": TARGET, "queue": TARGET_QUEUE, "contracts": [CONTRACT]},
            ],
        }
    )


@dataclass(frozen=True)
class KsbResult:
    dialogs: int
    rate: Rate
    """First BEGIN to the last applied commit outcome."""
    send_seconds: float
    """How long the sender took to hand every request to its producer and have it acknowledged."""
    latency: LatencySummary
    """SEND -> commit outcome under full load (includes time queued behind earlier messages)."""
    probe: LatencySummary
    """SEND -> RECEIVE -> commit outcome of one message at a time, nothing else in flight."""
    delivered: LatencySummary
    """SEND -> RECEIVE of the same messages: what raw Kafka's one at a time measures (produce ->
    consume, no offset commit), so the like-for-like figure beside the round trip."""
    commits: int
    refused: int
    lock_lost: int
    receive_error_codes: dict[str, int]
    """RECEIVEs that failed (a body not read back in time, Redis failing) and were rolled back
    and retried, by `KsbError.code`: a test of a Redis fault tells its expected errors
    (``lock_store_unavailable``) from ones it must not cause (``not_authorized``)."""
    receivers: int
    window: int
    top: int | None
    verified: bool
    problems: tuple[str, ...]
    phase_seconds: dict[str, float]

    @property
    def receive_errors(self) -> int:
        return sum(self.receive_error_codes.values())

    def as_json(self) -> dict[str, Any]:
        return {
            "dialogs": self.dialogs,
            "throughput": self.rate.as_json(),
            "send_seconds": self.send_seconds,
            "latency_loaded": self.latency.as_json(),
            "latency_unloaded": self.probe.as_json(),
            "latency_delivered": self.delivered.as_json(),
            "commits": self.commits,
            "messages_per_commit": self.rate.messages / self.commits if self.commits else 0,
            "refused_commits": self.refused,
            "lock_lost": self.lock_lost,
            "receive_errors": self.receive_errors,
            "receive_error_codes": self.receive_error_codes,
            "receivers": self.receivers,
            "window": self.window,
            "top": self.top,
            "verified_exactly_once_in_order": self.verified,
            "problems": list(self.problems),
            "phase_seconds": {k: round(v, 2) for k, v in self.phase_seconds.items()},
        }


@dataclass
class Tally:
    """What the commit outcomes said; fed from the reader thread that resolves the futures.

    A caller that passes its own to `run_ksb` can watch ``delivered`` while the run goes on (to
    inject a fault part way), and with ``keep_times`` gets each delivery's time and dialog."""

    expected: int
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: threading.Event = field(default_factory=threading.Event)
    next_seq: dict[int, int] = field(default_factory=dict)
    latencies_ns: list[int] = field(default_factory=list)
    delivered: int = 0
    commits: int = 0
    refused: int = 0
    lock_lost: int = 0
    receive_error_codes: Counter[str] = field(default_factory=Counter)
    last_ns: int = 0
    problems: list[str] = field(default_factory=list)
    keep_times: bool = False
    times: list[tuple[int, int]] = field(default_factory=list)
    """(delivery ns, dialog) per message, with ``keep_times``."""
    handles: list[str] = field(default_factory=list)
    """The dialogs' handles, by dialog number, once they are all begun."""

    def outcome(self, fut: Future[Any], batch: list[tuple[int, int, int]]) -> None:
        now = now_ns()
        with self.lock:
            if fut.exception() is not None:
                self.refused += 1
                return
            self.commits += 1
            for dialog, seq, sent in batch:
                want = self.next_seq.get(dialog, 0)
                if seq != want:
                    kind = "duplicate" if seq < want else "gap"
                    self._problem(f"dialog {dialog}: got message {seq}, expected {want} ({kind})")
                self.next_seq[dialog] = max(want, seq + 1)
                self.latencies_ns.append(now - sent)
                if self.keep_times:
                    self.times.append((now, dialog))
            self.delivered += len(batch)
            self.last_ns = now
            if self.delivered >= self.expected:
                self.done.set()

    def short_of(self, per_dialog: int) -> dict[int, tuple[int, str]]:
        """The dialogs that have not had `per_dialog` messages in order: dialog number ->
        (how many they had, handle)."""
        with self.lock:
            return {
                d: (self.next_seq.get(d, 0), h)
                for d, h in enumerate(self.handles)
                if self.next_seq.get(d, 0) != per_dialog
            }

    def _problem(self, text: str) -> None:
        if len(self.problems) < 20:
            self.problems.append(text)


def _decode(m: QueueMessage) -> tuple[int, int, int]:
    sent, tag = parse_body(m.message_body)
    dialog, _, seq = tag.partition(":")
    return int(dialog), int(seq), sent


def _settle(client: KsbClient, fut: Future[Any], timeout_s: float) -> None:
    """Wait for one outcome, serving producer delivery reports meanwhile; refusals are tallied."""
    with contextlib.suppress(KsbError):  # CommitRefused / LockLost: counted by the done-callback
        client.wait(fut, timeout_s)


def receive_batch(
    tx: Transaction, *, top: int | None, waitfor_ms: int
) -> tuple[list[QueueMessage], KsbError | None]:
    """One RECEIVE on the target queue; `tx` is rolled back when it got nothing or failed (a body
    not read back in time: its messages are still there, to be received again)."""
    try:
        msgs = tx.receive(TARGET_QUEUE, top=top, waitfor_ms=waitfor_ms)
    except KsbError as exc:
        tx.rollback()
        return [], exc
    if not msgs:
        tx.rollback()
    return msgs, None


def _receive_loop(
    client: KsbClient,
    tally: Tally,
    stop: threading.Event,
    *,
    window: int,
    top: int | None,
    errors: list[BaseException],
) -> None:
    # Any outcome frees a place in the window, not only the oldest: a commit waiting on a shard
    # whose dispatcher was lost must not hold up commits that other dispatchers apply.
    outstanding: set[Future[Any]] = set()
    try:
        while not stop.is_set() and not tally.done.is_set():
            outstanding = {f for f in outstanding if not f.done()}
            if len(outstanding) >= window:
                wait(outstanding, timeout=30, return_when=FIRST_COMPLETED)
                continue
            tx = client.transaction()
            msgs, failed = receive_batch(tx, top=top, waitfor_ms=100)
            if failed is not None:
                log.warning("RECEIVE failed; rolled back: %s", failed)
                with tally.lock:
                    tally.receive_error_codes[failed.code] += 1
                stop.wait(_RETRY_S)  # Redis failing over, say: not a tight loop meanwhile
                continue
            if not msgs:
                continue
            batch = [_decode(m) for m in msgs]
            try:
                fut = tx.commit_async()
            except KsbError:
                with tally.lock:
                    tally.lock_lost += 1
                continue
            fut.add_done_callback(functools.partial(_record_outcome, tally, batch))
            outstanding.add(fut)
        for fut in outstanding:
            _settle(client, fut, 30)
    except BaseException as exc:
        errors.append(exc)
        stop.set()


def _send_all(
    client: KsbClient,
    dialogs: int,
    per_dialog: int,
    body_bytes: int,
    started: list[int],
    handles: list[str],
    rate: float | None = None,
) -> None:
    """Every dialog's next message in turn, as fast as the client takes them or at `rate` msg/s."""
    started.append(now_ns())
    handles += [client.begin_dialog(INITIATOR, TARGET, CONTRACT) for _ in range(dialogs)]
    for seq in range(per_dialog):
        for d, h in enumerate(handles):
            if rate is not None:
                _pace(started[0], seq * dialogs + d, rate)
            while True:
                try:
                    client.send(h, MESSAGE_TYPE, make_body(body_bytes, now_ns(), f"{d}:{seq}"))
                    break
                except BufferError:  # the producer's local queue is full: let it drain
                    with contextlib.suppress(KsbError):
                        client.flush(0.05)
    client.flush(60)
    started.append(now_ns())


def _pace(start_ns: int, sent: int, rate: float) -> None:
    """Sleep until the `sent`-th message is due at `rate` msg/s from `start_ns`."""
    ahead_s = (start_ns + sent * 1e9 / rate - now_ns()) / 1e9
    if ahead_s > 0.001:
        time.sleep(ahead_s)


def _probe(
    sender: KsbClient, receiver: KsbClient, count: int, body_bytes: int
) -> tuple[list[int], list[int]]:
    """One message at a time on a fresh dialog: SEND, RECEIVE, commit, wait for the outcome.
    Returns each message's latency to RECEIVE and to its commit's outcome (ns)."""
    handle = sender.begin_dialog(INITIATOR, TARGET, CONTRACT)
    delivered: list[int] = []
    out: list[int] = []
    for i in range(count):
        sender.send(handle, MESSAGE_TYPE, make_body(body_bytes, now_ns(), f"probe:{i}"))
        tx = receiver.transaction()
        msgs = tx.receive(TARGET_QUEUE, waitfor_ms=10_000)
        if len(msgs) != 1:
            tx.rollback()
            raise RuntimeError(f"probe {i}: received {len(msgs)} messages instead of 1")
        sent, _tag = parse_body(msgs[0].message_body)
        delivered.append(now_ns() - sent)
        tx.commit(30)
        out.append(now_ns() - sent)
    return delivered, out


def run_ksb(
    settings: Deployment,
    *,
    dialogs: int,
    messages: int,
    body_bytes: int,
    receivers: int,
    window: int,
    top: int | None,
    probes: int,
    timeout_s: float,
    receiver_settings: Deployment | None = None,
    tally: Tally | None = None,
    on_load: Callable[[bool], None] | None = None,
    rate: float | None = None,
) -> KsbResult:
    """SEND ``messages`` over ``dialogs`` dialogs and RECEIVE them all; the dispatcher must run.

    ``receiver_settings`` names another instance to RECEIVE on (the target service's, across a
    route); by default sender and receiver are on ``settings``' instance. ``on_load`` is called
    with True just before the first BEGIN and with False once the last message is delivered (or
    the run gave up), so a caller can measure the loaded phase alone (CPU time, say). ``rate``
    paces the sender (msg/s); by default it sends as fast as the client takes the messages."""
    per_dialog = max(1, messages // dialogs)
    expected = per_dialog * dialogs
    tally = tally or Tally(expected=expected)
    tally.expected = expected
    stop = threading.Event()
    errors: list[BaseException] = []
    with (
        KsbClient(settings) as sender,
        KsbClient(receiver_settings or settings) as receiver,
    ):
        warm_ns = now_ns()
        _probe(sender, receiver, _WARMUP, body_bytes)  # first transactions, connections, metadata
        threads = start_receivers(
            receiver, tally, stop, errors, receivers=receivers, window=window, top=top
        )
        marks: list[int] = []
        if on_load is not None:
            on_load(True)
        try:
            _send_all(sender, dialogs, per_dialog, body_bytes, marks, tally.handles, rate)
            try:
                _wait_done(tally, stop, timeout_s)
            except TimeoutError as exc:
                short = tally.short_of(per_dialog)
                report = stuck_report(receiver, TARGET_QUEUE, short)
                raise TimeoutError(f"{exc}; problems {tally.problems[:5]}; {report}") from exc
        finally:
            if on_load is not None:
                on_load(False)
            stop.set()
            for t in threads:
                t.join(35)
        if errors:
            raise RuntimeError("a receiver thread failed") from errors[0]
        problems = check_run(tally, receiver, dialogs, per_dialog)
        verified_ns = now_ns()
        delivered, probe = _probe(sender, receiver, probes, body_bytes)
        probe_ns = now_ns()
    return KsbResult(
        dialogs=dialogs,
        rate=Rate(expected, (tally.last_ns - marks[0]) / 1e9),
        send_seconds=(marks[1] - marks[0]) / 1e9,
        latency=summarize(tally.latencies_ns),
        probe=summarize(probe),
        delivered=summarize(delivered),
        commits=tally.commits,
        refused=tally.refused,
        lock_lost=tally.lock_lost,
        receive_error_codes=dict(tally.receive_error_codes),
        receivers=receivers,
        window=window,
        top=top,
        verified=not problems,
        phase_seconds={
            "warmup": (marks[0] - warm_ns) / 1e9,
            "send_receive": (tally.last_ns - marks[0]) / 1e9,
            "drain_and_verify": (verified_ns - tally.last_ns) / 1e9,
            "probes": (probe_ns - verified_ns) / 1e9,
        },
        problems=tuple(problems),
    )


def _wait_done(tally: Tally, stop: threading.Event, timeout_s: float) -> None:
    """Until every message is delivered; a receiver that failed (it sets `stop`) ends the wait
    at once, so its error is reported instead of a timeout minutes later."""
    deadline = time.monotonic() + timeout_s
    while not tally.done.wait(0.2):
        if stop.is_set():
            return
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"only {tally.delivered} of {tally.expected} messages received in {timeout_s:.0f}s"
            )


def start_receivers(
    receiver: KsbClient,
    tally: Tally,
    stop: threading.Event,
    errors: list[BaseException],
    *,
    receivers: int,
    window: int,
    top: int | None,
) -> list[threading.Thread]:
    """Started receiver threads, each keeping up to ``window`` commits in flight until `stop`."""
    threads = [
        threading.Thread(
            target=_receive_loop,
            args=(receiver, tally, stop),
            kwargs={"window": window, "top": top, "errors": errors},
            name=f"bench-receiver-{i}",
            daemon=True,
        )
        for i in range(receivers)
    ]
    for t in threads:
        t.start()
    return threads


def check_run(tally: Tally, receiver: KsbClient, dialogs: int, per_dialog: int) -> list[str]:
    """What is wrong with a finished run: order and duplicates (from the tally), completeness,
    and anything still receivable (a leftover would be a duplicate or a lost receipt)."""
    problems = list(tally.problems)
    if tally.delivered != tally.expected:
        problems.append(f"delivered {tally.delivered} messages, expected {tally.expected}")
    missing = [d for d in range(dialogs) if tally.next_seq.get(d, 0) != per_dialog]
    if missing:
        problems.append(f"{len(missing)} dialogs incomplete, e.g. dialog {missing[0]}")
    tx = receiver.transaction()
    leftover = tx.receive(TARGET_QUEUE, waitfor_ms=500)
    tx.rollback()
    if leftover:
        problems.append(f"{len(leftover)} messages still receivable after the run")
    return problems


def _record_outcome(tally: Any, batch: list[tuple[int, int, int]], fut: Future[Any]) -> None:
    """A commit's outcome, bound to its batch (a named function so its type is known)."""
    tally.outcome(fut, batch)


@contextlib.contextmanager
def fault_at(
    tally: Tally, at: float, fault: Callable[[Tally], None], *, join_s: float = 130
) -> Iterator[list[BaseException]]:
    """Run `fault` in a thread of its own once the share `at` of `tally`'s expected messages has
    been delivered, beside the `run_ksb` of the ``with`` block (the failover section, the
    scale-out and Kafka-cluster tests). Yields the list that receives what the fault raised,
    including that the run ended before it came."""
    failures: list[BaseException] = []

    def inject() -> None:
        try:
            while tally.delivered < at * tally.expected and not tally.done.is_set():
                time.sleep(0.01)
            if tally.done.is_set():
                raise RuntimeError("the run ended before the fault")
            fault(tally)
        except BaseException as exc:
            failures.append(exc)

    injector = threading.Thread(target=inject, name="bench-fault", daemon=True)
    injector.start()
    try:
        yield failures
    finally:
        injector.join(join_s)
