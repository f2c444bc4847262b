"""The external activator's pure decisions: config, event parsing, min/max, disable, back-off."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Literal

import pytest

from ksb.activation.external import ActivationPlanner, ExternalActivatorConfig, load_config
from ksb.backoff import Backoff
from ksb.errors import CatalogError, ProtocolError
from ksb.settings import ExternalActivatorSettings
from ksb.wire.activation import (
    ActivationEvent,
    BrokerQueueDisabled,
    QueueActivation,
    parse_activation_event,
)
from services.external_activator.service import ReaderSupervisor, build_app

INSTANCE = "i1"


def planner(min_readers: int = 0, max_readers: int = 2) -> ActivationPlanner:
    config = ExternalActivatorConfig.model_validate(
        {"queues": {"Q": {"command": "run-reader", "min": min_readers, "max": max_readers}}}
    )
    return ActivationPlanner(config, INSTANCE, backoff=Backoff(initial_ms=100, max_ms=1_000))


def event(
    kind: Literal["QUEUE_ACTIVATION", "BROKER_QUEUE_DISABLED"] = "QUEUE_ACTIVATION",
    queue: str = "Q",
    instance: str = INSTANCE,
) -> ActivationEvent:
    made = QueueActivation if kind == "QUEUE_ACTIVATION" else BrokerQueueDisabled
    return made(instance=instance, queue=queue, reason="runnable work", event_ms=1)


# -- configuration ---------------------------------------------------------------------------


def test_config_reads_min_and_max_from_yaml(tmp_path: Path) -> None:
    path = tmp_path / "ext.yaml"
    path.write_text("queues:\n  Q:\n    command: echo hi\n    min: 1\n    max: 3\n")
    q = load_config(path).queues["Q"]
    assert (q.command, q.min_readers, q.max_readers) == ("echo hi", 1, 3)


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ("queues:\n  Q:\n    command: x\n    maxx: 3\n", "maxx"),  # a typo is named, not ignored
        ("queues:\n  Q:\n    command: x\n    min: 3\n    max: 2\n", "min (3) exceeds max (2)"),
        ("queues:\n  Q:\n    command: x\n    max: 0\n", "max"),
        ("queues:\n  Q:\n    min: 1\n", "command"),
        ("queues: {}\n", "queues"),
        ("queues: [\n", "ext.yaml"),  # not YAML at all
    ],
)
def test_bad_config_fails_at_start_up_with_the_field_named(
    tmp_path: Path, body: str, named: str
) -> None:
    path = tmp_path / "ext.yaml"
    path.write_text(body)
    with pytest.raises(CatalogError, match=re.escape(named)):
        load_config(path)


def test_missing_config_file_is_a_named_error(tmp_path: Path) -> None:
    with pytest.raises(CatalogError, match=re.escape("nope.yaml")):
        load_config(tmp_path / "nope.yaml")


# -- events ----------------------------------------------------------------------------------


def test_parse_event_reads_what_the_activation_service_writes() -> None:
    raw = json.dumps(
        {
            "v": 1,
            "kind": "QUEUE_ACTIVATION",
            "instance": INSTANCE,
            "queue": "Q",
            "reason": "first message",
            "event_ms": 42,
        }
    ).encode()
    assert parse_activation_event(raw) == QueueActivation(
        instance=INSTANCE, queue="Q", reason="first message", event_ms=42
    )


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        b"[1]",
        b'{"v": 2, "kind": "QUEUE_ACTIVATION", "instance": "i1", "queue": "Q", "event_ms": 1}',
        b'{"v": 1, "kind": "SOMETHING", "instance": "i1", "queue": "Q", "event_ms": 1}',
        b'{"v": 1, "kind": "QUEUE_ACTIVATION", "instance": "i1", "event_ms": 1}',
        b'{"v": 1, "kind": "QUEUE_ACTIVATION", "instance": "i1", "queue": "Q", "event_ms": "1"}',
    ],
)
def test_malformed_events_are_protocol_errors(raw: bytes) -> None:
    with pytest.raises(ProtocolError):
        parse_activation_event(raw)


# -- QUEUE_ACTIVATION: one more, never beyond max --------------------------------------------


def test_activation_starts_one_reader_below_max_and_none_at_max() -> None:
    p = planner(max_readers=2)
    assert p.on_event(event(), running=0).start == 1
    assert p.on_event(event(), running=1).start == 1
    at_max = p.on_event(event(), running=2)
    assert at_max.start == 0 and "at max 2" in at_max.reason
    assert p.on_event(event(), running=5).start == 0  # even if something else overshot


def test_events_for_other_queues_or_instances_start_nothing() -> None:
    p = planner()
    assert p.on_event(event(queue="Other"), running=0).start == 0
    assert p.on_event(event(instance="i2"), running=0).start == 0


# -- min readers -----------------------------------------------------------------------------


def test_minimum_is_kept_and_topped_up() -> None:
    p = planner(min_readers=2, max_readers=3)
    assert p.keep_minimum("Q", running=0, now_ms=0).start == 2
    assert p.keep_minimum("Q", running=1, now_ms=0).start == 1
    assert p.keep_minimum("Q", running=2, now_ms=0).start == 0
    assert planner(min_readers=0).keep_minimum("Q", running=0, now_ms=0).start == 0


def test_clean_exits_restart_at_once_failures_back_off_exponentially() -> None:
    p = planner(min_readers=1)
    p.on_exit("Q", 0, now_ms=1_000)
    assert p.keep_minimum("Q", 0, now_ms=1_000).start == 1
    p.on_exit("Q", 1, now_ms=1_000)  # 1st failure: 100 ms
    assert p.keep_minimum("Q", 0, now_ms=1_099).start == 0
    assert p.keep_minimum("Q", 0, now_ms=1_100).start == 1
    p.on_exit("Q", 1, now_ms=2_000)  # 2nd in a row: 200 ms
    assert p.keep_minimum("Q", 0, now_ms=2_199).start == 0
    assert p.keep_minimum("Q", 0, now_ms=2_200).start == 1
    for _ in range(10):  # capped
        p.on_exit("Q", 1, now_ms=3_000)
    assert p.keep_minimum("Q", 0, now_ms=4_000).start == 1
    p.on_exit("Q", 0, now_ms=5_000)  # a clean exit resets the back-off
    p.on_exit("Q", 1, now_ms=5_000)
    assert p.keep_minimum("Q", 0, now_ms=5_100).start == 1


def test_back_off_does_not_hold_back_activation_events() -> None:
    p = planner(min_readers=1)
    p.on_exit("Q", 1, now_ms=0)
    assert p.keep_minimum("Q", 0, now_ms=0).start == 0
    assert p.on_event(event(), running=0).start == 1


# -- BROKER_QUEUE_DISABLED -------------------------------------------------------------------


def test_disabled_queue_starts_nothing_until_an_activation_event_re_enables_it() -> None:
    p = planner(min_readers=1, max_readers=2)
    d = p.on_event(event("BROKER_QUEUE_DISABLED"), running=1)
    assert d.start == 0 and p.disabled("Q")
    assert p.keep_minimum("Q", running=0, now_ms=0).start == 0  # no restarts either
    # The activation service only sends QUEUE_ACTIVATION for an enabled queue.
    assert p.on_event(event(), running=0).start == 1 and not p.disabled("Q")
    assert p.keep_minimum("Q", running=0, now_ms=0).start == 1


# -- the faust app -----------------------------------------------------------------------------
@pytest.mark.parametrize("copies", [1, 3])
def test_fausts_own_topic_gets_the_copies_the_deployment_asks_for(
    copies: int, tmp_path: Path
) -> None:
    settings = ExternalActivatorSettings(
        instance=INSTANCE,
        kafka_bootstrap="127.0.0.1:9",
        kafka_security_protocol="PLAINTEXT",
        faust_replication_factor=copies,
    )
    app = build_app(
        settings, ReaderSupervisor(settings, planner()), partitions=4, datadir=str(tmp_path)
    )
    assert app.conf.topic_replication_factor == copies
    assert app.conf.topic_partitions == 4
