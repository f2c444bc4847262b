"""The demo's processes: the services of both instances, the first instance's dispatchers (one
per shard, `devtools.dispatchers.DispatcherPool`), the Spark job, the catalogs, signals."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

from devtools.demo.common import INSTANCE_B, say
from devtools.demo.cross_instance import (
    RESERVE_STOCK,
    STOCK_CLIENT,
    STOCK_CONTRACT,
    STOCK_RESERVED,
    WAREHOUSE,
)
from devtools.demo.orders import CLIENT_SERVICE, CONTRACT, LINE_ACCEPTED, ORDER_LINE, ORDER_SERVICE
from devtools.deployment import Deployment
from devtools.dispatchers import DispatcherPool
from devtools.localstack import LocalStackError
from devtools.processes import free_port
from devtools.runner import ServiceProcess, stop_all
from ksb.catalog.model import Catalog
from ksb.errors import KsbError
from ksb.runtime.catalog_store import apply_catalog
from ksb.security.principals import Role

__all__ = [
    "REPO_ROOT",
    "SERVICE_NAMES",
    "SERVICE_NAMES_B",
    "SPARK_JOB",
    "SUFFIX_B",
    "apply_catalogs",
    "available_services",
    "check_catalogs",
    "cli_hint",
    "defer_interrupts",
    "dispatcher_pool",
    "dispatchers_applied",
    "dispatchers_summary",
    "guard_workdir",
    "interrupt",
    "operator_login",
    "print_env",
    "queue_replicas",
    "report_sla",
    "running_services",
    "service_processes",
    "wait_until_interrupted",
]

REPO_ROOT = Path(__file__).resolve().parents[2]
# Services in start order; a name counts only once `services/<name>/__main__.py` exists.
SERVICE_NAMES = ("dispatcher", "transmitter", "transport", "forwarder", "activation")
SERVICE_NAMES_B = ("dispatcher", "transmitter", "transport")
SUFFIX_B = "-b"
"""The second instance's process names get this suffix."""
SPARK_JOB = "spark-audit"
SPARK_MODULE = "ksb.spark"


def available_services(names: tuple[str, ...] = SERVICE_NAMES) -> list[str]:
    return [n for n in names if (REPO_ROOT / "services" / n / "__main__.py").is_file()]


def service_processes(
    settings: Deployment, names: list[str], logs: Path, suffix: str = ""
) -> list[ServiceProcess]:
    """One (not yet started) process per name; `suffix` tells a second instance's apart in the
    process names and logs, while each still runs its own `services.<name>` module."""
    procs = []
    for name in names:
        module = SPARK_MODULE if name == SPARK_JOB else f"services.{name}"
        procs.append(
            ServiceProcess(f"{name}{suffix}", settings, logs / f"{name}{suffix}.log", module=module)
        )
    return procs


def queue_replicas(
    settings: Deployment, count: int, logs: Path, suffix: str = ""
) -> tuple[Deployment, list[ServiceProcess]]:
    """The instance's queue service, `count` replicas (not yet started), each on a port and a
    store of its own; and the instance's settings with every replica as its clients'
    ``KSB_QUEUE_ADDRESSES``, which every other process of the instance is started with."""
    ports = [free_port() for _ in range(count)]
    addresses = ",".join(f"127.0.0.1:{port}" for port in ports)
    with_queues = settings.model_copy(update={"queue_addresses": addresses})
    procs = []
    for n, port in enumerate(ports, start=1):
        name = f"queue{suffix}/q{n}"
        replica = with_queues.model_copy(
            update={
                "queue_port": port,
                "queue_store_dir": str(logs.parent / f"queue-store{suffix}-q{n}"),
            }
        )
        log = logs / f"queue{suffix}-q{n}.log"
        procs.append(ServiceProcess(name, replica, log, module="services.queue"))
    return with_queues, procs


def dispatcher_pool(settings: Deployment, count: int, logs: Path) -> DispatcherPool:
    """The instance's `count` dispatchers (not yet started: `running_services` starts them with
    the rest), members ``d1``, ``d2``, ... of its consumer group, each to own its share of the
    instance's `request_partitions` shards. Each process is named ``dispatcher/<member>``."""
    members = {
        f"d{n}": ServiceProcess(
            f"dispatcher/d{n}",
            settings,
            logs / f"dispatcher-d{n}.log",
            extra_env={"KSB_MEMBER": f"d{n}"},
            module="services.dispatcher",
        )
        for n in range(1, count + 1)
    }
    return DispatcherPool(settings, logs, members=members)


