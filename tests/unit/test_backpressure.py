"""Back-pressure: requests in flight until the dispatchers' committed offset passes them; a client
over its limit waits, asks for offsets at most every 20 ms, and fails clearly when nothing moves."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from confluent_kafka import KafkaError, KafkaException

from ksb.clock import ManualClock
from ksb.errors import BackpressureTimeout, KsbError
from ksb.sdk.backpressure import Backpressure
from ksb.sdk.inflight import InflightRequests, TopicPartitionKey
from ksb.settings import ClientSettings

T = "ksb.i.requests"


def test_a_request_is_in_flight_until_the_committed_offset_passes_it() -> None:
    rule = InflightRequests(limit=3)
    for _ in range(3):
        rule.sent()
    assert rule.inflight == 3 and not rule.room()
    rule.delivered(T, 0, 10)
    rule.delivered(T, 1, 4)
    rule.delivered(T, 0, 11)
    assert rule.inflight == 3  # stored is not applied
    rule.committed({(T, 0): 11})  # the next offset the dispatchers read: 10 is applied, 11 not
    assert rule.inflight == 2 and rule.room()
    rule.committed({(T, 0): 12, (T, 1): 5})
    assert rule.inflight == 0


def test_partitions_and_topics_are_counted_apart() -> None:
    rule = InflightRequests(limit=10)
    other = "ksb.i.requests.alice"
    for tp in [(T, 0), (other, 0)]:
        rule.sent()
        rule.delivered(*tp, 7)
    rule.committed({(other, 0): 8})
    assert rule.inflight == 1
    assert rule.queried(0) == [(T, 0)]  # only partitions with requests in flight are asked


def test_a_committed_offset_never_goes_back_and_late_reports_of_applied_requests_count_nothing() -> (
    None
):
    rule = InflightRequests(limit=10)
    rule.committed({(T, 0): 50})
    rule.committed({(T, 0): 40})  # an older answer arriving late
    rule.sent()
    rule.delivered(T, 0, 45)  # its report came after the dispatchers had applied it
    assert rule.inflight == 0


def test_failed_deliveries_are_not_in_flight_and_zero_means_no_limit() -> None:
    rule = InflightRequests(limit=1)
    rule.sent()
    assert not rule.room()
    rule.failed()
    assert rule.room()
    unlimited = InflightRequests(limit=0)
    for _ in range(10_000):
        unlimited.sent()
    assert unlimited.room()


def test_offsets_are_asked_for_at_most_every_query_interval() -> None:
    rule = InflightRequests(limit=1, query_every_ms=20)
    assert rule.query_due(1_000)
    rule.queried(1_000)
    assert not rule.query_due(1_019)
    assert rule.query_due(1_020)


class _Dispatchers:
    """Committed offsets that advance by `step` each time they are asked for."""

    def __init__(self, clock: ManualClock, step: int) -> None:
        self.clock = clock
        self.step = step
        self.offset = 0
        self.asked_at: list[int] = []

    def __call__(
        self, partitions: Sequence[TopicPartitionKey], _timeout_s: float
    ) -> dict[TopicPartitionKey, int]:
        self.asked_at.append(self.clock.now_ms())
        self.offset += self.step
        return {tp: self.offset for tp in partitions}


def _client(limit: int, timeout_s: float) -> ClientSettings:
    return ClientSettings(max_inflight_requests=limit, backpressure_timeout_s=timeout_s)


def _send(bp: Backpressure, offset: int) -> None:
    bp.before_send()
    bp.delivered(T, 0, offset)


def test_a_client_over_its_limit_waits_until_the_dispatchers_catch_up() -> None:
    clock = ManualClock()
    dispatchers = _Dispatchers(clock, step=1)
    bp = Backpressure(_client(limit=3, timeout_s=5), dispatchers, clock)
    for off in range(3):
        _send(bp, off)
    assert dispatchers.asked_at == []  # under the limit: Kafka is never asked
    _send(bp, 3)  # waits until offset 0 is applied (the first answer says 1)
    assert len(dispatchers.asked_at) == 1 and bp.rule.inflight == 3
    _send(bp, 4)
    intervals = {
        b - a for a, b in zip(dispatchers.asked_at, dispatchers.asked_at[1:], strict=False)
    }
    assert intervals == {20}  # asked again only after the query interval
    assert bp.waited_ms == 20


def test_a_client_that_cannot_send_fails_with_a_clear_error_after_its_timeout() -> None:
    clock = ManualClock()
    dispatchers = _Dispatchers(clock, step=0)  # no dispatcher applies anything
    bp = Backpressure(_client(limit=2, timeout_s=1), dispatchers, clock)
    _send(bp, 0)
    _send(bp, 1)
    start = clock.now_ms()
    with pytest.raises(
        BackpressureTimeout, match=r"2 requests not applied .*\(limit 2\)"
    ) as caught:
        bp.before_send()
    assert isinstance(caught.value, KsbError) and caught.value.code == "backpressure_timeout"
    assert clock.now_ms() - start == 1_000
    assert len(dispatchers.asked_at) == 50  # every 20 ms for 1 s, never more often
    assert bp.rule.inflight == 2  # the refused request was not counted


def test_an_offset_query_kafka_does_not_answer_is_asked_again_not_raised() -> None:
    """Found by the chaos harness: a committed-offsets query that timed out (a loaded machine,
    a broker restarting) escaped from `send` as a KafkaException long before the timeout."""
    clock = ManualClock()
    answers = _Dispatchers(clock, step=1)
    failures = [KafkaException(KafkaError(KafkaError._TIMED_OUT)) for _ in range(3)]

    def flaky(
        partitions: Sequence[TopicPartitionKey], timeout_s: float
    ) -> dict[TopicPartitionKey, int]:
        if failures:
            clock.advance(2.0)
            raise failures.pop()
        return answers(partitions, timeout_s)

    bp = Backpressure(_client(limit=1, timeout_s=30), flaky, clock)
    _send(bp, 0)
    _send(bp, 1)  # three unanswered questions, then offset 1: request 0 is applied
    assert failures == [] and bp.rule.inflight == 1


def test_a_partition_left_behind_by_the_others_is_counted_apart() -> None:
    """A dead dispatcher's partition must not hold a client that sends to every shard in turn."""
    rule = InflightRequests(limit=3, stalled_ms=200)
    for p, off in [(0, 10), (0, 11), (1, 20), (1, 21), (1, 22)]:
        rule.sent()
        rule.delivered(T, p, off, now_ms=0)
    rule.committed({(T, 1): 21}, now_ms=150)  # partition 1 moves; 0 stood still for 150 ms only
    assert rule.stalled() == [] and rule.inflight == 4 and not rule.room()
    rule.committed({(T, 1): 22}, now_ms=300)  # 1 moved again, 300 ms after 0 last did
    assert rule.stalled() == [(T, 0)] and rule.inflight == 3  # still in flight...
    assert rule.room()  # ...but only partition 1's one counts against the limit
    rule.committed({(T, 0): 11}, now_ms=400)  # 0 moves again: counted as before
    assert rule.stalled() == [] and rule.inflight == 2


def test_requests_counted_apart_still_meet_a_bound_of_ten_times_the_limit() -> None:
    rule = InflightRequests(limit=2, stalled_ms=200)
    for p, off in [(1, 0), (1, 1)] + [(0, n) for n in range(17)]:
        rule.sent()
        rule.delivered(T, p, off, now_ms=0)
    rule.committed({(T, 1): 1}, now_ms=500)  # 1 moves; 0 is left behind
    assert rule.stalled() == [(T, 0)] and rule.inflight == 18 and rule.room()
    for n in range(17, 19):
        rule.sent()
        rule.delivered(T, 0, n, now_ms=500)
    assert rule.inflight == 20 and not rule.room()  # ten times the limit, whatever is apart


def test_with_no_other_partition_moving_nothing_is_stalled() -> None:
    rule = InflightRequests(limit=1, stalled_ms=200)
    rule.sent()
    rule.delivered(T, 0, 5, now_ms=0)
    assert rule.stalled() == [] and not rule.room()  # every dispatcher gone: the client waits
