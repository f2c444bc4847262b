"""What a queue service replica remembers between calls: logins Kafka answered, and commit
outcomes awaited by request id."""

from __future__ import annotations

import threading

from ksb.clock import ManualClock
from ksb.queue.fold import Outcome
from ksb.queue.logins import LoginMemory
from ksb.queue.outcomes import Outcomes
from ksb.wire.protocol import CommitOutcome


def test_an_accepted_login_is_remembered_a_refused_one_a_tenth_as_long() -> None:
    clock = ManualClock(start_ms=0)
    memory = LoginMemory(clock, accepted_ms=10_000)
    memory.note("alice", "right", True)
    memory.note("alice", "wrong", False)
    assert memory.known("alice", "right") is True and memory.known("alice", "wrong") is False
    assert memory.known("bob", "right") is None  # never a principal for another's password
    clock.advance(1.0)
    assert memory.known("alice", "wrong") is None and memory.known("alice", "right") is True
    clock.advance(9.0)
    assert memory.known("alice", "right") is None


def _outcome(rid: str) -> Outcome:
    record = CommitOutcome(request_id=rid, group="g", token=1, applied=True, reason="")
    return Outcome("Q", record, 0, 7)


def test_an_outcome_read_before_the_question_is_answered_at_once() -> None:
    outcomes = Outcomes(remember=10)
    outcomes.read(_outcome("r1"))
    assert outcomes.wait("r1", 0) == _outcome("r1")


def test_a_question_waits_for_its_own_outcome_only() -> None:
    outcomes = Outcomes(remember=10)
    got: list[Outcome | None] = []
    waiter = threading.Thread(target=lambda: got.append(outcomes.wait("r2", 5)))
    waiter.start()
    while outcomes.waiting == 0:
        threading.Event().wait(0.001)
    outcomes.read(_outcome("other"))
    assert waiter.is_alive()
    outcomes.read(_outcome("r2"))
    waiter.join(5)
    assert got == [_outcome("r2")] and outcomes.waiting == 0


def test_only_the_newest_outcomes_are_remembered() -> None:
    outcomes = Outcomes(remember=2)
    for rid in ("a", "b", "c"):
        outcomes.read(_outcome(rid))
    assert outcomes.wait("a", 0) is None and outcomes.wait("c", 0) is not None
