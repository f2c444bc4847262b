"""The service shell: what every KSB service runs inside, so each service is only its work.

A service (dispatcher, transmitter, transport, forwarder, activation) is a `Service`: it gives the
shell `open` (build its clients and read its state: the network I/O that constructors must not do),
a `step` (one pass of its loop, returning within about 100 ms), the tick tasks it wants on the
broker's periodic timer, what to do when the catalog changes, its JSON views and its health. The
shell owns the rest, the same way for every service:

* `/metrics`, `/healthz` and the service's JSON views on ``metrics_port``;
* the health gauge (``ksb_service_up``) and the service's health check;
* the task handlers (`ksb.runtime.task_handlers`), started first, checked on every tick, drained last;
* the ticker (`ksb.runtime.ticker`), counting ticks from when work starts;
* the catalog watcher, so every service picks up a new catalog version without a restart;
* signals: SIGTERM or SIGINT stops taking work, the loop finishes its pass, `close` drains, and the
  process exits 0 (or 1, with every thread's stack in its log, if its exit hangs: `run_main`).

The external activator is the one service that does not run here: it is a faust app, and faust owns
its event loop, its signals and its workers.
"""

from __future__ import annotations

import faulthandler
import logging
import signal
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any

from ksb.catalog.model import Catalog, CatalogView
from ksb.clock import Clock, SystemClock
from ksb.names import Names
from ksb.runtime.catalog_store import CatalogWatcher
from ksb.runtime.log_format import JsonFormatter, LogFormat, text_format
from ksb.runtime.log_limits import LIBRARY_LOGGERS, RepeatLimit
from ksb.runtime.metrics import (
    HEALTHY,
    JsonRoute,
    register_health_check,
    serve_metrics,
    unregister_health_check,
)
from ksb.runtime.task_handlers import TaskHandlers
from ksb.runtime.ticker import Ticker
from ksb.settings import ServiceSettings

__all__ = [
    "Service",
    "ServiceShell",
    "TickTask",
    "configure_logging",
    "run_main",
    "stop_on_signals",
]

log = logging.getLogger("ksb.service")

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@dataclass(frozen=True)
class TickTask:
    """Run `fn(tick)` on every `every`-th tick of the broker's periodic timer."""

    every: int
    name: str
    fn: Callable[[int], None]


class Service(ABC):
    """What a service gives the shell; subclasses define `step` and override what they need.

    The constructor only stores settings and builds in-memory state: everything that talks to
    Kafka or Redis happens in `open`, so a service object can be made (and tested) without a
    network, and a start that fails does so inside the shell, which reports it and closes.
    """

    name = "service"
    ready_at_open = True
    """The shell sets `ready` after `open`; the dispatcher sets it once its broker has started."""
    drain_s = 2.0
    """How long the task handlers may take to finish queued work on the way out."""

    def __init__(self, settings: ServiceSettings, clock: Clock | None = None) -> None:
        self.settings = settings
        self.names = Names(settings.instance)
        self.clock = clock or SystemClock()
        self.ready = threading.Event()
        """Set when the service takes work."""
        self.shell = ServiceShell(self)

    @property
    def catalog(self) -> CatalogView:
        """The newest catalog the shell has seen (read in `open`, then kept up to date)."""
        return self.shell.catalog

    @property
    def handlers(self) -> TaskHandlers:
        """The service's task handlers (owned by the shell)."""
        return self.shell.handlers

    @property
    def ticker(self) -> Ticker:
        """The broker's periodic timer as the shell runs it for this service."""
        return self.shell.ticker

    def run(self, stop: threading.Event) -> None:
        """Run in the shell until `stop` is set (what `python -m services.<name>` does)."""
        self.shell.run(stop)

    @abstractmethod
    def open(self) -> None:
        """Build clients, create topics, read state: everything that talks to the network."""

    @abstractmethod
    def step(self) -> None:
        """One pass of the service's loop; waits for input at most about 100 ms."""

    def tick_tasks(self) -> Iterable[TickTask]:
        """The service's housekeeping on the periodic timer."""
        return ()

    def on_catalog(self, view: CatalogView) -> None:
        """A new catalog version was applied (most services only keep the newest view)."""
        return None

    def routes(self) -> Mapping[str, JsonRoute]:
        """Extra JSON views served on the metrics port."""
        return {}

    def health(self) -> str | None:
        """Why the service cannot do its job now (its /healthz answers 503 with it), or None."""
        return None

    def log_fields(self) -> dict[str, Any]:
        """What every JSON log line of the process carries besides the service's name."""
        return {"instance": self.settings.instance}

    @abstractmethod
    def close(self) -> None:
        """Flush and close what `open` built; called once, after the loop, also after a failure
        (so it must cope with an `open` that stopped half-way)."""


