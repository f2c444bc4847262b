"""A small executable model of Service Broker's conversation rules, written apart from the engine.

It knows nothing of Kafka, records or the engine's modules: only conversations, their two
endpoints, the messages waiting in each queue and the rules that move them, as Service Broker's
documentation and KSB's protocol page state them. `tests.model.test_engine_model` drives the real
engine and this model side by side and requires them to agree. The rules, in one place:

* **BEGIN** makes an initiator endpoint (STARTED_OUTBOUND) in the conversation group of the
  related conversation, or the named group, or a new one, at the level of the most specific
  broker priority (1-10, default 5). A second BEGIN with the same handle and target is a retry
  and changes nothing; any other reuse of an open handle is ``duplicate_handle``.
* **SEND** puts one message in the far endpoint's queue, numbered in its direction from 0; the
  target endpoint (STARTED_INBOUND, a new group, its own level) comes with the first message. A
  body its message type refuses (here: EMPTY) fails the dialog instead: the sender gets an Error
  (-9615) and goes to ERROR, the receiving side closes. A multi-handle SEND is all or nothing.
* **RECEIVE** returns the ready messages of one unlocked group: the group of the highest level
  (a group's level is its best conversation's with ready messages), the oldest-ready among equals;
  inside it the best conversation first, the oldest-ready among equals; inside a conversation
  DialogTimer, then Error, then sequence order. A first RECEIVE makes a STARTED_INBOUND endpoint
  CONVERSING; receiving the far side's EndDialog or Error closes the far side if it had ended.
* **commit** applies the receipt and the actions whole or not at all; a receipt naming a message
  not ready (received already) or under a lock token older than one already applied for the group
  is refused. **rollback** changes nothing: the messages are back.
* **END** sends the far side an EndDialog (or an Error WITH ERROR) in sequence and leaves this
  side DISCONNECTED_OUTBOUND until the far side has it; a side whose far side already ended or
  failed closes at once, and its END completes the far side's END too: both have ended. An
  initiator that never sent closes at once. WITH CLEANUP closes this side silently: the far side
  is not told, what it sends afterwards goes nowhere, and its END closes it at once. Ending a
  conversation removes its messages from this side's queue: an ended side receives nothing more,
  and ending it again is refused.
* **Timers**: a DialogTimer arrives in the endpoint's own queue when its timer passes (a new
  timer replaces the old; none on an ended side). The dialog **lifetime** fails both sides that
  are still open with an Error (-8489); an ended side just closes.

Where Service Broker and KSB's documents are silent, the choices are written at the rule.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, TypeAlias

__all__ = [
    "DIALOG_TIMER",
    "END_DIALOG",
    "ERROR",
    "Action",
    "Begin",
    "Broker",
    "End",
    "Message",
    "Send",
    "Side",
    "Spec",
    "Timer",
    "error_body",
]

_SB = "http://schemas.microsoft.com/SQL/ServiceBroker"
END_DIALOG = f"{_SB}/EndDialog"
ERROR = f"{_SB}/Error"
DIALOG_TIMER = f"{_SB}/DialogTimer"
LIFETIME_EXPIRED = -8489
VALIDATION_FAILED = -9615

StateName = Literal[
    "STARTED_OUTBOUND",
    "STARTED_INBOUND",
    "CONVERSING",
    "DISCONNECTED_INBOUND",
    "DISCONNECTED_OUTBOUND",
    "ERROR",
    "CLOSED",
]
_CAN_SEND = ("STARTED_OUTBOUND", "STARTED_INBOUND", "CONVERSING")
ANY = "ANY"


@dataclass(frozen=True)
class Spec:
    """The catalog the model and the engine share, in the model's own terms."""

    services: dict[str, tuple[str, tuple[str, ...]]]
    """service -> (queue, contracts it accepts as a target)"""
    contracts: dict[str, dict[str, str]]
    """contract -> message type -> who sends it: INITIATOR, TARGET or ANY"""
    message_types: dict[str, str]
    """message type -> validation: NONE or EMPTY"""
    priorities: tuple[tuple[str, str, str, int], ...]
    """(contract, local service, remote service, level); ANY is the wildcard"""
    max_body: int

    def level(self, contract: str, local: str, remote: str) -> int:
        """The most specific rule wins: contract, then local service, then remote service."""
        for row in range(8):
            exact = (row < 4, row % 4 < 2, row % 2 == 0)
            for rule in self.priorities:
                wanted = [
                    name if is_exact else ANY
                    for is_exact, name in zip(exact, (contract, local, remote), strict=True)
                ]
                if list(rule[:3]) == wanted:
                    return rule[3]
        return 5


