"""Queue-depth back-pressure on real Kafka: the dispatcher writes each queue's depth per shard, a
sender with `max_queue_depth` waits while its target queue holds its share in the dialog's shard,
goes on as readers receive, never waits for another shard, and fails clearly when nobody reads."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from devtools.deployment import Deployment, secure_instance
from ksb.catalog.model import parse_catalog
from ksb.errors import BackpressureTimeout
from ksb.names import Names
from ksb.runtime.catalog_store import apply_catalog
from ksb.sdk.client import KsbClient
from ksb.wire.depth import parse_depth
from ksb.wire.partitioning import shard_of
from tests.integration.conftest import BASIC_CATALOG, ThreadDispatcher, serving
from tests.integration.support import read_topic, receive_all, wait_for

pytestmark = pytest.mark.integration

I, T, C = "//t/Initiator", "//t/Target", "//t/Contract"  # noqa: E741
SHARE = 3
SHARDS = 2


@pytest.fixture
def sharded(settings: Deployment, tmp_path: Path) -> Iterator[Deployment]:
    """An instance of two shards (its topics are made with the count when it is secured), with
    its queue service."""
    update = {"instance": f"{settings.instance}q", "request_partitions": SHARDS}
    s = secure_instance(settings.model_copy(update=update))
    apply_catalog(s, parse_catalog(BASIC_CATALOG))
    with serving(s, tmp_path / "queue-store") as served:
        yield served


@pytest.fixture
def dispatched(sharded: Deployment) -> Iterator[Deployment]:
    d = ThreadDispatcher(sharded)
    d.wait_owning_every_shard()
    yield sharded
    d.stop()


def _limited(settings: Deployment, timeout_s: float = 30.0) -> Deployment:
    return settings.model_copy(
        update={
            "max_queue_depth": SHARE * settings.request_partitions,
            "backpressure_timeout_s": timeout_s,
        }
    )


def _dialogs_in_two_shards(client: KsbClient, shards: int) -> tuple[str, str]:
    first = client.begin_dialog(I, T, C)
    while True:
        other = client.begin_dialog(I, T, C)
        if shard_of(other, shards) != shard_of(first, shards):
            return first, other


def _depth_records(settings: Deployment) -> list[tuple[str, int, int]]:
    return [
        (d.queue, d.shard, d.depth)
        for d in (parse_depth(v) for _k, v in read_topic(settings, Names(settings.instance).depth))
    ]


def test_a_sender_waits_at_its_share_and_goes_on_as_readers_receive(
    dispatched: Deployment,
) -> None:
    settings, shards = dispatched, SHARDS
    with KsbClient(_limited(settings)) as sender, KsbClient(settings) as reader:
        full, free = _dialogs_in_two_shards(sender, shards)
        for n in range(SHARE):
            sender.send(full, "//t/Request", json.dumps({"n": n}))
        wait_for(
            "the full shard's depth written",
            lambda: ("TargetQueue", shard_of(full, shards), SHARE) in _depth_records(settings),
            15,
        )
        sent = threading.Event()

        def send_one_more() -> None:
            sender.send(full, "//t/Request", json.dumps({"n": SHARE}))
            sent.set()

        waiter = threading.Thread(target=send_one_more, daemon=True)
        waiter.start()
        for n in range(5):  # another shard of the same queue is not held back
            sender.send(free, "//t/Request", json.dumps({"n": n}))
        assert not sent.wait(1.0), "the SEND past the full shard's share went out"

        got = receive_all(reader, "TargetQueue", SHARE + 5, timeout_s=30)
        assert sent.wait(10), "the SEND did not go on once the readers had received"
        waiter.join(5)
        got += receive_all(reader, "TargetQueue", 1, timeout_s=30)
        assert sender.depths.waited_ms >= 900

    by_dialog: dict[str, list[int]] = {}
    for m in got:
        by_dialog.setdefault(m.conversation_handle, []).append(json.loads(m.message_body)["n"])
    assert sorted(len(v) for v in by_dialog.values()) == sorted([5, SHARE + 1])
    assert all(v == sorted(v) for v in by_dialog.values()), by_dialog
    records = _depth_records(settings)
    assert ("TargetQueue", shard_of(full, shards), 0) in records, records


def test_a_sender_nobody_reads_for_fails_clearly_after_its_timeout(dispatched: Deployment) -> None:
    settings = dispatched
    with KsbClient(_limited(settings, timeout_s=1.0)) as sender:
        h = sender.begin_dialog(I, T, C)
        for n in range(SHARE):
            sender.send(h, "//t/Request", json.dumps({"n": n}))
        sender.flush()
        wait_for("the depth written", lambda: sender.depths.rule.over(T, h) is not None, 15)
        started = time.monotonic()
        with pytest.raises(BackpressureTimeout, match="is a reader keeping up"):
            sender.send(h, "//t/Request", json.dumps({"n": SHARE}))
        assert time.monotonic() - started >= 0.9


def test_without_a_limit_a_sender_never_reads_depths(
    settings: Deployment, dispatcher: ThreadDispatcher
) -> None:
    with KsbClient(settings) as sender:
        h = sender.begin_dialog(I, T, C)
        for n in range(20):
            sender.send(h, "//t/Request", json.dumps({"n": n}))
        sender.flush()
        assert sender.depths.rule.target(h) is None and sender.depths.waited_ms == 0
