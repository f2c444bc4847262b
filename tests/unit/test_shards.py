"""Several engines, each owning one shard, agree with one engine owning all of them.

The harness plays Kafka's part: a request goes to the owner of its key's shard (the partition the
key hashes to), relayed work to the owner of its relay key's shard, in order. The same scripts run
against one engine and against a cluster of two; what every queue receives, per conversation, must
be the same, and what crosses shards must be applied exactly once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from ksb.catalog.model import END_DIALOG, CatalogView, parse_catalog
from ksb.dialog.engine import Engine
from ksb.dialog.outputs import Outputs
from ksb.dialog.shards import Ownership, colocated_group
from ksb.sdk.groups import GroupDirectory
from ksb.wire.endpoint import State
from ksb.wire.partitioning import shard_of, target_handle
from ksb.wire.protocol import (
    AnyRequest,
    BeginRequest,
    CommitOutcome,
    CommitRequest,
    EndRequest,
    ErrorRecord,
    QueueMessage,
    Receipt,
    SendRequest,
)
from ksb.wire.relay import RelayRequest, relay_key

CATALOG: dict[str, Any] = {
    "message_types": [{"name": "Req"}, {"name": "Rep"}],
    "contracts": [
        {
            "name": "C",
            "messages": [
                {"type": "Req", "sent_by": "INITIATOR"},
                {"type": "Rep", "sent_by": "TARGET"},
            ],
        }
    ],
    "queues": [{"name": "IQ", "partitions": 4}, {"name": "TQ", "partitions": 4}],
    "services": [
        {"name": "Init", "queue": "IQ"},
        {"name": "Tgt", "queue": "TQ", "contracts": ["C"]},
    ],
}


class Cluster:
    """`shards` engines of one instance, one per shard, joined the way Kafka joins dispatchers."""

    def __init__(self, shards: int) -> None:
        view = CatalogView(parse_catalog(CATALOG))
        self.shards = shards
        owned = [{s} for s in range(shards)] if shards > 1 else [None]
        self.engines = [
            Engine(view, instance="u", max_body_bytes=1000, ownership=Ownership(shards, o))
            for o in owned
        ]
        self.messages: list[QueueMessage] = []
        self.outcomes: list[CommitOutcome] = []
        self.errors: list[ErrorRecord] = []
        self.relayed = 0
        self.token = 0

    def owner(self, key: str) -> Engine:
        return self.engines[shard_of(key, self.shards) if self.shards > 1 else 0]

    def request(self, req: AnyRequest, key: str, now: int = 0) -> None:
        """A request keyed `key`, as a client puts it in `key`'s partition."""
        self._settle(self.owner(key).handle(req, now), now)

    def _settle(self, first: Outputs, now: int) -> None:
        pending = deque([first])
        while pending:
            out = pending.popleft()
            self.messages += [w.value for w in out.queue if isinstance(w.value, QueueMessage)]
            self.outcomes += [w.value for w in out.queue if isinstance(w.value, CommitOutcome)]
            self.errors += out.errors
            for r in out.relays:
                assert not isinstance(r, RelayRequest)  # only the dispatcher's router makes those
                self.relayed += 1
                pending.append(self.owner(relay_key(r)).handle_relayed(r, now))

    def waiting(self, queue: str, group: str) -> list[QueueMessage]:
        """The messages of `group` still in `queue` (the owner's ledger says which)."""
        return [
            m
            for m in self.messages
            if m.queue == queue
            and m.conversation_group_id == group
            and m.message_id in self.owner(group).waiting
        ]

    def receive(self, queue: str, group: str, *actions: Any) -> CommitRequest:
        """Commit everything waiting for `group` with `actions`, keyed by the group."""
        got = self.waiting(queue, group)
        self.token += 1
        receipt = Receipt(
            queue=queue, group=group, token=self.token, message_ids=tuple(m.message_id for m in got)
        )
        req = CommitRequest(receipt=receipt, actions=tuple(actions))
        self.request(req, group)
        return req

    def endpoint_state(self, handle: str, group: str) -> State | None:
        ep = self.owner(group).endpoints.get(handle)
        return None if ep is None else ep.state