@dataclass
class Side:
    """One conversation endpoint."""

    handle: str
    conversation: str
    initiator: bool
    service: str
    far_service: str
    contract: str
    queue: str
    group: int
    level: int
    state: StateName
    far: str
    send_seq: int = 0
    timer_ms: int | None = None
    lifetime_ms: int | None = None


@dataclass
class Message:
    """A message waiting in a queue, as RECEIVE would return it."""

    ident: int
    handle: str
    type: str
    seq: int
    body: bytes
    queue: str
    group: int
    level: int

    @property
    def rank(self) -> tuple[int, int]:
        """Inside a conversation: DialogTimer, then Error, then sequence order."""
        kind = 0 if self.type == DIALOG_TIMER else 1 if self.type == ERROR else 2
        return (kind, self.seq)


Codes = frozenset[str]
"""Error codes any of which would be a right refusal (when several rules refuse a request, the
documents do not say which one speaks, so any does)."""


@dataclass
class Broker:
    """The model's whole state: endpoints, ready messages, fences, and the clock of enqueues."""

    spec: Spec
    target_of: Callable[[str], str]
    """The target's handle from the conversation id: a rule of the protocol (docs/protocol.md)."""
    sides: dict[str, Side] = field(default_factory=dict)
    ready: dict[int, Message] = field(default_factory=dict)
    fences: dict[tuple[str, int], int] = field(default_factory=dict)
    group_names: dict[str, int] = field(default_factory=dict)
    """Groups named by BEGIN's conversation_group_id (or learnt from the engine), by name."""
    step: int = 0
    """Which request or tick the model is at: 'oldest-ready' compares these."""
    since: dict[tuple[str, str, int | str], int] = field(default_factory=dict)
    """(queue, 'group' or 'conv', group or handle) -> step it became ready (while it stays so)."""
    added: list[Message] = field(default_factory=list)
    """Messages enqueued in the current step (the test matches them to the engine's)."""
    turns: dict[tuple[str, int], int] = field(default_factory=dict)
    """(queue, partition) -> when a RECEIVE last took one of its groups: partitions take turns."""
    _turn: int = 0
    _ids: int = 0
    _groups: int = 0

    # ----------------------------------------------------------------- bookkeeping
    def new_group(self) -> int:
        self._groups += 1
        return self._groups

    def open(self, handle: str) -> Side | None:
        side = self.sides.get(handle)
        return side if side is not None and side.state != "CLOSED" else None

    def _enqueue(self, receiver: Side, mtype: str, seq: int, body: bytes) -> None:
        self._ids += 1
        m = Message(
            self._ids,
            receiver.handle,
            mtype,
            seq,
            body,
            receiver.queue,
            receiver.group,
            receiver.level,
        )
        for key in ((m.queue, "group", m.group), (m.queue, "conv", m.handle)):
            self.since.setdefault(key, self.step)
        self.ready[m.ident] = m
        self.added.append(m)

    def _remove(self, ident: int) -> None:
        m = self.ready.pop(ident)
        waiting = list(self.ready.values())
        if not any(w.queue == m.queue and w.group == m.group for w in waiting):
            self.since.pop((m.queue, "group", m.group), None)
        if not any(w.queue == m.queue and w.handle == m.handle for w in waiting):
            self.since.pop((m.queue, "conv", m.handle), None)

    def _close(self, side: Side) -> None:
        """CLOSED: the endpoint is gone, and so is everything waiting for it."""
        side.state = "CLOSED"
        side.timer_ms = side.lifetime_ms = None
        self._drop_messages(side)

    def _drop_messages(self, side: Side) -> None:
        for ident in [i for i, m in self.ready.items() if m.handle == side.handle]:
            self._remove(ident)

    # ----------------------------------------------------------------- BEGIN
    def begin(
        self,
        now: int,
        *,
        handle: str,
        from_service: str,
        to_service: str,
        contract: str,
        related: str | None = None,
        group_name: str | None = None,
        lifetime_s: int | None = None,
    ) -> Codes:
        existing = self.open(handle)
        if existing is not None:
            retry = existing.initiator and existing.far_service == to_service
            return frozenset() if retry else frozenset({"duplicate_handle"})
        codes: set[str] = set()
        if from_service not in self.spec.services:
            codes.add("unknown_service")
        if contract not in self.spec.contracts:
            codes.add("unknown_contract")
        target = self.spec.services.get(to_service)
        if target is None:
            codes.add("unknown_service")
        elif contract not in target[1]:
            codes.add("contract_not_accepted")
        if related is not None and self.open(related) is None:
            codes.add("unknown_conversation")
        if codes:
            return frozenset(codes)
        if related is not None:
            group = self.sides[related].group
        elif group_name is not None:
            group = self.group_names.setdefault(group_name, self.new_group())
        else:
            group = self.new_group()
        self.sides[handle] = Side(
            handle=handle,
            conversation=handle,
            initiator=True,
            service=from_service,
            far_service=to_service,
            contract=contract,
            queue=self.spec.services[from_service][0],
            group=group,
            level=self.spec.level(contract, from_service, to_service),
            state="STARTED_OUTBOUND",
            far="",
            lifetime_ms=now + lifetime_s * 1000 if lifetime_s else None,
        )
        return frozenset()

    # ----------------------------------------------------------------- SEND
    def send_refusals(self, now: int, handles: list[str], mtype: str, body: bytes) -> Codes:
        codes: set[str] = set()
        if len(body) > self.spec.max_body:
            codes.add("body_too_large")
        if mtype not in self.spec.message_types:
            codes.add("unknown_message_type")
        for handle in dict.fromkeys(handles):
            side = self.open(handle)
            if side is None:
                codes.add("unknown_conversation")
                continue
            if side.state not in _CAN_SEND:
                codes.add("conversation_closed")
            senders = self.spec.contracts[side.contract]
            if mtype in self.spec.message_types and mtype not in senders:
                codes.add("message_type_not_in_contract")
            elif mtype in senders and senders[mtype] not in (
                "ANY",
                "INITIATOR" if side.initiator else "TARGET",
            ):
                codes.add("message_type_not_allowed")
            if side.lifetime_ms is not None and now >= side.lifetime_ms:
                codes.add("lifetime_expired")
        return frozenset(codes)

    def send(self, now: int, handles: list[str], mtype: str, body: bytes) -> Codes:
        codes = self.send_refusals(now, handles, mtype, body)
        if codes:
            return codes
        for handle in dict.fromkeys(handles):
            self._deliver(self.sides[handle], mtype, body)
        return frozenset()

    def _far(self, side: Side) -> Side | None:
        """The far endpoint; the target is made with the first message sent to it."""
        if side.far:
            return self.sides[side.far]
        return None

    def _deliver(self, sender: Side, mtype: str, body: bytes) -> None:
        receiver = self._far(sender) or self._make_target(sender)
        sender.state = "CONVERSING"
        if receiver.state == "CLOSED":
            # Choice (the documents are silent): the far side ended WITH CLEANUP, which tells
            # nobody, so this side still sends, as in Service Broker; the message has no endpoint
            # to go to. It must not make a new one either: that conversation was removed.
            return  # nobody is there to validate it either
        if self.spec.message_types[mtype] == "EMPTY" and body:
            self._enqueue(sender, ERROR, -1, error_body(VALIDATION_FAILED))
            sender.state = "ERROR"
            self._close(receiver)
            return
        self._enqueue(receiver, mtype, sender.send_seq, body)
        sender.send_seq += 1

    def _make_target(self, initiator: Side) -> Side:
        service = initiator.far_service
        target = Side(
            handle=self.target_of(initiator.conversation),
            conversation=initiator.conversation,
            initiator=False,
            service=service,
            far_service=initiator.service,
            contract=initiator.contract,
            queue=self.spec.services[service][0],
            group=self.new_group(),
            level=self.spec.level(initiator.contract, service, initiator.service),
            state="STARTED_INBOUND",
            far=initiator.handle,
            lifetime_ms=initiator.lifetime_ms,
        )
        self.sides[target.handle] = target
        initiator.far = target.handle
        return target

    # ----------------------------------------------------------------- END
    def end(
        self, now: int, handle: str, *, error: tuple[int, str] | None = None, cleanup: bool = False
    ) -> Codes:
        side = self.open(handle)
        if side is None:
            return frozenset({"unknown_conversation"})
        if cleanup:
            self._close(side)
            return frozenset()
        if side.state == "DISCONNECTED_OUTBOUND":
            # Choice: ending twice is refused; a second EndDialog would reach the far side.
            return frozenset({"conversation_closed"})
        far = self._far(side)
        if side.state in ("DISCONNECTED_INBOUND", "ERROR"):
            self._close(side)
            if far is not None and far.state == "DISCONNECTED_OUTBOUND":
                self._close(far)  # both sides have ended: the conversation is complete
            return frozenset()
        if far is None:
            self._close(side)  # never sent: there is no far side to tell
            return frozenset()
        if far.state == "CLOSED":
            # Choice: the far side is gone (WITH CLEANUP); Service Broker would wait for it
            # forever, but here it is known that nobody will answer, so this side closes.
            self._close(side)
            return frozenset()
        self._drop_messages(side)
        side.state = "DISCONNECTED_OUTBOUND"
        side.timer_ms = None
        if error is None:
            self._enqueue(far, END_DIALOG, side.send_seq, b"")
            far.state = "DISCONNECTED_INBOUND"
        else:
            self._enqueue(far, ERROR, side.send_seq, error_body(*error))
            far.state = "ERROR"
        side.send_seq += 1
        return frozenset()

    # ----------------------------------------------------------------- timers and lifetimes
    def timer(self, now: int, handle: str, timeout_s: float) -> Codes:
        side = self.open(handle)
        if side is None:
            return frozenset({"unknown_conversation"})
        if side.state == "DISCONNECTED_OUTBOUND":
            return frozenset({"conversation_closed"})
        side.timer_ms = now + round(timeout_s * 1000)
        return frozenset()

    def tick(self, now: int) -> None:
        due = sorted(
            [(s.timer_ms, 0, s.handle) for s in self.sides.values() if s.timer_ms is not None]
            + [(s.lifetime_ms, 1, s.handle) for s in self.sides.values() if s.lifetime_ms]
        )
        for deadline, kind, handle in due:
            side = self.sides[handle]
            if deadline > now or side.state == "CLOSED":
                continue
            if kind == 0 and side.timer_ms == deadline:
                side.timer_ms = None
                self._enqueue(side, DIALOG_TIMER, -1, b"")
            elif kind == 1 and side.lifetime_ms == deadline:
                self._expire(side)

    def _expire(self, side: Side) -> None:
        for s in (side, self._far(side)):
            if s is None or s.lifetime_ms is None:
                continue
            s.lifetime_ms = None
            if s.state == "DISCONNECTED_OUTBOUND":
                self._close(s)  # Choice: an ended side is told nothing; its dialog is over
            elif s.state not in ("ERROR", "CLOSED"):
                self._enqueue(s, ERROR, -1, error_body(LIFETIME_EXPIRED))
                s.state = "ERROR"

    # ----------------------------------------------------------------- RECEIVE and commit
    def receivable(
        self, queue: str, locked: set[int], partition_of: Callable[[int], int]
    ) -> list[int]:
        """The groups RECEIVE may pick now: best level; within it, the queue partition served
        longest ago (`turns`); in it, the oldest-ready group (ties are all right)."""
        groups = {m.group for m in self.ready.values() if m.queue == queue} - locked
        if not groups:
            return []
        best = max(self._group_level(queue, g) for g in groups)
        top = [g for g in groups if self._group_level(queue, g) == best]
        turn_of = {g: self.turns.get((queue, partition_of(g)), 0) for g in top}
        turn = min(turn_of.values())
        due = [g for g in top if turn_of[g] == turn]
        oldest = min(self.since[(queue, "group", g)] for g in due)
        return [g for g in due if self.since[(queue, "group", g)] == oldest]

    def served(self, queue: str, partition: int) -> None:
        """A RECEIVE returned messages of a group in this partition: its turn is over."""
        self._turn += 1
        self.turns[(queue, partition)] = self._turn

    def _group_level(self, queue: str, group: int) -> int:
        return max(m.level for m in self.ready.values() if m.queue == queue and m.group == group)

    def order_ok(self, queue: str, taken: list[Message]) -> str | None:
        """Why `taken` (what RECEIVE returned of one group) is not in RECEIVE order, or None."""
        runs: list[list[Message]] = []
        for m in taken:
            if runs and runs[-1][0].handle == m.handle:
                runs[-1].append(m)
            else:
                runs.append([m])
        if len({run[0].handle for run in runs}) != len(runs):
            return "a conversation's messages are not together"
        for run in runs:
            if [m.rank for m in run] != sorted(m.rank for m in run):
                return f"conversation {run[0].handle} is not in DialogTimer, Error, sequence order"
        keys = [self._conv_key(queue, run[0]) for run in runs]
        if keys != sorted(keys):
            return f"conversations not best level first, then oldest-ready: {keys}"
        return None

    def prefix_ok(self, queue: str, group: int, taken: list[Message]) -> str | None:
        """Why `taken` (RECEIVE with TOP) is not the first messages of the group, or None."""
        why = self.order_ok(queue, taken)
        if why is not None:
            return why
        chosen = {m.ident for m in taken}
        rest = [
            m
            for m in self.ready.values()
            if m.queue == queue and m.group == group and m.ident not in chosen
        ]
        for r in rest:
            for t in taken:
                if t.handle == r.handle and r.rank < t.rank:
                    return f"{r.type} seq {r.seq} was left behind {t.type} seq {t.seq}"
                if t.handle != r.handle and self._conv_key(queue, r) < self._conv_key(queue, t):
                    return f"conversation {r.handle} was left behind {t.handle}"
        unfinished = {r.handle for r in rest} & {t.handle for t in taken}
        if unfinished and unfinished != {taken[-1].handle}:
            return f"conversations {unfinished} were cut short before another one"
        return None

    def _conv_key(self, queue: str, m: Message) -> tuple[int, int]:
        return (-m.level, self.since[(queue, "conv", m.handle)])

    def receipt_refusals(self, queue: str, group: int, token: int, idents: list[int]) -> Codes:
        codes: set[str] = set()
        if token and token < self.fences.get((queue, group), 0):
            codes.add("stale_token")
        for ident in idents:
            m = self.ready.get(ident)
            if m is None:
                codes.add("already_received")
            elif m.queue != queue or m.group != group:
                codes.add("wrong_group")
        return frozenset(codes)

    def receive(self, queue: str, group: int, token: int, idents: list[int]) -> None:
        """Apply a receipt already found acceptable."""
        for ident in dict.fromkeys(idents):
            m = self.ready[ident]
            self._remove(ident)
            side = self.sides[m.handle]
            if side.state == "STARTED_INBOUND":
                side.state = "CONVERSING"
            far = self._far(side)
            ended = far is not None and far.state == "DISCONNECTED_OUTBOUND"
            if m.type in (END_DIALOG, ERROR) and far is not None and ended:
                self._close(far)  # the far side's END has been received: it is complete
        if token:
            self.fences[(queue, group)] = max(self.fences.get((queue, group), 0), token)

    def commit(
        self, now: int, receipt: tuple[str, int, int, list[int]] | None, actions: list[Action]
    ) -> Codes:
        """A reader's transaction: receipt, then actions, all applied or none."""
        trial = copy.deepcopy(self)
        codes: set[str] = set()
        if receipt is not None:
            codes |= trial.receipt_refusals(*receipt)
            if not codes:
                trial.receive(*receipt)
        for action in actions:
            refused = trial.apply(now, action)
            if refused:
                codes |= refused
                break
        if codes:
            return frozenset(codes)
        self.__dict__.update(trial.__dict__)
        return frozenset()

    def apply(self, now: int, action: Action) -> Codes:
        """One request of a client (or one action of a commit)."""
        if isinstance(action, Begin):
            return self.begin(
                now,
                handle=action.handle,
                from_service=action.from_service,
                to_service=action.to_service,
                contract=action.contract,
                related=action.related,
                group_name=action.group_name,
                lifetime_s=action.lifetime_s,
            )
        if isinstance(action, Send):
            return self.send(now, list(action.handles), action.message_type, action.body)
        if isinstance(action, End):
            return self.end(now, action.handle, error=action.error, cleanup=action.cleanup)
        return self.timer(now, action.handle, action.timeout_s)


@dataclass(frozen=True)
class Begin:
    handle: str
    from_service: str
    to_service: str
    contract: str
    related: str | None = None
    group_name: str | None = None
    lifetime_s: int | None = None


@dataclass(frozen=True)
class Send:
    handles: tuple[str, ...]
    message_type: str
    body: bytes


@dataclass(frozen=True)
class End:
    handle: str
    error: tuple[int, str] | None = None
    cleanup: bool = False


@dataclass(frozen=True)
class Timer:
    handle: str
    timeout_s: float


Action: TypeAlias = Begin | Send | End | Timer


def error_body(code: int, description: str = "") -> bytes:
    """An Error message's body as the model compares it: by code only (descriptions are prose)."""
    return f"error:{code}".encode()
