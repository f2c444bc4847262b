"""The queue monitor's decision: should a new queue reader be started now?

Activation is worth it only when a new reader would have useful work. Counting unread messages is
not enough: a backlog on one conversation group can be read by one reader at a time, because the
group lock serialises them, so extra readers would only wait. The monitor therefore looks at
runnable work (groups with ready messages that are not locked), at readers already waiting, and
at how recently a RECEIVE came back empty.

Two steps, as in Service Broker:

* **Necessary** when (1) a message arrives on a queue with no unread messages and no activated
  task runs, or (2) some unlocked group has ready messages, no session waits in a RECEIVE or GET
  CONVERSATION GROUP without WHERE, and no such statement returned empty for `empty_grace_ms`.
  A disabled queue is never worth a reader: RECEIVE on it fails.
* **Occurs** (internal activation) only when activation is enabled and fewer than
  MAX_QUEUE_READERS tasks run. External activation has no reader count; `ExternalNotifier` instead
  holds back a second notification until a RECEIVE is seen or a time-out passes.

One addition to rule (2): after starting a reader the monitor is NOTIFIED and does not start
another for rule (2) until that reader issues a RECEIVE, the tasks exit, or `starting_hold_ms`
passes. A reader that has not reached RECEIVE yet will take the work; without the hold a burst of
arrivals would start every allowed reader before the first one got going, which is the waste the
locking-aware rule exists to avoid.

And one for tasks that fail: a task that exits with a failure status (its procedure cannot be
loaded, its principal may not RECEIVE, it crashed) holds activation back as `retry` says
(`ActivationSettings.activation_retry_ms`, doubled with each failure in a row up to
`activation_retry_max_ms`); a task that ends normally, or an
ALTER QUEUE, clears it.
Service Broker starts a failing procedure again while messages wait; started again the moment it
ended, a KSB task (a Python process) whose procedure could not be loaded was started every 1.1 s,
each one's whole life spent starting up, for as long as the fault lasted.

Everything is pure: the service feeds observations with `now_ms` from its clock and acts on the
returned `Decision`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ksb.backoff import Backoff, FailureHold

__all__ = [
    "Decision",
    "ExternalNotifier",
    "MonitorState",
    "QueueMonitor",
    "QueueObservation",
]

MonitorState = Literal["INACTIVE", "NOTIFIED", "RECEIVES_OCCURRING"]


@dataclass(frozen=True)
class QueueObservation:
    """What the monitor knows about one queue at one instant."""

    now_ms: int
    ready_groups: int  # runnable work: groups with ready messages that are NOT locked
    ready_messages: int
    waiting_receivers: int  # sessions waiting in RECEIVE / GET CONVERSATION GROUP without WHERE
    running_tasks: int
    last_empty_receive_ms: int | None
    max_queue_readers: int
    activation_enabled: bool
    queue_enabled: bool


@dataclass(frozen=True)
class Decision:
    """The outcome of one evaluation; `reason` names the rule that decided, for logs and metrics."""

    activate: bool
    reason: str
    state: MonitorState
    necessary: bool = False


class QueueMonitor:
    """One queue's monitor; call the `on_*` method matching each event and act on the Decision."""

    def __init__(
        self,
        *,
        empty_grace_ms: int,
        starting_hold_ms: int,
        retry: Backoff,
    ) -> None:
        self._empty_grace_ms = empty_grace_ms
        self._starting_hold_ms = starting_hold_ms
        self._hold = FailureHold(retry)
        self._state: MonitorState = "INACTIVE"
        self._notified_ms: int | None = None
        self._last_empty_ms: int | None = None

    @property
    def state(self) -> MonitorState:
        return self._state

    def on_message_arrived(self, obs: QueueObservation, had_unread_before: bool) -> Decision:
        first = not had_unread_before and obs.running_tasks == 0
        return self._evaluate(obs, first_message=first)

    def on_receive(self, obs: QueueObservation, returned_empty: bool) -> Decision:
        """A RECEIVE or GET CONVERSATION GROUP without WHERE finished."""
        if returned_empty:
            self._last_empty_ms = obs.now_ms
        self._state = "RECEIVES_OCCURRING"
        return self._evaluate(obs)

    def on_rollback(self, obs: QueueObservation) -> Decision:
        """Rolled-back messages are ready again, so there may be work for a new reader."""
        return self._evaluate(obs)

    def on_tasks_exited(self, obs: QueueObservation) -> Decision:
        """All started tasks exited; a reader that never reached RECEIVE no longer holds us back."""
        if self._state == "NOTIFIED":
            self._state = "INACTIVE"
        return self._evaluate(obs)

    def on_task_exit(self, now_ms: int, status: int) -> int | None:
        """A started task ended with exit `status`. Returns how long activation is held back
        (ms) if that was a failure, None if the task ended normally."""
        if status == 0:
            self._hold.clear()
            return None
        return self._hold.failed(now_ms)

    def on_alter(self, obs: QueueObservation) -> Decision:
        """ALTER QUEUE may have enabled activation, raised MAX_QUEUE_READERS, or named another
        procedure or principal: what made tasks fail may be mended, so they are not held back."""
        self._hold.clear()
        return self._evaluate(obs)

    def on_tick(self, obs: QueueObservation) -> Decision:
        return self._evaluate(obs)

    def _evaluate(self, obs: QueueObservation, first_message: bool = False) -> Decision:
        necessary, reason = self._necessity(obs, first_message)
        if necessary:
            blocked = _blocked(obs) or self._failing(obs)
            if blocked is None:
                self._state = "NOTIFIED"
                self._notified_ms = obs.now_ms
                return Decision(activate=True, reason=reason, state=self._state, necessary=True)
            reason = blocked
        elif obs.ready_messages == 0 and obs.running_tasks == 0:
            self._state = "INACTIVE"
        return Decision(activate=False, reason=reason, state=self._state, necessary=necessary)

    def _necessity(self, obs: QueueObservation, first_message: bool) -> tuple[bool, str]:
        if not obs.queue_enabled:
            return False, "queue_disabled"
        if first_message:
            return True, "first_message"
        if obs.ready_groups <= 0:
            return False, "no_ready_groups"
        if obs.waiting_receivers > 0:
            return False, "reader_waiting"
        if self._recent_empty_receive(obs):
            return False, "recent_empty_receive"
        if self._reader_starting(obs):
            return False, "reader_starting"
        return True, "backlog"

    def _failing(self, obs: QueueObservation) -> str | None:
        """Held back since the last task failed (`on_task_exit`)."""
        if self._hold.holds(obs.now_ms):
            return "failing_tasks"
        return None

    def _recent_empty_receive(self, obs: QueueObservation) -> bool:
        seen = [t for t in (obs.last_empty_receive_ms, self._last_empty_ms) if t is not None]
        return bool(seen) and obs.now_ms - max(seen) < self._empty_grace_ms

    def _reader_starting(self, obs: QueueObservation) -> bool:
        return (
            self._state == "NOTIFIED"
            and obs.running_tasks > 0
            and self._notified_ms is not None
            and obs.now_ms - self._notified_ms < self._starting_hold_ms
        )


def _blocked(obs: QueueObservation) -> str | None:
    """Why internal activation may not occur although it is necessary, or None if it may."""
    if not obs.activation_enabled:
        return "activation_disabled"
    if obs.running_tasks >= obs.max_queue_readers:
        return "max_queue_readers"
    return None


class ExternalNotifier:
    """Rate-limits QUEUE_ACTIVATION notifications for external activators.

    The broker cannot count external readers and they take time to start, so after one
    notification it stays quiet until a RECEIVE on the queue shows a reader arrived, or until
    `timeout_ms` passes (the reader evidently did not come, so ask again).
    """

    def __init__(self, timeout_ms: int) -> None:
        self._timeout_ms = timeout_ms
        self._notified_ms: int | None = None

    @property
    def outstanding_since_ms(self) -> int | None:
        return self._notified_ms

    def should_notify(self, decision: Decision, now_ms: int) -> bool:
        """True means: send the notification now (it is recorded as sent)."""
        if not decision.necessary:
            return False
        if self._notified_ms is not None and now_ms - self._notified_ms < self._timeout_ms:
            return False
        self._notified_ms = now_ms
        return True

    def on_receive(self) -> None:
        self._notified_ms = None
