"""`python -m devtools.demo` (`make run`): the whole system on this machine, end to end.

Starts a fresh local stack under ``var/demo/``, every service of two broker instances as child
processes (`devtools.demo.processes`), the first instance's requests sharded between two
dispatchers, applies their catalogs, and runs the two scenarios: order processing on one instance
(`devtools.demo.orders`) and dialogs between the instances (`devtools.demo.cross_instance`). The
exit code says whether it all worked: every message, reply and `CLOSED` endpoint there, every
shard owned, every service still running.

The console shows progress and the summary only: each service logs to its own file under
``<workdir>/logs/``, and so does the demo itself (``demo.log``: its own Kafka clients' lines,
`ksb.runtime.kafka_logs`), which it names when something failed.

Ctrl-C (or SIGTERM) at any moment stops the services, then the stack: nothing is left running.
"""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path

from devtools.demo.common import INSTANCE, INSTANCE_B, say
from devtools.demo.cross_instance import STOCK_CLIENT, WAREHOUSE, run_cross_instance
from devtools.demo.options import DemoOptions, parse_args
from devtools.demo.orders import run_dialogs
from devtools.demo.processes import (
    SERVICE_NAMES_B,
    SPARK_JOB,
    SUFFIX_B,
    apply_catalogs,
    available_services,
    check_catalogs,
    defer_interrupts,
    dispatcher_pool,
    dispatchers_applied,
    dispatchers_summary,
    guard_workdir,
    interrupt,
    print_env,
    queue_replicas,
    report_sla,
    running_services,
    service_processes,
    wait_until_interrupted,
)
from devtools.deployment import Deployment, secure_instance, stack_fields
from devtools.dispatchers import DispatcherPool
from devtools.localstack import LocalStackError, start_stack
from ksb.catalog.model import Catalog, load_catalog_file
from ksb.errors import KsbError

__all__ = ["main"]

EXIT_OK, EXIT_FAILED, EXIT_START_FAILED, EXIT_INTERRUPTED = 0, 1, 2, 130
QUEUE_REPLICAS = 2
"""The first instance's queue service replicas: a client moves on to the other when one fails."""


