"""Crashes: SIGKILL the dispatcher or a reader mid-stream; still exactly once and in order."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from devtools.deployment import Deployment
from devtools.runner import REPO_ROOT, ServiceProcess
from ksb.sdk.client import KsbClient
from ksb.settings import ClientSettings, settings_env
from tests.integration.conftest import ThreadDispatcher, serving
from tests.integration.support import Flow, check_exactly_once_in_order, queue_receipts

pytestmark = pytest.mark.integration


def test_dispatcher_sigkill_three_times_keeps_exactly_once_in_order(
    settings: Deployment, client: KsbClient, dispatcher_process: ServiceProcess, tmp_path: Path
) -> None:
    """10,000 messages over 100 dialogs; the dispatcher is SIGKILLed three times while they flow."""
    # The sender is paced so that the messages are still flowing at every kill.
    flow = Flow(settings, client, dialogs=100, per_dialog=100, round_pause_s=0.1).start()
    procs = [dispatcher_process]
    kills: list[tuple[int, int]] = []
    # Three points: early while the sender is sending, then twice once the restarted dispatcher has
    # made progress, in the middle and late in the stream.
    points: list[Callable[[], bool]] = [
        lambda: flow.sent >= 2_000,
        lambda: flow.sent >= 5_000 and len(flow.received) >= 2_500,
        lambda: flow.sent >= 8_000 and len(flow.received) >= 6_000,
    ]
    try:
        for n, point in enumerate(points, start=1):
            _wait_for(point, flow, timeout_s=60)
            kills.append((flow.sent, len(flow.received)))
            procs[-1].kill()
            proc = ServiceProcess("dispatcher", settings, tmp_path / f"dispatcher-{n}.log").start()
            procs.append(proc)
            proc.wait_ready("dispatcher ready")
        flow.wait_received(flow.total, timeout_s=90)
    finally:
        try:
            flow.close()
        finally:
            for p in procs[1:]:
                p.stop()
    assert kills[0][0] < flow.total, f"the first kill came after everything was sent: {kills}"
    assert kills[1][1] < kills[2][1] < flow.total, kills
    flow.check_exactly_once_in_order()
    # The broker's own record agrees: one message record and one receipt per message id.
    receipts = queue_receipts(settings, "TargetQueue")
    assert len(receipts) == flow.total
    assert set(receipts.values()) == {(1, 1)}
    assert {m.message_id for m in flow.received} == set(receipts)


def _wait_for(condition: Callable[[], bool], flow: Flow, *, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        flow.raise_failures()
        assert time.monotonic() < deadline, "the flow did not get there in time"
        time.sleep(0.005)


# --------------------------------------------------------------------------- reader crashes


@pytest.fixture
def reader_procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


def _start_reader(
    settings: Deployment, out: Path, log: Path, procs: list[subprocess.Popen[bytes]], *, top: int
) -> subprocess.Popen[bytes]:
    with log.open("ab") as f:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.integration.reader_proc",
                "TargetQueue",
                str(out),
                str(top),
            ],
            cwd=REPO_ROOT,
            env=settings_env(settings.narrow(ClientSettings)),
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    procs.append(proc)
    return proc


def _batches(out: Path) -> list[dict[str, Any]]:
    """The reader's lines; a line cut short by SIGKILL is ignored (its commit had not returned)."""
    if not out.exists():
        return []
    lines = []
    for line in out.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            lines.append(json.loads(line))
    return lines


def _committed(out: Path) -> int:
    return sum(len(b["m"]) for b in _batches(out) if b["s"] == "C")


def _wait_committed(
    outs: list[Path], count: int, proc: subprocess.Popen[bytes], timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    while sum(_committed(o) for o in outs) < count:
        assert proc.poll() is None, f"reader exited with {proc.returncode}"
        assert time.monotonic() < deadline, f"only {sum(_committed(o) for o in outs)} committed"
        time.sleep(0.02)


def test_reader_sigkill_redelivers_uncommitted_after_lock_expiry(
    settings: Deployment,
    client: KsbClient,
    dispatcher: ThreadDispatcher,
    tmp_path: Path,
    reader_procs: list[subprocess.Popen[bytes]],
) -> None:
    """Readers are child processes; two are SIGKILLed mid-stream and the next one picks up."""
    with serving(settings, tmp_path / "q", lock_ttl_ms=2000, lock_renew_ms=500) as fast:
        flow = Flow(
            settings, client, dialogs=20, per_dialog=50, round_pause_s=0.05, read=False
        ).start()
        outs = [tmp_path / f"reader-{n}.jsonl" for n in range(3)]
        try:
            for n, at in enumerate((200, 500)):
                proc = _start_reader(
                    fast, outs[n], tmp_path / f"reader-{n}.log", reader_procs, top=10
                )
                _wait_committed(outs, at, proc, timeout_s=60)
                proc.kill()
                proc.wait(10)
            last = _start_reader(fast, outs[2], tmp_path / "reader-2.log", reader_procs, top=10)
            flow.wait_sent(30)
            # The killed readers' last batches may have been applied without their "C" line.
            _wait_committed(outs, flow.total - 2 * 10, last, timeout_s=60)
            receipts: dict[str, tuple[int, int]] = {}
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                receipts = queue_receipts(settings, "TargetQueue")
                if len(receipts) == flow.total and all(r == (1, 1) for r in receipts.values()):
                    break
                time.sleep(0.2)
            last.terminate()
            last.wait(10)
        finally:
            flow.close()
    # The broker received every message exactly once ...
    assert len(receipts) == flow.total
    assert set(receipts.values()) == {(1, 1)}, "a message was received twice or never"
    # ... and the readers saw them once each, in order: each killed reader's last, unconfirmed batch
    # counts if (and only if) no later reader got those messages again.
    ordered: list[dict[str, int]] = []
    seen: set[str] = set()
    later: list[set[str]] = [
        {mid for b in _batches(o) if b["s"] == "C" for mid, _ in b["m"]} for o in outs
    ]
    for n, out in enumerate(outs):
        batches = _batches(out)
        for b in batches:
            if b["s"] == "C":
                ids = [mid for mid, _ in b["m"]]
                assert not seen & set(ids), "a reader committed a message another already had"
                seen.update(ids)
                ordered.extend(json.loads(body) for _, body in b["m"])
        if n < 2 and batches and batches[-1]["s"] == "R":
            dangling = [mid for mid, _ in batches[-1]["m"]]
            redelivered = set().union(*later[n + 1 :]) & set(dangling)
            if not redelivered:  # applied before the kill: nobody may get them again
                seen.update(dangling)
                ordered.extend(json.loads(body) for _, body in batches[-1]["m"])
            else:
                assert redelivered == set(dangling), "part of one batch came back"
    assert seen == set(receipts)
    check_exactly_once_in_order(ordered, flow.dialogs, flow.per_dialog)
