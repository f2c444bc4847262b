"""Cross-instance delivery beside local delivery, and backlog drain after a restored link (issue 5).

Three broker instances on the suite's one Kafka cluster, each with its own topics:

* **local** (``<i>xl``): both bench services, one dispatcher, the suite's own KSB path;
* **A** (``<i>xa``) hosts the initiator service and routes the target service to B (address LOCAL,
  i.e. the same cluster); **B** (``<i>xb``) hosts the target service and its queue.

A message from A to B goes: dispatcher A -> ``ksb.A.transmission`` -> transmitter A ->
``ksb.A.outbound`` -> transport A -> ``ksb.B.inbound`` -> dispatcher B (which acknowledges to ``ksb.A.acks`` in its transaction) ->
B's queue topic -> RECEIVE + commit on B. Both paths are measured by the same code as the suite's
KSB figures (`bench.e2e`: the sender BEGINs every dialog and SENDs round-robin, receiver threads
keep ``window`` commits in flight, a message counts when its commit is applied, per-dialog order and
exactly-once are checked, then one-at-a-time probes), with the same counts, the one after the other.
Every service is a child process (`services.dispatcher`, `services.transmitter`,
`services.transport`, with A's shorter `INTERVALS`), so the bench's own threads do not share a
GIL with them; B needs no transmitter (it sends nothing back but acks, which its dispatcher writes).

**Backlog drain.** A's route is pointed at an address where nothing listens (``127.0.0.1:1``), a
backlog of ``backlog`` messages over ``backlog_dialogs`` new dialogs is sent, and the bench waits
until transmitter A's view (Redis) lists every one of them as unacknowledged with the connection failure as
their last failure, and nothing has reached B. Then the original route is applied again (as
``tests/integration/test_two_instances.py`` cuts and restores its link) and the clock starts: time
to the first and to the last message received (commit applied) on B, exactly once and in order, and
whether A's transmission queue then empties (everything acknowledged). The restored link waits out
what is left of the failed-connect suppression, so that interval and the connect timeout are part of
the figure: both are short here (`INTERVALS`) and printed with it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from bench.e2e import (
    CONTRACT,
    INITIATOR,
    INITIATOR_QUEUE,
    MESSAGE_TYPE,
    TARGET,
    TARGET_QUEUE,
    KsbResult,
    Tally,
    _send_all,
    bench_catalog,
    check_run,
    run_ksb,
    start_receivers,
)
from bench.queues import DEFAULT_REPLICAS, running_queues
from bench.stats import fmt_ms, fmt_x, now_ns, run_ratios
from devtools.deployment import Deployment, secure_instance
from devtools.runner import ServiceProcess
from ksb.catalog.model import Catalog, parse_catalog
from ksb.names import Names
from ksb.runtime.catalog_store import apply_catalog
from ksb.runtime.redis_client import redis_client
from ksb.runtime.redis_view import read_transmission_view
from ksb.sdk.client import KsbClient
from ksb.security.principals import peer_principal
from ksb.settings import TransmitterSettings, TransportSettings

__all__ = [
    "INTERVALS",
    "CrossOptions",
    "format_lines",
    "run_cross_instance",
]

INTERVALS = {
    "tick_ms": 100,
    "suppress_after_disconnect_ms": 500,
    "suppress_after_failed_connect_ms": 1_000,
    "connect_timeout_ms": 1_000,
}
"""Transmitter and transport A's housekeeping intervals (the rest at their defaults). A failed
connect blocks the transport's loop for up to the connect timeout: keep it short."""
UNREACHABLE = "127.0.0.1:1"
"""Where the cut route points: a port nothing listens on."""
_VIEW_ROWS = 1_000
"""The transmission view lists at most this many messages (`TransmissionQueue.rows`)."""
LOG_NAMES = (
    "xi-local-dispatcher.log",
    "xi-a-dispatcher.log",
    "xi-b-dispatcher.log",
    "xi-a-transmitter.log",
    "xi-a-transport.log",
)


