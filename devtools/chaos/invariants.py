"""The invariants a chaos round must keep, checked against what the broker itself recorded.

The evidence is Kafka's, read committed after the round (`devtools.chaos.facts`): each queue
topic (message records, receipt tombstones, commit outcomes with their fencing tokens), each
instance's audit topic (the dispatchers write a ``commit`` event per received message **in the
transaction that applies the receipt**, in one partition, so it is the order receipts were
applied in), the dead-letter topic and the endpoints topic. The readers' own lines
(`devtools.chaos.reader`) are checked against it: a batch a reader was told was applied must be
one the broker recorded.

* **lost**: an expected message (a request on B, its reply on A, each dialog's EndDialog or Error
  on A, each timer dialog's DialogTimer on B) never received, a poison request never
  dead-lettered, or a batch a reader saw applied that the broker has no receipt of.
* **duplicated**: a message received twice (by id, or the same request or reply enqueued under
  two ids and both received), dead-lettered twice, or in two batches readers saw applied; a
  message received that the workload never asked for counts here too.
* **out of order**: within a conversation, a message received after one with a higher
  sequence number (DialogTimer and Error messages are ordered ahead of the sequence by rule, and
  are left out of it).
* **stale**: a commit applied under a fencing token older than one applied before it for its
  group (its queue partition's outcomes, in order).
* **open**: an endpoint not CLOSED once the round drained (or a target endpoint never made).
* **pending**: messages still in a transmission queue (A's, B's) or held by the forwarder.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from devtools.chaos.workload import REPLY, REQUEST, Kind, Workload
from ksb.catalog.model import DIALOG_TIMER, END_DIALOG, ERROR
from ksb.wire.protocol import CommitOutcome, QueueMessage

__all__ = ["INVARIANTS", "Side", "Verdict", "check_round", "stale_commits"]

_UNSEQUENCED = frozenset({DIALOG_TIMER, ERROR})
INVARIANTS = ("lost", "dup", "order", "stale", "open", "pending", "refused")
"""``refused``: a hostile record (`devtools.chaos.hostile`) not refused with its code."""


@dataclass
class Side:
    """What one instance recorded about one queue in a round."""

    messages: list[QueueMessage] = field(default_factory=list)
    """Every message record (status 1) of the queue topic, in topic order."""
    outcomes: list[list[CommitOutcome]] = field(default_factory=list)
    """Commit outcomes per queue partition, in offset order."""
    committed: list[str] = field(default_factory=list)
    """Message ids of the audit's ``commit`` events: receipts in the order they were applied."""
    dead_lettered: list[QueueMessage] = field(default_factory=list)
    endpoints: dict[str, str | None] = field(default_factory=dict)
    """Handle -> state of its newest record (None: tombstoned)."""
    notes: dict[str, str] = field(default_factory=dict)
    """Handle -> what else its newest record says that explains an endpoint left open (its
    conversation timer, its counters), for the report."""
    applied_batches: list[list[str]] = field(default_factory=list)
    """Message ids of each batch a reader of this side logged as applied (``C``)."""


@dataclass
class Verdict:
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(INVARIANTS, 0))
    problems: list[str] = field(default_factory=list)
    stale_refused: int = 0
    """Commits the dispatchers refused for a stale token (the fence at work)."""

    def add(self, invariant: str, n: int, text: str) -> None:
        if n <= 0:
            return
        self.counts[invariant] += n
        if len(self.problems) < 40:
            self.problems.append(f"{invariant}: {text}")

    @property
    def ok(self) -> bool:
        return not any(self.counts.values())


def stale_commits(outcomes: list[list[CommitOutcome]]) -> tuple[list[CommitOutcome], int]:
    """Applied outcomes whose token is below one applied earlier for their group, and how many
    commits were refused for a stale token. Token 0 (no KSB lock) is never fenced."""
    bad: list[CommitOutcome] = []
    refused = 0
    for partition in outcomes:
        newest: dict[str, int] = {}
        for o in partition:
            if not o.applied:
                refused += o.reason.startswith("stale_token")
                continue
            if o.token and o.token < newest.get(o.group, 0):
                bad.append(o)
            newest[o.group] = max(newest.get(o.group, 0), o.token)
    return bad, refused


def _key(m: QueueMessage, dialog_of: dict[str, int]) -> tuple[str, int, int] | None:
    """The workload's name for a message: (what, dialog, seq)."""
    t = m.message_type_name
    if t in (REQUEST, REPLY):
        body = json.loads(m.message_body)
        return ("q" if t == REQUEST else "p", int(body["d"]), int(body["s"]))
    d = dialog_of.get(m.conversation_handle)
    if d is None:
        return None
    short = {END_DIALOG: "E", ERROR: "X", DIALOG_TIMER: "T"}.get(t, t)
    return (short, d, 0)


def _expected(workload: Workload) -> tuple[set[tuple[str, int, int]], ...]:
    on_b: set[tuple[str, int, int]] = set()
    on_a: set[tuple[str, int, int]] = set()
    poison: set[tuple[str, int, int]] = set()
    for d in workload.dialogs:
        if d.kind is Kind.POISON:
            poison.add(("q", d.number, 0))
        else:
            on_b.update(("q", d.number, s) for s in range(d.requests))
            on_a.update(("p", d.number, s) for s in range(d.requests))
        if d.kind is Kind.TIMER:
            on_b.add(("T", d.number, 0))
        on_a.add(("E" if d.closing_type == END_DIALOG else "X", d.number, 0))
    return on_b, on_a, poison


