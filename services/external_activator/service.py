"""The external activator: a faust app that turns activation events into reader processes.

Service Broker's external activation leaves running readers to a program outside the broker; this
is that program for KSB. A faust agent follows ``ksb.<instance>.activation``; `ReaderSupervisor`
applies each event through the pure `ksb.activation.external.ActivationPlanner` and starts, counts
and reaps the configured shell commands. A faust timer keeps each queue's minimum running.

Why faust: the events are a plain keyed stream, and a faust agent gives the consumer group, offset
commits after processing, rebalancing and a supervised actor for free. No tables are used, so faust
creates no changelog topics; its only internal topic (the assignor's leader topic) is created with
``KSB_FAUST_REPLICATION_FACTOR`` copies (1, which the one-broker stack needs, by default).

Delivery is at least once: a record re-read after a crash can start one extra command, still
within ``max``. A fresh consumer group starts at the earliest offset on purpose: the activation
service sends no second event until a RECEIVE is seen or the notification times out, so an event
skipped while the activator was down would leave the queue without readers for that long.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
import subprocess
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from signal import SIGKILL, SIGTERM, Signals
from typing import Any

import faust
import redis
from faust.types import TP
from mode.types.signals import BaseSignalT

from ksb.activation.external import ActivationPlanner, StartDecision
from ksb.activation.host import confined_argv, task_settings
from ksb.clock import Clock, SystemClock
from ksb.errors import ProtocolError
from ksb.names import Names
from ksb.runtime import confinement
from ksb.runtime.credentials import kafka_login
from ksb.runtime.metrics import HEALTHY
from ksb.runtime.redis_client import best_effort
from ksb.settings import ClientSettings, ExternalActivatorSettings, settings_env
from ksb.wire.activation import parse_activation_event

__all__ = ["ActivatorWorker", "ReaderSupervisor", "build_app"]

log = logging.getLogger("ksb.external_activator")

SERVICE = "external_activator"
KEEP_MINIMUM_S = 0.5


@dataclass
class _Reader:
    task_id: str
    proc: subprocess.Popen[bytes]


class ReaderSupervisor:
    """Starts, counts and stops the reader commands; every choice is the planner's.

    Events and the timer call it on the faust event loop (starting a process takes milliseconds,
    so it is not worth a thread). `close` waits for processes, so `ActivatorWorker` runs it in a
    thread after `begin_close` has, on the loop, barred new starts; `main` calls it again as a
    backstop, which is why it is idempotent.
    """

    def __init__(
        self,
        settings: ExternalActivatorSettings,
        planner: ActivationPlanner,
        *,
        clock: Clock | None = None,
        heartbeats: redis.Redis | None = None,
    ) -> None:
        """`heartbeats`: the Redis client the readers' heartbeats are kept with (None: not
        kept, for tests of the rules alone)."""
        self.settings = settings
        self.planner = planner
        self.clock = clock or SystemClock()
        self.readers: dict[str, list[_Reader]] = {q: [] for q in planner.queues}
        self.started: dict[str, int] = dict.fromkeys(planner.queues, 0)
        self.peak: dict[str, int] = dict.fromkeys(planner.queues, 0)
        self._closing = False
        self._closed = False
        self._names = Names(settings.instance)
        self._heartbeats = heartbeats
        secured = settings.kafka_security_protocol != "PLAINTEXT"
        self._confine = secured and confinement.available()
        if secured and not self._confine:
            log.warning("this kernel has no Landlock: reader commands are not confined")

    # ----------------------------------------------------------------- events and the timer
    def handle(self, raw: bytes | str) -> None:
        """One record of the activation topic; a malformed one is logged and skipped."""
        try:
            event = parse_activation_event(raw.encode() if isinstance(raw, str) else raw)
        except ProtocolError as exc:
            log.warning("skipping activation record: %s", exc.reason)
            return
        running = self.running(event.queue) if event.queue in self.readers else 0
        decision = self.planner.on_event(event, running)
        log.info("%s for %s (%s): %s", event.kind, event.queue, event.reason, decision.reason)
        self._apply(decision)

    def tick(self) -> None:
        """Reap exited commands, then top every queue up to its minimum; renew the heartbeats of
        the commands still running."""
        for queue in self.readers:
            self._apply(self.planner.keep_minimum(queue, self.running(queue), self.clock.now_ms()))
        self._beat({q: [r.task_id for r in rs] for q, rs in self.readers.items()})

    def _beat(self, alive: dict[str, list[str]], gone: dict[str, list[str]] | None = None) -> None:
        """The readers' heartbeats in their queues' task sets, kept by the activator (a reader
        logs in as its own principal, which has no Redis user of its own)."""
        if self._heartbeats is None:
            return
        until = int(time.time() * 1000) + self.settings.activated_heartbeat_ttl_ms
        with best_effort(log, "reader heartbeats not written this time"):
            pipe = self._heartbeats.pipeline(transaction=False)
            for queue, ids in alive.items():
                if ids:
                    pipe.zadd(self._names.tasks_key(queue), dict.fromkeys(ids, until))
            for queue, ids in (gone or {}).items():
                if ids:
                    pipe.zrem(self._names.tasks_key(queue), *ids)
            pipe.execute()

    def running(self, queue: str) -> int:
        """Live commands of ``queue``; reaps (and tells the planner about) the ones that exited."""
        alive, gone = [], []
        for r in self.readers[queue]:
            code = r.proc.poll()
            if code is None:
                alive.append(r)
            else:
                gone.append(r.task_id)
                self.planner.on_exit(queue, code, self.clock.now_ms())
                log.info("reader %s of %s exited with %s", r.task_id, queue, code)
        self.readers[queue] = alive
        if gone:
            self._beat({}, {queue: gone})
        return len(alive)

    def _apply(self, decision: StartDecision) -> None:
        for _ in range(decision.start):
            if self._closing:
                return
            self._start(decision.queue)

    def _start(self, queue: str) -> None:
        spec = self.planner.readers(queue)
        task_id = f"{queue}-ext-{uuid.uuid4().hex[:8]}"
        # The command gets the instance's KSB_* settings (so `python -m ksb.activation.activated`
        # and KsbClient find Kafka and the queue service), logged in as its own principal and
        # with none of the activator's secrets, plus which queue and task it is, as internal
        # activation does.
        config = self.planner.config
        login = config.logins.get(spec.execute_as) if spec.execute_as else None
        reader = task_settings(self.settings, ClientSettings, spec.execute_as, login)
        env = settings_env(reader, ACTIVATED_QUEUE=queue, ACTIVATED_TASK_ID=task_id)
        argv = ["/bin/sh", "-c", spec.command]  # the host's own command line (its config file)
        if self._confine:
            argv = confined_argv(argv, self.settings, config.secret_files(), reader)
        # Its own session: stopping it signals the whole group, the shell and what it started.
        proc = subprocess.Popen(argv, env=env, start_new_session=True)
        self.readers[queue].append(_Reader(task_id, proc))
        self._beat({queue: [task_id]})
        self.started[queue] += 1
        n = len(self.readers[queue])
        self.peak[queue] = max(self.peak[queue], n)
        log.info(
            "started reader %s for %s (pid %d, %d running, max %d)",
            task_id,
            queue,
            proc.pid,
            n,
            spec.max_readers,
        )

    # ----------------------------------------------------------------- shutdown
    def begin_close(self) -> None:
        """Stop starting commands and send SIGTERM to every running one (does not wait)."""
        self._closing = True
        for r in self._all():
            if r.proc.poll() is None:
                _signal_group(r.proc.pid, SIGTERM)

    def close(self, grace_s: float = 5.0) -> None:
        """SIGTERM every command, wait up to ``grace_s`` each, then SIGKILL; idempotent."""
        if self._closed:
            return
        self.begin_close()
        for r in self._all():
            try:
                r.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(r.proc.pid, SIGKILL)
                r.proc.wait(5)
        for queue in self.readers:
            self.readers[queue] = []
        self._closed = True
        log.info("external_activator stopped its readers")

    def _all(self) -> Iterable[_Reader]:
        return [r for rs in self.readers.values() for r in rs]

    # ----------------------------------------------------------------- views
    def view(self) -> list[dict[str, Any]]:
        """One row per configured queue, for the /readers metrics route."""
        return [
            {
                "queue": q,
                "running": sum(1 for r in rs if r.proc.poll() is None),
                "min": self.planner.readers(q).min_readers,
                "max": self.planner.readers(q).max_readers,
                "started": self.started[q],
                "peak": self.peak[q],
                "disabled": self.planner.disabled(q),
                "tasks": [r.task_id for r in rs],
            }
            for q, rs in self.readers.items()
        ]


def _signal_group(pid: int, sig: Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # already gone
        os.killpg(pid, sig)


def build_app(
    settings: ExternalActivatorSettings,
    supervisor: ReaderSupervisor,
    *,
    partitions: int,
    datadir: str,
) -> faust.App:
    """The faust app: one agent over the activation topic and one timer; nothing at import time.

    ``partitions`` is the existing topic's count: faust must not guess it (its default is 8) and
    must not create the topic. ``datadir`` is a scratch directory, as the memory store keeps
    nothing there.
    """
    names = Names(settings.instance)
    session_s = settings.session_timeout_ms / 1000
    app = faust.App(
        names.external_activator_app,
        broker=f"kafka://{settings.kafka_bootstrap}",
        broker_credentials=faust_credentials(settings),
        store="memory://",
        web_enabled=False,
        topic_replication_factor=settings.faust_replication_factor,
        topic_partitions=partitions,
        datadir=datadir,
        autodiscover=False,
        consumer_auto_offset_reset="earliest",
        # Short sessions, as the other KSB consumers use: a restarted activator rejoins in seconds
        # instead of waiting out faust's one-minute default for its previous member.
        broker_session_timeout=session_s,
        broker_heartbeat_interval=max(0.1, session_s / 5),
    )
    topic = app.topic(
        names.activation,
        partitions=partitions,
        key_type=bytes,
        value_type=bytes,
        key_serializer="raw",
        value_serializer="raw",
    )

    async def activation_events(stream: faust.StreamT[bytes]) -> None:
        async for value in stream:
            supervisor.handle(value)

    async def keep_minimum() -> None:
        supervisor.tick()

    ready = False

    async def on_assigned(_app: Any, *args: Any, signal: BaseSignalT[Any], **_: Any) -> None:
        nonlocal ready
        assigned: set[TP] = args[0] if args else set()
        if not ready and any(tp.topic == names.activation for tp in assigned):
            ready = True
            HEALTHY.labels(SERVICE).set(1)
            log.info(
                "external_activator ready (instance %s, queues %s)",
                settings.instance,
                ", ".join(supervisor.readers),
            )

    app.agent(topic, name=f"{names.external_activator_app}.events")(activation_events)
    app.timer(KEEP_MINIMUM_S)(keep_minimum)
    # mode's SignalHandlerT (VarArg/NamedArg from mypy_extensions) matches no plain function under
    # mypy; the handler above has exactly the shape mode calls it with.
    app.on_partitions_assigned.connect(on_assigned)  # type: ignore[arg-type]
    return app


def faust_credentials(settings: ExternalActivatorSettings) -> faust.SASLCredentials | None:
    """The process's Kafka login (`ksb.runtime.kafka.client_security`'s) in aiokafka's terms."""
    login = kafka_login(settings)
    if not login.sasl:
        return None
    context = ssl.create_default_context(cafile=login.ssl_ca or None)
    return faust.SASLCredentials(
        username=login.username,
        password=login.password,
        mechanism=login.mechanism,
        ssl_context=context if login.security_protocol == "SASL_SSL" else None,
    )


class ActivatorWorker(faust.Worker):
    """A faust worker that stops the reader commands first when it is told to stop.

    `on_stop` runs before the app's consumer leaves its group, which can take seconds; readers
    must not outlive a SIGTERM by that long, nor be restarted by the timer meanwhile.
    """

    def __init__(self, app: faust.App, readers: ReaderSupervisor, **kwargs: Any) -> None:
        # Not `self.supervisor`: mode's Service already uses that name for its restart strategy.
        self.readers = readers
        super().__init__(app, **kwargs)
        self.spinner = None  # a log file is no terminal: no progress spinner escape codes

    async def on_stop(self) -> None:
        HEALTHY.labels(SERVICE).set(0)
        self.readers.begin_close()
        await asyncio.get_running_loop().run_in_executor(None, self.readers.close)
        await super().on_stop()
