"""Kafka clients' log lines go through Python's logging, at levels that mean what they say, and
repeats are held back: the rate limit and the streak rule on a manual clock, and one real
librdkafka consumer pointed at a closed port (no broker needed: it is refused at once)."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator

import pytest
from confluent_kafka import KafkaError

from devtools.processes import free_port
from ksb.clock import ManualClock
from ksb.runtime import kafka
from ksb.runtime.kafka_logs import PERSIST_S, ClientLog, Streaks, is_transient, kind_of
from ksb.runtime.log_limits import REPEAT_EVERY_S, RepeatLimit
from ksb.settings import KsbSettings

REFUSED = (
    "[thrd:127.0.0.1:9092/bootstrap]: 127.0.0.1:9092/bootstrap: Connect to ipv4#127.0.0.1:9092 "
    "failed: Connection refused (after 0ms in state CONNECT)"
)
COORDINATOR = (
    "[thrd:GroupCoordinator]: GroupCoordinator: SASL authentication error: "
    "SaslAuthenticateRequest failed: Local: Broker transport failure (after 0ms in state DOWN)"
)
BAD_PASSWORD = (
    "[thrd:sasl_plaintext://127.0.0.1:9092/1]: sasl_plaintext://127.0.0.1:9092/1: SASL "
    "authentication error: Authentication failed during authentication due to invalid "
    "credentials with SASL mechanism SCRAM-SHA-512 (after 3ms in state AUTH_REQ)"
)
RAW_LIBRDKAFKA_LINE = re.compile(r"^%\d\|", re.MULTILINE)
"""How librdkafka's own stderr logger starts a line: ``%3|1732...|FAIL|rdkafka#consumer-1| ...``."""


def _record(msg: str, *args: object, level: int = logging.WARNING) -> logging.LogRecord:
    return logging.LogRecord("ksb.test", level, __file__, 1, msg, args, None)


def test_repeat_limit_lets_the_first_through_then_one_per_interval_with_a_count() -> None:
    clock = ManualClock()
    limit = RepeatLimit(30.0, clock=clock)
    assert limit.filter(_record("broker %s down", "a"))
    for _ in range(5):
        clock.advance(1)
        assert not limit.filter(_record("broker %s down", "b"))  # same call site: same kind
    assert limit.filter(_record("another kind"))  # kinds are limited apart
    clock.advance(24)  # 29 s after the first
    assert not limit.filter(_record("broker %s down", "c"))
    clock.advance(1)
    passed = _record("broker %s down", "d")
    assert limit.filter(passed)
    assert passed.getMessage() == "broker d down (6 more like it in the last 30 s)"
    clock.advance(30)  # nothing held since: no count
    quiet = _record("broker %s down", "e")
    assert limit.filter(quiet)
    assert quiet.getMessage() == "broker e down"


def test_repeat_limit_keys_on_a_records_kind_and_never_holds_debug() -> None:
    clock = ManualClock()
    limit = RepeatLimit(30.0, clock=clock)
    first, same = _record("x"), _record("y")
    first.kind = same.kind = "k"
    assert limit.filter(first)
    assert not limit.filter(same)
    assert all(limit.filter(_record("dbg", level=logging.DEBUG)) for _ in range(3))


def test_repeat_limit_on_a_handler_limits_only_the_loggers_named() -> None:
    limit = RepeatLimit(30.0, prefixes=("aiokafka",), clock=ManualClock())
    ours = [_record("tick") for _ in range(3)]
    assert all(limit.filter(r) for r in ours)
    theirs = [
        logging.LogRecord(name, logging.ERROR, __file__, 1, "Unable connect to node %s", (1,), None)
        for name in ("aiokafka", "aiokafka", "aiokafka.conn", "aiokafkax")
    ]
    assert [limit.filter(r) for r in theirs] == [True, False, True, True]


def test_a_transient_failure_is_info_until_it_has_gone_on_for_persist_s() -> None:
    clock = ManualClock()
    streaks = Streaks(clock=clock)
    assert streaks.seen("refused") == 0
    clock.advance(PERSIST_S - 1)
    assert streaks.seen("refused") == PERSIST_S - 1
    clock.advance(1)
    assert streaks.seen("refused") == PERSIST_S
    clock.advance(PERSIST_S)  # nothing for that long: it had ended, and starts over
    assert streaks.seen("refused") == 0
    assert streaks.seen("other") == 0


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def sink() -> Iterator[tuple[ClientLog, ManualClock, list[logging.LogRecord]]]:
    """A `ClientLog` on a logger of its own with a rate limit, on a manual clock."""
    clock = ManualClock()
    logger = logging.getLogger("ksb.kafka.test-sink")
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    handler = _Records()
    logger.addHandler(handler)
    logger.addFilter(RepeatLimit(REPEAT_EVERY_S, clock=clock))
    try:
        yield ClientLog(logger, Streaks(clock=clock)), clock, handler.records
    finally:
        logger.removeHandler(handler)
        logger.filters.clear()