def _check_side(
    name: str,
    side: Side,
    expected: set[tuple[str, int, int]],
    dialog_of: dict[str, int],
    verdict: Verdict,
) -> dict[tuple[str, int, int], int]:
    """Lost, duplicated and order on one side; returns how often each key was received."""
    by_id: dict[str, QueueMessage] = {}
    ids_of_key: dict[tuple[str, int, int], set[str]] = defaultdict(set)
    for m in side.messages:
        if m.message_id in by_id:
            verdict.add("dup", 1, f"{name}: message {m.message_id} enqueued twice")
            continue
        by_id[m.message_id] = m
        key = _key(m, dialog_of)
        if key is not None:
            ids_of_key[key].add(m.message_id)
    times = Counter(side.committed)
    for mid, n in times.items():
        verdict.add("dup", n - 1, f"{name}: message {mid} received {n} times")
    received: Counter[tuple[str, int, int]] = Counter()
    last_seq: dict[str, tuple[int, str]] = {}
    for mid in dict.fromkeys(side.committed):
        got = by_id.get(mid)
        if got is None:
            continue  # a message of the broker's own making that the queue no longer shows
        key = _key(got, dialog_of)
        if key is not None:
            received[key] += 1
        if got.message_type_name in _UNSEQUENCED:
            continue  # ordered by class, ahead of the sequence (docs/reliability.md)
        prev = last_seq.get(got.conversation_handle)
        if prev is not None and got.message_sequence_number <= prev[0]:
            verdict.add(
                "order",
                1,
                f"{name}: conversation {got.conversation_handle} received {mid} "
                f"(seq {got.message_sequence_number}) after {prev[1]} (seq {prev[0]})",
            )
        last_seq[got.conversation_handle] = (got.message_sequence_number, mid)
    for key in expected:
        if received[key] == 0:
            verdict.add("lost", 1, f"{name}: {key} never received (ids {sorted(ids_of_key[key])})")
    for key, n in received.items():
        if key not in expected:
            verdict.add("dup", n, f"{name}: {key} received but never asked for")
        elif n > 1:
            verdict.add("dup", n - 1, f"{name}: {key} received {n} times")
    seen_applied: set[str] = set()
    receipts = set(side.committed)
    for batch in side.applied_batches:
        for mid in batch:
            if mid in seen_applied:
                verdict.add("dup", 1, f"{name}: {mid} in two batches readers saw applied")
            seen_applied.add(mid)
            if mid not in receipts:
                verdict.add("lost", 1, f"{name}: {mid} applied for a reader, no receipt recorded")
    return received


def check_round(workload: Workload, handles: list[str], a: Side, b: Side, pending: int) -> Verdict:
    """Every invariant of one round. `handles` are A's dialog handles by dialog number;
    `pending` counts what the transmission queues and the forwarder still hold."""
    verdict = Verdict()
    on_b, on_a, poison = _expected(workload)
    a_dialog = {h: n for n, h in enumerate(handles)}
    b_dialog: dict[str, int] = {}
    for m in b.messages:
        if m.message_type_name == REQUEST:
            b_dialog[m.conversation_handle] = int(json.loads(m.message_body)["d"])
    _check_side("A", a, on_a, a_dialog, verdict)
    _check_side("B", b, on_b, b_dialog, verdict)
    dead = Counter(k for m in b.dead_lettered if (k := _key(m, b_dialog)) is not None)
    for key in poison:
        if dead[key] == 0:
            verdict.add("lost", 1, f"B: poison {key} never dead-lettered")
    for key, n in dead.items():
        if key not in poison:
            verdict.add("dup", n, f"B: {key} dead-lettered but not poison")
        elif n > 1:
            verdict.add("dup", n - 1, f"B: {key} dead-lettered {n} times")
    for name, side in (("A", a), ("B", b)):
        bad, refused = stale_commits(side.outcomes)
        verdict.stale_refused += refused
        for o in bad:
            verdict.add(
                "stale",
                1,
                f"{name}: commit {o.request_id} of group {o.group} applied "
                f"with token {o.token} after a newer one",
            )
    _check_endpoints(verdict, "A", a, handles)
    _check_endpoints(verdict, "B", b, list(b_dialog) + _b_only(b, b_dialog))
    verdict.add(
        "open",
        max(0, len(handles) - len(b.endpoints)),
        f"B: {len(b.endpoints)} endpoints for {len(handles)} dialogs",
    )
    verdict.add("pending", pending, f"{pending} messages still in transmission queues")
    return verdict


def _b_only(b: Side, known: dict[str, int]) -> list[str]:
    return [h for h in b.endpoints if h not in known]


def _check_endpoints(verdict: Verdict, name: str, side: Side, handles: Iterable[str]) -> None:
    for h in handles:
        state = side.endpoints.get(h, "MISSING")
        if state is not None and state != "CLOSED":
            note = side.notes.get(h)
            verdict.add("open", 1, f"{name}: endpoint {h} is {state}{f' ({note})' if note else ''}")