def dispatchers_summary(pool: DispatcherPool) -> str:
    """Which shards each dispatcher owns now, as their logs say (the summary's line)."""
    owned = pool.owned()
    parts = [f"{name} owns {_shards(owned[name])}" for name in sorted(owned)]
    parts += [f"{name} not running" for name in sorted(set(pool.members) - set(owned))]
    shards = f"{pool.shards} shard" + ("" if pool.shards == 1 else "s")
    return f"dispatchers: {pool.settings.instance}'s {shards}, " + ", ".join(parts)


def dispatchers_applied(pool: DispatcherPool) -> str:
    """What each dispatcher applied (requests and relayed records), from the count it logs when
    it stops."""
    applied = pool.applied()
    parts = [
        f"{name} {applied[name].records} in {applied[name].transactions} transactions"
        if name in applied
        else f"{name} ?"
        for name in sorted(pool.members)
    ]
    return "records applied per dispatcher: " + ", ".join(parts)


def _shards(owned: set[int]) -> str:
    if not owned:
        return "no shard"
    return ("shard " if len(owned) == 1 else "shards ") + ", ".join(map(str, sorted(owned)))


@contextlib.contextmanager
def running_services(procs: list[ServiceProcess]) -> Iterator[list[ServiceProcess]]:
    """Start the services, wait for each to log "ready", and stop them all on the way out."""
    try:
        for proc in procs:
            proc.start()
        for proc in procs:
            marker = "audit job running" if proc.module == SPARK_MODULE else "ready"
            proc.wait_ready(marker, timeout_s=180)
            assert proc.proc is not None
            say(f"  {proc.name} ready (pid {proc.proc.pid}, log {proc.log_path})")
        yield procs
    finally:
        defer_interrupts()
        if procs:
            say("stopping services: " + ", ".join(p.name for p in procs))
        for proc in stop_all(procs, grace_s=10):
            assert proc.proc is not None
            say(
                f"  {proc.name} (pid {proc.proc.pid}) is still running after SIGKILL; see {proc.log_path}"
            )


