"""`python -m bench` (`make bench`): run the benchmarks, print the table, write the JSON."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from types import FrameType

from bench.activation import ActivationOptions
from bench.cross_instance import CrossOptions
from bench.cross_instance import format_lines as cross_lines
from bench.priorities import PriorityOptions
from bench.report import format_table, write_json
from bench.spark_audit import SparkOptions
from bench.suite import Options, run
from bench.transmission import SchedulerOptions

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "var" / "bench" / "results.json"


def _options(argv: list[str] | None) -> tuple[Options, Path]:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--messages", type=int, help="KSB messages in total (default 20000)")
    parser.add_argument("--dialogs", type=int, help="KSB dialogs (default 1000)")
    parser.add_argument("--raw-messages", type=int, help="raw Kafka messages (default: --messages)")
    parser.add_argument("--body-bytes", type=int, default=1024, help="message size (default 1024)")
    parser.add_argument("--partitions", type=int, default=4, help="target queue partitions")
    parser.add_argument("--receivers", type=int, default=2, help="receiver threads (default 2)")
    parser.add_argument("--window", type=int, default=64, help="commits in flight per receiver")
    parser.add_argument("--top", type=int, default=0, help="RECEIVE TOP (n); 0 = the whole group")
    parser.add_argument(
        "--probes", type=int, help="one-at-a-time latency round trips (default 100)"
    )
    parser.add_argument("--timeout", type=float, help="seconds each phase may take (default 180)")
    parser.add_argument(
        "--no-activation", action="store_true", help="skip the activation section (run by default)"
    )
    parser.add_argument(
        "--activation-dialogs",
        type=int,
        help="conversation groups in the activation burst (default 200)",
    )
    parser.add_argument(
        "--no-priority", action="store_true", help="skip the priorities section (run by default)"
    )
    parser.add_argument(
        "--no-spark", action="store_true", help="skip the Spark audit section (run by default)"
    )
    parser.add_argument(
        "--no-cross-instance",
        action="store_true",
        help="skip the cross-instance section (run by default)",
    )
    parser.add_argument("--quick", action="store_true", help="small counts, for a CI smoke run")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where to write the JSON")
    a = parser.parse_args(argv)
    messages = a.messages or (400 if a.quick else 20_000)
    dialogs = a.dialogs or (50 if a.quick else 1_000)
    if messages < dialogs:
        parser.error("--messages must be at least --dialogs")
    opts = Options(
        messages=messages,
        dialogs=dialogs,
        raw_messages=a.raw_messages or messages,
        body_bytes=a.body_bytes,
        partitions=a.partitions,
        receivers=a.receivers,
        window=a.window,
        top=a.top or None,
        probes=a.probes if a.probes is not None else (10 if a.quick else 100),
        timeout_s=a.timeout or (60.0 if a.quick else 180.0),
        log_dir=a.out.parent,
        activation=None
        if a.no_activation
        else ActivationOptions(rounds=1 if a.quick else 3, dialogs=a.activation_dialogs or 200),
        priorities=None if a.no_priority else _priority_options(a.quick),
        spark=None if a.no_spark else _spark_options(a.quick),
        cross_instance=None if a.no_cross_instance else _cross_options(a),
    )
    return opts, a.out


def _priority_options(quick: bool) -> tuple[PriorityOptions, SchedulerOptions]:
    if not quick:
        return PriorityOptions(), SchedulerOptions()
    return (
        PriorityOptions(
            idle_probes=20,
            backlog=500,
            backlog_groups=50,
            saturated_probes=30,
            throughput_messages=500,
            throughput_groups=50,
            throughput_rounds=1,
            timeout_s=60.0,
        ),
        SchedulerOptions(
            slots=10_000, backlog=1_000, conversations=100, throughput_messages=10_000
        ),
    )


def _spark_options(quick: bool) -> SparkOptions:
    if not quick:
        return SparkOptions()
    return SparkOptions(lag_probes=8, warmup_probes=2, events=10_000, warmup_events=500)


def _cross_options(a: argparse.Namespace) -> CrossOptions:
    """Its own counts (a few thousand messages: it starts four services), the suite's shape."""
    shape = {
        "body_bytes": a.body_bytes,
        "partitions": a.partitions,
        "receivers": a.receivers,
        "window": a.window,
    }
    if not a.quick:
        return CrossOptions(**shape)
    return CrossOptions(
        messages=200, dialogs=20, probes=10, backlog=100, backlog_dialogs=10, timeout_s=60, **shape
    )


def _terminate(signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through the `finally` blocks that stop processes


def main(argv: list[str] | None = None) -> int:
    opts, out = _options(argv)
    signal.signal(signal.SIGTERM, _terminate)
    results = run(opts)
    write_json(results, out)
    print(format_table(results))
    cross = results["cross_instance"]
    if cross is not None:
        if "error" in cross:
            print(f"cross-instance: FAILED: {cross['error']}")
        else:
            print("\n".join(cross_lines(cross)))
    print(f"results written to {out}")
    activation = results["activation"]
    verified = results["ksb"]["verified_exactly_once_in_order"]
    if activation is not None and not activation["verified_exactly_once"]:
        verified = False
    for section in ("priorities", "spark_audit", "cross_instance"):
        if results[section] is not None and "error" in results[section]:
            verified = False
    if cross is not None and not cross.get("verified", False):
        verified = False
    return 0 if verified else 1


if __name__ == "__main__":
    sys.exit(main())
