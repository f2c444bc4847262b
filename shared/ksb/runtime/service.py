"""The run loop every tick-driven service shares: metrics, health gauge, ticker, graceful stop.

The transmitter, transport and forwarder do their housekeeping on the broker's periodic timer
(`ksb.runtime.ticker`). Keeping the loop, the signal handling and the "ready" log line in one place means
each service's `__main__` only says which tasks it registers, and every service stops the same way:
SIGTERM or SIGINT sets an event, the loop finishes the tick it is in, the health gauge drops to 0
and the process exits 0.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

from ksb.clock import Clock, SystemClock
from ksb.runtime.metrics import HEALTHY, serve_metrics
from ksb.runtime.ticker import Ticker, TickSchedule
from ksb.settings import Settings

__all__ = ["configure_logging", "run_service", "stop_on_signals"]

log = logging.getLogger("ksb.runtime.service")

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def configure_logging(name: str) -> None:
    """One line format for every service, with its name, so interleaved logs stay readable."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(levelname)s %(message)s")


def stop_on_signals() -> threading.Event:
    """For a service's `main`: an event that SIGTERM or SIGINT sets, so the loop stops taking work
    and drains instead of dying mid-transaction."""
    stop = threading.Event()
    for sig in _SIGNALS:
        signal.signal(sig, lambda _s, _f: stop.set())
    return stop


def run_service(
    name: str,
    settings: Settings,
    ticker: Ticker | None = None,
    *,
    clock: Clock | None = None,
    stop: threading.Event | None = None,
) -> None:
    """Run `ticker` until stopped; return normally so the process exits 0.

    `ticker` defaults to one with no tasks, on `clock` (the real clock unless given), ticking every
    `settings.tick_ms`. Without a `stop` event the loop installs its own SIGTERM/SIGINT handlers
    (main thread only) and restores the previous ones when it returns; with one, the caller owns
    stopping, so the loop can also run in a thread or a test.
    """
    clock = clock or SystemClock()
    if ticker is None:
        ticker = Ticker(clock.now_ms(), TickSchedule(tick_ms=settings.tick_ms))
    if stop is None:
        stop = threading.Event()
        with _stop_on_signals(stop):
            _loop(name, settings, ticker, clock, stop)
    else:
        _loop(name, settings, ticker, clock, stop)


def _loop(
    name: str, settings: Settings, ticker: Ticker, clock: Clock, stop: threading.Event
) -> None:
    port = serve_metrics(settings.metrics_port, host=settings.metrics_host)
    HEALTHY.labels(name).set(1)
    log.info(
        "%s ready (instance %s, tick %d ms, metrics port %s)",
        name,
        settings.instance,
        settings.tick_ms,
        port or "off",
    )
    try:
        while not stop.is_set():
            wait_ms = ticker.next_due_ms - clock.now_ms()
            # Event.wait returns as soon as a signal handler sets `stop`, so shutdown never waits
            # for the rest of a 5 s tick.
            if wait_ms > 0 and stop.wait(wait_ms / 1000):
                break
            ticker.poll(clock.now_ms())
    finally:
        HEALTHY.labels(name).set(0)
        log.info("%s stopped after %d tick(s)", name, ticker.tick)


_Handler = Callable[[int, FrameType | None], object] | int | signal.Handlers | None


@contextmanager
def _stop_on_signals(stop: threading.Event) -> Iterator[None]:
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
