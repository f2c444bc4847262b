"""One record Kafka will not take, amid ten thousand it will: set aside, the rest delivered.

The target queue's topic takes records of at most 256 KiB (a cluster's default limit, or an
operator's setting, below KSB's own body limit of 1 MiB), and an application SENDs a 700 KB body
(random, so compression does not shrink it under the limit) to it while a flow of 10,000 small
messages is being delivered and received. Before poison
isolation the dispatcher's transaction failed, was redone from Kafka and failed again, forever,
and nothing else was delivered. Now the batch is redone one record per transaction, the SEND
whose transaction fails alone is refused with an error record to its sender (keyed by its request
id) and skipped, and every other message arrives exactly once, in order.
"""

from __future__ import annotations

import base64
import json
import os
import threading
import time
from collections.abc import Iterator

import pytest

# confluent_kafka.admin re-exports these from a private module, with no __all__ to say so.
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
)

from devtools.deployment import Deployment
from ksb.catalog.model import Catalog
from ksb.names import Names
from ksb.runtime import kafka
from ksb.runtime.metrics import POISON_RECORDS
from ksb.sdk.client import KsbClient
from ksb.security.principals import ADMIN
from tests.integration.conftest import ThreadDispatcher
from tests.integration.support import Flow, wait_error

pytestmark = pytest.mark.integration

I, T, C = "//t/Initiator", "//t/Target", "//t/Contract"  # noqa: E741
DIALOGS, PER_DIALOG = 20, 500
TOPIC_LIMIT = 256 * 1024
BODY_LIMIT = 1024 * 1024


def _limit_topic(settings: Deployment, topic: str, max_bytes: int) -> None:
    admin = kafka.admin(settings.as_principal(ADMIN))
    entry = ConfigEntry(
        "max.message.bytes", str(max_bytes), incremental_operation=AlterConfigOpType.SET
    )
    resource = ConfigResource(ConfigResource.Type.TOPIC, topic, incremental_configs=[entry])
    for fut in admin.incremental_alter_configs([resource]).values():
        fut.result(30)


@pytest.fixture
def roomy(settings: Deployment, catalog: Catalog) -> Iterator[Deployment]:
    """The instance with KSB's default body limit (1 MiB), its dispatcher running."""
    wide = settings.model_copy(update={"max_body_bytes": BODY_LIMIT})
    d = ThreadDispatcher(wide)
    try:
        yield wide
    finally:
        d.stop()


def test_a_record_kafka_refuses_is_refused_and_the_others_are_delivered(
    roomy: Deployment, client: KsbClient
) -> None:
    settings = roomy
    _limit_topic(settings, Names(settings.instance).queue("TargetQueue"), TOPIC_LIMIT)
    refused_before = POISON_RECORDS.labels("refused")._value.get()
    flow = Flow(settings, client, dialogs=DIALOGS, per_dialog=PER_DIALOG, max_outstanding=16)
    flow.start()
    longest_pause_s, stop = [0.0], threading.Event()

    def watch() -> None:
        """The longest time the flow's deliveries stood still (the figure for the notes)."""
        last_count, last_change = 0, time.monotonic()
        while not stop.wait(0.02):
            n = len(flow.received)
            now = time.monotonic()
            if n != last_count:
                longest_pause_s[0] = max(longest_pause_s[0], now - last_change)
                last_count, last_change = n, now

    watcher = threading.Thread(target=watch, daemon=True)
    try:
        flow.wait_received(DIALOGS * PER_DIALOG // 5, timeout_s=120)
        watcher.start()
        with KsbClient(settings) as poisoner:
            handle = poisoner.begin_dialog(I, T, C)
            pad = base64.b64encode(os.urandom(520 * 1024)).decode()  # ~700 KB, incompressible
            poisoner.send(handle, "//t/Request", json.dumps({"pad": pad}))
            poisoner.flush()
        err = wait_error(settings, lambda r: r.get("code") == "poison_record", timeout_s=120)
        assert "failed twice, alone" in err["reason"] and err["request_id"], err
        assert err["source_topic"] == Names(settings.instance).requests_for(settings.sender)
        flow.wait_received(DIALOGS * PER_DIALOG, timeout_s=600)
    finally:
        stop.set()
        flow.close()
    flow.check_exactly_once_in_order()
    assert POISON_RECORDS.labels("refused")._value.get() == refused_before + 1
    print(f"longest pause in deliveries around the poison record: {longest_pause_s[0]:.2f} s")
    # Deliveries went on: not a figure of speed, only that nothing stood still for long.
    assert longest_pause_s[0] < 30