def split_handles(shards: int) -> Iterator[str]:
    """Initiator handles whose target handle hashes to another shard (a target in a group named
    after its handle would be another dispatcher's)."""
    n = 0
    while True:
        h = f"h{n}"
        n += 1
        if shard_of(h, shards) != shard_of(target_handle(h), shards):
            yield h


def delivered(c: Cluster) -> dict[tuple[str, str], list[tuple[int, str, str | None]]]:
    """What each queue got, per conversation handle: (sequence, type, body), in order."""
    per: dict[tuple[str, str], list[tuple[int, str, str | None]]] = {}
    for m in c.messages:
        per.setdefault((m.queue, m.conversation_handle), []).append(
            (m.message_sequence_number, m.message_type_name, m.body)
        )
    return per


def request_reply(c: Cluster, handles: list[str]) -> None:
    """Each dialog: BEGIN, two requests, the target replies in its receipt's commit and ENDs; the
    initiator receives the reply and the EndDialog and ENDs too."""
    for h in handles:
        c.request(BeginRequest(handle=h, from_service="Init", to_service="Tgt", contract="C"), h)
        for i in range(2):
            c.request(SendRequest(handles=(h,), message_type="Req", body=f"{h}-{i}"), h)
    for h in handles:
        t = target_handle(h)
        [group] = {m.conversation_group_id for m in c.messages if m.conversation_handle == t}
        reply = SendRequest(handles=(t,), message_type="Rep", body=f"re-{h}")
        c.receive("TQ", group, reply, EndRequest(handle=t))
    for h in handles:
        c.receive("IQ", h, EndRequest(handle=h))


def test_two_shards_deliver_what_one_engine_delivers() -> None:
    handles = [h for h, _ in zip(split_handles(2), range(6), strict=False)]
    one, two = Cluster(1), Cluster(2)
    request_reply(one, handles)
    request_reply(two, handles)
    assert not one.errors and not two.errors
    assert delivered(two) == delivered(one)
    assert all(o.applied for o in two.outcomes) and len(two.outcomes) == len(one.outcomes)
    assert two.relayed == one.relayed == 0  # both ends of each dialog have one owner
    for h in handles:  # both sides ended and closed
        assert two.endpoint_state(h, h) in (None, State.CLOSED)
    # The targets' groups: the handle with one shard, the initiator's shard with two.
    one_groups = {m.conversation_group_id for m in one.messages if m.queue == "TQ"}
    two_groups = {m.conversation_group_id for m in two.messages if m.queue == "TQ"}
    assert one_groups == {target_handle(h) for h in handles}
    assert {shard_of(g, 2) for g in two_groups} == {shard_of(h, 2) for h in handles}
    assert two_groups == {colocated_group(h, shard_of(h, 2), 2) for h in handles}
    reply_types = [t for (q, _h), seq in delivered(two).items() if q == "IQ" for _s, t, _b in seq]
    assert reply_types.count(END_DIALOG) == len(handles)


@pytest.mark.parametrize("shards", [1, 2, 3, 6])
def test_a_targets_group_is_new_fixed_and_in_its_initiators_shard(shards: int) -> None:
    for n in range(100):
        cid = f"conversation-{n}"
        for shard in range(shards):
            group = colocated_group(cid, shard, shards)
            assert shard_of(group, shards) == shard
            assert group == colocated_group(cid, shard, shards)  # anyone can recompute it
            assert group != cid
        if shards == 1:
            assert colocated_group(cid, 0, 1) == target_handle(cid)


def test_a_dialog_in_a_named_group_has_its_target_beside_it() -> None:
    c = Cluster(3)
    h, group = named_group_in_other_shard(3)
    begin = BeginRequest(
        handle=h, from_service="Init", to_service="Tgt", contract="C", conversation_group_id=group
    )
    c.request(begin, group)
    for i in range(20):
        c.request(SendRequest(handles=(h,), message_type="Req", body=str(i)), group)
    got = [m for m in c.messages if m.queue == "TQ"]
    assert [m.body for m in got] == [str(i) for i in range(20)]
    assert {shard_of(m.conversation_group_id, 3) for m in got} == {shard_of(group, 3)}
    assert c.relayed == 0 and not c.errors


