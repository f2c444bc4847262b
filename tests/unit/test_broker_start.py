"""Broker start: why it failed, the every-5th-tick retry, Kafka's return, and the BCNs, in ms."""

from __future__ import annotations

import json

import pytest
from confluent_kafka import KafkaError, KafkaException

from ksb.clock import ManualClock
from ksb.dialog.broker_start import (
    KAFKA_UNAVAILABLE,
    BrokerNotStarted,
    BrokerStart,
    BrokerState,
    StartFailure,
    failure_from_exception,
    start_problem,
)
from ksb.errors import CatalogError, ProtocolError
from ksb.runtime.ticker import Ticker
from ksb.wire.protocol import BrokerNotification, dumps, parse_bcn, to_dict

NO_CATALOG = StartFailure("no_catalog", "no catalog applied")


class FakeBroker:
    """What the dispatcher does on its timer, with the start itself replaced by a flag."""

    def __init__(self, clock: ManualClock, *, tick_ms: int = 5000) -> None:
        self.clock = clock
        self.state = BrokerStart("i1")
        self.ticker = Ticker(clock.now_ms(), tick_ms=tick_ms)
        self.ticker.every(1, "broker_start", self.on_tick)
        self.ready_version = 0
        self.attempt_ticks: list[int] = []
        self.bcns: list[BrokerNotification] = []

    def on_tick(self, tick: int) -> None:
        if self.state.due(tick):
            self.try_start(tick)

    def try_start(self, tick: int) -> None:
        self.state.attempt(tick)
        self.attempt_ticks.append(tick)
        now = self.clock.now_ms()
        if self.ready_version:
            self.bcns.append(self.state.on_started(self.ready_version, now))
        else:
            self.bcns.append(self.state.on_failed(NO_CATALOG, now))

    def run_for(self, seconds: float) -> None:
        for _ in range(round(seconds * 10)):
            self.clock.advance(0.1)
            self.ticker.poll(self.clock.now_ms())


def test_start_problem_names_what_is_missing() -> None:
    failure = start_problem("i1", 0, [])
    assert failure is not None and failure.code == "no_catalog"
    assert "instance i1" in failure.reason and "ksb catalog apply" in failure.reason
    failure = start_problem("i1", 3, ["ksb.i1.queue.B", "ksb.i1.dlq.A"])
    assert failure is not None and failure.code == "missing_topics"
    assert failure.reason == (
        "catalog v3 names topics that do not exist: ksb.i1.dlq.A, ksb.i1.queue.B"
    )
    assert start_problem("i1", 1, []) is None


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (KafkaException(KafkaError(KafkaError._TRANSPORT)), "kafka_unavailable"),
        (TimeoutError("topics not visible"), "kafka_unavailable"),
        (CatalogError("unknown field 'queus'"), "invalid_catalog"),
        (json.JSONDecodeError("Expecting value", "x", 0), "invalid_catalog"),
        (RuntimeError("bug"), "start_error"),
        (BrokerNotStarted(NO_CATALOG), "no_catalog"),
    ],
)
def test_failures_are_classified(exc: Exception, code: str) -> None:
    failure = failure_from_exception(exc)
    assert failure.code == code
    assert failure.reason


def test_a_failed_start_is_retried_every_fifth_tick_until_it_starts() -> None:
    clock = ManualClock(start_ms=0)
    b = FakeBroker(clock)
    b.try_start(0)  # the dispatcher tries at once when it starts
    assert b.state.state is BrokerState.FAILED
    b.run_for(24.9)  # ticks 1..4: no retry
    assert b.attempt_ticks == [0]
    b.run_for(0.1)  # 25 000 ms: tick 5
    assert b.attempt_ticks == [0, 5]
    b.run_for(25)
    assert b.attempt_ticks == [0, 5, 10]
    b.ready_version = 1
    b.run_for(20)
    assert b.attempt_ticks == [0, 5, 10]  # ticks 11..14: still waiting
    b.run_for(5)
    assert b.attempt_ticks == [0, 5, 10, 15]
    assert b.state.started and b.state.started_tick == 15
    b.run_for(60)
    assert b.attempt_ticks == [0, 5, 10, 15]  # a started broker is not started again
    assert [x.event for x in b.bcns] == ["start_failed"] * 3 + ["started"]
    assert [x.attempt for x in b.bcns] == [1, 2, 3, 4]
    assert [x.at_ms for x in b.bcns] == [0, 25_000, 50_000, 75_000]


