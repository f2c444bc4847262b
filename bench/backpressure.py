"""Back-pressure on and off: the e2e load (bench/e2e.py) with the sender's in-flight limit unset
and set, on one dispatcher, so loaded latency can be compared with nothing else changed.

Without a limit the sender hands its whole burst to Kafka at once and every message then waits
behind all earlier ones, so loaded latency is the burst's length over the dispatcher's rate. With
`ClientSettings.max_inflight_requests` the sender waits instead (`ksb.sdk.backpressure`): the wait
moves to before the SEND, which the latency of a message (SEND to commit outcome) does not include.
`run_backpressure` runs on a stack with a dispatcher (bench/suite.py); `python -m bench.backpressure`
starts both.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.e2e import bench_catalog, run_ksb
from bench.queues import DEFAULT_REPLICAS, running_queues
from bench.stats import fmt_ms
from devtools.deployment import Deployment, secure_instance, stack_fields
from devtools.localstack import start_stack
from devtools.runner import ServiceProcess
from ksb.runtime.catalog_store import apply_catalog

__all__ = ["BackpressureOptions", "format_lines", "main", "run_backpressure"]


@dataclass(frozen=True)
class BackpressureOptions:
    limits: tuple[int, ...] = (0, 2_000)
    """`max_inflight_requests` of each run; 0 is back-pressure off."""
    messages: int = 20_000
    dialogs: int = 1_000
    body_bytes: int = 1024
    receivers: int = 2
    window: int = 64
    top: int | None = None
    probes: int = 50
    timeout_s: float = 300.0


def run_backpressure(settings: Deployment, opts: BackpressureOptions) -> dict[str, Any]:
    """One e2e run per limit on `settings`' instance (its dispatcher and queue service must be
    running)."""
    runs = []
    for limit in opts.limits:
        limited = settings.model_copy(update={"max_inflight_requests": limit})
        result = run_ksb(
            limited,
            dialogs=opts.dialogs,
            messages=opts.messages,
            body_bytes=opts.body_bytes,
            receivers=opts.receivers,
            window=opts.window,
            top=opts.top,
            probes=opts.probes,
            timeout_s=opts.timeout_s,
        )
        runs.append({"max_inflight_requests": limit, **result.as_json()})
    return {"load_average_1m": round(os.getloadavg()[0], 2), "runs": runs}


def format_lines(r: dict[str, Any]) -> list[str]:
    lines = [
        f"back-pressure (load average {r['load_average_1m']}): "
        f"{'limit':>6} {'msg/s':>8} {'loaded p50':>12} {'loaded p99':>12} "
        f"{'1-at-a-time p50':>16} {'send s':>7} ok"
    ]
    for run in r["runs"]:
        loaded, probe = run["latency_loaded"], run["latency_unloaded"]
        limit = run["max_inflight_requests"] or "off"
        lines.append(
            f"{'':>38}{limit:>6} {run['throughput']['per_s']:>8,.0f} "
            f"{fmt_ms(loaded['p50_ms'], 0):>12} {fmt_ms(loaded['p99_ms'], 0):>12} "
            f"{fmt_ms(probe['p50_ms'], 1):>16} {run['send_seconds']:>7.1f} "
            + ("yes" if run["verified_exactly_once_in_order"] else "NO")
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.backpressure", description=__doc__)
    d = BackpressureOptions()
    parser.add_argument("--limits", default=",".join(str(n) for n in d.limits))
    parser.add_argument("--messages", type=int, default=d.messages)
    parser.add_argument("--dialogs", type=int, default=d.dialogs)
    parser.add_argument("--probes", type=int, default=d.probes)
    parser.add_argument("--queue-replicas", type=int, default=DEFAULT_REPLICAS)
    parser.add_argument("--out", type=Path, help="also write the figures as JSON here")
    a = parser.parse_args(argv)
    opts = BackpressureOptions(
        limits=tuple(int(n) for n in a.limits.split(",")),
        messages=a.messages,
        dialogs=a.dialogs,
        probes=a.probes,
    )
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    with tempfile.TemporaryDirectory(prefix="ksb-backpressure-") as tmp:
        stack = start_stack(Path(tmp) / "stack")
        dispatcher: ServiceProcess | None = None
        try:
            settings = secure_instance(
                Deployment.model_validate(
                    {
                        "instance": f"bp{uuid.uuid4().hex[:8]}",
                        "kafka_bootstrap": stack.kafka_bootstrap,
                        "redis_url": stack.redis_url,
                        **stack_fields(stack.security),
                    }
                )
            )
            apply_catalog(settings, bench_catalog(4))
            with running_queues(settings, Path(tmp), a.queue_replicas) as (settings, _queues):
                dispatcher = ServiceProcess("dispatcher", settings, Path(tmp) / "dispatcher.log")
                dispatcher.start().wait_ready("dispatcher ready")
                result = run_backpressure(settings, opts)
                dispatcher.stop()
        finally:
            if dispatcher is not None:
                dispatcher.stop()
            stack.stop()
    print("\n".join(format_lines(result)))
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if all(run["verified_exactly_once_in_order"] for run in result["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