@dataclass(frozen=True)
class CrossOptions:
    messages: int = 2_000
    dialogs: int = 100
    body_bytes: int = 1024
    partitions: int = 4
    """B's (and the local instance's) target queue partitions."""
    receivers: int = 2
    window: int = 64
    probes: int = 50
    backlog: int = 1_000
    backlog_dialogs: int = 50
    timeout_s: float = 90.0
    """Seconds each wait may take."""
    queue_replicas: int = DEFAULT_REPLICAS
    """Queue service replicas of each receiving instance (the local one and B)."""

    def __post_init__(self) -> None:
        if self.messages < self.dialogs or self.backlog < self.backlog_dialogs:
            raise ValueError("messages must be at least dialogs, backlog at least backlog_dialogs")
        if self.backlog > _VIEW_ROWS:
            raise ValueError(f"backlog is at most {_VIEW_ROWS} (what the transmission view lists)")


def cross_catalogs(a: str, b: str, address: str, partitions: int) -> tuple[Catalog, Catalog]:
    """A hosts the initiator and routes the target to B at ``address``; B the reverse."""
    common: dict[str, Any] = {
        "message_types": [{"name": MESSAGE_TYPE, "validation": "NONE"}],
        "contracts": [
            {"name": CONTRACT, "messages": [{"type": MESSAGE_TYPE, "sent_by": "INITIATOR"}]}
        ],
    }
    ca = {
        **common,
        "queues": [{"name": INITIATOR_QUEUE, "partitions": 1}],
        "services": [{"name": INITIATOR, "queue": INITIATOR_QUEUE}],
        "routes": [
            {"name": "to-target", "service_name": TARGET, "broker_instance": b, "address": address}
        ],
    }
    cb = {
        **common,
        "queues": [{"name": TARGET_QUEUE, "partitions": partitions}],
        "services": [{"name": TARGET, "queue": TARGET_QUEUE, "contracts": [CONTRACT]}],
        "routes": [{"name": "to-init", "service_name": INITIATOR, "broker_instance": a}],
        "grants": [{"permission": "SEND", "target": TARGET, "principal": peer_principal(a)}],
    }
    return parse_catalog(ca), parse_catalog(cb)


# ----------------------------------------------------------------------------- delivery
def _deliver(
    sender_settings: Deployment, receiver_settings: Deployment, o: CrossOptions
) -> KsbResult:
    """`bench.e2e.run_ksb` with the sender on one instance and the receiver on another (or the
    same): the same code, so local and cross figures are comparable."""
    return run_ksb(
        sender_settings,
        dialogs=o.dialogs,
        messages=o.messages,
        body_bytes=o.body_bytes,
        receivers=o.receivers,
        window=o.window,
        top=None,
        probes=o.probes,
        timeout_s=o.timeout_s,
        receiver_settings=receiver_settings,
    )


# ----------------------------------------------------------------------------- backlog drain
class _DrainTally(Tally):
    """The tally, plus when the first message of the backlog was received."""

    first_ns: int = 0

    def outcome(self, fut: Any, batch: list[tuple[int, int, int]]) -> None:
        super().outcome(fut, batch)
        with self.lock:
            if not self.first_ns and self.delivered:
                self.first_ns = self.last_ns


def _view(r: redis.Redis, names: Names) -> dict[str, Any]:
    return read_transmission_view(r, names)


