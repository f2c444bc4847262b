"""The audit's pure parts: the per-queue ordering state machine and the dispatcher's events."""

from __future__ import annotations

import json

from ksb.audit import Audit, AuditHook, BatchedAudit, KafkaAudit, dispatcher_events
from ksb.dialog.outputs import Inflight, Outputs, QueueWrite
from ksb.names import Names
from ksb.spark.ordering import OrderingEvent, QueueOrdering
from ksb.wire.audit import BATCH_EVENTS, AuditEvent, parse_audit_event, parse_audit_record
from ksb.wire.protocol import CommitOutcome, QueueMessage


def ev(
    kind: str, t: int, group: str | None = None, priority: int | None = None, **kw: object
) -> OrderingEvent:
    return OrderingEvent(kind=kind, event_ms=t, group=group, priority=priority, **kw)  # type: ignore[arg-type]


def rows_of(m: QueueOrdering, row: str) -> list[dict[str, object]]:
    return [r for r in m.drain_rows("Q") if r["row"] == row]


def test_receiving_a_lower_group_while_a_higher_unlocked_one_is_ready_is_an_inversion() -> None:
    m = QueueOrdering(window_ms=10_000)
    m.apply(ev("enqueue", 1_000, "low", 3))
    m.apply(ev("enqueue", 1_001, "high", 8))
    m.apply(ev("receive", 1_002, "low", 3))
    inv = rows_of(m, "inversions")
    assert [(r["high"], r["low"], r["inversions"], r["window_start_ms"]) for r in inv] == [
        (8, 3, 1, 0)
    ]


def test_a_higher_group_locked_by_another_reader_is_no_inversion() -> None:
    m = QueueOrdering()
    m.apply(ev("enqueue", 1, "low", 3))
    m.apply(ev("enqueue", 2, "high", 8))
    m.apply(ev("receive", 3, "high", 8))
    m.apply(ev("receive", 4, "low", 3))
    assert rows_of(m, "inversions") == []
    # Once the high group's commit unlocks it and its message is gone, nothing is pending.
    m.apply(ev("commit", 5, "high", 8))
    assert m.ready.keys() == {"low"} and "high" not in m.locked


def test_rollback_unlocks_and_the_messages_stay_ready() -> None:
    m = QueueOrdering()
    m.apply(ev("enqueue", 1, "high", 8))
    m.apply(ev("enqueue", 2, "low", 2))
    m.apply(ev("receive", 3, "high", 8))
    m.apply(ev("rollback", 4, "high", 8))
    m.apply(ev("receive", 5, "low", 2))
    inv = rows_of(m, "inversions")
    assert [(r["high"], r["low"], r["inversions"]) for r in inv] == [(8, 2, 1)]


def test_starvation_exceptions_and_targeted_receives_are_not_inversions() -> None:
    m = QueueOrdering()
    m.apply(ev("enqueue", 1, "a", 9))
    m.apply(ev("enqueue", 2, "b", 1))
    m.apply(ev("enqueue", 3, "c", 1))
    m.apply(ev("transmit", 4, "b", 1, starvation_exception=True))
    m.apply(ev("receive", 5, "c", 1, targeted=True))
    rows = m.drain_rows("Q")
    inv = [r for r in rows if r["row"] == "inversions"]
    assert [
        (r["kind"], r["high"], r["low"], r["inversions"], r["starvation_exceptions"]) for r in inv
    ] == [("transmit", 9, 1, 0, 1)]
    totals = [r for r in rows if r["row"] == "totals"]
    assert [(r["inversions"], r["starvation_exceptions"]) for r in totals] == [(0, 1)]


def test_a_second_receive_in_the_same_transaction_is_not_judged_again() -> None:
    m = QueueOrdering()
    m.apply(ev("enqueue", 1, "low", 3))
    m.apply(ev("receive", 2, "low", 3))
    m.apply(ev("enqueue", 3, "high", 8))
    m.apply(ev("receive", 4, "low", 3))
    assert rows_of(m, "inversions") == []


def test_a_lock_without_commit_expires_after_the_lock_ttl() -> None:
    m = QueueOrdering(lock_ttl_ms=1_000)
    m.apply(ev("enqueue", 0, "high", 8))
    m.apply(ev("enqueue", 0, "low", 2))
    m.apply(ev("receive", 10, "high", 8))  # the reader crashes: no commit, no rollback
    m.apply(ev("receive", 5_000, "low", 2))
    assert [r["inversions"] for r in rows_of(m, "inversions")] == [1]


def test_counts_are_absolute_per_window_and_totals_survive_the_state_store() -> None:
    m = QueueOrdering(window_ms=10_000)
    for t in (1_000, 2_000):
        m.apply(ev("enqueue", t, f"h{t}", 7))
        m.apply(ev("enqueue", t, f"l{t}", 2))
        m.apply(ev("receive", t + 1, f"l{t}", 2))
    first = m.drain_rows("Q")
    assert [r["inversions"] for r in first if r["row"] == "inversions"] == [2]
    restored = QueueOrdering.from_json(m.to_json())
    restored.apply(ev("enqueue", 12_000, "l3", 2))
    restored.apply(ev("receive", 12_001, "l3", 2))
    rows = restored.drain_rows("Q")
    windows = {r["window_start_ms"]: r["inversions"] for r in rows if r["row"] == "inversions"}
    assert windows == {10_000: 1}
    assert [r["inversions"] for r in rows if r["row"] == "totals"] == [3]


def test_activation_reaction_is_measured_to_the_next_receive() -> None:
    m = QueueOrdering()
    m.apply(ev("queue_activation", 1_000))
    m.apply(ev("activation_start", 1_200))  # the first activation counts
    m.apply(ev("enqueue", 1_300, "g", 5))
    m.apply(ev("receive", 1_750, "g", 5))
    m.apply(ev("receive", 1_900, "g", 5))
    assert [r["reaction_ms"] for r in rows_of(m, "reaction")] == [750]


