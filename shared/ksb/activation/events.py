"""What happened on a queue since the monitor last looked, as the events its monitor decides on.

Readers leave traces in Redis (when a RECEIVE returned messages, when one returned empty, how many
rollbacks in a row) and the queue topic says how many messages are ready. The monitor compares each
look with the previous one: a rise in ready messages is an arrival, a newer receive time is a
RECEIVE, a newer empty time is an empty RECEIVE, a rise in rollbacks is a rollback. Each such edge
becomes one call on the `QueueMonitor`, in that order, followed by "the tasks exited" and the
periodic tick when they apply; the service acts on the first decision that activates.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ksb.activation.monitor import Decision, QueueMonitor, QueueObservation

__all__ = ["Edges", "Traces", "decisions", "edges"]


@dataclass(frozen=True)
class Traces:
    """One look at a queue: ready messages, and the readers' last receive, empty receive and
    rollbacks in a row (0 before the first look)."""

    ready: int = 0
    receive_ms: int = 0
    empty_ms: int = 0
    rollbacks: int = 0


@dataclass(frozen=True)
class Edges:
    """What changed between two looks."""

    arrived: bool = False
    had_unread_before: bool = False
    received: bool = False
    returned_empty: bool = False
    rolled_back: bool = False


def edges(before: Traces, now: Traces) -> tuple[Edges, Traces]:
    """The edges from `before` to `now`, and the traces to compare the next look with.

    Times only move forward: a receive time older than the one already seen is not news (a reader
    on another clock, or Redis flushed), so the newer of the two is kept.
    """
    seen = Edges(
        arrived=now.ready > before.ready,
        had_unread_before=before.ready > 0,
        received=now.receive_ms > before.receive_ms,
        returned_empty=now.empty_ms > before.empty_ms,
        rolled_back=now.rollbacks > before.rollbacks,
    )
    kept = replace(
        now,
        receive_ms=max(now.receive_ms, before.receive_ms),
        empty_ms=max(now.empty_ms, before.empty_ms),
    )
    return seen, kept


def decisions(
    monitor: QueueMonitor,
    obs: QueueObservation,
    seen: Edges,
    *,
    tasks_all_exited: bool,
    tick: bool,
) -> list[Decision]:
    """The monitor's decisions on these edges, in the order the events are taken."""
    out: list[Decision] = []
    if seen.arrived:
        out.append(monitor.on_message_arrived(obs, had_unread_before=seen.had_unread_before))
    if seen.received:
        out.append(monitor.on_receive(obs, returned_empty=False))
    if seen.returned_empty:
        out.append(monitor.on_receive(obs, returned_empty=True))
    if seen.rolled_back:
        out.append(monitor.on_rollback(obs))
    if tasks_all_exited:
        out.append(monitor.on_tasks_exited(obs))
    if tick:
        out.append(monitor.on_tick(obs))
    return out