def test_a_new_catalog_makes_the_next_tick_retry() -> None:
    clock = ManualClock(start_ms=0)
    b = FakeBroker(clock)
    b.try_start(0)
    b.run_for(6)  # tick 1 passed
    b.ready_version = 1
    b.state.note_configuration_change()
    b.run_for(4)  # tick 2 at 10 000 ms
    assert b.attempt_ticks == [0, 2]
    assert b.state.started


def test_a_change_is_only_noted_while_failed() -> None:
    state = BrokerStart("i1")
    state.note_configuration_change()
    assert state.due(1)  # not started yet: any tick is due
    state.attempt(0)
    state.on_failed(NO_CATALOG, 0)
    assert not state.due(1)
    state.note_configuration_change()
    assert state.due(1)
    state.attempt(1)
    assert not state.due(2)  # the attempt consumed the change
    assert state.due(5)


def test_bcns_carry_the_reason_then_the_version() -> None:
    state = BrokerStart("i1")
    state.attempt(0)
    failed = state.on_failed(NO_CATALOG, 1_000)
    assert to_dict(failed) == {
        "v": 1,
        "kind": "bcn",
        "event": "start_failed",
        "instance": "i1",
        "service": "dispatcher",
        "catalog_version": 0,
        "attempt": 1,
        "code": "no_catalog",
        "reason": "no catalog applied",
        "at_ms": 1_000,
    }
    assert state.status() == {
        "state": "failed",
        "attempts": 1,
        "catalog_version": 0,
        "code": "no_catalog",
        "reason": "no catalog applied",
    }
    state.attempt(5)
    started = state.on_started(4, 26_000)
    assert (started.event, started.catalog_version, started.attempt) == ("started", 4, 2)
    assert started.code is None and started.reason is None
    assert state.status() == {"state": "started", "attempts": 2, "catalog_version": 4}


def test_a_catalog_change_is_notified_once_per_version_and_only_when_started() -> None:
    state = BrokerStart("i1")
    assert state.on_catalog(2, 0) is None  # not started: the started BCN will carry it
    state.attempt(0)
    state.on_started(2, 0)
    assert state.on_catalog(2, 10) is None
    changed = state.on_catalog(3, 20)
    assert changed is not None
    assert (changed.event, changed.catalog_version, changed.attempt) == ("catalog_changed", 3, 0)
    assert state.on_catalog(3, 30) is None


def test_a_bcn_round_trips_and_parsing_is_strict() -> None:
    state = BrokerStart("i1")
    state.attempt(0)
    bcn = state.on_failed(NO_CATALOG, 5)
    assert parse_bcn(dumps(bcn)) == bcn
    assert b'"reason"' in dumps(bcn) and b"null" not in dumps(bcn)
    with pytest.raises(ProtocolError, match="tombstone"):
        parse_bcn(None)
    with pytest.raises(ProtocolError, match="malformed BCN"):
        parse_bcn(b'{"kind": "bcn", "event": "started", "instance": "i", "at_ms": 1, "x": 1}')


def test_retry_every_must_be_positive() -> None:
    with pytest.raises(ValueError, match="retry_every"):
        BrokerStart("i1", retry_every=0)


# --------------------------------------------------------------------------- Kafka coming back
KAFKA_DOWN = StartFailure(KAFKA_UNAVAILABLE, "Kafka: Local: Broker transport failure")


class FakeDispatcher:
    """The dispatcher's broker tick with Kafka replaced by flags and the probe by a list.

    As in the dispatcher, a probe sent on one tick is answered (with Kafka's state when the handler
    ran it, at once here) and the answer is taken on the next tick, before the retry decision.
    """

    def __init__(self, clock: ManualClock, *, tick_ms: int = 5000) -> None:
        self.clock = clock
        self.state = BrokerStart("i1")
        self.ticker = Ticker(clock.now_ms(), tick_ms=tick_ms)
        self.ticker.every(1, "broker_start", self.on_tick)
        self.kafka_up = False
        self.start_fails_anyway = False  # Kafka answers metadata, the start still fails for it
        self.attempt_ticks: list[int] = []
        self.probe_ticks: list[int] = []
        self.answers: list[tuple[int, bool]] = []

    def on_tick(self, tick: int) -> None:
        answers, self.answers = self.answers, []
        for sent_tick, reachable in answers:
            self.state.on_probe(sent_tick, reachable)
        if self.state.due(tick):
            self.try_start(tick)
        elif self.state.probe_due(tick):
            self.state.probe_sent(tick)
            self.probe_ticks.append(tick)
            self.answers.append((tick, self.kafka_up))

    def try_start(self, tick: int) -> None:
        self.state.attempt(tick)
        self.attempt_ticks.append(tick)
        if self.kafka_up and not self.start_fails_anyway:
            self.state.on_started(1, self.clock.now_ms())
        else:
            self.state.on_failed(KAFKA_DOWN, self.clock.now_ms())

    def run_for(self, seconds: float) -> None:
        for _ in range(round(seconds * 10)):
            self.clock.advance(0.1)
            self.ticker.poll(self.clock.now_ms())


