"""The dispatcher's gauges: members, shard owners, rebalances and the open transaction."""

from __future__ import annotations

from prometheus_client import REGISTRY

from services.dispatcher import gauges
from services.dispatcher.gauges import MemberLook, rebalanced


def _value(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def test_a_shard_no_member_owns_reads_0_under_max_by_shard() -> None:
    gauges.watch("m1", lambda: MemberLook(3, frozenset({0, 2}), 0.0))
    gauges.watch("m2", lambda: MemberLook(3, frozenset(), 12.5))
    try:
        owners = {
            shard: max(
                _value("ksb_dispatcher_shard_owned", member=m, shard=str(shard)) or 0
                for m in ("m1", "m2")
            )
            for shard in range(3)
        }
        assert owners == {0: 1.0, 1: 0.0, 2: 1.0}
        assert _value("ksb_dispatcher_owned_shards", member="m1") == 2
        assert _value("ksb_dispatcher_shards", member="m2") == 3
        assert _value("ksb_dispatcher_txn_open_seconds", member="m2") == 12.5
    finally:
        gauges.unwatch("m1")
        gauges.unwatch("m2")
    assert _value("ksb_dispatcher_owned_shards", member="m1") is None


def test_a_member_not_started_exports_no_shard() -> None:
    gauges.watch("m3", lambda: MemberLook(0, frozenset(), 0.0))
    try:
        assert _value("ksb_dispatcher_shards", member="m3") == 0
        assert _value("ksb_dispatcher_shard_owned", member="m3", shard="0") is None
    finally:
        gauges.unwatch("m3")


def test_rebalances_count_callbacks_that_moved_partitions() -> None:
    before = _value("ksb_dispatcher_rebalances_total", kind="revoked") or 0
    rebalanced("revoked", [])
    rebalanced("revoked", ["p0", "p1"])
    assert _value("ksb_dispatcher_rebalances_total", kind="revoked") == before + 1
    assert _value("ksb_dispatcher_rebalances_total", kind="lost") is not None  # declared at 0