def _wait_view(
    r: redis.Redis,
    names: Names,
    check: Callable[[dict[str, Any]], bool],
    what: str,
    timeout_s: float,
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        view = _view(r, names)
        if check(view):
            return view
        if time.monotonic() > deadline:
            raise TimeoutError(f"transmitter view: {what} not seen in {timeout_s:.0f}s")
        time.sleep(0.05)


def _link(view: dict[str, Any], destination: str) -> dict[str, Any] | None:
    """The transport's connection row for ``destination`` (like sys.dm_broker_connections)."""
    return next((c for c in view["connections"] if c["destination"] == destination), None)


def _drain(sa: Deployment, sb: Deployment, o: CrossOptions) -> dict[str, Any]:
    cut, _ = cross_catalogs(sa.instance, sb.instance, UNREACHABLE, o.partitions)
    good, _ = cross_catalogs(sa.instance, sb.instance, "LOCAL", o.partitions)
    per_dialog = max(1, o.backlog // o.backlog_dialogs)
    expected = per_dialog * o.backlog_dialogs
    tally = _DrainTally(expected=expected)
    stop = threading.Event()
    errors: list[BaseException] = []
    names = Names(sa.instance)
    r = redis_client(sa)
    try:
        with KsbClient(sa) as sender, KsbClient(sb) as receiver:
            apply_catalog(sa, cut)
            # The transport closes a connection whose route changed: from then on nothing moves.
            _wait_view(
                r,
                names,
                lambda v: all(
                    c["state"] != "CONNECTED"
                    for c in v["connections"]
                    if c["destination"] == sb.instance
                ),
                "the connection to B closed after the cut",
                o.timeout_s,
            )
            threads = start_receivers(
                receiver, tally, stop, errors, receivers=o.receivers, window=o.window, top=None
            )
            marks: list[int] = []
            try:
                _send_all(sender, o.backlog_dialogs, per_dialog, o.body_bytes, marks, tally.handles)
                view = _wait_view(
                    r,
                    names,
                    lambda v: (
                        len(v["messages"]) >= expected
                        # SENT only means handed to the transport, which drops packets for a
                        # destination it cannot reach: the failure is what says they wait
                        and all(m["last_failure"] for m in v["messages"])
                    ),
                    f"all {expected} backlog messages waiting with a failure",
                    o.timeout_s,
                )
                failure = view["messages"][0]["last_failure"]
                outage_ns = now_ns()
                failed_attempts = (_link(view, sb.instance) or {}).get("failed_attempts")
                with tally.lock:
                    during_outage = tally.delivered
                restored_ns, restored_ms = now_ns(), time.time_ns() // 1_000_000
                apply_catalog(sa, good)
                if not tally.done.wait(o.timeout_s):
                    raise TimeoutError(
                        f"only {tally.delivered} of {expected} backlog messages received "
                        f"{o.timeout_s:.0f}s after the link was restored"
                    )
            finally:
                stop.set()
                for t in threads:
                    t.join(35)
            if errors:
                raise RuntimeError("a receiver thread failed") from errors[0]
            problems = check_run(tally, receiver, o.backlog_dialogs, per_dialog)
        if during_outage:
            problems.append(f"{during_outage} messages reached B while the link was cut")
        try:
            view = _wait_view(r, names, lambda v: not v["messages"], "an empty queue", o.timeout_s)
            acknowledged = True
        except TimeoutError:
            view, acknowledged = _view(r, names), False
            problems.append("A's transmission queue still holds messages after the drain")
        link = _link(view, sb.instance)
        reconnected_ms = (
            None
            if link is None or link["connected_ms"] is None
            else link["connected_ms"] - restored_ms
        )
    finally:
        r.close()
    first_ms = (tally.first_ns - restored_ns) / 1e6
    all_ms = (tally.last_ns - restored_ns) / 1e6
    flowing_s = (tally.last_ns - tally.first_ns) / 1e9
    return {
        "backlog": expected,
        "dialogs": o.backlog_dialogs,
        "cut_by": f"A's route address set to {UNREACHABLE}",
        "failure_seen": failure,
        "outage_ms": (outage_ns - marks[0]) / 1e6,
        "failed_connects_during_outage": failed_attempts,
        "reconnected_after_restore_ms": reconnected_ms,
        "received_during_outage": during_outage,
        "first_received_after_restore_ms": first_ms,
        "all_received_after_restore_ms": all_ms,
        "drain_per_s": expected / flowing_s if flowing_s > 0 else None,
        "commits": tally.commits,
        "refused_commits": tally.refused,
        "acknowledged": acknowledged,
        "verified_exactly_once_in_order": not problems,
        "problems": problems,
    }


# ----------------------------------------------------------------------------- the section
def run_cross_instance(
    base: Deployment, o: CrossOptions, log_dir: Path, raw: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The section on the running stack: local, then cross-instance, then the backlog drain.

    ``raw`` is the suite's raw Kafka result (`RawResult.as_json`), for the ratios over raw."""
    started = time.monotonic()
    phases: dict[str, float] = {}
    mark = started

    def phase(name: str) -> None:
        nonlocal mark
        now = time.monotonic()
        phases[name] = round(now - mark, 2)
        mark = now

    sl = secure_instance(base.model_copy(update={"instance": f"{base.instance}xl"}))
    sa = base.model_copy(update={"instance": f"{base.instance}xa"})
    sb = base.model_copy(update={"instance": f"{base.instance}xb"})
    procs: list[ServiceProcess] = []
    local_queues, queues = contextlib.ExitStack(), contextlib.ExitStack()

    def start(p: ServiceProcess, marker: str) -> None:
        procs.append(p)
        p.start().wait_ready(marker)

    try:
        apply_catalog(sl, bench_catalog(o.partitions))
        sl, _ = local_queues.enter_context(
            running_queues(sl, log_dir / "xi-local", o.queue_replicas)
        )
        local_dispatcher = ServiceProcess("dispatcher", sl, log_dir / LOG_NAMES[0])
        start(local_dispatcher, "dispatcher ready")
        phase("local_start")
        local = _deliver(sl, sl, o)
        local_dispatcher.stop()  # idle from here on: keep it out of the cross figures
        local_queues.close()
        phase("local")
        ca, cb = cross_catalogs(sa.instance, sb.instance, "LOCAL", o.partitions)
        sa, sb = secure_instance(sa, ca), secure_instance(sb, cb)  # each grants the other's route
        apply_catalog(sa, ca)
        apply_catalog(sb, cb)
        sb, _ = queues.enter_context(running_queues(sb, log_dir / "xi-b", o.queue_replicas))
        start(ServiceProcess("dispatcher", sb, log_dir / LOG_NAMES[2]), "dispatcher ready")
        start(ServiceProcess("dispatcher", sa, log_dir / LOG_NAMES[1]), "dispatcher ready")
        fast = sa.model_copy(update=INTERVALS)
        start(ServiceProcess("transmitter", fast, log_dir / LOG_NAMES[3]), "transmitter ready")
        start(ServiceProcess("transport", fast, log_dir / LOG_NAMES[4]), "transport ready")
        phase("cross_start")
        cross = _deliver(sa, sb, o)
        phase("cross")
        drain = _drain(sa, sb, o)
        phase("drain")
    finally:
        for p in reversed(procs):
            p.stop()
        queues.close()
        local_queues.close()
    local_j, cross_j = local.as_json(), cross.as_json()
    return {
        "config": {
            "messages": local.rate.messages,
            "dialogs": o.dialogs,
            "body_bytes": o.body_bytes,
            "target_partitions": o.partitions,
            "receivers": o.receivers,
            "window": o.window,
            "probes": o.probes,
            "route_address": "LOCAL",
            "instances": {"local": sl.instance, "a": sa.instance, "b": sb.instance},
            "intervals": {
                **INTERVALS,
                "idle_connection_ms": TransportSettings().idle_connection_ms,
            },
            "transmitter_options": {
                "connect_timeout_s": INTERVALS["connect_timeout_ms"] / 1000,
                "delivery_timeout_ms": TransportSettings().delivery_timeout_ms,
                "view_every_ms": TransmitterSettings().view_every_ms,
                "max_wait_ms": TransmitterSettings().max_wait_ms,
                "backoff_initial_ms": TransmitterSettings().retry_initial_ms,
                "backoff_max_ms": TransmitterSettings().retry_max_ms,
            },
        },
        "local": local_j,
        "cross": cross_j,
        "ratio_cross_over_local": run_ratios(cross_j, local_j),
        "ratio_local_over_raw": None if raw is None else run_ratios(local_j, raw),
        "ratio_cross_over_raw": None if raw is None else run_ratios(cross_j, raw),
        "drain": drain,
        "verified": local.verified and cross.verified and drain["verified_exactly_once_in_order"],
        "phase_seconds": phases,
        "seconds": round(time.monotonic() - started, 2),
    }


# ----------------------------------------------------------------------------- output
def format_lines(j: dict[str, Any]) -> list[str]:
    ms, x = fmt_ms, fmt_x
    cfg, local, cross = j["config"], j["local"], j["cross"]
    ratio, iv, to = j["ratio_cross_over_local"], cfg["intervals"], cfg["transmitter_options"]
    rows = [
        (
            "throughput",
            f"{local['throughput']['per_s']:,.0f} msg/s",
            f"{cross['throughput']['per_s']:,.0f} msg/s",
            x(ratio["throughput"]),
        )
    ]
    for label, key, kind in (
        ("p50 latency (loaded)", "latency_loaded", "p50_ms"),
        ("p99 latency (loaded)", "latency_loaded", "p99_ms"),
        ("p50 latency (1 at a time)", "latency_unloaded", "p50_ms"),
        ("p99 latency (1 at a time)", "latency_unloaded", "p99_ms"),
    ):
        rows.append(
            (label, ms(local[key][kind]), ms(cross[key][kind]), x(ratio[f"{key}_{kind[:3]}"]))
        )
    header = ("", "local", "cross-instance", "cross/local")
    widths = [max(len(row[i]) for row in [*rows, header]) for i in range(4)]

    def line(row: tuple[str, str, str, str]) -> str:
        return "    " + "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )

    lines = [
        f"cross-instance: A -> B on one cluster (route LOCAL) beside local delivery, "
        f"{cfg['messages']:,} messages over {cfg['dialogs']:,} dialogs each, "
        f"{cfg['body_bytes']} B bodies, {cfg['target_partitions']} queue partitions, "
        f"{cfg['receivers']} receivers x window {cfg['window']}, {cfg['probes']} probes; "
        f"latency = SEND -> RECEIVE + commit applied",
        line(header),
        *(line(row) for row in rows),
    ]
    for name in ("local", "cross"):
        r = j[name]
        lines.append(
            f"    {name}: {r['commits']:,} commits ({r['messages_per_commit']:.1f} msg/commit), "
            f"refused {r['refused_commits']}, lock lost {r['lock_lost']}; exactly once and in "
            f"order: {'yes' if r['verified_exactly_once_in_order'] else 'NO'}"
        )
        lines.extend(f"      problem: {p}" for p in r["problems"])
    for name in ("local", "cross"):
        rr = j[f"ratio_{name}_over_raw"]
        if rr is not None:
            lines.append(
                f"    ratio {name}/raw kafka: throughput {rr['throughput']:.3f}x, p50 latency "
                f"{x(rr['latency_loaded_p50'])}, p99 {x(rr['latency_loaded_p99'])} (1 at a time: "
                f"p50 {x(rr['latency_unloaded_p50'])}, p99 {x(rr['latency_unloaded_p99'])})"
            )
    d = j["drain"]
    lines += [
        f"  backlog drain after a restored link: {d['backlog']:,} messages over {d['dialogs']} "
        f"dialogs held {ms(d['outage_ms'])} ({d['cut_by']}); after the route was restored: "
        f"first received {ms(d['first_received_after_restore_ms'])}, all received "
        f"{ms(d['all_received_after_restore_ms'])} ("
        + ("n/a" if d["drain_per_s"] is None else f"{d['drain_per_s']:,.0f} msg/s")
        + f" once flowing); link reconnected {ms(d['reconnected_after_restore_ms'])} after the "
        f"restore (wall clock, ms resolution), {d['failed_connects_during_outage']} failed "
        f"connects during the outage; received during the outage {d['received_during_outage']}; exactly once and in order: "
        f"{'yes' if d['verified_exactly_once_in_order'] else 'NO'}; all acknowledged to A: "
        f"{'yes' if d['acknowledged'] else 'NO'}",
        f"    intervals (transmitter A): tick {iv['tick_ms']:,} ms, suppress after failed connect "
        f"{iv['suppress_after_failed_connect_ms']:,} ms, after disconnect "
        f"{iv['suppress_after_disconnect_ms']:,} ms, idle connection {iv['idle_connection_ms']:,} "
        f"ms; connect timeout {to['connect_timeout_s']:g} s, delivery timeout "
        f"{to['delivery_timeout_ms']:,} ms, retransmit backoff {to['backoff_initial_ms']:,}.."
        f"{to['backoff_max_ms']:,} ms, view every {to['view_every_ms']:,} ms",
    ]
    lines.extend(f"    problem: {p}" for p in d["problems"])
    return lines