def guard_workdir(workdir: Path) -> None:
    """Refuse to wipe the state of a demo that still runs (e.g. one left with --keep-running)."""
    pid_file = workdir / "demo.pid"
    try:
        pid = int(pid_file.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        cmdline = b""
    else:
        if pid != os.getpid() and b"devtools.demo" in cmdline:
            raise LocalStackError(
                f"a demo (pid {pid}) is still running in {workdir}; stop it with Ctrl-C or "
                f"`kill -INT {pid}`, or pass another --workdir"
            )
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    pid_file.write_text(f"{os.getpid()}\n")


def _wait_for_catalog(dispatcher: ServiceProcess, version: int) -> None:
    """The dispatcher was running before the catalog existed: wait until it has hot-loaded it."""
    deadline = time.monotonic() + 30
    markers = (f"catalog v{version} applied", f", catalog v{version}, ")
    while time.monotonic() < deadline:
        text = dispatcher.log_path.read_text(errors="replace")
        if any(mark in text for mark in markers):
            return
        if not dispatcher.alive():
            raise KsbError(f"{dispatcher.name} exited:\n{dispatcher.tail()}")
        time.sleep(0.05)
    raise KsbError(
        f"{dispatcher.name} did not load catalog v{version} in 30s:\n{dispatcher.tail()}"
    )


def apply_catalogs(
    catalogs: list[tuple[Deployment, Catalog, Path, list[ServiceProcess]]],
) -> None:
    """Apply each instance's catalog, then wait for its dispatchers (last in each tuple) to have
    loaded it: all are applied first, so the dispatchers load them in the same wait."""
    versions = [apply_catalog(settings, catalog).version for settings, catalog, _, _ in catalogs]
    for (settings, catalog, path, readers), version in zip(catalogs, versions, strict=True):
        for reader in readers:
            _wait_for_catalog(reader, version)
        say(
            f"catalog v{version} applied to {settings.instance} from {path.name}: "
            f"{len(catalog.message_types)} message types, "
            f"{len(catalog.contracts)} contract(s), "
            f"{len(catalog.queues)} queues, {len(catalog.services)} services, "
            f"{len(catalog.priorities)} priorities, {len(catalog.routes)} route(s)"
        )


def check_catalogs(catalog: Catalog, catalog_b: Catalog) -> None:
    """Fail before anything starts if a catalog lacks a name the demo's applications use."""
    _require(
        catalog,
        "the demo catalog",
        services=(CLIENT_SERVICE, ORDER_SERVICE, STOCK_CLIENT),
        routes=(WAREHOUSE,),
    )
    _require(catalog_b, f"the {INSTANCE_B} catalog", services=(WAREHOUSE,), routes=(STOCK_CLIENT,))


def _require(
    catalog: Catalog, what: str, services: tuple[str, ...], routes: tuple[str, ...]
) -> None:
    """Fail before anything starts if a catalog lacks a name the demo's applications use."""
    types = {m.name for m in catalog.message_types}
    contracts = {c.name for c in catalog.contracts}
    missing = [n for n in services if n not in {s.name for s in catalog.services}]
    missing += [
        f"a route for {n}" for n in routes if n not in {r.service_name for r in catalog.routes}
    ]
    missing += [n for n in (RESERVE_STOCK, STOCK_RESERVED) if n not in types]
    missing += [STOCK_CONTRACT] if STOCK_CONTRACT not in contracts else []
    if CLIENT_SERVICE in services:
        missing += [n for n in (ORDER_LINE, LINE_ACCEPTED) if n not in types]
        missing += [CONTRACT] if CONTRACT not in contracts else []
    if missing:
        raise KsbError(f"{what} lacks {', '.join(missing)}")


def interrupt(_signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _stopping(_signum: int, _frame: FrameType | None) -> None:
    say("still stopping; everything started will be stopped")


def defer_interrupts() -> None:
    """Cleanup has begun: a second Ctrl-C must not cut it short and leave processes behind."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _stopping)
        signal.signal(signal.SIGTERM, _stopping)


def report_sla(out_dir: Path, wait_s: float = 40.0) -> None:
    """The Spark job closes an SLA window once the watermark passes it: wait a little for the
    first Parquet files, then say where `make report` will find them."""
    deadline = time.monotonic() + wait_s
    files: list[Path] = []
    while time.monotonic() < deadline and not files:
        files = list(out_dir.rglob("*.parquet")) if out_dir.exists() else []
        time.sleep(1.0)
    say(f"spark audit job: {len(files)} Parquet file(s) of SLA/audit output under {out_dir}")


# The CLI's login, in the order a reader pastes it; the CA only where there is one.
_LOGIN_FIELDS = (
    "kafka_security_protocol",
    "kafka_username",
    "kafka_password_file",
    "redis_username",
    "redis_password_file",
    "kafka_ssl_ca",
)


def operator_login(settings: Deployment) -> dict[str, str]:
    """The ``KSB_*`` variables of `settings`' instance's operator, the login the CLI uses (none on
    a stack without security). Each instance has its own operator: another instance's may not
    read this one's Redis keys, so a hint that changes only ``KSB_INSTANCE`` is refused."""
    operator = settings.as_service(Role.OPERATOR)
    if not operator.secured:
        return {}
    values = {f"KSB_{name.upper()}": str(getattr(operator, name)) for name in _LOGIN_FIELDS}
    return {name: value for name, value in values.items() if value}


def cli_hint(settings: Deployment, settings_b: Deployment) -> list[str]:
    """What `print_env` prints: exports for the first instance, a command for the second."""
    first = {
        "KSB_INSTANCE": settings.instance,
        "KSB_KAFKA_BOOTSTRAP": settings.kafka_bootstrap,
        "KSB_REDIS_URL": settings.redis_url,
        **operator_login(settings),
    }
    second = {"KSB_INSTANCE": settings_b.instance, **operator_login(settings_b)}
    return [
        "To use the ksb CLI against this instance, export:",
        *(f"  export {name}={value}" for name, value in first.items()),
        "then e.g. `ksb endpoints --leaked` or `ksb errors`.",
        f"The second instance, {settings_b.instance}, has its own operator; e.g.:",
        *(f"  {name}={value} \\" for name, value in second.items()),
        "  ksb transmission",
    ]


def print_env(settings: Deployment, settings_b: Deployment) -> None:
    say("")
    say("The stack and services keep running; press Ctrl-C to stop them all.")
    for line in cli_hint(settings, settings_b):
        say(line)
    sys.stdout.flush()


def wait_until_interrupted(services: list[ServiceProcess]) -> bool:
    """Block until Ctrl-C / SIGTERM (True) or until a service dies (False)."""
    try:
        while True:
            time.sleep(0.5)
            dead = [s.name for s in services if not s.alive()]
            if dead:
                say(f"service(s) exited: {', '.join(dead)}; stopping")
                return False
    except KeyboardInterrupt:
        say("interrupted")
        return True
