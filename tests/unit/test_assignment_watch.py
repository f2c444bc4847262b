"""The dispatcher's watch on its assignment: a shard it and the coordinator disagree on for too
long is reported (the member then rejoins), a brief disagreement is not."""

from __future__ import annotations

from services.dispatcher.assignment_watch import AssignmentWatch, CoordinatorView


def _view(current: set[int], target: set[int]) -> CoordinatorView:
    return CoordinatorView(frozenset(current), frozenset(target))


def test_a_shard_held_after_its_revocation_was_lost_is_overdue_after_the_stall() -> None:
    w = AssignmentWatch(stall_s=3.0)
    assert w.observe(0.0, {0, 1}, _view({0, 1}, {0})) == []  # revocation on its way
    assert w.observe(2.9, {0, 1}, _view({0, 1}, {0})) == []
    assert w.observe(3.0, {0, 1}, _view({0, 1}, {0})) == [1]


def test_an_assignment_sent_and_never_given_is_overdue_after_the_stall() -> None:
    w = AssignmentWatch(stall_s=3.0)
    assert w.observe(0.0, {0}, _view({0, 1}, {0, 1})) == []
    assert w.observe(3.5, {0}, _view({0, 1}, {0, 1})) == [1]


def test_a_disagreement_that_ends_in_time_starts_the_clock_again() -> None:
    w = AssignmentWatch(stall_s=3.0)
    w.observe(0.0, {0, 1}, _view({0, 1}, {0}))
    assert w.observe(2.0, {0}, _view({0}, {0})) == []  # the revocation arrived
    assert w.observe(4.0, {0, 1}, _view({0, 1}, {0})) == []  # a new one, counted from 4.0
    assert w.observe(6.9, {0, 1}, _view({0, 1}, {0})) == []
    assert w.observe(7.0, {0, 1}, _view({0, 1}, {0})) == [1]


def test_a_shard_given_here_before_the_coordinator_sent_it_is_not_a_disagreement() -> None:
    """A new assignment reaches the member and the description at slightly different times: the
    target already lists it, the current assignment not yet."""
    w = AssignmentWatch(stall_s=1.0)
    assert w.observe(0.0, {0, 1}, _view({0}, {0, 1})) == []
    assert w.observe(5.0, {0, 1}, _view({0}, {0, 1})) == []


def test_no_answer_concludes_nothing_and_a_rejoin_forgets() -> None:
    w = AssignmentWatch(stall_s=1.0)
    w.observe(0.0, {0, 1}, _view({0, 1}, {0}))
    assert w.observe(0.5, {0, 1}, None) == []
    assert w.observe(1.5, {0, 1}, None) == [1]  # the last answer still stands
    w.reset()
    assert w.overdue(10.0) == []
