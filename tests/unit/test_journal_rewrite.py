"""When a refused transaction is written again once more, and when its shards are rebuilt instead
(`services.dispatcher.journal.write_again_or_give_up`)."""

from __future__ import annotations

from confluent_kafka import KafkaError

from services.dispatcher.journal import (
    WRITE_AGAIN_ATTEMPTS,
    Rewrite,
    worth_writing_again,
    write_again_or_give_up,
)

OUT_OF_ORDER = KafkaError(
    KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER, "skipped sequence numbers", txn_requires_abort=True
)
STALE = KafkaError(KafkaError.ILLEGAL_GENERATION, "stale epoch", txn_requires_abort=True)
GONE = KafkaError(KafkaError.UNKNOWN_MEMBER_ID, "not a member", txn_requires_abort=True)
FENCED = KafkaError(KafkaError._FENCED, "fenced", fatal=True)
NOTHING = KafkaError(KafkaError._STATE, "the refused transaction sent no offsets")


class Attempts:
    """`write` failing with each of `failures` in turn, then writing; what was called, in order."""

    def __init__(self, *failures: KafkaError, abort_ends: bool = True) -> None:
        self.failures = list(failures)
        self.abort_ends = abort_ends
        self.calls: list[str] = []

    def write(self) -> KafkaError | None:
        self.calls.append("write")
        return self.failures.pop(0) if self.failures else None

    def abort(self) -> bool:
        self.calls.append("abort")
        return self.abort_ends


def test_a_sequence_gap_is_aborted_and_written_once_more() -> None:
    t = Attempts(OUT_OF_ORDER)
    assert write_again_or_give_up(t.write, t.abort) == Rewrite()
    assert t.calls == ["write", "abort", "write"]


def test_two_failures_give_up_with_the_last_one_aborted() -> None:
    t = Attempts(OUT_OF_ORDER, STALE)
    assert WRITE_AGAIN_ATTEMPTS == 2
    assert write_again_or_give_up(t.write, t.abort) == Rewrite(STALE)
    assert t.calls == ["write", "abort", "write", "abort"]


def test_a_member_the_group_left_behind_is_not_written_again() -> None:
    t = Attempts(GONE)
    assert write_again_or_give_up(t.write, t.abort) == Rewrite(GONE)
    assert t.calls == ["write", "abort"]


def test_nothing_to_write_gives_up_at_once() -> None:
    t = Attempts(NOTHING)
    assert write_again_or_give_up(t.write, t.abort) == Rewrite(NOTHING)
    assert t.calls == ["write", "abort"]


def test_an_abort_that_does_not_end_stops_the_attempts() -> None:
    t = Attempts(OUT_OF_ORDER, abort_ends=False)
    assert write_again_or_give_up(t.write, t.abort) == Rewrite(OUT_OF_ORDER, stuck=True)
    assert t.calls == ["write", "abort"]


def test_only_errors_an_abort_mends_are_worth_another_try() -> None:
    assert worth_writing_again(OUT_OF_ORDER) and worth_writing_again(STALE)
    assert not worth_writing_again(GONE)
    assert not worth_writing_again(FENCED)
    assert not worth_writing_again(NOTHING)
