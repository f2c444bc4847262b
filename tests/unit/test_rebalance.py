"""The offsets every dispatcher transaction commits, so that Kafka fences a left-behind member."""

from __future__ import annotations

from confluent_kafka import OFFSET_INVALID, TopicPartition

from services.dispatcher.rebalance import fencing_offsets


def _pairs(tps: list[TopicPartition]) -> list[tuple[str, int, int]]:
    return [(tp.topic, tp.partition, tp.offset) for tp in tps]


def test_positions_read_since_assignment_are_committed_as_they_are() -> None:
    positions = [TopicPartition("relay", 0, 12), TopicPartition("requests", 0, 7)]
    assert _pairs(fencing_offsets(positions, {("relay", 0): 3})) == [
        ("relay", 0, 12),
        ("requests", 0, 7),
    ]


def test_a_timer_only_transaction_still_commits_offsets_the_generation_is_checked_on() -> None:
    """Nothing read since the shard came: its committed offsets go again (changing nothing)."""
    positions = [
        TopicPartition("relay", 1, OFFSET_INVALID),
        TopicPartition("inbound", 1, OFFSET_INVALID),
    ]
    committed = {("relay", 1): 40, ("relay", 0): 99}
    assert _pairs(fencing_offsets(positions, committed)) == [("relay", 1, 40)]


def test_a_partition_never_committed_nor_read_is_left_out() -> None:
    assert fencing_offsets([TopicPartition("relay", 2, OFFSET_INVALID)], {}) == []
