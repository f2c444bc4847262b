"""What one chaos round asks of the broker: its dialogs, their messages, and each reader's rule.

A round runs ``dialogs`` dialogs from instance A's initiator services to instance B's target
services, ``messages`` requests in all. Each dialog is drawn from the round's seed:

* **end** (most): every request gets a reply in the transaction that receives it; the last
  request's transaction also ENDs the conversation; A's reader ENDs its side on the EndDialog.
* **error**: the same, but the target ends WITH ERROR; A receives an Error and ENDs.
* **timer**: the target answers the last request and begins a conversation timer instead of
  ending; the DialogTimer's transaction ENDs (a timer that never fires leaves the dialog open).
* **poison**: one request that the target's reader always rolls back; the queue's dead-letter
  policy moves it to the dead-letter topic after ``max_rollbacks`` and ends the dialog WITH
  ERROR, so A receives an Error and ENDs.

Some dialogs are begun with RELATED_CONVERSATION of an earlier one (their initiator sides share a
conversation group on A), and some go through the forwarder instance F (the ``Fwd`` services, whose
routes name F as ``via``). The readers' rules are pure functions of what a RECEIVE returned
(`target_step`, `initiator_step`), so a reader process killed at any point and started again
does exactly what the one before it would have done.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ksb.catalog.model import DIALOG_TIMER, END_DIALOG, ERROR, Catalog, parse_catalog
from ksb.security.principals import peer_principal

__all__ = [
    "CONTRACT",
    "DEAD_LETTER_ROLLBACKS",
    "ERROR_CODE",
    "INITIATOR",
    "INITIATOR_FWD",
    "INITIATOR_QUEUE",
    "REPLY",
    "REQUEST",
    "TARGET",
    "TARGET_FWD",
    "TARGET_QUEUE",
    "TIMER_S",
    "DialogPlan",
    "Kind",
    "Received",
    "Step",
    "Workload",
    "catalogs",
    "initiator_step",
    "plan_workload",
    "request_body",
    "target_step",
]

INITIATOR, INITIATOR_FWD = "//chaos/Initiator", "//chaos/InitiatorFwd"
TARGET, TARGET_FWD = "//chaos/Target", "//chaos/TargetFwd"
CONTRACT = "//chaos/Contract"
REQUEST, REPLY = "//chaos/Request", "//chaos/Reply"
INITIATOR_QUEUE, TARGET_QUEUE = "ChaosInitiatorQueue", "ChaosTargetQueue"
TIMER_S = 1.0
"""A timer dialog's conversation timer, begun when its last request is answered."""
ERROR_CODE = 4242
DEAD_LETTER_ROLLBACKS = 3


class Kind(str, Enum):
    END = "end"
    ERROR = "error"
    TIMER = "timer"
    POISON = "poison"


_KIND_WEIGHTS = ((Kind.END, 80), (Kind.ERROR, 8), (Kind.TIMER, 8), (Kind.POISON, 4))
_RELATED_SHARE = 0.2
_FORWARDED_SHARE = 0.2


@dataclass(frozen=True)
class DialogPlan:
    number: int
    kind: Kind
    requests: int
    forwarded: bool
    """Through the forwarder instance (the ``Fwd`` services) instead of the direct route."""
    related_to: int | None
    """An earlier dialog (same services) whose conversation group this one joins on A."""

    @property
    def services(self) -> tuple[str, str]:
        return (INITIATOR_FWD, TARGET_FWD) if self.forwarded else (INITIATOR, TARGET)

    @property
    def replies(self) -> int:
        """Replies A must receive: one per request, but a poison request is never answered."""
        return 0 if self.kind is Kind.POISON else self.requests

    @property
    def closing_type(self) -> str:
        """What A receives last on this dialog: EndDialog, or Error (error end, dead letter)."""
        return END_DIALOG if self.kind in (Kind.END, Kind.TIMER) else ERROR


@dataclass(frozen=True)
class Workload:
    dialogs: tuple[DialogPlan, ...]

    @property
    def requests(self) -> int:
        return sum(d.requests for d in self.dialogs)

    @property
    def replies(self) -> int:
        return sum(d.replies for d in self.dialogs)

    def count(self, kind: Kind) -> int:
        return sum(1 for d in self.dialogs if d.kind is kind)

    @property
    def related(self) -> int:
        return sum(1 for d in self.dialogs if d.related_to is not None)

    @property
    def forwarded(self) -> int:
        return sum(1 for d in self.dialogs if d.forwarded)


def plan_workload(seed: int, dialogs: int, messages: int) -> Workload:
    """The round's dialogs, drawn from `seed`: ``messages`` requests over ``dialogs`` dialogs
    (at least one each; a poison dialog has exactly one)."""
    if dialogs < 1 or messages < dialogs:
        raise ValueError("a round needs at least one dialog and one message per dialog")
    rng = random.Random(seed)
    kinds = [k for k, _ in _KIND_WEIGHTS]
    weights = [w for _, w in _KIND_WEIGHTS]
    drawn = [rng.choices(kinds, weights)[0] for _ in range(dialogs)]
    forwarded = [rng.random() < _FORWARDED_SHARE for _ in range(dialogs)]
    counts = [1] * dialogs
    growable = [n for n in range(dialogs) if drawn[n] is not Kind.POISON] or [0]
    for _ in range(messages - dialogs):
        counts[rng.choice(growable)] += 1
    if drawn[0] is Kind.POISON and counts[0] > 1:
        drawn[0] = Kind.END  # every dialog was poison: keep the message count honest
    plans: list[DialogPlan] = []
    for n in range(dialogs):
        related = None
        if n > 0 and rng.random() < _RELATED_SHARE:
            same = [p.number for p in plans[-20:] if p.forwarded == forwarded[n]]
            related = rng.choice(same) if same else None
        plans.append(DialogPlan(n, drawn[n], counts[n], forwarded[n], related))
    return Workload(tuple(plans))


