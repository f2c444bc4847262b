"""Queue depth per shard: counted by the shard's owner, written when it changes, read by senders.

The engine counts each queue's waiting messages per shard and hands out the counts a batch
changed (`Engine.changed_depths`), which the dispatcher writes in the batch's transaction; the
SDK's rule (`ksb.sdk.depth.QueueDepths`) holds a SEND while its target queue's count in the
dialog's shard is at its share of the limit.
"""

from __future__ import annotations

from ksb.catalog.model import CatalogView, parse_catalog
from ksb.dialog.engine import Engine
from ksb.dialog.shards import Ownership
from ksb.sdk.depth import QueueDepths
from ksb.wire.depth import QueueDepth, parse_depth
from ksb.wire.partitioning import shard_of
from ksb.wire.protocol import BeginRequest, CommitRequest, Receipt, SendRequest, dumps
from tests.unit.test_shards import CATALOG, Cluster, _fold, split_handles

SHARDS = 2


def _depths(engine: Engine) -> dict[tuple[str, int], int]:
    return {(d.queue, d.shard): d.depth for d in engine.changed_depths(0)}


def _begin_and_send(c: Cluster, handle: str, n: int) -> None:
    c.request(
        BeginRequest(handle=handle, from_service="Init", to_service="Tgt", contract="C"), handle
    )
    for i in range(n):
        c.request(SendRequest(handles=(handle,), message_type="Req", body=f"{i}"), handle)


def _target_group(c: Cluster, handle: str) -> str:
    [group] = {m.conversation_group_id for m in c.messages if m.conversation_handle != handle}
    return group


def test_each_owner_counts_its_shards_waiting_messages_and_hands_out_what_changed() -> None:
    c = Cluster(SHARDS)
    h = next(split_handles(SHARDS))
    shard = shard_of(h, SHARDS)
    owner, other = c.engines[shard], c.engines[1 - shard]
    _begin_and_send(c, h, 3)

    assert _depths(owner) == {("TQ", shard): 3}
    assert _depths(owner) == {}, "handed out once, until the count changes again"
    assert _depths(other) == {}
    [record] = owner.waiting.shard_depth.items()
    assert record == (("TQ", shard), 3)

    c.receive("TQ", _target_group(c, h))
    assert _depths(owner) == {("TQ", shard): 0}, "a receipt's change is written too, down to 0"
    assert owner.depth == {"TQ": 0}


def test_the_record_names_the_queues_services_so_a_sender_can_find_its_target() -> None:
    c = Cluster(1)
    _begin_and_send(c, "h0", 2)
    [record] = c.engines[0].changed_depths(0)
    assert record == QueueDepth(queue="TQ", shard=0, depth=2, services=("Tgt",))
    assert parse_depth(dumps(record)) == record


def test_a_refused_commit_changes_no_count() -> None:
    c = Cluster(1)
    _begin_and_send(c, "h0", 1)
    engine = c.engines[0]
    engine.changed_depths(0)
    group = _target_group(c, "h0")
    unknown = Receipt(queue="TQ", group=group, token=1, message_ids=("nope:1",))
    assert engine.handle(CommitRequest(receipt=unknown), 0).errors
    assert _depths(engine) == {}


def test_a_dropped_shard_is_forgotten_and_an_adopted_one_is_written_again() -> None:
    """Its next owner writes a shard's counts: the one who let it go must not write a stale one
    after it; the one who takes it writes what it rebuilt, so a record left by a previous owner
    that died between two writes is brought up to date."""
    c = Cluster(SHARDS)
    h = next(split_handles(SHARDS))
    shard = shard_of(h, SHARDS)
    _begin_and_send(c, h, 2)
    view = CatalogView(parse_catalog(CATALOG))
    taker = Engine(view, instance="u", max_body_bytes=1000, ownership=Ownership(SHARDS, ()))
    rebuilt = taker.rebuilding([shard])
    _fold(rebuilt, c, shard)
    rebuilt.changed_depths(0)  # what the rebuild counted on its own is not what is written...
    taker.adopt(rebuilt)
    assert _depths(taker) == {("TQ", shard): 2}  # ... the adopted counts are, once

    owner = c.engines[shard]  # its change of the two SENDs is not written yet
    owner.drop_shard(shard)
    assert _depths(owner) == {} and owner.depth == {}


def test_a_sender_waits_at_its_share_of_the_limit_in_its_dialogs_shard_only() -> None:
    rule = QueueDepths(limit=100, shards=4)
    assert rule.share == 25
    group = next(g for g in (f"g{i}" for i in range(100)) if shard_of(g, 4) == 1)
    elsewhere = next(g for g in (f"g{i}" for i in range(100)) if shard_of(g, 4) == 2)
    assert rule.over("Tgt", group) is None, "no record yet: nothing waits there"
    rule.update(QueueDepth(queue="TQ", shard=1, depth=24, services=("Tgt", "Tgt2")))
    assert rule.over("Tgt", group) is None
    rule.update(QueueDepth(queue="TQ", shard=1, depth=25, services=("Tgt", "Tgt2")))
    assert rule.over("Tgt", group) == ("TQ", 25)
    assert rule.over("Tgt2", group) == ("TQ", 25), "every service of the queue"
    assert rule.over("Tgt", elsewhere) is None, "another shard's SENDs go on"
    assert rule.over("Other", group) is None
    rule.update(QueueDepth(queue="TQ", shard=1, depth=3, services=("Tgt",)))
    assert rule.over("Tgt", group) is None


def test_the_share_rounds_up_and_no_limit_never_waits() -> None:
    assert QueueDepths(limit=10, shards=4).share == 3
    off = QueueDepths(limit=0, shards=4)
    off.began("h", "Tgt")
    off.update(QueueDepth(queue="TQ", shard=0, depth=10**6, services=("Tgt",)))
    assert off.target("h") is None
    assert off.over("Tgt", "h") is None


def test_a_sender_remembers_the_targets_of_the_dialogs_it_began_up_to_its_capacity() -> None:
    rule = QueueDepths(limit=10, shards=1, capacity=2)
    for h in ("a", "b", "c"):
        rule.began(h, f"S{h}")
    assert [rule.target(h) for h in ("a", "b", "c")] == [None, "Sb", "Sc"]


def test_changed_depths_are_handed_out_at_most_every_depth_every_ms_and_come_due() -> None:
    """A dispatcher writes the counts at most every `depth_every_ms` (a partition more in a
    transaction costs a produce request more); a count held back makes the engine's next
    deadline its due time, so a quiet dispatcher still writes it."""
    c = Cluster(1)
    engine = c.engines[0]
    engine.depth_every_ms = 100
    _begin_and_send(c, "h0", 1)
    assert [d.depth for d in engine.changed_depths(1_000)] == [1]
    assert engine.next_deadline_ms() is None, "nothing owed"
    c.request(SendRequest(handles=("h0",), message_type="Req", body="x"), "h0", now=1_050)
    assert engine.changed_depths(1_050) == [], "too soon after the last write"
    assert engine.next_deadline_ms() == 1_100
    assert [d.depth for d in engine.changed_depths(1_100)] == [2]
    assert engine.next_deadline_ms() is None
