"""Helpers the integration tests share: draining a queue, reading the error and endpoint topics,
waiting for a condition."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaError, TopicPartition

from devtools.deployment import Deployment
from ksb.names import Names
from ksb.runtime import kafka
from ksb.sdk.client import KsbClient
from ksb.wire.endpoint import Endpoint, decode_endpoint
from ksb.wire.protocol import QueueMessage


def wait_for(what: str, check: Callable[[], bool], timeout_s: float, poll_s: float = 0.02) -> float:
    """Seconds until ``check`` holds; fails the test after ``timeout_s``."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"{what}: not within {timeout_s}s")
        time.sleep(poll_s)
    return time.monotonic() - start


def receive_all(
    client: KsbClient, queue: str, count: int, *, timeout_s: float = 30, top: int | None = None
) -> list[QueueMessage]:
    """RECEIVE and commit until ``count`` messages have arrived (or time runs out)."""
    got: list[QueueMessage] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < count and time.monotonic() < deadline:
        with client.transaction() as tx:
            got.extend(tx.receive(queue, top=top, waitfor_ms=500))
    return got


def read_topic(
    settings: Deployment, topic: str, *, timeout_s: float = 10
) -> list[tuple[bytes | None, bytes | None]]:
    """Every record of a topic, from the beginning to its current end."""
    c = kafka.consumer(settings)
    out: list[tuple[bytes | None, bytes | None]] = []
    try:
        kafka.read_to_end(c, topic, lambda m: out.append((m.key(), m.value())), timeout_s=timeout_s)
    finally:
        c.close()
    return out


def errors(
    settings: Deployment, *, at_least: int = 1, timeout_s: float = 15
) -> list[dict[str, Any]]:
    """The error topic's records, waiting until at least ``at_least`` are there."""
    deadline = time.monotonic() + timeout_s
    while True:
        recs = [
            json.loads(v)
            for _k, v in read_topic(settings, Names(settings.instance).errors_for(settings.sender))
            if v
        ]
        if len(recs) >= at_least or time.monotonic() > deadline:
            return recs
        time.sleep(0.1)


def endpoints(settings: Deployment) -> dict[str, Endpoint]:
    """The latest state of every endpoint, from the compacted endpoints topic."""
    latest: dict[str, Endpoint] = {}
    for k, v in read_topic(settings, Names(settings.instance).endpoints):
        if k is not None and v is not None:
            latest[k.decode()] = decode_endpoint(v)
    return latest


def wait_endpoint(
    settings: Deployment, handle: str, state: str, *, timeout_s: float = 15
) -> Endpoint:
    deadline = time.monotonic() + timeout_s
    while True:
        ep = endpoints(settings).get(handle)
        if ep is not None and ep.state.name == state:
            return ep
        if time.monotonic() > deadline:
            raise AssertionError(
                f"endpoint {handle} is {ep.state.name if ep else None}, not {state}"
            )
        time.sleep(0.1)


def end_offsets(settings: Deployment, topic: str) -> dict[int, int]:
    c = kafka.consumer(settings)
    try:
        md = c.list_topics(topic, timeout=10).topics[topic]
        return {
            p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
            for p in md.partitions
        }
    finally:
        c.close()


__all__ = [
    "KafkaError",
    "end_offsets",
    "endpoints",
    "errors",
    "read_topic",
    "receive_all",
    "wait_endpoint",
]


# --------------------------------------------------------------------------- fault-test helpers
# (appended for test_faults, test_redis_flush and test_bad_input)

import collections  # noqa: E402
import json as _json  # noqa: E402
import threading  # noqa: E402
from concurrent.futures import Future  # noqa: E402

from ksb.errors import CommitRefused, LockLost  # noqa: E402


