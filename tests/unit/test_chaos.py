"""The chaos harness's pure parts: the workload it draws, the readers' rules, the fault schedule,
and the invariant checks on hand-made records (each invariant caught, a clean round passing)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from devtools.chaos.__main__ import main as chaos_main
from devtools.chaos.invariants import Side, check_round, stale_commits
from devtools.chaos.remedy import CoordinatorWatch, failed_loads
from devtools.chaos.schedule import FaultKind, draw_schedule
from devtools.chaos.workload import (
    REPLY,
    REQUEST,
    DialogPlan,
    Kind,
    Received,
    Workload,
    initiator_step,
    plan_workload,
    request_body,
    target_step,
)
from devtools.processes import LogTail
from ksb.catalog.model import DIALOG_TIMER, END_DIALOG, ERROR
from ksb.wire.protocol import CommitOutcome, QueueMessage


def test_a_workload_is_drawn_from_its_seed_with_every_kind_of_dialog() -> None:
    w = plan_workload(3, 1_000, 5_000)
    assert w == plan_workload(3, 1_000, 5_000) and w != plan_workload(4, 1_000, 5_000)
    assert w.requests == 5_000 and len(w.dialogs) == 1_000
    assert all(w.count(k) > 0 for k in Kind) and w.related > 0 and w.forwarded > 0
    assert all(d.requests == 1 for d in w.dialogs if d.kind is Kind.POISON)
    for d in w.dialogs:
        if d.related_to is not None:
            earlier = w.dialogs[d.related_to]
            assert d.related_to < d.number and earlier.forwarded == d.forwarded


def _req(plan: DialogPlan, seq: int, handle: str = "h") -> Received:
    return Received(handle, REQUEST, request_body(plan, seq).encode())


def test_the_target_answers_every_request_and_ends_as_its_dialog_says() -> None:
    end = DialogPlan(0, Kind.END, 2, False, None)
    step = target_step([_req(end, 0), _req(end, 1)])
    assert [b for _, b in step.replies] == ['{"d": 0, "s": 0}', '{"d": 0, "s": 1}']
    assert step.ends == [("h", False)] and not step.rollback
    assert target_step([_req(DialogPlan(1, Kind.ERROR, 1, False, None), 0)]).ends == [("h", True)]
    timer = target_step([_req(DialogPlan(2, Kind.TIMER, 1, False, None), 0)])
    assert timer.timers == ["h"] and timer.ends == []
    assert target_step([Received("h", DIALOG_TIMER, b"")]).ends == [("h", False)]
    poison = target_step([_req(DialogPlan(3, Kind.POISON, 1, False, None), 0)])
    assert poison.rollback and not poison.replies


def test_the_initiator_ends_on_enddialog_or_error_only() -> None:
    got = [Received("a", REPLY, b"{}"), Received("a", ERROR, b""), Received("b", END_DIALOG, b"")]
    assert initiator_step(got).ends == [("a", False), ("b", False)]


def test_a_schedule_is_drawn_from_its_seed_with_each_kind_once_first() -> None:
    s = draw_schedule(9, 16, lock_ttl_s=3.0)
    assert s == draw_schedule(9, 16, lock_ttl_s=3.0)
    assert {f.kind for f in s[: len(FaultKind)]} == set(FaultKind)
    assert [f.at for f in s] == sorted(f.at for f in s) and s[0].at > 0 and s[-1].at < 1
    pauses = [
        f for f in s if f.kind in (FaultKind.PAUSE, FaultKind.READER_PAUSE, FaultKind.QUEUE_PAUSE)
    ]
    assert pauses and all(f.duration_s > 3.0 for f in pauses)
    only = draw_schedule(9, 5, lock_ttl_s=3.0, kinds=(FaultKind.KILL,))
    assert {f.kind for f in only} == {FaultKind.KILL}


# --------------------------------------------------------------------------- invariants


def _msg(mid: str, handle: str, seq: int, mtype: str, body: str = "") -> QueueMessage:
    return QueueMessage(
        message_id=mid,
        queue="q",
        status=1,
        priority=5,
        queuing_order=0,
        conversation_group_id=handle,
        conversation_handle=handle,
        conversation_id=handle,
        message_sequence_number=seq,
        service_name="s",
        service_contract_name="c",
        message_type_name=mtype,
        validation="N",
        enqueued_ms=0,
        body=body,
    )


def _round() -> tuple[Workload, list[str], Side, Side]:
    """One dialog of two requests, answered and ended, as the broker would record it."""
    w = Workload((DialogPlan(0, Kind.END, 2, False, None),))
    b_msgs = [
        _msg("t:0", "t", 0, REQUEST, json.dumps({"d": 0, "s": 0})),
        _msg("t:1", "t", 1, REQUEST, json.dumps({"d": 0, "s": 1})),
    ]
    a_msgs = [
        _msg("i:0", "i", 0, REPLY, json.dumps({"d": 0, "s": 0})),
        _msg("i:1", "i", 1, REPLY, json.dumps({"d": 0, "s": 1})),
        _msg("i:2", "i", 2, END_DIALOG),
    ]
    a = Side(messages=a_msgs, committed=["i:0", "i:1", "i:2"], endpoints={"i": "CLOSED"})
    b = Side(messages=b_msgs, committed=["t:0", "t:1"], endpoints={"t": "CLOSED"})
    a.applied_batches = [["i:0"], ["i:1", "i:2"]]
    return w, ["i"], a, b


def test_a_clean_round_keeps_every_invariant() -> None:
    w, handles, a, b = _round()
    verdict = check_round(w, handles, a, b, pending=0)
    assert verdict.ok, verdict.problems


def test_each_broken_invariant_is_counted() -> None:
    w, handles, a, b = _round()
    b.committed = ["t:1", "t:0"]  # received out of order
    a.committed = ["i:0", "i:2"]  # a reply lost
    a.applied_batches.append(["i:0"])  # a batch seen applied twice
    b.messages.append(_msg("t:9", "t", 9, REQUEST, json.dumps({"d": 0, "s": 0})))
    b.committed.append("t:9")  # the same request enqueued again and received again
    a.endpoints["i"] = "DISCONNECTED_INBOUND"
    a.notes["i"] = "timer due 1234"
    verdict = check_round(w, handles, a, b, pending=3)
    assert "open: A: endpoint i is DISCONNECTED_INBOUND (timer due 1234)" in verdict.problems
    assert verdict.counts["order"] >= 1 and verdict.counts["lost"] >= 1
    assert verdict.counts["dup"] >= 2 and verdict.counts["open"] == 1
    assert verdict.counts["pending"] == 3 and not verdict.ok


def test_a_commit_applied_under_an_older_token_is_stale_and_a_refusal_is_the_fence() -> None:
    def outcome(token: int, applied: bool, reason: str = "") -> CommitOutcome:
        return CommitOutcome(
            request_id=f"r{token}", group="g", token=token, applied=applied, reason=reason
        )

    fine = [[outcome(5, True), outcome(4, False, "stale_token: old"), outcome(7, True)]]
    assert stale_commits(fine) == ([], 1)
    bad, refused = stale_commits([[outcome(5, True), outcome(4, True), outcome(0, True)]])
    assert [o.token for o in bad] == [4] and refused == 0


def test_a_coordinator_that_failed_to_load_gets_the_broker_restarted_once(tmp_path: Path) -> None:
    log_file = tmp_path / "server.log"
    log_file.write_text("[t] ERROR Failed to load metadata from __consumer_offsets-3 (before)\n")
    asked: list[str] = []
    free = [False, True]  # a Kafka fault holds the broker at first, then it is free

    def restart(why: str) -> bool:
        asked.append(why)
        return free.pop(0)

    watch = CoordinatorWatch(LogTail(log_file), restart)
    watch.check()
    assert asked == []  # what the log held before the watch began is not acted on
    with log_file.open("a") as f:
        f.write(
            "[t] ERROR [GroupCoordinator id=1] Failed to load metadata from __consumer_offsets-1"
        )
    watch.check()
    assert asked == []  # a line still being written waits for its end
    with log_file.open("a") as f:
        f.write(" with epoch 4 due to Replaying record ...\n")
    watch.check()
    watch.check()
    watch.check()
    assert asked == ["kafka's group coordinator failed to load __consumer_offsets-1"] * 2
    assert watch.pending == []  # asked again while busy, then restarted; nothing left


def test_the_broker_logs_failed_loads_are_found_by_partition() -> None:
    text = (
        "ERROR Failed to load metadata from __consumer_offsets-1 with epoch 4 due to ...\n"
        "ERROR The state machine of the coordinator __consumer_offsets-2 is out of sync\n"
        "ERROR Failed to load metadata from __transaction_state-0 with epoch 2 due to ...\n"
    )
    assert failed_loads(text) == ["__consumer_offsets-1", "__transaction_state-0"]


def test_more_dialogs_than_messages_is_refused_before_a_stack_starts(tmp_path: Path) -> None:
    workdir = tmp_path / "chaos"
    with pytest.raises(SystemExit) as exit_:
        chaos_main(["--messages", "500", "--workdir", str(workdir)])  # 1,000 dialogs by default
    assert exit_.value.code == 2
    assert not workdir.exists()  # nothing started, nothing wiped