def test_backlog_snapshot() -> None:
    m = QueueOrdering()
    m.apply(ev("enqueue", 1, "a", 5, count=3))
    m.apply(ev("enqueue", 2, "b", 5))
    m.apply(ev("receive", 3, "a", 5))
    m.apply(ev("purge", 4, "b", 5))
    (snap,) = rows_of(m, "backlog")
    assert (snap["ready_messages"], snap["ready_groups"], snap["locked_groups"]) == (3, 1, 1)


def _message(mid: str, priority: int) -> QueueMessage:
    return QueueMessage(
        message_id=mid,
        queue="Q",
        status=1,
        priority=priority,
        queuing_order=0,
        conversation_group_id="g",
        conversation_handle="h",
        conversation_id="c",
        message_sequence_number=0,
        service_name="//s",
        service_contract_name="//c",
        message_type_name="//m",
        validation="N",
        enqueued_ms=100,
    )


def test_dispatcher_events_are_derived_from_outputs() -> None:
    out = Outputs()
    out.queue.append(QueueWrite("Q", 0, "m1", _message("m1", 7)))
    out.queue.append(
        QueueWrite(
            "Q",
            0,
            "commit/r",
            CommitOutcome(
                request_id="r", group="g", token=1, applied=False, reason="stale_token: x"
            ),
        )
    )
    out.received.append(
        Inflight(
            "Q",
            0,
            "g",
            "h",
            "//m",
            priority=7,
            enqueued_ms=400,
            message_id="m0",
            service="//s",
            sent_ms=300,
        )
    )
    out.purged.append(Inflight("Q", 0, "g2", "h2", "//m", priority=2, enqueued_ms=900))
    events = dispatcher_events(out, 1_000, "inst")
    kinds = [(e.kind, e.message_id) for e in events]
    assert kinds == [("enqueue", "m1"), ("refused", None), ("commit", "m0"), ("purge", None)]
    commit = events[2]
    assert (commit.time_in_queue_ms, commit.end_to_end_ms, commit.priority) == (600, 700, 7)
    assert events[1].reason == "stale_token: x"
    # The wire form is compact and round-trips.
    raw = commit.to_json()
    assert b"null" not in raw
    assert parse_audit_event(raw) == commit


def test_a_failing_hook_is_logged_not_fatal() -> None:
    seen: list[AuditEvent] = []

    class Broken(AuditHook):
        def emit(self, event: AuditEvent) -> None:
            raise RuntimeError("boom")

    class Keep(AuditHook):
        def emit(self, event: AuditEvent) -> None:
            seen.append(event)

    audit = Audit(Broken(), Keep())
    audit.emit([AuditEvent(kind="error", event_ms=1, instance="i")])
    assert len(seen) == 1
    assert not Audit().enabled


class _Recorder:
    """Stands in for the producer: what KafkaAudit would hand Kafka, in order."""

    def __init__(self) -> None:
        self.records: list[tuple[str, bytes, bytes]] = []

    def produce(self, topic: str, *, key: bytes, value: bytes, on_delivery: object) -> None:
        self.records.append((topic, key, value))


def test_a_batch_is_one_record_per_queue_in_order_and_reads_back() -> None:
    events = [
        AuditEvent(kind="enqueue", event_ms=i, instance="i", queue="AB"[i % 2], message_id=str(i))
        for i in range(2 * BATCH_EVENTS + 3)
    ]
    rec = _Recorder()
    KafkaAudit(rec, Names("i")).emit_batch(events)  # type: ignore[arg-type]
    assert [(t, k) for t, k, _v in rec.records] == [("ksb.i.audit", b"A")] * 2 + [
        ("ksb.i.audit", b"B")
    ] * 2
    read = [e for _t, _k, v in rec.records for e in parse_audit_record(v)]
    assert sorted(read, key=lambda e: e.event_ms) == events
    for queue in "AB":  # each queue's events keep their order across records
        mine = [e.event_ms for e in read if e.queue == queue]
        assert mine == sorted(mine)
    single = events[0].to_json()
    assert parse_audit_record(single) == [events[0]]
    first = json.loads(rec.records[0][2])["events"]
    assert [next(iter(e.items())) for e in first[:2]] == [("v", 1), ("v", 1)]
    assert rec.records[0][2].count(b'{"v":1,"kind":"enqueue"') == BATCH_EVENTS


def test_an_event_whose_text_looks_like_an_event_survives_the_batch() -> None:
    tricky = AuditEvent(kind="error", event_ms=1, instance="i", reason='{"kind":"x"} {"kind":')
    rec = _Recorder()
    KafkaAudit(rec, Names("i")).emit_batch([tricky])  # type: ignore[arg-type]
    assert parse_audit_record(rec.records[0][2]) == [tricky]


def test_a_clients_events_wait_for_the_drain_then_go_as_one_record_per_queue() -> None:
    rec = _Recorder()
    batched = BatchedAudit(KafkaAudit(rec, Names("i")))  # type: ignore[arg-type]
    events = [
        AuditEvent(kind="receive", event_ms=i, instance="i", queue="AB"[i % 2], count=1)
        for i in range(6)
    ]
    for e in events[:5]:
        batched.emit(e)
    assert rec.records == []
    batched.drain()
    assert [k for _t, k, _v in rec.records] == [b"A", b"B"]
    batched.emit_batch(events[5:])
    batched.drain()
    batched.drain()  # nothing new: nothing written
    read = [e for _t, _k, v in rec.records for e in parse_audit_record(v)]
    assert sorted(read, key=lambda e: e.event_ms) == events and len(rec.records) == 3