def test_kafka_answering_again_makes_the_next_tick_retry() -> None:
    d = FakeDispatcher(ManualClock(start_ms=0))
    d.try_start(0)
    assert d.state.waiting_for_kafka
    d.run_for(31)  # ticks 1..6; tick 5 retried on the cadence and failed; Kafka is back at 31 s
    d.kafka_up = True
    assert d.attempt_ticks == [0, 5]
    assert d.probe_ticks == [1, 2, 3, 4, 6]  # every tick that does not retry anyway
    d.run_for(4)  # tick 7 (35 s): the probe finds Kafka answering
    assert d.probe_ticks[-1] == 7 and not d.state.started
    d.run_for(5)  # tick 8 (40 s): retried at once, not on tick 10
    assert d.attempt_ticks == [0, 5, 8]
    assert d.state.started and d.state.started_tick == 8
    d.run_for(30)
    assert d.probe_ticks[-1] == 7  # a started broker probes nothing


def test_a_kafka_answering_all_along_stays_on_the_fifth_tick_cadence() -> None:
    d = FakeDispatcher(ManualClock(start_ms=0))
    d.kafka_up, d.start_fails_anyway = True, True  # a transaction coordinator not ready, say
    d.try_start(0)
    d.run_for(50)  # every probe answers, none saw silence: nothing is brought forward
    assert d.attempt_ticks == [0, 5, 10]
    assert d.probe_ticks == [1, 2, 3, 4, 6, 7, 8, 9]
    d.kafka_up = False
    d.run_for(5)  # tick 11: a probe finds it silent
    d.kafka_up = True
    d.run_for(20)  # tick 12 finds it answering again: tick 13 retries early, then the cadence
    assert d.attempt_ticks == [0, 5, 10, 13, 15]


def test_kafka_back_before_the_first_probe_waits_for_the_cadence() -> None:
    d = FakeDispatcher(ManualClock(start_ms=0))
    d.try_start(0)  # Kafka silent for the attempt...
    d.kafka_up = True  # ...and back before tick 1's probe: no probe saw it silent
    d.run_for(25)
    assert d.attempt_ticks == [0, 5] and d.state.started


def test_only_a_start_that_kafka_failed_is_probed() -> None:
    state = BrokerStart("i1")
    assert not state.probe_due(1)  # not started yet: the next tick tries anyway
    state.attempt(0)
    state.on_failed(NO_CATALOG, 0)
    assert not any(state.probe_due(t) for t in range(1, 12))
    assert not state.on_probe(1, True)  # an answer changes nothing for a catalog problem
    assert not state.due(1)
    state.attempt(5)
    state.on_failed(KAFKA_DOWN, 0)
    assert state.probe_due(6)
    assert not state.probe_due(10)  # the 5th tick retries anyway
    state.attempt(10)
    state.on_started(1, 0)
    assert not state.probe_due(11)


def test_one_probe_at_a_time_and_a_lost_one_is_replaced() -> None:
    state = BrokerStart("i1")
    state.attempt(0)
    state.on_failed(KAFKA_DOWN, 0)
    state.probe_sent(1)
    assert not state.probe_due(2) and not state.probe_due(4)
    assert state.probe_due(6)  # unanswered for 5 ticks: its handler died; send another
    state.on_probe(1, False)
    assert state.probe_due(2)


def test_an_answer_older_than_the_latest_attempt_is_ignored() -> None:
    state = BrokerStart("i1")
    state.attempt(0)
    state.on_failed(KAFKA_DOWN, 0)
    state.probe_sent(4)
    state.attempt(5)  # the 5th tick retried while the probe was out
    state.on_failed(KAFKA_DOWN, 0)
    assert not state.on_probe(4, False)  # about Kafka before attempt 2: that attempt knows better
    assert not state.on_probe(6, True)  # no probe since the attempt saw it silent
    assert not state.on_probe(7, False)
    assert state.on_probe(8, True)
    assert state.due(9)


def test_problem_says_why_the_broker_is_not_started() -> None:
    state = BrokerStart("i1")
    assert state.problem() == "broker of instance i1 not started yet (first attempt)"
    state.attempt(0)
    state.on_failed(NO_CATALOG, 0)
    assert state.problem() == (
        "broker of instance i1 not started (no_catalog, attempt 1): no catalog applied"
    )
    state.attempt(1)
    state.on_started(1, 0)
    assert state.problem() is None
