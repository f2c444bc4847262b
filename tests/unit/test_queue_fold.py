"""Folding a queue topic in the queue service: the index, the store's writes, the outcomes."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from ksb.queue.bodies import BodyStore, store_key
from ksb.queue.fold import Folded, QueueFold
from ksb.queue.index import pack_position
from ksb.wire.protocol import CommitOutcome, QueueMessage, dumps


def _message(n: int, group: str = "g", handle: str = "h") -> QueueMessage:
    return QueueMessage(
        message_id=f"{handle}:{n}",
        queue="Q",
        status=1,
        priority=5,
        queuing_order=n,
        conversation_group_id=group,
        conversation_handle=handle,
        conversation_id=handle,
        message_sequence_number=n,
        service_name="//s",
        service_contract_name="//c",
        message_type_name="//m",
        validation="N",
        enqueued_ms=1_000 + n,
        body=f"body {n}",
    )


def _fold(fold: QueueFold, m: QueueMessage | CommitOutcome | None, key: str, offset: int) -> Folded:
    out = Folded()
    fold.fold(key.encode(), None if m is None else dumps(m), 0, offset, out)
    return out


def test_a_ready_message_goes_into_the_index_and_its_record_into_the_store() -> None:
    fold = QueueFold("Q", queue_id=3, partitions=1)
    out = _fold(fold, _message(0), "h:0", offset=5)
    assert out.puts == [(store_key(3, pack_position(0, 5)), dumps(_message(0)))]
    assert fold.index.ready_messages == 1 and fold.read_to == {0: 6}


def test_a_receipt_takes_the_message_out_of_both() -> None:
    fold = QueueFold("Q", queue_id=3, partitions=1)
    _fold(fold, _message(0), "h:0", offset=5)
    out = _fold(fold, None, "h:0", offset=9)
    assert out.deletes == [store_key(3, pack_position(0, 5))] and not out.puts
    assert fold.index.ready_messages == 0


def test_outcomes_are_collected_with_their_place_and_an_emptied_groups_tombstone_is_nothing() -> (
    None
):
    fold = QueueFold("Q", queue_id=1, partitions=1)
    outcome = CommitOutcome(request_id="r1", group="g", token=4, applied=True, reason="")
    out = _fold(fold, outcome, "commit/g", offset=2)
    assert [(o.record, o.partition, o.offset) for o in out.outcomes] == [(outcome, 0, 2)]
    assert _fold(fold, None, "commit/g", offset=3) == Folded()


def test_a_bad_record_is_skipped_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    fold = QueueFold("Q", queue_id=1, partitions=1)
    out = Folded()
    with caplog.at_level(logging.WARNING):
        fold.fold(b"k", b'{"kind":"message","v":1}', 0, 4, out)
    assert out == Folded() and "skipping bad queue record" in caplog.text
    assert fold.read_to == {0: 5}  # read past, all the same


def test_caught_up_once_every_partitions_end_was_reached() -> None:
    fold = QueueFold("Q", queue_id=1, partitions=2)
    fold.end_of(0, 10)
    assert not fold.caught_up
    fold.end_of(1, 0)
    assert fold.caught_up and fold.read_to == {0: 10, 1: 0}


def test_the_store_keeps_what_it_is_given_and_starts_empty(tmp_path: Path) -> None:
    store = BodyStore(tmp_path / "s", max_bytes=1 << 24, readers=4)
    store.apply([(b"a", b"1"), (b"b", b"2")], [])
    store.apply([], [b"a"])
    assert store.get_many([b"a", b"b", b"c"]) == [None, b"2", None] and len(store) == 1
    store.close()
    again = BodyStore(tmp_path / "s", max_bytes=1 << 24, readers=4)  # a restart rebuilds
    assert len(again) == 0
    again.close()


def test_a_restart_empties_the_store_in_the_same_directory(tmp_path: Path) -> None:
    """The directory itself is kept (its inode): a confined queue service may read beneath the
    directory it was given, not one made again in its place (`ksb.runtime.confinement`)."""
    path = tmp_path / "s"
    path.mkdir()
    (path / "leftover").write_text("x")
    inode = path.stat().st_ino
    store = BodyStore(path, max_bytes=1 << 24, readers=4)
    assert path.stat().st_ino == inode and not (path / "leftover").exists()
    assert len(store) == 0 and path.stat().st_mode & 0o777 == 0o700
    store.close()