def request_body(plan: DialogPlan, seq: int) -> str:
    return json.dumps({"d": plan.number, "s": seq, "n": plan.requests, "k": plan.kind.value})


def reply_body(dialog: int, seq: int) -> str:
    return json.dumps({"d": dialog, "s": seq})


@dataclass(frozen=True)
class Received:
    """What a reader's rule needs of one received message."""

    handle: str
    message_type: str
    body: bytes


@dataclass
class Step:
    """What one transaction does with what it received."""

    rollback: bool = False
    replies: list[tuple[str, str]] = field(default_factory=list)
    """(handle, body) to SEND as REPLY."""
    ends: list[tuple[str, bool]] = field(default_factory=list)
    """(handle, with error) to END."""
    timers: list[str] = field(default_factory=list)
    """Handles to begin a `TIMER_S` conversation timer on."""


def target_step(received: list[Received]) -> Step:
    """B's reader: answer every request; end (or start the closing timer) on the last; end on a
    DialogTimer; roll back a batch that holds a poison request."""
    step = Step()
    for m in received:
        if m.message_type == REQUEST:
            req: dict[str, Any] = json.loads(m.body)
            kind = Kind(req["k"])
            if kind is Kind.POISON:
                return Step(rollback=True)
            step.replies.append((m.handle, reply_body(req["d"], req["s"])))
            if req["s"] == req["n"] - 1:
                if kind is Kind.TIMER:
                    step.timers.append(m.handle)
                else:
                    step.ends.append((m.handle, kind is Kind.ERROR))
        elif m.message_type == DIALOG_TIMER:
            step.ends.append((m.handle, False))
        # An EndDialog or Error from A needs nothing: this side has ended already.
    return step


def initiator_step(received: list[Received]) -> Step:
    """A's reader: replies are just received; an EndDialog or Error ends this side."""
    step = Step()
    for m in received:
        if m.message_type in (END_DIALOG, ERROR):
            step.ends.append((m.handle, False))
    return step


def catalogs(a: str, b: str, f: str, target_partitions: int) -> tuple[Catalog, Catalog, Catalog]:
    """A hosts the initiator services, B the target services, F only forwards: the direct
    services route straight to each other, the ``Fwd`` ones through F in both directions."""
    common: dict[str, Any] = {
        "message_types": [
            {"name": REQUEST, "validation": "WELL_FORMED_JSON"},
            {"name": REPLY, "validation": "WELL_FORMED_JSON"},
        ],
        "contracts": [
            {
                "name": CONTRACT,
                "messages": [
                    {"type": REQUEST, "sent_by": "INITIATOR"},
                    {"type": REPLY, "sent_by": "TARGET"},
                ],
            }
        ],
    }
    ca = {
        **common,
        "queues": [{"name": INITIATOR_QUEUE, "partitions": 2}],
        "services": [
            {"name": INITIATOR, "queue": INITIATOR_QUEUE},
            {"name": INITIATOR_FWD, "queue": INITIATOR_QUEUE},
        ],
        "routes": [
            {"name": "to-target", "service_name": TARGET, "broker_instance": b},
            {"name": "to-target-fwd", "service_name": TARGET_FWD, "broker_instance": b, "via": f},
        ],
    }
    cb = {
        **common,
        "queues": [
            {
                "name": TARGET_QUEUE,
                "partitions": target_partitions,
                "dead_letter": {"max_rollbacks": DEAD_LETTER_ROLLBACKS, "error_code": ERROR_CODE},
            }
        ],
        "services": [
            {"name": TARGET, "queue": TARGET_QUEUE, "contracts": [CONTRACT]},
            {"name": TARGET_FWD, "queue": TARGET_QUEUE, "contracts": [CONTRACT]},
        ],
        "routes": [
            {"name": "to-init", "service_name": INITIATOR, "broker_instance": a},
            {"name": "to-init-fwd", "service_name": INITIATOR_FWD, "broker_instance": a, "via": f},
        ],
        # A may begin dialogs with B's targets (directly and through F): the peer's grant.
        "grants": [
            {"permission": "SEND", "target": TARGET, "principal": peer_principal(a)},
            {"permission": "SEND", "target": TARGET_FWD, "principal": peer_principal(a)},
        ],
    }
    cf = {
        **common,
        "routes": [
            {"name": "fwd-target", "service_name": TARGET_FWD, "broker_instance": b},
            {"name": "fwd-init", "service_name": INITIATOR_FWD, "broker_instance": a},
        ],
    }
    return parse_catalog(ca), parse_catalog(cb), parse_catalog(cf)
