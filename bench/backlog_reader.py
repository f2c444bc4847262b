"""The reader of the backlog bench, in a process of its own so that its memory is only its own.

`python -m bench.backlog_reader --messages N --dialogs D ...` (settings from ``KSB_*`` as for any
SDK program) opens one `KsbClient`, waits until the queue service says all N messages are ready
(the ``indexed`` phase: the bench measures the queue service's replicas then), then drains the
queue with RECEIVE + commit and checks that every dialog's messages came exactly once and in
order. Each phase is one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from bench.e2e import TARGET_QUEUE, receive_batch
from bench.stats import parse_body, peak_rss_kb, rss_kb
from ksb.errors import KsbError
from ksb.sdk.client import KsbClient
from ksb.settings import ClientSettings

__all__ = ["main"]


_PROGRESS_S = 30.0
"""How often the drain reports how far it got."""


def _emit(phase: str, **fields: Any) -> None:
    print(json.dumps({"phase": phase, **fields}), flush=True)


@dataclass
class _Drained:
    """What the commit outcomes said, checked as they come (per dialog: the next sequence)."""

    expected: int
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: threading.Event = field(default_factory=threading.Event)
    next_seq: dict[int, int] = field(default_factory=dict)
    delivered: int = 0
    commits: int = 0
    refused: int = 0
    receive_errors: int = 0
    """RECEIVEs that failed (bodies not read back in time), rolled back and tried again."""
    last_error: str = ""
    problems: list[str] = field(default_factory=list)

    def outcome(self, batch: list[tuple[int, int]], fut: Future[Any]) -> None:
        with self.lock:
            if fut.exception() is not None:
                self.refused += 1
                return
            self.commits += 1
            for dialog, seq in batch:
                want = self.next_seq.get(dialog, 0)
                if seq != want and len(self.problems) < 20:
                    kind = "duplicate" if seq < want else "gap"
                    self.problems.append(f"dialog {dialog}: got {seq}, expected {want} ({kind})")
                self.next_seq[dialog] = max(want, seq + 1)
            self.delivered += len(batch)
            if self.delivered >= self.expected:
                self.done.set()


def _drain(client: KsbClient, tally: _Drained, *, top: int | None, window: int) -> None:
    """`_drain_until_done`; a failure ends the drain as a problem instead of leaving the process
    waiting for messages nobody receives."""
    try:
        _drain_until_done(client, tally, top=top, window=window)
    except Exception as exc:
        with tally.lock:
            tally.problems.append(f"a drain thread failed: {type(exc).__name__}: {exc}")
        tally.done.set()


def _drain_until_done(client: KsbClient, tally: _Drained, *, top: int | None, window: int) -> None:
    """RECEIVE and commit with up to `window` commits in flight, until every message came."""
    outstanding: deque[Future[Any]] = deque()
    while not tally.done.is_set():
        while outstanding and outstanding[0].done():
            outstanding.popleft()
        if len(outstanding) >= window:
            with contextlib.suppress(KsbError):
                outstanding.popleft().result(60)
            continue
        tx = client.transaction()
        msgs, failed = receive_batch(tx, top=top, waitfor_ms=200)
        if failed is not None:
            with tally.lock:
                tally.receive_errors += 1
                tally.last_error = str(failed)
            continue
        if not msgs:
            continue
        batch = []
        for m in msgs:
            _sent, tag = parse_body(m.message_body)
            dialog, _, seq = tag.partition(":")
            batch.append((int(dialog), int(seq)))
        fut = tx.commit_async()
        fut.add_done_callback(functools.partial(tally.outcome, batch))
        outstanding.append(fut)
    for fut in outstanding:
        with contextlib.suppress(KsbError):
            fut.result(60)


def run(settings: ClientSettings, a: argparse.Namespace) -> int:
    expected = a.messages // a.dialogs * a.dialogs
    _emit("start", rss_kb=rss_kb())
    with KsbClient(settings) as client:
        base = rss_kb()
        started = time.monotonic()
        deadline = started + a.timeout
        while (ready := client.queue_state(TARGET_QUEUE).ready_messages) < expected:
            if time.monotonic() > deadline:
                _emit("failed", reason=f"{ready} of {expected} indexed")
                return 1
            time.sleep(0.05)
        _emit(
            "indexed",
            seconds=time.monotonic() - started,
            base_rss_kb=base,
            rss_kb=rss_kb(),
            peak_rss_kb=peak_rss_kb(),
            ready=ready,
        )
        tally = _Drained(expected)
        started = time.monotonic()
        threads = [
            threading.Thread(
                target=_drain,
                args=(client, tally),
                kwargs={"top": a.top or None, "window": a.window},
                daemon=True,
            )
            for _ in range(a.receivers)
        ]
        for t in threads:
            t.start()
        drain_deadline = started + a.drain_timeout
        while not tally.done.wait(min(_PROGRESS_S, max(0.0, drain_deadline - time.monotonic()))):
            _emit(
                "draining",
                seconds=time.monotonic() - started,
                delivered=tally.delivered,
                receive_errors=tally.receive_errors,
            )
            if time.monotonic() >= drain_deadline:
                break
        finished = tally.delivered >= expected
        tally.done.set()  # the drain threads stop here if the time ran out first
        drain_s = time.monotonic() - started
        for t in threads:
            t.join(70)
        problems = list(tally.problems)
        if finished:
            incomplete = [
                d for d in range(a.dialogs) if tally.next_seq.get(d, 0) != a.messages // a.dialogs
            ]
            if incomplete:
                problems.append(
                    f"{len(incomplete)} dialogs incomplete, e.g. dialog {incomplete[0]}"
                )
            tx = client.transaction()
            leftover = tx.receive(TARGET_QUEUE, waitfor_ms=500)
            tx.rollback()
            if leftover:
                problems.append(f"{len(leftover)} messages still receivable after the drain")
        else:
            problems.append(
                f"only {tally.delivered:,} of {expected:,} drained in {a.drain_timeout:.0f} s"
            )
        _emit(
            "drained",
            seconds=drain_s,
            delivered=tally.delivered,
            commits=tally.commits,
            refused=tally.refused,
            receive_errors=tally.receive_errors,
            last_receive_error=tally.last_error,
            problems=problems,
            peak_rss_kb=peak_rss_kb(),
        )
    return 0 if not problems else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.backlog_reader", description=__doc__)
    parser.add_argument("--messages", type=int, required=True)
    parser.add_argument("--dialogs", type=int, required=True)
    parser.add_argument("--top", type=int, default=0, help="RECEIVE TOP (n); 0 = the whole group")
    parser.add_argument("--window", type=int, default=16, help="commits in flight per receiver")
    parser.add_argument("--receivers", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds to index all")
    parser.add_argument(
        "--drain-timeout", type=float, default=3600.0, help="seconds the drain may take"
    )
    return run(ClientSettings.from_env(), parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