def demo(opts: DemoOptions) -> int:
    catalog, catalog_b = load_catalog_file(opts.catalog), load_catalog_file(opts.catalog_b)
    check_catalogs(catalog, catalog_b)
    guard_workdir(opts.workdir)
    logs = opts.workdir / "logs"
    _log_to(logs / "demo.log")
    say(f"starting the local stack (Kafka + Redis) under {opts.workdir}")
    t0 = time.perf_counter()
    stack = start_stack(opts.workdir / "stack", timeout_s=120, stop_at_exit=True)
    try:
        say(
            f"  kafka {stack.kafka_bootstrap} (pid {stack.kafka_pid}), redis {stack.redis_url} "
            f"(pid {stack.redis_pid}), up in {time.perf_counter() - t0:.1f}s"
        )
        base = {
            "kafka_bootstrap": stack.kafka_bootstrap,
            "redis_url": stack.redis_url,
            **stack_fields(stack.security),
        }
        # Each instance's principals and ACLs first (`ksb acl apply`, as the stack's admin); the
        # demo's clients are the instances' owners, every service runs as its own principal.
        settings = secure_instance(
            Deployment.model_validate(
                {
                    **base,
                    "instance": INSTANCE,
                    "request_partitions": opts.dispatchers,
                    "spark_checkpoint_dir": str(opts.workdir / "spark" / "checkpoints"),
                    "spark_output_dir": str(opts.workdir / "spark"),
                }
            ),
            catalog,
        )
        settings_b = secure_instance(
            Deployment.model_validate({**base, "instance": INSTANCE_B}), catalog_b
        )
        if stack.security.enabled:
            say(
                f"  security: {stack.security.protocol}, principals and ACLs of both instances made"
            )
        # The queue service first: every other process of an instance is its client. The first
        # instance runs two replicas (its clients move on when one fails), the second one.
        settings, queues_a = queue_replicas(settings, QUEUE_REPLICAS, logs)
        settings_b, queues_b = queue_replicas(settings_b, 1, logs, SUFFIX_B)
        # The first instance's dispatchers share its shards; every other service runs once.
        pool = dispatcher_pool(settings, opts.dispatchers, logs)
        others = [n for n in available_services() if n not in ("dispatcher", "queue")]
        procs = [*queues_a, *queues_b, *pool.members.values()]
        procs += service_processes(settings, others + ([SPARK_JOB] if opts.spark else []), logs)
        procs += service_processes(settings_b, available_services(SERVICE_NAMES_B), logs, SUFFIX_B)
        say(f"starting services: {', '.join(p.name for p in procs)}")
        with running_services(procs) as services:
            pids = [f"kafka={stack.kafka_pid}", f"redis={stack.redis_pid}"]
            pids += [f"{s.name}={s.proc.pid}" for s in services if s.proc is not None]
            say("pids: " + " ".join(pids))
            readers_b = [s for s in services if s.name == f"dispatcher{SUFFIX_B}"]
            apply_catalogs(
                [
                    (settings, catalog, opts.catalog, [*pool.members.values(), *queues_a]),
                    (settings_b, catalog_b, opts.catalog_b, [*readers_b, *queues_b]),
                ]
            )
            # A dispatcher joins its consumer group once its broker has started on the catalog.
            pool.wait_settled(timeout_s=90)
            say(f"  {dispatchers_summary(pool)}")
            outcome = run_dialogs(opts, settings, catalog, services)
            print(outcome.summary, flush=True)
            queues = (_queue_of(catalog, STOCK_CLIENT), _queue_of(catalog_b, WAREHOUSE))
            cross = run_cross_instance(opts, settings, settings_b, queues, services)
            print(cross.summary, flush=True)
            if opts.spark:
                report_sla(opts.workdir / "spark" / INSTANCE)
            print(dispatchers_summary(pool), flush=True)
            dead = [s.name for s in services if not s.alive()]
            if dead:
                say(f"service(s) exited during the demo: {', '.join(dead)}")
            ok = outcome.ok and cross.ok and _settles(pool) and not dead
            say("demo OK" if ok else f"demo FAILED; the logs are in {logs}")
            if opts.keep_running:
                print_env(settings, settings_b)
                if not wait_until_interrupted(services):
                    return EXIT_FAILED
        say(dispatchers_applied(pool))
        return EXIT_OK if ok else EXIT_FAILED
    finally:
        defer_interrupts()
        say("stopping the stack")
        stack.stop()
        (opts.workdir / "demo.pid").unlink(missing_ok=True)


def _log_to(path: Path) -> None:
    """The demo process's own log records go to `path`, as each service's go to its own file,
    so that the console keeps to progress and the summary."""
    path.parent.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(
        filename=path,
        level=logging.INFO,
        format="%(asctime)s demo %(name)s %(levelname)s %(message)s",
        force=True,
    )


def _settles(pool: DispatcherPool, timeout_s: float = 30) -> bool:
    """Whether every shard has one owner, or gets one within `timeout_s`: a look at one instant
    would fail a demo whose dispatchers happen to be in the middle of a rebalance."""
    try:
        pool.wait_settled(timeout_s)
    except TimeoutError as exc:
        say(str(exc))
        return False
    return True


def _queue_of(catalog: Catalog, service: str) -> str:
    return next(s.queue for s in catalog.services if s.name == service)


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)
    try:
        return demo(opts)
    except KeyboardInterrupt:
        say("interrupted; everything stopped")
        return EXIT_INTERRUPTED
    except (LocalStackError, KsbError, TimeoutError, RuntimeError) as exc:
        say(f"demo could not run: {exc}")
        return EXIT_START_FAILED


if __name__ == "__main__":
    raise SystemExit(main())