class Flow:
    """Messages over many dialogs while things break: one thread sends, one RECEIVEs and commits.

    The sender begins ``dialogs`` dialogs and sends ``per_dialog`` messages on each, round-robin, in
    order per dialog, with the JSON body ``{"conv": i, "n": k}``. The reader (unless ``read`` is False)
    RECEIVEs one group per transaction and commits with `commit_async`, keeping at most
    ``max_outstanding`` commits in flight;
    a batch counts as received only once the dispatcher has applied its commit. A commit refused or
    whose lock was lost is not counted: its messages must come back. ``before_commit`` runs in the
    reader thread between RECEIVE and commit, where a test injects a fault.
    """

    def __init__(
        self,
        settings: Deployment,
        sender: KsbClient,
        *,
        dialogs: int,
        per_dialog: int,
        queue: str = "TargetQueue",
        top: int | None = None,
        max_outstanding: int = 32,
        round_pause_s: float = 0.0,
        from_service: str = "//t/Initiator",
        to_service: str = "//t/Target",
        contract: str = "//t/Contract",
        message_type: str = "//t/Request",
        read: bool = True,
        before_commit: Callable[[Flow], None] | None = None,
    ) -> None:
        self.settings = settings
        self.sender = sender
        self.dialogs = dialogs
        self.per_dialog = per_dialog
        self.queue = queue
        self.top = top
        self.max_outstanding = max_outstanding
        self.round_pause_s = round_pause_s
        self._begin = (from_service, to_service, contract)
        self.message_type = message_type
        self.before_commit = before_commit
        self.handles: list[str] = []
        self.received: list[QueueMessage] = []
        self.sent = 0
        self.lock_lost = 0
        self.refused = 0
        self.commits = 0
        self._stop = threading.Event()
        self._failures: list[BaseException] = []
        self._reader_client = KsbClient(settings)
        self._threads = [
            threading.Thread(target=self._guard, args=(self._send_all,), name="flow-sender")
        ]
        if read:
            self._threads.append(
                threading.Thread(target=self._guard, args=(self._receive_all,), name="flow-reader")
            )

    @property
    def total(self) -> int:
        return self.dialogs * self.per_dialog

    def start(self) -> Flow:
        for t in self._threads:
            t.start()
        return self

    def _guard(self, body: Callable[[], None]) -> None:
        try:
            body()
        except BaseException as exc:  # reported by wait_received / close
            self._failures.append(exc)
            self._stop.set()

    def _send_all(self) -> None:
        self.handles = [self.sender.begin_dialog(*self._begin) for _ in range(self.dialogs)]
        for k in range(self.per_dialog):
            for i, h in enumerate(self.handles):
                self.sender.send(h, self.message_type, _json.dumps({"conv": i, "n": k}))
                self.sent += 1
            if self.round_pause_s:
                self._stop.wait(self.round_pause_s)
            if self._stop.is_set():
                return
        self.sender.flush()

    def _receive_all(self) -> None:
        c = self._reader_client
        outstanding: collections.deque[tuple[Future[Any], list[QueueMessage]]] = collections.deque()
        while not self._stop.is_set() and len(self.received) < self.total:
            while outstanding and (
                outstanding[0][0].done() or len(outstanding) >= self.max_outstanding
            ):
                self._settle(*outstanding.popleft())
            tx = c.transaction()
            msgs = tx.receive(self.queue, top=self.top, waitfor_ms=100)
            if not msgs:
                tx.rollback()
                if outstanding:  # every ready group may be waiting for its outcome
                    self._settle(*outstanding.popleft())
                continue
            if self.before_commit is not None:
                self.before_commit(self)
            try:
                outstanding.append((tx.commit_async(), msgs))
            except LockLost:
                self.lock_lost += 1
        while outstanding:
            self._settle(*outstanding.popleft())

    def _settle(self, fut: Future[Any], msgs: list[QueueMessage]) -> None:
        try:
            self._reader_client.wait(fut, timeout_s=90)
        except LockLost:
            self.lock_lost += 1
            return
        except CommitRefused:
            self.refused += 1
            return
        except TimeoutError:
            raise AssertionError(
                f"no outcome in 90 s for a commit of {len(msgs)} messages of group "
                f"{msgs[0].conversation_group_id}; the client has "
                f"{self._reader_client.describe()}"
            ) from None
        self.commits += 1
        self.received.extend(msgs)

    def raise_failures(self) -> None:
        """Re-raise, in the test's thread, what the sender or reader thread raised."""
        if self._failures:
            raise self._failures[0]

    def wait_received(self, count: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.received) < count:
            self.raise_failures()
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"only {len(self.received)} of {count} messages received in {timeout_s}s "
                    f"(sent {self.sent}, lock lost {self.lock_lost}, refused {self.refused})"
                )
            time.sleep(0.01)

    def wait_sent(self, timeout_s: float) -> None:
        self._threads[0].join(timeout_s)
        if self._failures:
            raise self._failures[0]
        assert self.sent == self.total, f"only {self.sent} of {self.total} sent in {timeout_s}s"

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)
        self._reader_client.close()
        if self._failures:
            raise self._failures[0]

    def check_exactly_once_in_order(self) -> None:
        """Every message received once, none missing, and each conversation's in send order."""
        check_exactly_once_in_order(
            [_json.loads(m.message_body) for m in self.received], self.dialogs, self.per_dialog
        )
        ids = [m.message_id for m in self.received]
        assert len(ids) == len(set(ids)), "a message id was received twice"


def check_exactly_once_in_order(
    bodies: list[dict[str, int]], dialogs: int, per_dialog: int
) -> None:
    """``bodies`` in the order they were received: each conversation's ``n`` must run 0, 1, 2, ..."""
    by_conv: dict[int, list[int]] = collections.defaultdict(list)
    for b in bodies:
        by_conv[b["conv"]].append(b["n"])
    problems = []
    for conv in range(dialogs):
        seq = by_conv.get(conv, [])
        if seq != list(range(per_dialog)):
            dupes = sorted(n for n, c in collections.Counter(seq).items() if c > 1)
            missing = sorted(set(range(per_dialog)) - set(seq))
            problems.append(
                f"conv {conv}: {len(seq)} received, duplicates {dupes[:10]}, "
                f"missing {missing[:10]}, in order: {seq == sorted(seq)}"
            )
    assert not problems, "; ".join(problems[:10])
    assert sum(len(v) for v in by_conv.values()) == dialogs * per_dialog


def queue_receipts(settings: Deployment, queue: str) -> dict[str, tuple[int, int]]:
    """Per message id in a queue topic: (message records, receipt tombstones); no commit outcomes."""
    counts: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for k, v in read_topic(settings, Names(settings.instance).queue(queue), timeout_s=60):
        key = (k or b"").decode()
        if key.startswith("commit/"):
            continue
        counts[key][0 if v is not None else 1] += 1
    return {k: (c[0], c[1]) for k, c in counts.items()}


def wait_error(
    settings: Deployment, match: Callable[[dict[str, Any]], bool], *, timeout_s: float = 15
) -> dict[str, Any]:
    """The first error-topic record ``match`` accepts, waiting for it to appear."""
    deadline = time.monotonic() + timeout_s
    while True:
        recs = [r for r in errors(settings, at_least=0, timeout_s=0) if match(r)]
        if recs:
            return recs[0]
        if time.monotonic() > deadline:
            seen = errors(settings, at_least=0, timeout_s=0)
            raise AssertionError(f"no matching error record in {timeout_s}s; the topic has {seen}")
        time.sleep(0.1)


__all__ += ["Flow", "check_exactly_once_in_order", "queue_receipts", "wait_error"]
