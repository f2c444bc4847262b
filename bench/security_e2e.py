"""KSB end to end with security on and off in one run (issue 38): what SCRAM, ACLs and Redis
users cost a whole message, not only a producer.

The load is the scaling section's 2-dispatcher column (bench/scaling.py: BEGIN + SEND over the
dialogs, RECEIVE + commit by the receiver threads through two queue service replicas, then one
message at a time), on two stacks running side by side: one secured as `make up` starts it
(``sasl``: SCRAM logins, deny-by-default ACLs, a Redis user per principal) and one without
security (``plaintext``). Each stack's broker is warmed with the scaling section's warm-up first,
then the runs alternate between the stacks (plaintext, secured, plaintext, ...), each on an
instance of its own after the broker's JIT compilers have gone idle, so the machine's other work
slows both alike; each mode's figure is its median run by throughput, as in the scaling table.
The ratio is secured over plaintext (throughput: at least 0.9 is issue 38's target; latency and
CPU per message: lower is better). The CPU counted is each run's own stack's (broker, Redis), its
dispatchers', queue service replicas' and this process's; the idle stack beside it is not.

Also `python -m bench.security_e2e` alone (small counts with ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import uuid
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.scaling import ScalingOptions, median_ksb_run, run_count, warm_up
from bench.stats import fmt_ms, jit_settle, ratio, run_ratios
from devtools.deployment import Deployment, secure_instance, stack_fields
from devtools.localstack import LocalStack, start_stack
from devtools.processes import REPO_ROOT
from devtools.stack_security import SecurityMode

__all__ = [
    "SecurityE2eOptions",
    "format_lines",
    "main",
    "run_security_e2e",
    "secured_ratio",
    "summarize",
]

log = logging.getLogger("bench.security_e2e")

OUT = REPO_ROOT / "var" / "bench" / "security_e2e.json"
SECURED: SecurityMode = "sasl"
"""The secured mode set against plaintext: the one `make up` and `make bench` run."""


@dataclass(frozen=True)
class SecurityE2eOptions:
    load: ScalingOptions = field(default_factory=ScalingOptions)
    """The scaling section's load, warm-up, JIT settling and queue replicas."""
    dispatchers: int = 2
    runs: int = 3
    """Runs per mode, alternating; each mode's column is its median run by throughput."""
    modes: tuple[SecurityMode, ...] = ("plaintext", SECURED)
    """The first is the baseline every other mode is set against."""


def _base(stack: LocalStack) -> Deployment:
    return secure_instance(
        Deployment.model_validate(
            {
                "instance": f"sec{uuid.uuid4().hex[:8]}",
                "kafka_bootstrap": stack.kafka_bootstrap,
                "redis_url": stack.redis_url,
                **stack_fields(stack.security),
            }
        )
    )


def run_security_e2e(opts: SecurityE2eOptions, workdir: Path) -> dict[str, Any]:
    """Every figure of the section; starts its stacks under `workdir` and stops them."""
    stacks: dict[SecurityMode, LocalStack] = {}
    tries: dict[SecurityMode, list[dict[str, Any]]] = {m: [] for m in opts.modes}
    warmup_s: dict[SecurityMode, float | None] = {}
    try:
        for mode in opts.modes:
            stacks[mode] = start_stack(workdir / "stacks" / mode, security=mode, timeout_s=240)
        bases = {m: _base(s) for m, s in stacks.items()}
        pids = {m: {"kafka": s.kafka_pid, "redis": s.redis_pid} for m, s in stacks.items()}
        for mode in opts.modes:
            warmup_s[mode] = warm_up(bases[mode], opts.load, workdir / mode)
        for attempt in range(opts.runs):
            for mode in opts.modes:
                if opts.load.settle_jit:
                    jit_settle(stacks[mode].kafka_pid)
                log.info("security e2e: %s, run %d", mode, attempt + 1)
                tries[mode].append(
                    run_count(
                        bases[mode],
                        opts.dispatchers,
                        opts.load,
                        workdir / mode,
                        pids[mode],
                        attempt=attempt,
                    )
                )
    finally:
        for s in stacks.values():
            s.stop()
    return summarize(opts, tries, warmup_s)


