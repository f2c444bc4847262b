"""`python -m bench.engine_cpu`: the dispatcher's own Python work per message, without a broker.

`make bench` measures a dispatcher's CPU per message in a real run, where it moves by tens of
per cent from run to run with what else the two CPUs do (the broker's JIT compiler, the SDK
clients). This measures the part that is the dispatcher's Python alone, the same way every time:
records decoded as `services.dispatcher.routing` hands them over, applied by the engine and written
by the dispatcher's `OutputWriter` through its `JournaledProducer` and its audit, for the bench's
load shape (BEGIN, then SENDs round-robin over the dialogs in batches, then RECEIVE-sized receipts
of a few messages per group). The producer points at no broker: its records only queue in
librdkafka, so neither the network, the transactions nor librdkafka's own threads are in the
figure; `make bench`'s "dispatcher CPU per message" is the whole of it. ``--profile`` prints where
the time goes (cProfile, which slows it down about 2.5x).

It is a yardstick for changes to the hot path, not a benchmark of KSB. On this project's VM one
run varies by up to a fifth from the next even on an idle machine: compare medians of many runs,
before and after, alternating.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from dataclasses import dataclass

from bench.e2e import CONTRACT, INITIATOR, MESSAGE_TYPE, TARGET, bench_catalog
from ksb.audit import Audit, KafkaAudit
from ksb.catalog.model import CatalogView
from ksb.dialog.engine import Engine
from ksb.names import Names
from ksb.wire.protocol import (
    BeginRequest,
    CommitRequest,
    QueueMessage,
    Receipt,
    SendRequest,
    dumps,
    parse_request,
)
from services.dispatcher.journal import JournaledProducer
from services.dispatcher.writer import OutputWriter

__all__ = ["EngineLoad", "run_load"]

_INSTANCE = "bench"


@dataclass(frozen=True)
class EngineLoad:
    dialogs: int = 1_000
    per_dialog: int = 10
    batch: int = 200
    """Records per transaction, as the dispatcher takes them from one poll."""
    per_receipt: int = 5
    """Messages per RECEIVE (one group's)."""
    body_bytes: int = 1024
    audit: bool = True


@dataclass(frozen=True)
class EngineResult:
    messages: int
    cpu_s: float
    records: int

    @property
    def ms_per_message(self) -> float:
        return self.cpu_s * 1000 / self.messages


class _Harness:
    def __init__(self, load: EngineLoad) -> None:
        self.load = load
        self.engine = Engine(
            CatalogView(bench_catalog(8)), instance=_INSTANCE, max_body_bytes=1 << 20
        )
        # No broker: records queue in librdkafka (room for all of them) and are never sent.
        self.producer = JournaledProducer(
            {
                "bootstrap.servers": "127.0.0.1:9",
                "queue.buffering.max.messages": 10_000_000,
                "queue.buffering.max.kbytes": 8_000_000,
                "log_level": 0,
            }
        )
        names = Names(_INSTANCE)
        audit = Audit(KafkaAudit(self.producer, names)) if load.audit else Audit()
        self.writer = OutputWriter(self.producer, names, 1, audit)
        self.now = 1_000

    def apply(self, raws: list[bytes]) -> list[QueueMessage]:
        """One batch: every record applied and written, then the transaction's endpoint records."""
        enqueued: list[QueueMessage] = []
        for raw in raws:
            out = self.engine.handle(parse_request(raw), self.now)
            self.writer.write(out, self.now, _INSTANCE)
            enqueued += [w.value for w in out.queue if isinstance(w.value, QueueMessage)]
        self.writer.flush(self.engine.changed_depths(self.now))
        return enqueued

    def in_batches(self, raws: list[bytes]) -> list[QueueMessage]:
        size = self.load.batch
        return [m for i in range(0, len(raws), size) for m in self.apply(raws[i : i + size])]


def _begins(load: EngineLoad) -> list[bytes]:
    return [
        dumps(
            BeginRequest(
                handle=f"h{d}", from_service=INITIATOR, to_service=TARGET, contract=CONTRACT
            )
        )
        for d in range(load.dialogs)
    ]


def _sends(load: EngineLoad) -> list[bytes]:
    body = "x" * load.body_bytes
    return [
        dumps(SendRequest(handles=(f"h{d}",), message_type=MESSAGE_TYPE, body=body))
        for _seq in range(load.per_dialog)
        for d in range(load.dialogs)
    ]


def _receipts(load: EngineLoad, messages: list[QueueMessage]) -> list[bytes]:
    by_group: dict[str, list[QueueMessage]] = {}
    for m in messages:
        by_group.setdefault(m.conversation_group_id, []).append(m)
    raws: list[bytes] = []
    token = 0
    for group, mine in by_group.items():
        for i in range(0, len(mine), load.per_receipt):
            token += 1
            ids = tuple(m.message_id for m in mine[i : i + load.per_receipt])
            receipt = Receipt(queue=mine[0].queue, group=group, token=token, message_ids=ids)
            raws.append(dumps(CommitRequest(receipt=receipt)))
    return raws


def run_load(load: EngineLoad, profile: cProfile.Profile | None = None) -> EngineResult:
    """BEGIN every dialog (unmeasured), then measure the SENDs and their receipts."""
    h = _Harness(load)
    h.in_batches(_begins(load))
    sends = _sends(load)
    queued = len(h.producer)
    started = time.process_time()
    if profile is not None:
        profile.enable()
    messages = h.in_batches(sends)
    h.in_batches(_receipts(load, messages))
    if profile is not None:
        profile.disable()
    cpu = time.process_time() - started
    records = len(h.producer) - queued
    h.producer.purge()
    return EngineResult(messages=len(messages), cpu_s=cpu, records=records)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.engine_cpu", description=__doc__)
    parser.add_argument("--runs", type=int, default=9, help="runs; their median is printed")
    parser.add_argument("--dialogs", type=int, default=EngineLoad.dialogs)
    parser.add_argument("--per-dialog", type=int, default=EngineLoad.per_dialog)
    parser.add_argument("--no-audit", action="store_true", help="audit events off")
    parser.add_argument("--profile", action="store_true", help="one run under cProfile")
    args = parser.parse_args(argv)
    load = EngineLoad(dialogs=args.dialogs, per_dialog=args.per_dialog, audit=not args.no_audit)
    if args.profile:
        prof = cProfile.Profile()
        run_load(load, prof)
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
        return
    results = [run_load(load) for _ in range(args.runs)]
    per_message = sorted(r.ms_per_message for r in results)
    print(
        f"engine + writer: {statistics.median(per_message):.4f} ms CPU per message, median of "
        f"{args.runs} runs ({per_message[0]:.4f}-{per_message[-1]:.4f}); "
        f"{results[0].messages:,} messages, "
        f"{results[0].records / results[0].messages:.2f} records written per message"
    )


if __name__ == "__main__":
    main()