class ServiceShell:
    """Runs one `Service` until stopped."""

    def __init__(self, service: Service) -> None:
        self.service = service
        settings = service.settings
        self.handlers = TaskHandlers(service.name, settings.task_handlers)
        self.ticker = Ticker(service.clock.now_ms(), tick_ms=settings.tick_ms)
        self.catalog = CatalogView(Catalog())
        """The catalog as of the watcher's last poll (empty until `read_catalog`)."""
        self.metrics_port = 0
        self._watcher: CatalogWatcher | None = None

    def run(self, stop: threading.Event) -> None:
        """Open the service and run its loop until `stop` is set; close it on the way out."""
        service, settings = self.service, self.service.settings
        name = service.name
        self.metrics_port = serve_metrics(
            settings.metrics_port,
            service.routes(),
            host=settings.metrics_host,
            instance=settings.instance,
        )
        register_health_check(name, service.health)
        self.handlers.start()
        try:
            service.open()
            watcher = self._watch_catalog()
            self.start_ticker()
            self._announce()
            while not stop.is_set():
                if watcher.poll(0):
                    self.catalog = watcher.view
                    service.on_catalog(watcher.view)
                service.step()
                self.ticker.poll(service.clock.now_ms())
        finally:
            HEALTHY.labels(name).set(0)
            unregister_health_check(name, service.health)
            self.handlers.stop(service.drain_s)
            try:
                service.close()
            finally:
                if self._watcher is not None:
                    self._watcher.close()
                log.info("%s stopped after %d tick(s)", name, self.ticker.tick)

    def read_catalog(self) -> CatalogView:
        """The newest catalog now (reads the catalog topic to its end); for `Service.open`, once
        it has made sure the topic exists."""
        self.catalog = self._watch_catalog().catch_up()
        return self.catalog

    def _watch_catalog(self) -> CatalogWatcher:
        if self._watcher is None:
            self._watcher = CatalogWatcher(self.service.settings)
            self._watcher.view = self.catalog
        return self._watcher

    def start_ticker(self) -> None:
        """Ticks count from here: the time `open` took is not ticks the service missed."""
        now = self.service.clock.now_ms()
        self.ticker = Ticker(now, tick_ms=self.service.settings.tick_ms)
        self.ticker.every(1, "task_handlers", self.handlers.on_tick)
        for task in self.service.tick_tasks():
            self.ticker.every(task.every, task.name, task.fn)

    def _announce(self) -> None:
        service, s = self.service, self.service.settings
        if service.ready_at_open:
            HEALTHY.labels(service.name).set(1)
            service.ready.set()
        log.info(
            "%s %s (instance %s, tick %d ms, %d task handlers, metrics port %s)",
            service.name,
            "ready" if service.ready_at_open else "process ready",
            s.instance,
            s.tick_ms,
            self.handlers.size,
            self.metrics_port or "off",
        )


def configure_logging(
    name: str, log_format: LogFormat = "text", fields: Mapping[str, Any] | None = None
) -> None:
    """One line format for every service, with its name, so interleaved logs stay readable (or,
    with ``json``, one JSON object a line with the service, and `fields` such as its instance:
    `ksb.runtime.log_format`); the client libraries' own loggers (aiokafka's, which logs every
    reconnect attempt) rate-limited as KSB's Kafka clients are (`ksb.runtime.log_limits`).
    Called again (once the settings are read), it changes the format of the same handlers."""
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=logging.INFO)
        for handler in root.handlers:
            handler.addFilter(RepeatLimit(prefixes=LIBRARY_LOGGERS))
    formatter: logging.Formatter
    if log_format == "json":
        formatter = JsonFormatter({"service": name, **(fields or {})})
    else:
        formatter = logging.Formatter(text_format(name))
    for handler in root.handlers:
        handler.setFormatter(formatter)


EXIT_GRACE_S = 5.0
"""How long the interpreter's own exit may take once the service has closed."""


def run_main(make: Callable[[], Service], name: str, *, exit_grace_s: float = EXIT_GRACE_S) -> None:
    """A service's `python -m` entry point: logging, its settings from the environment (inside
    `make`), signals, then the service in its shell until SIGTERM or SIGINT.

    After the service has closed (drained and flushed), only the interpreter's exit is left:
    joining threads, freeing librdkafka's handles. A dispatcher that had logged "stopped" once
    outlived its supervisor's grace there, so the exit is bounded: past ``exit_grace_s`` the
    process writes every thread's stack to its log and ends with status 1.
    """
    configure_logging(name)
    stop = threading.Event()
    try:
        with stop_on_signals(stop):
            service = make()
            configure_logging(name, service.settings.log_format, service.log_fields())
            service.run(stop)
    finally:
        faulthandler.dump_traceback_later(exit_grace_s, exit=True)


_Handler = Callable[[int, FrameType | None], object] | int | signal.Handlers | None


@contextmanager
def stop_on_signals(stop: threading.Event) -> Iterator[None]:
    """Within it, SIGTERM or SIGINT sets `stop` (a service's shell, and an application's main)."""

    def handle(_signum: int, _frame: FrameType | None) -> None:
        # Only set the event: the handler interrupts arbitrary code, so the loop does the logging.
        stop.set()

    previous: dict[signal.Signals, _Handler] = {}
    for sig in _SIGNALS:
        previous[sig] = signal.signal(sig, handle)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