def test_client_log_levels_transient_failures_down_and_real_errors_not(
    sink: tuple[ClientLog, ManualClock, list[logging.LogRecord]],
) -> None:
    log, _, records = sink
    log.log(logging.ERROR, "%s [%s] %s", "FAIL", "rdkafka#consumer-7", COORDINATOR)
    log.log(logging.ERROR, "%s [%s] %s", "FAIL", "rdkafka#consumer-1", BAD_PASSWORD)
    log.log(logging.WARNING, "%s [%s] %s", "MAXPOLL", "rdkafka#consumer-1", "poll interval")
    assert [(r.levelno, r.getMessage()) for r in records] == [
        (
            logging.INFO,
            "rdkafka#consumer-7 FAIL: GroupCoordinator: SASL authentication error: "
            "SaslAuthenticateRequest failed: Local: Broker transport failure "
            "(after 0ms in state DOWN)",
        ),
        (logging.ERROR, "rdkafka#consumer-1 FAIL: " + BAD_PASSWORD.split("]: ", 1)[1]),
        (logging.WARNING, "rdkafka#consumer-1 MAXPOLL: poll interval"),
    ]


def test_a_refusal_logged_and_raised_is_one_kind_and_warns_once_it_persists(
    sink: tuple[ClientLog, ManualClock, list[logging.LogRecord]],
) -> None:
    log, clock, records = sink
    text = REFUSED.split("]: ", 1)[1]
    for _ in range(int(PERSIST_S * 20)):  # librdkafka's pace against a closed port: 20 a second
        log.log(logging.ERROR, "%s [%s] %s", "FAIL", "rdkafka#producer-2", REFUSED)
        log.error(KafkaError(KafkaError._TRANSPORT, text))
        clock.advance(0.05)
    log.error(KafkaError(KafkaError._TRANSPORT, text))
    assert [r.levelno for r in records] == [logging.INFO, logging.WARNING]
    assert records[0].getMessage() == f"rdkafka#producer-2 FAIL: {text}"
    assert records[1].getMessage() == f"error _TRANSPORT: {text} (going on for 30 s)"


def test_fatal_errors_are_errors_whatever_they_say(
    sink: tuple[ClientLog, ManualClock, list[logging.LogRecord]],
) -> None:
    log, _, records = sink
    log.error(KafkaError(KafkaError._FENCED, "Producer fenced: request timed out", fatal=True))
    assert [r.levelno for r in records] == [logging.ERROR]


def test_what_counts_as_transient_and_as_one_kind() -> None:
    assert is_transient(REFUSED) and is_transient(COORDINATOR)
    assert is_transient("3/3 brokers are down") and is_transient("x", KafkaError._TRANSPORT)
    assert not is_transient(BAD_PASSWORD)
    refused = "127.0.0.1:9092/1: Connection refused"
    assert (
        kind_of(f"{refused} (after 12ms in state CONNECT)")
        == kind_of("127.0.0.1:9093/2: Connection refused (after 0ms in state CONNECT)")
        == kind_of(f"{refused} (after 0ms in state CONNECT, 1 identical error(s) suppressed)")
        == kind_of(refused)
    )


def test_a_consumers_librdkafka_lines_reach_logging_not_stderr(
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A consumer of a port nothing listens on is refused ~20 times a second; each refusal is a
    FAIL log line and a _TRANSPORT error. They reach ``ksb.kafka.consumer``, once (INFO: young
    and transient), and librdkafka writes nothing to stderr."""
    monkeypatch.setattr(logging.getLogger("ksb.kafka.consumer"), "filters", [])  # a fresh limit
    caplog.set_level(logging.DEBUG, logger="ksb.kafka")
    settings = KsbSettings(
        kafka_bootstrap=f"127.0.0.1:{free_port()}", kafka_security_protocol="PLAINTEXT"
    )
    consumer = kafka.consumer(settings)
    try:
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            consumer.poll(0.1)
    finally:
        consumer.close()
    refused = [r for r in caplog.records if "Connection refused" in r.getMessage()]
    assert [(r.name, r.levelno) for r in refused] == [("ksb.kafka.consumer", logging.INFO)], (
        caplog.text
    )
    stderr = capfd.readouterr().err
    assert not RAW_LIBRDKAFKA_LINE.search(stderr), stderr
