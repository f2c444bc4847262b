"""The dispatcher's engine against a reference model of Service Broker (`tests.model.broker`).

A hypothesis state machine sends the engine random sequences of BEGIN, SEND (one or several
conversations), END (plain, WITH ERROR, WITH CLEANUP), conversation timers, the passing of time,
RECEIVE (a reader folding the engine's queue records, taking one group in the SDK's RECEIVE
order), commits (receipt and actions), rollbacks and expired locks whose holder commits late,
and applies each to the model too. After every step they must agree on:

* which requests are refused, and with which error code (docs/protocol.md);
* what is ready in every queue, message for message: nothing lost, nothing twice, nothing
  received twice, each with its receiving endpoint's level and group;
* what each RECEIVE returns, and in which order;
* every endpoint's state, as the endpoints topic shows it and as the engine holds it.

``make test`` runs 100 sequences of up to 40 steps; ``make fuzz`` (``--long``) 2,000 of up to 120.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule, run_state_machine_as_test

from ksb.catalog.model import CatalogView, parse_catalog
from ksb.dialog.engine import Engine
from ksb.dialog.outputs import Outputs
from ksb.wire.partitioning import target_handle
from ksb.wire.protocol import (
    BeginRequest,
    CommitRequest,
    EndRequest,
    QueueMessage,
    Receipt,
    SendRequest,
    TimerRequest,
)
from tests.model.broker import ERROR, Action, Begin, Broker, End, Send, Spec, Timer, error_body
from tests.model.reader import Topics

MAX_BODY = 64

CATALOG: dict[str, Any] = {
    "message_types": [
        {"name": "Req"},
        {"name": "Rep"},
        {"name": "Any"},
        {"name": "Ping", "validation": "EMPTY"},
    ],
    "contracts": [
        {
            "name": "C",
            "messages": [
                {"type": "Req", "sent_by": "INITIATOR"},
                {"type": "Rep", "sent_by": "TARGET"},
                {"type": "Any", "sent_by": "ANY"},
                {"type": "Ping", "sent_by": "ANY"},
            ],
        },
        {
            "name": "D",
            "messages": [
                {"type": "DEFAULT", "sent_by": "ANY"},
                {"type": "Any", "sent_by": "ANY"},
            ],
        },
    ],
    "queues": [{"name": "IQ"}, {"name": "TQ", "partitions": 3}],
    "services": [
        {"name": "Init", "queue": "IQ"},
        {"name": "Tgt", "queue": "TQ", "contracts": ["C", "D"]},
        {"name": "Tgt2", "queue": "TQ", "contracts": ["C"]},
    ],
    "priorities": [
        {"name": "tgt-on-c", "contract": "C", "local_service": "Tgt", "level": 8},
        {"name": "init-to-tgt2", "local_service": "Init", "remote_service": "Tgt2", "level": 3},
        {"name": "d", "contract": "D", "level": 6},
    ],
}

SPEC = Spec(
    services={"Init": ("IQ", ()), "Tgt": ("TQ", ("C", "D")), "Tgt2": ("TQ", ("C",))},
    contracts={
        "C": {"Req": "INITIATOR", "Rep": "TARGET", "Any": "ANY", "Ping": "ANY"},
        "D": {"DEFAULT": "ANY", "Any": "ANY"},
        "DEFAULT": {"DEFAULT": "ANY"},
    },
    message_types={"Req": "NONE", "Rep": "NONE", "Any": "NONE", "Ping": "EMPTY", "DEFAULT": "NONE"},
    priorities=(("C", "Tgt", "ANY", 8), ("ANY", "Init", "Tgt2", 3), ("D", "ANY", "ANY", 6)),
    max_body=MAX_BODY,
)

QUEUES = ("IQ", "TQ")


@dataclass
class Txn:
    """A reader's open transaction: what it RECEIVEd, under which lock token."""

    queue: str
    group: str
    token: int
    message_ids: list[str]
    locked: bool


def _identity(m: QueueMessage) -> tuple[str, str, int, bytes]:
    body = m.message_body
    if m.message_type_name == ERROR:
        body = error_body(json.loads(body)["code"])
    return (m.conversation_handle, m.message_type_name, m.message_sequence_number, body)


class EngineAgainstModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        catalog = CatalogView(parse_catalog(CATALOG))
        self.engine = Engine(catalog, instance="model", max_body_bytes=MAX_BODY)
        self.model = Broker(SPEC, target_of=target_handle)
        self.topics = Topics(QUEUES)
        self.now = 1_700_000_000_000
        self.initiators: list[str] = []
        self.ids: dict[str, int] = {}
        """Engine message id -> the model's message."""
        self.groups: dict[int, str] = {}
        """Model group -> engine group id (a bijection, checked as it is learnt)."""
        self.txns: list[Txn] = []
        self.tokens: Counter[tuple[str, str]] = Counter()
        self.received: Counter[str] = Counter()
        self.serial = 0

    # ----------------------------------------------------------------- helpers
    def _next(self, prefix: str) -> str:
        self.serial += 1
        return f"{prefix}{self.serial}"

    def _handles(self) -> list[str]:
        """Every handle a client could name: initiators, their targets, and one never begun."""
        return self.initiators + [target_handle(h) for h in self.initiators] + ["never-begun"]

    def _live(self) -> list[str]:
        """Handles of open endpoints: most requests name one, or little would ever be sent."""
        return [h for h in self._handles() if self.model.open(h) is not None]

    def _handle_to_use(self, data: st.DataObject, among: list[str] | None = None) -> str:
        """Mostly an open endpoint, sometimes any handle at all (closed, never begun)."""
        live = [h for h in among or self._live() if self.model.open(h) is not None]
        anything = among or self._handles()
        if live and data.draw(st.integers(0, 9), label="live?") < 8:
            return data.draw(st.sampled_from(live))
        return data.draw(st.sampled_from(anything))

    def _engine_groups(self) -> list[str]:
        """In the order they were learnt: the ids are random, so sorting them would make the
        draws differ between runs of the same example (hypothesis calls that flaky)."""
        return list(self.groups.values())

    def _model_group(self, group: str) -> int:
        for g, engine_group in self.groups.items():
            if engine_group == group:
                return g
        raise AssertionError(f"the engine's group {group} is none the model knows")

    def _bind_group(self, model_group: int, engine_group: str) -> None:
        known = self.groups.get(model_group)
        if known is None:
            assert engine_group not in self.groups.values(), (
                f"the engine put two of the model's groups into one: {engine_group}"
            )
            self.groups[model_group] = engine_group
            self.model.group_names.setdefault(engine_group, model_group)
        else:
            assert known == engine_group, (
                f"model group {model_group} is {known}, not {engine_group}"
            )

    def _apply(self, out: Outputs, refusals: frozenset[str]) -> None:
        """Check one engine call's output against what the model just did, then fold it in."""
        if refusals:
            assert len(out.errors) == 1, f"expected one of {sorted(refusals)}, got {out.errors}"
            assert out.errors[0].code in refusals, (
                f"refused with {out.errors[0].code!r} ({out.errors[0].reason}); "
                f"the model expects one of {sorted(refusals)}"
            )
        else:
            assert not out.errors, f"refused: {[(e.code, e.reason) for e in out.errors]}"
        new = self.topics.fold(out)
        self._match(new)
        self._check_queues()
        self._check_endpoints()

    def _match(self, new: list[QueueMessage]) -> None:
        """The engine's new messages are the model's, one for one; learn their ids."""
        expected = {(m.handle, m.type, m.seq, m.body): m for m in self.model.added}
        want = Counter((m.handle, m.type, m.seq, m.body) for m in self.model.added)
        got = Counter(_identity(m) for m in new)
        assert got == want, f"enqueued {dict(got)}; the model enqueued {dict(want)}"
        for m in new:
            model_message = expected[_identity(m)]
            self.ids[m.message_id] = model_message.ident
            assert m.priority == model_message.level, f"{m.message_type_name} level {m.priority}"
            self._bind_group(model_message.group, m.conversation_group_id)
        self.model.added.clear()

    def _check_queues(self) -> None:
        ready = Counter(self.ids[mid] for mid in self.topics.ready)
        model = Counter(self.model.ready.keys())
        missing = [self.model.ready[i] for i in model - ready]
        extra = [i for i in ready - model]
        assert not missing and not extra, f"lost (or never sent) {missing}; ready but gone {extra}"

    def _check_endpoints(self) -> None:
        for handle, side in self.model.sides.items():
            record = self.topics.endpoints.get(handle)
            assert record is not None, f"no endpoint record for {handle} ({side.state})"
            assert record.state.name == side.state, (
                f"{'initiator' if side.initiator else 'target'} {handle} is "
                f"{record.state.name}; the model says {side.state}"
            )
            assert record.priority == side.level
            self._bind_group(side.group, record.group)
            held = self.engine.endpoints.get(handle)
            if side.state == "CLOSED":
                assert held is None, f"the engine still holds CLOSED endpoint {handle}"
            else:
                assert held is not None and held.state.name == side.state

    def _handle(self, request: Any, refusals_of: Action) -> None:
        self.model.step += 1
        refusals = self.model.apply(self.now, refusals_of)
        self._apply(self.engine.handle(request, self.now), refusals)

    # ----------------------------------------------------------------- client requests
    @rule(data=st.data())
    def begin_another(self, data: st.DataObject) -> None:
        """Dialogs are begun twice as often as anything else is done, so there is much to do."""
        self.begin(data)

    @rule(data=st.data())
    def begin(self, data: st.DataObject) -> None:
        open_handles = [h for h in self._handles() if self.model.open(h) is not None]
        fresh = data.draw(st.integers(0, 9), label="fresh?") > 0 or not open_handles
        handle = self._next("i") if fresh else data.draw(st.sampled_from(open_handles))
        related = None
        if data.draw(st.integers(0, 3), label="related?") == 0:
            related = self._handle_to_use(data)
        group_name = None
        if related is None:
            group_name = data.draw(
                st.none()
                | st.none()
                | st.just(self._next("g"))
                | st.sampled_from(self._engine_groups() or ["g0"])
            )
        valid = data.draw(st.integers(0, 3), label="valid?") > 0
        services = ["Init", "Init", "Tgt"] + ([] if valid else ["Ghost"])
        targets = ["Tgt", "Tgt", "Tgt2"] + ([] if valid else ["Nobody", "Init"])
        contracts = ["C", "C", "D"] + ([] if valid else ["Nope"])
        action = Begin(
            handle=handle,
            from_service=data.draw(st.sampled_from(services)),
            to_service=data.draw(st.sampled_from(targets)),
            contract=data.draw(st.sampled_from(contracts)),
            related=related,
            group_name=group_name,
            lifetime_s=data.draw(st.sampled_from([None] * 6 + [1, 5, 30])),
        )
        if handle not in self.initiators and handle not in self._handles():
            self.initiators.append(handle)
        self._handle(_request(action), action)

    @precondition(lambda self: bool(self._live()))
    @rule(data=st.data())
    def send(self, data: st.DataObject) -> None:
        self._handle_action(self._draw_send(data))

    @precondition(lambda self: bool(self._live()))
    @rule(data=st.data())
    def end(self, data: st.DataObject) -> None:
        self._handle_action(self._draw_end(data))

    @precondition(lambda self: bool(self._live()))
    @rule(data=st.data())
    def timer(self, data: st.DataObject) -> None:
        action = Timer(
            handle=self._handle_to_use(data),
            timeout_s=data.draw(st.sampled_from([0, 0.5, 2, 10])),
        )
        self._handle_action(action)

    @rule(ms=st.sampled_from([1, 100, 600, 2_000, 5_000, 30_000]))
    def time_passes(self, ms: int) -> None:
        self.now += ms
        self.model.step += 1
        self.model.tick(self.now)
        self._apply(self.engine.tick(self.now), frozenset())

    def _handle_action(self, action: Action) -> None:
        self._handle(_request(action), action)

    def _draw_send(self, data: st.DataObject, among: list[str] | None = None) -> Send:
        count = data.draw(st.sampled_from([1, 1, 1, 2, 3]), label="conversations")
        handles = [self._handle_to_use(data, among) for _ in range(count)]
        by_conversation = {self._conversation(h): h for h in handles}  # one per conversation
        body = data.draw(
            st.sampled_from([self._next("m").encode()] * 8 + [b"", b"x" * (MAX_BODY + 1)])
        )
        kinds = ["Any", "Any", "Any", "Req", "Rep", "Ping", "DEFAULT", "Nope"]
        return Send(tuple(by_conversation.values()), data.draw(st.sampled_from(kinds)), body)

    def _conversation(self, handle: str) -> str:
        for h in self.initiators:
            if handle in (h, target_handle(h)):
                return h
        return handle

    def _draw_end(self, data: st.DataObject, among: list[str] | None = None) -> End:
        how = data.draw(st.sampled_from(["plain", "plain", "plain", "error", "cleanup"]))
        return End(
            handle=self._handle_to_use(data, among),
            error=(data.draw(st.sampled_from([1, 42])), "failed") if how == "error" else None,
            cleanup=how == "cleanup",
        )

    # ----------------------------------------------------------------- a reader
    @rule(data=st.data())
    def receive(self, data: st.DataObject) -> None:
        queue = data.draw(st.sampled_from(QUEUES))
        locked = {t.group for t in self.txns if t.queue == queue and t.locked}
        expected = self.model.receivable(
            queue,
            {self._model_group(g) for g in locked},
            lambda g: self.topics.partition_of[(queue, self.groups[g])],
        )
        index = self.topics.index[queue]
        group = next(iter(index.candidates(exclude=locked)), None)
        if group is None:
            assert not expected, f"RECEIVE on {queue} found nothing; the model has {expected}"
            return
        model_group = self._model_group(group)
        assert model_group in expected, f"RECEIVE picked {group}; the model says {expected}"
        top = data.draw(st.sampled_from([None, None, None, 1, 2]))
        taken = index.take(group, top)
        self.model.served(queue, self.topics.partition_of[(queue, group)])
        mine = [self.model.ready[self.ids[m.message_id]] for m in taken]
        why = self.model.prefix_ok(queue, model_group, mine)
        assert why is None, why
        if top is None:
            everything = [m for m in self.model.ready.values() if m.queue == queue]
            assert len(mine) == len([m for m in everything if m.group == model_group])
        with_lock = data.draw(st.sampled_from([True, True, True, False]), label="with lock")
        token = 0
        if with_lock:
            self.tokens[(queue, group)] += 1
            token = self.tokens[(queue, group)]
        self.txns.append(Txn(queue, group, token, [m.message_id for m in taken], with_lock))

    @precondition(lambda self: bool(self.txns))
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        txn = data.draw(st.sampled_from(self.txns))
        self.txns.remove(txn)
        mine = [self.topics_or_model_handle(mid) for mid in txn.message_ids]
        actions: list[Action] = []
        for _ in range(data.draw(st.integers(0, 2))):
            kind = data.draw(st.sampled_from(["reply", "reply", "end", "begin", "timer"]))
            if kind == "reply":
                actions.append(self._draw_send(data, mine))
            elif kind == "end":
                actions.append(self._draw_end(data, mine))
            elif kind == "timer":
                actions.append(Timer(self._handle_to_use(data, mine), 2))
            else:
                handle = self._next("i")
                self.initiators.append(handle)
                actions.append(
                    Begin(handle, "Tgt", "Tgt2", "C", related=self._handle_to_use(data, mine))
                )
        model_group = self._model_group(txn.group)
        idents = [self.ids[mid] for mid in txn.message_ids]
        request = CommitRequest(
            request_id=self._next("commit-"),
            receipt=Receipt(
                queue=txn.queue,
                group=txn.group,
                token=txn.token,
                message_ids=tuple(txn.message_ids),
            ),
            actions=tuple(_request(a) for a in actions),
        )
        self.model.step += 1
        refusals = self.model.commit(self.now, (txn.queue, model_group, txn.token, idents), actions)
        self._apply(self.engine.handle(request, self.now), refusals)
        outcome = self.topics.outcomes.get(request.request_id)
        assert outcome is not None and outcome.applied == (not refusals)
        if not refusals:
            self.received.update(txn.message_ids)
            twice = [mid for mid, n in self.received.items() if n > 1]
            assert not twice, f"received twice: {twice}"

    def topics_or_model_handle(self, message_id: str) -> str:
        """The receiving handle of a message this reader took (ready or not any more)."""
        ident = self.ids[message_id]
        for m in self.model.ready.values():
            if m.ident == ident:
                return m.handle
        return self.topics.handles.get(message_id, "never-begun")

    @precondition(lambda self: bool(self.txns))
    @rule(data=st.data())
    def rollback(self, data: st.DataObject) -> None:
        """The messages are back: nothing is written, and the next checks must still hold."""
        self.txns.remove(data.draw(st.sampled_from(self.txns)))
        self._check_queues()

    @precondition(lambda self: any(t.locked for t in self.txns))
    @rule(data=st.data())
    def lock_expires(self, data: st.DataObject) -> None:
        """The holder pauses past its lease: the group is free for the next RECEIVE (a newer
        token), and the paused holder may still try to commit later."""
        txn = data.draw(st.sampled_from([t for t in self.txns if t.locked]))
        txn.locked = False


def _request(action: Action) -> Any:
    if isinstance(action, Begin):
        return BeginRequest(
            handle=action.handle,
            from_service=action.from_service,
            to_service=action.to_service,
            contract=action.contract,
            related_conversation=action.related,
            conversation_group_id=action.group_name,
            lifetime_s=action.lifetime_s,
        )
    if isinstance(action, Send):
        return SendRequest(
            handles=action.handles,
            message_type=action.message_type,
            body=action.body.decode(),
        )
    if isinstance(action, End):
        return EndRequest(
            handle=action.handle,
            error_code=action.error[0] if action.error else None,
            error_description=action.error[1] if action.error else None,
            cleanup=action.cleanup,
        )
    return TimerRequest(handle=action.handle, timeout_s=action.timeout_s)


def test_the_engine_follows_the_reference_model(long_mode: bool) -> None:
    run_state_machine_as_test(
        EngineAgainstModel,
        settings=settings(
            max_examples=2_000 if long_mode else 100,
            stateful_step_count=120 if long_mode else 40,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
