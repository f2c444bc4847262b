"""`python -m bench.engine_cpu` applies the bench's load through the dispatcher's real hot path."""

from __future__ import annotations

from bench.engine_cpu import EngineLoad, run_load


def test_every_message_is_applied_and_received_with_its_records_written() -> None:
    load = EngineLoad(dialogs=20, per_dialog=4, batch=7, per_receipt=3)
    result = run_load(load)
    assert result.messages == 80
    # A message and its receipt: the queue record and its tombstone at least, plus the commit
    # outcome of each receipt, endpoint records and audit batches.
    assert result.records >= 2 * result.messages + 20 * 2
    assert result.cpu_s > 0
    quiet = run_load(EngineLoad(dialogs=20, per_dialog=4, batch=7, per_receipt=3, audit=False))
    assert quiet.records < result.records  # the audit's records are the difference