def summarize(
    opts: SecurityE2eOptions,
    tries: dict[SecurityMode, list[dict[str, Any]]],
    warmup_s: dict[SecurityMode, float | None],
) -> dict[str, Any]:
    """Each mode's median run, and every other mode's figures over the first's."""
    runs = {m: median_ksb_run(ts) for m, ts in tries.items()}
    base = runs[opts.modes[0]]
    result: dict[str, Any] = {
        "config": asdict(opts),
        "warmup_s": warmup_s,
        "runs": runs,
        "ratio_over_plaintext": {
            m: {
                **run_ratios(r, base),
                "cpu_all": ratio(r["cpu_ms_per_message"]["all"], base["cpu_ms_per_message"]["all"]),
            }
            for m, r in runs.items()
            if m != opts.modes[0]
        },
        "verified_exactly_once_in_order": all(
            r["verified_exactly_once_in_order"] for r in runs.values()
        ),
    }
    return result


def secured_ratio(result: dict[str, Any]) -> float | None:
    """The secured mode's throughput over plaintext's (issue 38's target), if measured."""
    x = result.get("ratio_over_plaintext", {}).get(SECURED, {})
    return x.get("throughput") if isinstance(x, dict) else None


def format_lines(result: dict[str, Any]) -> list[str]:
    cfg, runs = result["config"], result["runs"]
    load = cfg["load"]
    modes = list(runs)
    lines = [
        f"KSB end to end, security on and off: {cfg['dispatchers']} dispatchers, "
        f"{load['messages']:,} x {load['body_bytes']} B over {load['dialogs']:,} dialogs, "
        f"{load['receivers']} receivers, {load['queue_replicas']} queue service replicas, on a "
        f"{' and a '.join(modes)} stack side by side, runs alternating, each the median of "
        f"{cfg['runs']} by throughput",
    ]
    for mode in modes:
        r = runs[mode]
        x = result["ratio_over_plaintext"].get(mode)
        cpu = r["cpu_ms_per_message"]

        def vs(key: str, x: dict[str, Any] | None = x) -> str:
            v = None if x is None else x.get(key)
            return "" if v is None else f" ({v:.2f}x)"

        rates = " / ".join(f"{t:,.0f}" for t in r["throughput_runs"])
        lines.append(
            f"  {mode:<10} {r['throughput']['per_s']:>7,.0f} msg/s{vs('throughput')} (runs {rates});"
            f" loaded p50 {fmt_ms(r['latency_loaded']['p50_ms'])}{vs('latency_loaded_p50')};"
            f" one at a time p50 {fmt_ms(r['latency_unloaded']['p50_ms'])}"
            f"{vs('latency_unloaded_p50')}; CPU all processes {fmt_ms(cpu['all'], 3)} a "
            f"message{vs('cpu_all')} (broker {fmt_ms(cpu.get('kafka'), 3)}, dispatchers "
            f"{fmt_ms(cpu['dispatchers'], 3)}, queue service {fmt_ms(cpu['queue_service'], 3)}, "
            f"clients {fmt_ms(cpu.get('client'), 3)});"
            f" exactly once, in order: {'yes' if r['verified_exactly_once_in_order'] else 'NO'}"
        )
        for problem in r["problems"]:
            lines.append(f"    problem ({mode}): {problem}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.security_e2e", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small counts, one run per mode")
    parser.add_argument("--messages", type=int, help="messages per run (default 20000)")
    parser.add_argument("--runs", type=int, help="runs per mode (default 3)")
    a = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    d = ScalingOptions()
    load = d
    if a.quick:
        load = replace(d, messages=400, dialogs=50, probes=10, warmup_messages=0, settle_jit=False)
    if a.messages:
        load = replace(load, messages=a.messages)
    opts = SecurityE2eOptions(load=load, runs=a.runs or (1 if a.quick else 3))
    with tempfile.TemporaryDirectory(prefix="ksb-bench-security-e2e-") as tmp:
        result = run_security_e2e(opts, Path(tmp))
    print("\n".join(format_lines(result)))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"results in {OUT}")
    return 0 if result["verified_exactly_once_in_order"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
