"""The queue monitor's activation decision and the external-activation notifier, in milliseconds."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ksb.activation.monitor import Decision, ExternalNotifier, QueueMonitor, QueueObservation
from ksb.backoff import Backoff
from ksb.settings import ActivationSettings

SETTINGS = ActivationSettings()


def new_monitor(
    *,
    empty_grace_ms: int = SETTINGS.activation_empty_grace_ms,
    starting_hold_ms: int = SETTINGS.activation_starting_hold_ms,
    retry: Backoff | None = None,
) -> QueueMonitor:
    """A monitor as the activation service makes one with its default settings."""
    default = Backoff(SETTINGS.activation_retry_ms, SETTINGS.activation_retry_max_ms)
    return QueueMonitor(
        empty_grace_ms=empty_grace_ms, starting_hold_ms=starting_hold_ms, retry=retry or default
    )


IDLE = QueueObservation(
    now_ms=100_000,
    ready_groups=0,
    ready_messages=0,
    waiting_receivers=0,
    running_tasks=0,
    last_empty_receive_ms=None,
    max_queue_readers=4,
    activation_enabled=True,
    queue_enabled=True,
)
BACKLOG = replace(IDLE, ready_groups=3, ready_messages=30, running_tasks=1)


def at(obs: QueueObservation, now_ms: int, **changes: int | bool | None) -> QueueObservation:
    return replace(obs, now_ms=now_ms, **changes)  # type: ignore[arg-type]


# -- rule 1: a message arrives on an empty queue with no task running -------------------------


def test_first_message_on_an_empty_queue_activates() -> None:
    obs = replace(IDLE, ready_groups=1, ready_messages=1)
    decision = new_monitor().on_message_arrived(obs, had_unread_before=False)
    assert decision == Decision(True, "first_message", "NOTIFIED", necessary=True)


def test_first_message_activates_even_right_after_an_empty_receive() -> None:
    obs = replace(IDLE, ready_groups=1, ready_messages=1, last_empty_receive_ms=99_999)
    assert new_monitor().on_message_arrived(obs, had_unread_before=False).activate


def test_a_message_on_a_queue_that_already_had_unread_messages_is_not_rule_1() -> None:
    obs = replace(IDLE, ready_groups=0, ready_messages=5)  # all groups locked
    decision = new_monitor().on_message_arrived(obs, had_unread_before=True)
    assert decision == Decision(False, "no_ready_groups", "INACTIVE")


def test_a_message_on_an_empty_queue_with_a_task_running_is_not_rule_1() -> None:
    obs = replace(IDLE, ready_groups=1, ready_messages=1, running_tasks=1, waiting_receivers=1)
    decision = new_monitor().on_message_arrived(obs, had_unread_before=False)
    assert decision == Decision(False, "reader_waiting", "INACTIVE")


# -- rule 2: runnable backlog, nobody waiting, no recent empty RECEIVE ------------------------


def test_a_backlog_in_unlocked_groups_activates() -> None:
    decision = new_monitor().on_tick(BACKLOG)
    assert decision == Decision(True, "backlog", "NOTIFIED", necessary=True)


def test_no_activation_while_a_reader_waits_in_receive() -> None:
    decision = new_monitor().on_tick(replace(BACKLOG, waiting_receivers=1))
    assert (decision.activate, decision.reason) == (False, "reader_waiting")


def test_no_activation_when_every_group_with_messages_is_locked() -> None:
    decision = new_monitor().on_tick(replace(BACKLOG, ready_groups=0))
    assert (decision.activate, decision.reason) == (False, "no_ready_groups")


def test_an_empty_receive_holds_activation_for_the_grace_period() -> None:
    monitor = new_monitor(empty_grace_ms=5000)
    obs = replace(BACKLOG, last_empty_receive_ms=96_000)
    assert monitor.on_tick(at(obs, 100_999)).reason == "recent_empty_receive"
    assert monitor.on_tick(at(obs, 101_000)).activate


def test_the_monitor_remembers_empty_receives_it_was_told_about() -> None:
    monitor = new_monitor(empty_grace_ms=2000)
    empty = monitor.on_receive(at(BACKLOG, 100_000, ready_groups=0), returned_empty=True)
    assert empty.state == "RECEIVES_OCCURRING"
    assert monitor.on_tick(at(BACKLOG, 101_999)).reason == "recent_empty_receive"
    assert monitor.on_tick(at(BACKLOG, 102_000)).activate


# -- whether activation occurs ------------------------------------------------------------------


def test_no_reader_beyond_max_queue_readers() -> None:
    decision = new_monitor().on_tick(replace(BACKLOG, running_tasks=4))
    assert decision == Decision(False, "max_queue_readers", "INACTIVE", necessary=True)


def test_activation_disabled_is_necessary_but_does_not_occur() -> None:
    decision = new_monitor().on_tick(replace(BACKLOG, activation_enabled=False))
    assert decision == Decision(False, "activation_disabled", "INACTIVE", necessary=True)


def test_a_disabled_queue_never_needs_a_reader() -> None:
    obs = replace(IDLE, ready_groups=1, ready_messages=1, queue_enabled=False)
    decision = new_monitor().on_message_arrived(obs, had_unread_before=False)
    assert decision == Decision(False, "queue_disabled", "INACTIVE")


# -- events ---------------------------------------------------------------------------------------


def test_a_started_reader_that_has_not_received_yet_holds_back_the_next_one() -> None:
    monitor = new_monitor(starting_hold_ms=5000)
    assert monitor.on_tick(BACKLOG).activate
    starting = at(BACKLOG, 101_000, running_tasks=2)
    assert monitor.on_message_arrived(starting, had_unread_before=True).reason == "reader_starting"
    assert monitor.on_tick(at(starting, 105_000)).activate  # the hold expired


def test_a_receive_releases_the_hold_and_moves_to_receives_occurring() -> None:
    monitor = new_monitor()
    monitor.on_tick(BACKLOG)
    decision = monitor.on_receive(at(BACKLOG, 100_500, running_tasks=2), returned_empty=False)
    assert decision == Decision(True, "backlog", "NOTIFIED", necessary=True)


def test_a_receive_with_nothing_left_to_do_reports_receives_occurring() -> None:
    monitor = new_monitor()
    obs = at(BACKLOG, 100_500, ready_groups=0, ready_messages=0)
    decision = monitor.on_receive(obs, returned_empty=False)
    assert decision == Decision(False, "no_ready_groups", "RECEIVES_OCCURRING")


def test_a_rollback_that_returns_messages_may_activate() -> None:
    monitor = new_monitor()
    busy = replace(BACKLOG, ready_groups=0)
    assert not monitor.on_tick(busy).activate
    assert monitor.on_rollback(at(busy, 100_100, ready_groups=1)).activate


def test_when_all_tasks_exit_a_remaining_backlog_starts_a_reader() -> None:
    monitor = new_monitor()
    assert monitor.on_tick(BACKLOG).activate
    assert monitor.state == "NOTIFIED"
    decision = monitor.on_tasks_exited(at(BACKLOG, 100_200, running_tasks=0))
    assert decision == Decision(True, "backlog", "NOTIFIED", necessary=True)


def test_when_all_tasks_exit_on_an_empty_queue_the_monitor_goes_inactive() -> None:
    monitor = new_monitor()
    monitor.on_tick(BACKLOG)
    decision = monitor.on_tasks_exited(at(IDLE, 100_200))
    assert decision == Decision(False, "no_ready_groups", "INACTIVE")


# -- tasks that fail -----------------------------------------------------------------------------


def test_a_failed_task_holds_activation_back_doubling_with_each_failure_in_a_row() -> None:
    monitor = new_monitor(retry=Backoff(initial_ms=1000, max_ms=3000))
    after_exit = at(BACKLOG, 100_000, running_tasks=0)
    assert monitor.on_task_exit(100_000, 2) == 1000
    held = monitor.on_tasks_exited(after_exit)
    assert held == Decision(False, "failing_tasks", "INACTIVE", necessary=True)
    assert not monitor.on_tick(at(after_exit, 100_999)).activate
    assert monitor.on_tick(at(after_exit, 101_000)).activate
    assert monitor.on_task_exit(101_500, 3) == 2000
    assert not monitor.on_tick(at(after_exit, 103_499)).activate
    assert monitor.on_tick(at(after_exit, 103_500)).activate
    assert monitor.on_task_exit(104_000, 1) == 3000  # at its ceiling
    assert monitor.on_task_exit(108_000, -9) == 3000


def test_a_failing_task_holds_back_the_first_message_rule_too() -> None:
    monitor = new_monitor()
    monitor.on_task_exit(100_000, 3)
    obs = at(IDLE, 100_500, ready_groups=1, ready_messages=1)
    assert monitor.on_message_arrived(obs, had_unread_before=False).reason == "failing_tasks"


def test_a_task_that_ends_normally_clears_the_failures() -> None:
    monitor = new_monitor()
    monitor.on_task_exit(100_000, 1)
    monitor.on_task_exit(100_100, 1)
    assert monitor.on_task_exit(100_200, 0) is None
    assert monitor.on_tick(at(BACKLOG, 100_300, running_tasks=0)).activate
    assert monitor.on_task_exit(100_400, 1) == 1000  # counted from one again


def test_alter_queue_clears_the_failures_it_may_have_mended() -> None:
    monitor = new_monitor(retry=Backoff(initial_ms=60_000, max_ms=60_000))
    monitor.on_task_exit(100_000, 2)
    assert monitor.on_alter(at(BACKLOG, 100_100, running_tasks=0)).activate


def test_alter_queue_raising_max_readers_activates() -> None:
    monitor = new_monitor()
    full = replace(BACKLOG, running_tasks=4)
    assert not monitor.on_tick(full).activate
    assert monitor.on_alter(at(full, 100_100, max_queue_readers=5)).activate


def test_alter_queue_enabling_activation_activates() -> None:
    monitor = new_monitor()
    off = replace(BACKLOG, activation_enabled=False)
    assert not monitor.on_tick(off).activate
    assert monitor.on_alter(at(off, 100_100, activation_enabled=True)).activate


# -- the seed's example -------------------------------------------------------------------------


def test_a_backlog_on_one_conversation_starts_only_one_extra_reader() -> None:
    """One conversation, many messages: reader 1 holds the group; reader 2 waits; no reader 3."""
    monitor = new_monitor()
    t = 100_000
    one_group = replace(IDLE, now_ms=t, ready_groups=1, ready_messages=1)
    assert monitor.on_message_arrived(one_group, had_unread_before=False).activate  # reader 1

    # Reader 1 locks the group; more messages keep arriving on the same conversation.
    locked = at(one_group, t + 100, ready_groups=0, ready_messages=50, running_tasks=1)
    assert monitor.on_receive(locked, returned_empty=False).state == "RECEIVES_OCCURRING"
    assert not monitor.on_message_arrived(locked, had_unread_before=True).activate

    # Between two of reader 1's transactions the group is free: a second reader is started.
    between = at(locked, t + 5000, ready_groups=1)
    assert monitor.on_tick(between).activate  # reader 2

    # Reader 2 waits in RECEIVE: the only group is locked by reader 1 or free with reader 2 waiting.
    for step in range(1, 50):
        now = t + 5000 + step * 1000
        group_locked = step % 2 == 0
        obs = at(
            locked,
            now,
            ready_groups=0 if group_locked else 1,
            running_tasks=2,
            waiting_receivers=1,
        )
        assert not monitor.on_message_arrived(obs, had_unread_before=True).activate
        assert not monitor.on_tick(obs).activate
        assert not monitor.on_receive(obs, returned_empty=False).activate


def test_a_backlog_over_many_groups_ramps_readers_up_to_the_maximum() -> None:
    monitor = new_monitor()
    started = 0
    now = 100_000
    starts: list[int] = []
    for _ in range(10):
        if monitor.on_tick(at(BACKLOG, now, running_tasks=started)).activate:
            started += 1
            starts.append(now)
        # The newest reader reaches RECEIVE: it takes a group, and other groups are still ready.
        obs = at(BACKLOG, now + 10, running_tasks=started)
        if monitor.on_receive(obs, returned_empty=False).activate:
            started += 1
            starts.append(now + 10)
        now += 1000
    assert started == BACKLOG.max_queue_readers
    # One at a time: each start waits until the previous reader reached RECEIVE (ticks at 101_000
    # and 102_000 are held back), so the ramp follows the readers instead of bursting ahead.
    assert starts == [100_000, 100_010, 101_010, 102_010]


# -- external activation --------------------------------------------------------------------------


def necessary() -> Decision:
    return Decision(False, "activation_disabled", "INACTIVE", necessary=True)


def test_external_notification_is_sent_when_activation_is_necessary() -> None:
    notifier = ExternalNotifier(timeout_ms=10_000)
    assert not notifier.should_notify(Decision(False, "no_ready_groups", "INACTIVE"), 0)
    assert notifier.should_notify(necessary(), 0)
    assert notifier.outstanding_since_ms == 0


def test_no_second_notification_until_a_receive_is_seen() -> None:
    notifier = ExternalNotifier(timeout_ms=10_000)
    assert notifier.should_notify(necessary(), 0)
    assert not notifier.should_notify(necessary(), 5_000)
    notifier.on_receive()
    assert notifier.should_notify(necessary(), 5_001)


@pytest.mark.parametrize(("now_ms", "expected"), [(9_999, False), (10_000, True)])
def test_the_time_out_allows_another_notification(now_ms: int, expected: bool) -> None:
    notifier = ExternalNotifier(timeout_ms=10_000)
    assert notifier.should_notify(necessary(), 0)
    assert notifier.should_notify(necessary(), now_ms) is expected


def test_external_activation_uses_the_monitors_necessity() -> None:
    monitor = new_monitor()
    notifier = ExternalNotifier(timeout_ms=60_000)
    external = replace(BACKLOG, activation_enabled=False, running_tasks=0)
    assert notifier.should_notify(monitor.on_tick(external), external.now_ms)
    waiting = at(external, 100_100, waiting_receivers=1)
    assert not notifier.should_notify(monitor.on_tick(waiting), waiting.now_ms)