def named_group_in_other_shard(shards: int) -> tuple[str, str]:
    """A handle and a group name whose shards differ."""
    for n in range(1000):
        h, g = f"n{n}", f"orders-{n}"
        if shard_of(h, shards) != shard_of(g, shards):
            return h, g
    raise AssertionError("no split pair")


def test_a_commit_action_names_the_group_of_a_conversation_begun_in_a_named_group() -> None:
    c = Cluster(2)
    h, group = named_group_in_other_shard(2)
    begin = BeginRequest(
        handle=h, from_service="Init", to_service="Tgt", contract="C", conversation_group_id=group
    )
    c.request(begin, group)  # keyed by its group
    # A reader of a group of the other shard sends on it in its commit: with the group named,
    # the action reaches the group's owner.
    other = next(f"o{n}" for n in range(100) if shard_of(f"o{n}", 2) != shard_of(group, 2))
    c.request(
        BeginRequest(handle=other, from_service="Init", to_service="Tgt", contract="C"), other
    )
    c.request(SendRequest(handles=(other,), message_type="Req", body="x"), other)
    [t] = {m.conversation_group_id for m in c.messages if m.conversation_id == other}
    assert c.waiting("TQ", t)  # the reader has a message of its own group to commit
    hinted = SendRequest(handles=(h,), message_type="Req", body="via-hint", group=group)
    c.receive("TQ", t, hinted)
    assert not c.errors
    assert [m.body for m in c.messages if m.conversation_id == h] == ["via-hint"]
    # Without it the action goes to the handle's shard, which does not know the conversation:
    # a clear refusal under the commit's request id, nothing applied twice or out of order.
    c.request(SendRequest(handles=(other,), message_type="Req", body="y"), other)
    bare = SendRequest(handles=(h,), message_type="Req", body="no-hint")
    commit = c.receive("TQ", t, bare)
    assert [(e.code, e.request_id) for e in c.errors] == [
        ("unknown_conversation", commit.request_id)
    ]
    assert [m.body for m in c.messages if m.conversation_id == h] == ["via-hint"]


def test_a_request_keyed_by_the_wrong_group_is_refused_with_the_key_rule() -> None:
    c = Cluster(2)
    h, group = named_group_in_other_shard(2)
    begin = BeginRequest(
        handle=h, from_service="Init", to_service="Tgt", contract="C", conversation_group_id=group
    )
    c.request(begin, group)
    send = SendRequest(handles=(h,), message_type="Req", body="x")
    c.request(send, h)  # keyed by the handle: the owner of its shard does not have it
    [err] = c.errors
    assert err.code == "unknown_conversation" and err.request_id == send.request_id
    assert "keyed by its conversation group" in err.reason
    assert not [m for m in c.messages if m.conversation_id == h]
    c.request(send, group)  # the same request under the right key applies, once
    assert [m.body for m in c.messages if m.conversation_id == h] == ["x"]


def test_the_sdk_directory_keys_requests_the_way_the_engine_groups_them() -> None:
    d = GroupDirectory(capacity=2)
    plain = BeginRequest(handle="a", from_service="Init", to_service="Tgt")
    named = BeginRequest(
        handle="b", from_service="Init", to_service="Tgt", conversation_group_id="g"
    )
    related = BeginRequest(
        handle="c", from_service="Init", to_service="Tgt", related_conversation="b"
    )
    assert (d.begun(plain), d.begun(named), d.begun(related)) == ("a", "g", "g")
    assert d.of("a") == "a" and d.hint("a") is None  # a handle that is its group costs nothing
    assert d.of("c") == "g" and d.hint("c") == "g"
    d.learn("d", "g2")  # capacity 2: the oldest ("b") is forgotten
    assert d.of("b") == "b" and d.of("d") == "g2"


@pytest.mark.parametrize("shards", [2, 3, 4])
def test_every_group_has_one_owner(shards: int) -> None:
    c = Cluster(shards)
    for n in range(200):
        owners = [e for e in c.engines if e.ownership.owns(f"g{n}")]
        assert len(owners) == 1


