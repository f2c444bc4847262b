"""`python -m bench.security`: what security costs (issue 13), secured against plaintext.

Three figures, each mode measured in the same run and interleaved, so a busy machine slows all
modes alike:

* the local stack's start (format + broker + Redis, up to a committed transaction), per mode;
* one instance's principals, topics, ACLs and Redis users (`devtools.deployment.secure_instance`,
  one ``ksb acl apply``), and an apply that changes nothing;
* a producer's throughput, 1 KiB records with lz4, ``acks=all``, idempotent, as an application
  principal (not a super user: ACL checks are on the path) against PLAINTEXT, SASL_PLAINTEXT and
  SASL_SSL stacks running side by side;
* the same producer's latency one record at a time (produce to acknowledged, ``acks=all``), the
  cost a request pays for authentication, encryption and ACL checks when nothing queues.

Writes ``var/bench/security.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from confluent_kafka import Producer

from bench.stats import now_ns, summarize
from devtools.deployment import Deployment, secure_instance, stack_fields
from devtools.localstack import LocalStack, start_stack
from devtools.processes import REPO_ROOT
from devtools.stack_security import MODES, SecurityMode
from ksb.catalog.model import Catalog
from ksb.names import Names
from ksb.runtime import kafka

__all__ = ["SecurityOptions", "format_lines", "main", "run_security"]

OUT = REPO_ROOT / "var" / "bench" / "security.json"


def _deployment(stack: LocalStack, instance: str) -> Deployment:
    return Deployment.model_validate(
        {
            "instance": instance,
            "kafka_bootstrap": stack.kafka_bootstrap,
            "redis_url": stack.redis_url,
            **stack_fields(stack.security),
        }
    )


def _start(root: Path, mode: SecurityMode) -> tuple[LocalStack, float]:
    t = time.monotonic()
    stack = start_stack(root / f"{mode}-{uuid.uuid4().hex[:6]}", security=mode, timeout_s=240)
    return stack, time.monotonic() - t


def _applies(stack: LocalStack, n: int) -> dict[str, float]:
    first, again = [], []
    for _ in range(n):
        d = _deployment(stack, f"sec{uuid.uuid4().hex[:8]}")
        t = time.monotonic()
        secure_instance(d, Catalog())
        first.append(time.monotonic() - t)
        t = time.monotonic()
        secure_instance(d, Catalog())
        again.append(time.monotonic() - t)
    return {
        "apply_p50_s": round(statistics.median(first), 3),
        "apply_max_s": round(max(first), 3),
        "reapply_p50_s": round(statistics.median(again), 3),
    }


def _producer_target(stack: LocalStack) -> tuple[Deployment, str]:
    """A principal and the topic it may write: the owner of a fresh instance, its requests topic."""
    owner = secure_instance(_deployment(stack, f"tp{uuid.uuid4().hex[:8]}"), Catalog())
    names = Names(owner.instance)
    if not owner.secured:  # no plan on a plaintext stack: the topic is made as anyone may
        kafka.ensure_topics(kafka.admin(owner), kafka.core_topics(names, owner))
        return owner, names.requests
    return owner, names.requests_of(owner.acting_principal)


def _producer(who: Deployment, linger_ms: int) -> Producer:
    return Producer(
        {
            "bootstrap.servers": who.kafka_bootstrap,
            **kafka.client_security(who, who.kafka_bootstrap),
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": linger_ms,
            "compression.type": "lz4",
        }
    )


def _latencies_ns(who: Deployment, topic: str, records: int, body: bytes) -> list[int]:
    """Produce `records` one at a time, each flushed before the next: ns to acknowledged."""
    p = _producer(who, 0)
    for _ in range(20):  # connections and metadata are not what is measured
        p.produce(topic, value=body)
    p.flush(60)
    out: list[int] = []
    for _ in range(records):
        t = now_ns()
        p.produce(topic, value=body)
        left = p.flush(30)
        assert left == 0, "a record was not acknowledged in 30 s"
        out.append(now_ns() - t)
    return out


def _throughput(who: Deployment, topic: str, records: int, body: bytes) -> float:
    p = _producer(who, 5)
    for _ in range(1000):  # connections and metadata are not what is measured
        p.produce(topic, value=body)
    p.flush(60)
    t = time.monotonic()
    for i in range(records):
        while True:
            try:
                p.produce(topic, value=body, key=str(i % 64).encode())
                break
            except BufferError:
                p.poll(0.01)
    left = p.flush(120)
    assert left == 0, f"{left} records not acknowledged"
    return records / (time.monotonic() - t)


@dataclass(frozen=True)
class SecurityOptions:
    starts: int = 2
    """Stack starts per mode."""
    applies: int = 10
    """Instances secured."""
    records: int = 200_000
    """Records per throughput trial: long enough (a second or more) that the rate is not noise."""
    trials: int = 3
    """Throughput trials per mode."""
    one_at_a_time: int = 200
    """Records produced one at a time per mode and trial, for the latency."""


def run_security(opts: SecurityOptions) -> dict[str, Any]:
    """Every figure of the section; starts and stops its own stacks (one per mode at a time)."""
    body = b"x" * 1024
    result: dict[str, Any] = {"config": asdict(opts), "start_s": {m: [] for m in MODES}}
    with tempfile.TemporaryDirectory(prefix="ksb-bench-security-") as tmp:
        root = Path(tmp)
        for _ in range(opts.starts):  # interleaved: each round starts every mode once
            for mode in MODES:
                stack, took = _start(root, mode)
                result["start_s"][mode].append(round(took, 1))
                stack.stop()
        stacks: dict[SecurityMode, LocalStack] = {}
        try:
            for m in MODES:
                stacks[m] = _start(root, m)[0]
            result["apply"] = _applies(stacks["sasl"], opts.applies)
            targets = {m: _producer_target(s) for m, s in stacks.items()}
            rates: dict[str, list[float]] = {m: [] for m in MODES}
            waits: dict[str, list[int]] = {m: [] for m in MODES}
            for _ in range(opts.trials):
                for mode in MODES:
                    rates[mode].append(_throughput(*targets[mode], opts.records, body))
                    waits[mode] += _latencies_ns(*targets[mode], opts.one_at_a_time, body)
            result["produce_msg_s"] = {m: [round(r) for r in rs] for m, rs in rates.items()}
            result["one_at_a_time_ms"] = {m: summarize(ws).as_json() for m, ws in waits.items()}
        finally:
            for s in stacks.values():
                s.stop()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.security", description=__doc__)
    d = SecurityOptions()
    parser.add_argument("--starts", type=int, default=d.starts, help="stack starts per mode")
    parser.add_argument("--applies", type=int, default=d.applies, help="instances secured")
    parser.add_argument("--records", type=int, default=d.records)
    parser.add_argument("--trials", type=int, default=d.trials, help="throughput trials per mode")
    a = parser.parse_args(argv)
    result = run_security(
        SecurityOptions(starts=a.starts, applies=a.applies, records=a.records, trials=a.trials)
    )
    print("\n".join(format_lines(result)))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"results in {OUT}")
    return 0


def format_lines(result: dict[str, Any]) -> list[str]:
    starts, rates = result["start_s"], result["produce_msg_s"]
    cfg = result["config"]
    base = statistics.median(rates["plaintext"])
    waits = result.get("one_at_a_time_ms", {})
    lines = [
        f"security on/off: {cfg['starts']} stack start(s) per mode, {cfg['trials']} producer "
        f"trial(s) of {cfg['records']:,} x 1 KiB per mode as an application principal, "
        f"{cfg['applies']} instances secured; one at a time = produce to acknowledged (acks=all)",
        f"  {'mode':<10} {'stack start (s)':>16} {'produce msg/s (median)':>23} {'vs plaintext':>13}"
        f" {'one at a time p50 / p99':>24} {'vs plaintext':>13}",
    ]
    base_wait = waits.get("plaintext")
    for mode in MODES:
        rate = statistics.median(rates[mode])
        line = (
            f"  {mode:<10} {statistics.median(starts[mode]):>16.1f} {rate:>23,.0f} "
            f"{rate / base:>12.2f}x"
        )
        w = waits.get(mode)
        if w and base_wait:
            line += (
                f" {w['p50_ms']:>11.2f} / {w['p99_ms']:>6.2f} ms"
                f" {w['p50_ms'] / base_wait['p50_ms']:>7.2f}x"
                f" / {w['p99_ms'] / base_wait['p99_ms']:.2f}x"
            )
        lines.append(line)
    a = result["apply"]
    lines.append(
        f"  one instance's principals + topics + ACLs + Redis users: p50 {a['apply_p50_s']} s "
        f"(max {a['apply_max_s']} s); an apply that changes nothing: {a['reapply_p50_s']} s"
    )
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
