"""A shard held here that the group coordinator has moved away: noticed in seconds, let go.

The shard without an owner (issue 41; docs/reliability.md, "What the harness found"): the
heartbeat answer that moved a shard away from this member was lost to a request timeout while
the broker stalled; librdkafka 2.16 went on heartbeating without saying what it owned, and the
coordinator never repeated the revocation, so the shard's new owner waited for it until this
member's rebalance timeout fenced it (`KSB_REBALANCE_TIMEOUT_MS`, 30 s; Kafka's default was 5
minutes). Nothing in the member notices: its shard flows as before, only not to the member the
group chose.

The coordinator does say it: its description of the group gives each member's *target*
assignment and its *current* one (what the coordinator has sent it). A revocation reaches a live
member within a heartbeat interval (500 ms on the local stack) and its callback runs at once, so a
shard this member holds that its target has left out for longer than `assignment_stall_ms` is one
whose revocation was lost; and a shard the coordinator counts as sent to this member that its
consumer has not been given for as long is an assignment lost the same way. `AssignmentWatch`
decides that, purely, from what it is shown; the dispatcher's shell asks the coordinator on a thread of
its own (never in the loop) and rejoins the group when the watch says so, as it does when an
assignment cannot be taken (`services.dispatcher.rebalance.AssignmentFailed`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from confluent_kafka import KafkaException

# confluent_kafka.admin re-exports it from a private module, with no __all__ to say so.
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    MemberAssignment,
)

__all__ = [
    "AssignmentWatch",
    "CoordinatorTargets",
    "CoordinatorView",
    "TargetProbe",
    "coordinator_targets",
]

log = logging.getLogger("ksb.dispatcher")


@dataclass(frozen=True)
class CoordinatorView:
    """What the coordinator says of one member: the shards it has sent it and those it means
    it to have."""

    current: frozenset[int]
    target: frozenset[int]


class AssignmentWatch:
    """Which shards this member and the coordinator have disagreed on for too long."""

    def __init__(self, stall_s: float) -> None:
        self.stall_s = stall_s
        self._since: dict[int, float] = {}
        """Shard -> since when it was seen in disagreement."""

    def observe(self, now: float, held: set[int], view: CoordinatorView | None) -> list[int]:
        """One look: `held` are the shards this member's consumer is assigned; `view` what the
        coordinator says (None: it does not list this member, or did not answer; nothing is
        concluded from that). A shard disagrees when it is held here and the target has left it
        out (a revocation lost), or the coordinator has sent it and it is not held here (an
        assignment lost). Returns the shards that have disagreed for `stall_s`, sorted."""
        if view is None:
            return self.overdue(now)
        disagree = (held - view.target) | (view.current - held)
        self._since = {s: self._since.get(s, now) for s in disagree}
        return self.overdue(now)

    def overdue(self, now: float) -> list[int]:
        return sorted(s for s, since in self._since.items() if now - since >= self.stall_s)

    def reset(self) -> None:
        """The member rejoined: what it held before says nothing about its next assignment."""
        self._since.clear()


TargetProbe = Callable[[str], CoordinatorView | None]
"""What the coordinator says of a member (by member id), in relay partitions; None when the
member is not listed or the group cannot be described."""


def coordinator_targets(
    make_admin: Callable[[], AdminClient], group: str, relay: str, timeout_s: float
) -> TargetProbe:
    """`TargetProbe` from the coordinator's description of the group (a new admin client after
    a failed one, as `services.dispatcher.rebalance.coordinator_shards` does)."""
    admins: list[AdminClient] = []

    def target(member: str) -> CoordinatorView | None:
        if not admins:
            admins.append(make_admin())
        try:
            groups = admins[0].describe_consumer_groups([group], request_timeout=timeout_s)
            desc = groups[group].result()
        except KafkaException:
            admins.clear()
            return None
        for m in desc.members:
            if m.member_id == member:
                current = _shards(m.assignment, relay)
                target = _shards(m.target_assignment, relay) if m.target_assignment else current
                return CoordinatorView(current, target)
        return None

    return target


def _shards(assignment: MemberAssignment | None, relay: str) -> frozenset[int]:
    if assignment is None:
        return frozenset()
    return frozenset(tp.partition for tp in assignment.topic_partitions if tp.topic == relay)


class CoordinatorTargets:
    """Asks `probe` for this member's target every `every_s` on a thread of its own; the loop
    reads the latest answer (`latest`) without waiting on Kafka."""

    def __init__(self, probe: TargetProbe, every_s: float) -> None:
        self._probe = probe
        self._every_s = every_s
        self._member = ""
        self._answers = 0
        self._latest: CoordinatorView | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="assignment-watch", daemon=True)

    def start(self) -> CoordinatorTargets:
        self._thread.start()
        return self

    def follow(self, member: str) -> None:
        """The member id to ask about (it changes when the member rejoins)."""
        with self._lock:
            if member != self._member:
                self._member, self._latest = member, None

    def latest(self) -> tuple[int, CoordinatorView | None]:
        """(how many answers came so far, the last one for the member followed now)."""
        with self._lock:
            return self._answers, self._latest

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            with self._lock:
                member = self._member
            if not member:
                continue
            try:
                answer = self._probe(member)
            except Exception:
                log.exception("describing the group for the assignment watch")
                answer = None
            with self._lock:
                if member == self._member:
                    self._answers += 1
                    self._latest = answer

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