def _fold(into: Engine, c: Cluster, shard: int) -> None:
    """What a rebuild reads of `shard` (its owner's endpoints, the messages still waiting in
    its groups, its groups' commit outcomes), folded into `into` as `load_shard` folds it."""
    src = c.engines[shard]
    for ep in src.endpoints.values():
        into.load_endpoint(ep.copy())
    for m in c.messages:
        if m.message_id in src.waiting:
            into.load_queue_record(m.message_id, m, 0)
    for o in c.outcomes:
        if shard_of(o.group, c.shards) == shard:
            into.fences.applied("TQ", o.group, o.fence)
    into.finish_load()


def test_a_shard_rebuilt_in_an_engine_of_its_own_then_adopted_is_the_shard_loaded_in_place() -> (
    None
):
    """The dispatcher rebuilds a shard it is given beside its loop, into an engine of its own,
    and adopts it between two transactions (`services.dispatcher.rebuild`): the engine must then
    hold and do exactly what it would had it loaded the shard itself."""
    handles = [h for h, _ in zip(split_handles(2), range(8), strict=False)]
    c = Cluster(2)
    for h in handles:
        begin = BeginRequest(handle=h, from_service="Init", to_service="Tgt", contract="C")
        c.request(msgspec.structs.replace(begin, lifetime_s=60), h)
        for i in range(3):
            c.request(SendRequest(handles=(h,), message_type="Req", body=f"{h}-{i}"), h)
    groups = sorted({m.conversation_group_id for m in c.messages})
    for group in groups[::2]:  # some groups have received (a fence and fewer waiting)
        c.receive("TQ", group)
    assert {shard_of(g, 2) for g in groups} == {0, 1} and not c.errors

    view = c.engines[0].catalog
    in_place = Engine(view, instance="u", max_body_bytes=1000, ownership=Ownership(2, {0, 1}))
    _fold(in_place, c, 0)
    _fold(in_place, c, 1)
    adopted = Engine(view, instance="u", max_body_bytes=1000, ownership=Ownership(2, {0}))
    _fold(adopted, c, 0)
    rebuilt = adopted.rebuilding([1])
    _fold(rebuilt, c, 1)
    adopted.adopt(rebuilt)

    assert adopted.ownership.owned == {0, 1}
    assert adopted.endpoints == in_place.endpoints and len(adopted.endpoints) == 2 * len(handles)
    assert dict(adopted.waiting.items()) == dict(in_place.waiting.items())
    assert adopted.depth == in_place.depth and sum(adopted.depth.values()) > 0
    assert [adopted.fences.get("TQ", g) for g in groups] == [
        in_place.fences.get("TQ", g) for g in groups
    ]
    assert adopted.changed_depths(0) and in_place.changed_depths(0)  # written; no longer due
    assert adopted.next_deadline_ms() == in_place.next_deadline_ms() == 60_000
    assert adopted._group_sizes == in_place._group_sizes  # when a group's fence is forgotten
    # ... and does the same: a receipt on the adopted shard, a stale token, the lifetimes.
    [group] = [g for g in groups[1::2] if shard_of(g, 2) == 1][:1]
    waiting = [m.message_id for m in c.messages if m.message_id in c.engines[1].waiting]
    for engine in (adopted, in_place):
        mids = tuple(m for m in waiting if engine.waiting[m].group == group)
        receipt = Receipt(queue="TQ", group=group, token=99, message_ids=mids)
        engine.handle(CommitRequest(receipt=receipt), 1)
    stale = CommitRequest(receipt=Receipt(queue="TQ", group=group, token=98, message_ids=()))
    assert [e.code for e in adopted.handle(stale, 2).errors] == ["stale_token"]
    assert adopted.depth == in_place.depth
    ending = [ep.handle for ep in in_place.endpoints.values() if ep.group == group]
    for engine in (adopted, in_place):  # the group's last conversation ends: its fence goes
        for handle in ending:
            assert not engine.handle(EndRequest(handle=handle, cleanup=True), 3).errors
        assert engine.fences.get("TQ", group) == 0
    expired, expected = adopted.tick(60_000), in_place.tick(60_000)
    assert sorted(w.key for w in expired.queue) == sorted(w.key for w in expected.queue)
    assert len(expired.queue) > 0
