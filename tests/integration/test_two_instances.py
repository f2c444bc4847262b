"""Dialogs between two broker instances on one Kafka cluster: exactly once, in order, by priority."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer

from devtools.deployment import Deployment, secure_instance
from devtools.queue_services import ThreadQueueService, with_queues
from ksb.catalog.model import Catalog, parse_catalog
from ksb.errors import QueueDisabled
from ksb.names import Names
from ksb.runtime.catalog_store import apply_catalog
from ksb.runtime.kafka import client_security
from ksb.runtime.redis_client import redis_client
from ksb.sdk.client import KsbClient
from ksb.security.principals import ADMIN, Role, peer_principal
from ksb.settings import ForwarderSettings, TransmitterSettings, TransportSettings
from ksb.transmission.links import Packet
from services.forwarder import Forwarder
from services.transmitter import Transmitter
from services.transport import Transport
from tests.conftest import Stack
from tests.integration.conftest import BASIC_CATALOG, ThreadDispatcher
from tests.integration.support import (
    check_exactly_once_in_order,
    endpoints,
    queue_receipts,
    read_topic,
    receive_all,
    wait_endpoint,
    wait_for,
)

pytestmark = pytest.mark.integration

I, T, C = "//t/Initiator", "//t/Target", "//t/Contract"  # noqa: E741


def _catalogs(address: str = "LOCAL") -> tuple[dict[str, Any], dict[str, Any]]:
    """A hosts the initiator and routes the target to B; B the reverse."""
    a = {
        **BASIC_CATALOG,
        "queues": [{"name": "InitiatorQueue", "partitions": 1}],
        "services": [{"name": I, "queue": "InitiatorQueue"}],
        "routes": [
            {"name": "to-target", "service_name": T, "broker_instance": "B", "address": address}
        ],
    }
    b = {
        **BASIC_CATALOG,
        "queues": [{"name": "TargetQueue", "partitions": 2}],
        "services": [{"name": T, "queue": "TargetQueue", "contracts": [C, "DEFAULT"]}],
        "routes": [{"name": "to-init", "service_name": I, "broker_instance": "A"}],
    }
    return a, b


FAST = {
    "tick_ms": 100,
    "suppress_after_disconnect_ms": 500,
    "suppress_after_failed_connect_ms": 1_000,
}
"""Transmitter and transport intervals for these tests (the rest at their defaults)."""


class ThreadTransmitter:
    def __init__(self, settings: Deployment) -> None:
        self.transmitter = Transmitter(
            settings.as_service(Role.TRANSMITTER).narrow(
                TransmitterSettings,
                tick_ms=FAST["tick_ms"],
                view_every_ms=100,
                retry_initial_ms=1_000,
                retry_max_ms=4_000,
            )
        )
        self.transport = Transport(
            settings.as_service(Role.TRANSPORT).narrow(
                TransportSettings,
                **FAST,
                connect_timeout_ms=1_000,
                delivery_timeout_ms=2_000,
                view_every_ms=100,
            )
        )
        self.stop_event = threading.Event()
        self.threads = [
            threading.Thread(target=self.transport.run, args=(self.stop_event,)),
            threading.Thread(target=self.transmitter.run, args=(self.stop_event,)),
        ]
        for t in self.threads:
            t.start()
        if not (self.transmitter.ready.wait(60) and self.transport.ready.wait(60)):
            raise TimeoutError("transmitter or transport not ready")

    def stop(self) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(30)


def admitting_peers(catalog: dict[str, Any]) -> dict[str, Any]:
    """`catalog` with SEND on each of its services granted to every instance its routes lead
    to: whoever it exchanges messages with may begin dialogs with it (`peer-<instance>`)."""
    peers = sorted({r["broker_instance"] for r in catalog.get("routes", [])})
    grants = [
        {"permission": "SEND", "target": s["name"], "principal": peer_principal(p)}
        for s in catalog.get("services", [])
        for p in peers
    ]
    return {**catalog, "grants": [*catalog.get("grants", []), *grants]}


class Instance:
    """One broker instance of a test: its queue service, dispatcher and transmitter (threads of
    the test process), and a client as its owner."""

    def __init__(self, settings: Deployment, catalog: dict[str, Any]) -> None:
        catalog = admitting_peers(catalog)
        settings = secure_instance(settings, parse_catalog(catalog))
        self._store = Path(tempfile.mkdtemp(prefix="ksb-queue-"))
        self.queues = ThreadQueueService(settings, self._store)
        settings = self.settings = with_queues(settings, [self.queues.address])
        self.catalog: Catalog = apply_catalog(settings, parse_catalog(catalog))
        self.dispatcher = ThreadDispatcher(settings)
        self.transmitter = ThreadTransmitter(settings)
        self.client = KsbClient(settings)

    def close(self) -> None:
        self.client.close()
        self.transmitter.stop()
        self.dispatcher.stop()
        self.queues.stop()
        shutil.rmtree(self._store, ignore_errors=True)


@contextmanager
def _two_instances(
    stack: Stack, unique: str, **a_settings: Any
) -> Iterator[tuple[Instance, Instance]]:
    """A (initiator) and B (target) on the session's cluster, routed to each other."""

    def settings(name: str, **extra: Any) -> Deployment:
        return stack.deployment(instance=f"t{unique}{name}", lock_ttl_ms=15_000, **extra)

    sa, sb = settings("A", **a_settings), settings("B")
    ca, cb = _catalogs()
    ca["routes"][0]["broker_instance"] = sb.instance
    cb["routes"][0]["broker_instance"] = sa.instance
    b = Instance(sb, cb)
    a = Instance(sa, ca)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


@pytest.fixture
def pair(stack: Stack, unique: str) -> Iterator[tuple[Instance, Instance]]:
    with _two_instances(stack, unique) as both:
        yield both


def test_request_reply_across_instances(pair: tuple[Instance, Instance]) -> None:
    a, b = pair
    h = a.client.begin_dialog(I, T, C)
    a.client.send(h, "//t/Request", json.dumps({"hello": "B"}))
    a.client.flush()
    got = receive_all(b.client, "TargetQueue", 1, timeout_s=30)
    assert len(got) == 1 and json.loads(got[0].message_body) == {"hello": "B"}
    m = got[0]
    assert m.conversation_id == h and m.service_name == T and m.message_sequence_number == 0
    with b.client.transaction() as tx:
        tx.send(m.conversation_handle, "//t/Reply", "done")
        tx.end_conversation(m.conversation_handle)
    replies = receive_all(a.client, "InitiatorQueue", 2, timeout_s=30)
    assert [r.message_type_name for r in replies] == [
        "//t/Reply",
        "http://schemas.microsoft.com/SQL/ServiceBroker/EndDialog",
    ]
    assert replies[0].conversation_handle == h and replies[0].message_body == b"done"
    a.client.end_conversation(h)
    a.client.flush()
    wait_endpoint(a.settings, h, "CLOSED", timeout_s=30)
    wait_endpoint(b.settings, m.conversation_handle, "CLOSED", timeout_s=30)
    # the transmission view drains: everything was acknowledged
    _wait_view_empty(a.settings)
    # the transmitter reports what it sent and what was acknowledged to the audit topic
    kinds = _audit_kinds(a.settings, {"transmit", "acknowledge"})
    assert {"transmit", "acknowledge"} <= kinds


def test_foreign_records_on_outbound_and_links_are_skipped_and_nothing_else_is_held_up(
    pair: tuple[Instance, Instance], caplog: pytest.LogCaptureFixture
) -> None:
    """Whoever may write the internal topics (the cluster's admin here; with security on, only
    their own services otherwise): a record that is not a packet, or not a link event, is
    skipped with a warning naming it, and traffic goes on."""
    a, b = pair
    names = Names(a.settings.instance)
    writer = a.settings.as_principal(ADMIN)
    raw = Producer(
        {
            "bootstrap.servers": writer.kafka_bootstrap,
            **client_security(writer, writer.kafka_bootstrap),
        }
    )
    raw.produce(names.outbound, value=b'{"not": "a packet"}')  # no packet headers
    packet = Packet(
        b.settings.instance,
        "LOCAL",
        Names(b.settings.instance).inbound_from(a.settings.instance),
        2**62,
    )
    raw.produce(names.outbound, value=b"not json", headers=packet.headers())
    raw.produce(names.links, value=b'{"destination": "x"}')
    raw.flush(10)
    h = a.client.begin_dialog(I, T, C)
    for n in range(5):
        a.client.send(h, "//t/Request", json.dumps({"conv": 0, "n": n}))
    a.client.flush()
    got = receive_all(b.client, "TargetQueue", 5, timeout_s=30)
    check_exactly_once_in_order([json.loads(m.message_body) for m in got], 1, 5)
    _wait_view_empty(a.settings)
    text = caplog.text
    assert "has no packet headers: skipped" in text
    assert "unreadable outbound record" in text
    assert "unreadable links record" in text


def _audit_kinds(settings: Deployment, wanted: set[str], timeout_s: float = 15) -> set[str]:
    deadline = time.monotonic() + timeout_s
    while True:
        records = read_topic(settings, Names(settings.instance).audit)
        kinds = {json.loads(v)["kind"] for _k, v in records if v}
        if wanted <= kinds or time.monotonic() > deadline:
            return kinds
        time.sleep(0.2)


def _wait_view_empty(settings: Deployment, timeout_s: float = 30) -> dict[str, Any]:
    r = redis_client(settings)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            raw = r.get(Names(settings.instance).transmission_view_key)
            view = json.loads(raw) if raw else None
            if view is not None and not view["messages"]:
                return dict(view)
            if time.monotonic() > deadline:
                raise AssertionError(f"transmission queue not drained: {view}")
            time.sleep(0.1)
    finally:
        r.close()


def _flow(a: Instance, dialogs: int, per_dialog: int) -> list[str]:
    handles = [a.client.begin_dialog(I, T, C) for _ in range(dialogs)]
    for k in range(per_dialog):
        for i, h in enumerate(handles):
            a.client.send(h, "//t/Request", json.dumps({"conv": i, "n": k}))
    a.client.flush()
    return handles


def test_500_messages_over_20_dialogs_exactly_once_in_order(
    pair: tuple[Instance, Instance],
) -> None:
    a, b = pair
    _flow(a, 20, 25)
    got = receive_all(b.client, "TargetQueue", 500, timeout_s=90)
    check_exactly_once_in_order([json.loads(m.message_body) for m in got], 20, 25)
    assert len({m.message_id for m in got}) == 500
    _wait_view_empty(a.settings)


def test_initiatordb_targetdb_priorities(pair: tuple[Instance, Instance]) -> None:
    """The seed's example: one CREATE BROKER PRIORITY in each database, levels 3 and 3."""
    a, b = pair
    ca, cb = _catalogs()
    ca["routes"][0]["broker_instance"] = b.settings.instance
    cb["routes"][0]["broker_instance"] = a.settings.instance
    ca["priorities"] = [
        {
            "name": "InitiatorAToTargetPriority",
            "contract": C,
            "local_service": I,
            "remote_service": T,
            "level": 3,
        }
    ]
    cb["priorities"] = [
        {
            "name": "TargetToInitiatorAPriority",
            "contract": C,
            "local_service": T,
            "remote_service": I,
            "level": 3,
        }
    ]
    apply_catalog(a.settings, parse_catalog(ca))
    v = apply_catalog(b.settings, parse_catalog(admitting_peers(cb))).version
    assert a.dispatcher.dispatcher.engine is not None
    _wait_catalog(a.dispatcher, v)
    _wait_catalog(b.dispatcher, v)
    h = a.client.begin_dialog(I, T, C)
    a.client.send(h, "//t/Request", "{}")
    a.client.flush()
    got = receive_all(b.client, "TargetQueue", 1, timeout_s=30)
    assert got[0].priority == 3
    assert wait_endpoint(a.settings, h, "CONVERSING").priority == 3
    assert endpoints(b.settings)[got[0].conversation_handle].priority == 3
    # a dialog begun without a matching rule on either side gets the default, 5
    h2 = a.client.begin_dialog(I, T, "DEFAULT")
    a.client.send(h2, "DEFAULT", "x")
    a.client.flush()
    got2 = receive_all(b.client, "TargetQueue", 1, timeout_s=30)
    assert got2[0].priority == 5 and endpoints(a.settings)[h2].priority == 5


def _wait_catalog(d: ThreadDispatcher, version: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while d.dispatcher.engine is None or d.dispatcher.engine.catalog.version < version:
        if time.monotonic() > deadline:
            raise AssertionError("catalog not applied")
        time.sleep(0.05)


def test_cut_link_mid_stream_then_restore(pair: tuple[Instance, Instance]) -> None:
    a, b = pair
    ca, _ = _catalogs("127.0.0.1:1")
    ca["routes"][0]["broker_instance"] = b.settings.instance
    good = _catalogs()[0]
    good["routes"][0]["broker_instance"] = b.settings.instance
    handles = [a.client.begin_dialog(I, T, C) for _ in range(10)]
    for k in range(30):
        if k == 10:
            apply_catalog(a.settings, parse_catalog(ca))  # the link is cut
            time.sleep(0.5)
        if k == 15:
            b.dispatcher.stop()  # and B stops reading its inbound topic for a while
        for i, h in enumerate(handles):
            a.client.send(h, "//t/Request", json.dumps({"conv": i, "n": k}))
        a.client.flush()
        time.sleep(0.05)
    # the view names the failure while the link is down
    deadline = time.monotonic() + 20
    rr = redis_client(a.settings)
    while True:
        raw = rr.get(Names(a.settings.instance).transmission_view_key)
        view = json.loads(raw) if raw else {"messages": [], "connections": []}
        if any(m["last_failure"] for m in view["messages"]):
            break
        assert time.monotonic() < deadline, view
        time.sleep(0.1)
    # the transport keeps B's suppression deadline in Redis (between a suppression running out
    # and the next failed attempt there is none, so wait for one)
    while rr.zscore(Names(a.settings.instance).suppress_key, b.settings.instance) is None:
        assert time.monotonic() < deadline, "no suppression deadline in Redis"
        time.sleep(0.05)
    rr.close()
    b.dispatcher = ThreadDispatcher(b.settings)  # B reads again (its window from its endpoints)
    apply_catalog(a.settings, parse_catalog(good))  # restored
    received = receive_all(b.client, "TargetQueue", 300, timeout_s=120)
    check_exactly_once_in_order([json.loads(m.message_body) for m in received], 10, 30)
    _wait_view_empty(a.settings, timeout_s=60)


def _wait_view(settings: Deployment, check: Any, timeout_s: float = 30) -> dict[str, Any]:
    r = redis_client(settings)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            raw = r.get(Names(settings.instance).transmission_view_key)
            view = json.loads(raw) if raw else {"messages": [], "connections": []}
            if check(view):
                return dict(view)
            if time.monotonic() > deadline:
                raise AssertionError(f"view never matched: {view}")
            time.sleep(0.1)
    finally:
        r.close()


def test_expired_route_holds_messages_until_renewed(pair: tuple[Instance, Instance]) -> None:
    a, b = pair
    ca, _ = _catalogs()
    ca["routes"][0]["broker_instance"] = b.settings.instance
    ca["routes"][0]["lifetime_s"] = 3
    v = apply_catalog(a.settings, parse_catalog(ca)).version
    _wait_catalog(a.dispatcher, v)
    h = a.client.begin_dialog(I, T, C)
    a.client.send(h, "//t/Request", "0")
    a.client.flush()
    assert [m.message_body for m in receive_all(b.client, "TargetQueue", 1, timeout_s=30)] == [b"0"]
    time.sleep(3.5)  # the route's LIFETIME is over
    a.client.send(h, "//t/Request", "1")
    a.client.flush()
    view = _wait_view(a.settings, lambda v: any(m["seq"] == 1 for m in v["messages"]))
    held = next(m for m in view["messages"] if m["seq"] == 1)
    assert held["status"] == "ROUTE_EXPIRED" and "route expired" in held["last_failure"]
    assert receive_all(b.client, "TargetQueue", 1, timeout_s=1.5) == []
    apply_catalog(a.settings, parse_catalog(ca))  # renewed: three more seconds
    assert [m.message_body for m in receive_all(b.client, "TargetQueue", 1, timeout_s=30)] == [b"1"]
    _wait_view_empty(a.settings)


class ThreadForwarder:
    def __init__(self, settings: Deployment) -> None:
        self.forwarder = Forwarder(
            settings.as_service(Role.FORWARDER).narrow(ForwarderSettings, tick_ms=100)
        )
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self.forwarder.run, args=(self.stop_event,))
        self.thread.start()
        if not self.forwarder.ready.wait(60):
            raise TimeoutError("forwarder not ready")

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(30)


def test_forwarded_through_a_middle_instance_survives_a_forwarder_restart(
    stack: Stack, unique: str
) -> None:
    """A -> B -> C: B hosts neither service; its forwarder passes both directions on."""

    def settings(name: str) -> Deployment:
        return stack.deployment(instance=f"t{unique}{name}", lock_ttl_ms=15_000)

    sa, sb, sc = settings("A"), settings("B"), settings("C")
    ca, cc = _catalogs()
    ca["routes"] = [
        {"name": "t", "service_name": T, "broker_instance": sc.instance, "via": sb.instance}
    ]
    cc["routes"] = [
        {"name": "i", "service_name": I, "broker_instance": sa.instance, "via": sb.instance}
    ]
    cb = {
        **BASIC_CATALOG,
        "routes": [
            {"name": "t", "service_name": T, "broker_instance": sc.instance},
            {"name": "i", "service_name": I, "broker_instance": sa.instance},
        ],
    }
    sb = secure_instance(sb, parse_catalog(cb))
    apply_catalog(sb, parse_catalog(cb))
    b_dispatcher = ThreadDispatcher(sb)  # reads the same inbound topic and leaves these alone
    b_forwarder = ThreadForwarder(sb)
    c = Instance(sc, cc)
    a = Instance(sa, ca)
    try:
        handles = [a.client.begin_dialog(I, T, C) for _ in range(5)]
        for k in range(40):
            if k == 5:  # the forwarder's task handlers publish what it holds
                assert (
                    b_forwarder.forwarder.handlers.alive == b_forwarder.forwarder.handlers.size > 0
                )
                assert _forwarded_view_published(sb)
            if k == 10:
                b_forwarder.stop()  # whatever it held is gone; nothing was acknowledged
            if k == 20:
                b_forwarder = ThreadForwarder(sb)
            for i, h in enumerate(handles):
                a.client.send(h, "//t/Request", json.dumps({"conv": i, "n": k}))
            a.client.flush()
            time.sleep(0.05)
        got = receive_all(c.client, "TargetQueue", 200, timeout_s=90)
        check_exactly_once_in_order([json.loads(m.message_body) for m in got], 5, 40)
        assert len({m.message_id for m in got}) == 200
        with c.client.transaction() as tx:  # and back: C -> B -> A
            tx.send(got[0].conversation_handle, "//t/Reply", "back")
        reply = receive_all(a.client, "InitiatorQueue", 1, timeout_s=30)
        assert [m.message_body for m in reply] == [b"back"]
        big = json.dumps({"blob": "x" * 600_000})  # fragments, joined and split again at B
        a.client.send(handles[0], "//t/Request", big)
        a.client.flush()
        assert [m.message_body for m in receive_all(c.client, "TargetQueue", 1)] == [big.encode()]
        _wait_view_empty(a.settings, timeout_s=60)
    finally:
        a.close()
        c.close()
        b_forwarder.stop()
        b_dispatcher.stop()


def _forwarded_view_published(settings: Deployment, timeout_s: float = 10) -> bool:
    r = redis_client(settings)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            raw = r.get(Names(settings.instance).forwarded_view_key)
            if raw and "updated_ms" in json.loads(raw):
                return True
            time.sleep(0.05)
        return False
    finally:
        r.close()


def test_one_megabyte_body_crosses_as_fragments(pair: tuple[Instance, Instance]) -> None:
    a, b = pair
    # about 1 MB of JSON (the contract validates it), over the 256 KiB default fragment size
    body = json.dumps({"blob": os.urandom(499_990).hex()})
    h = a.client.begin_dialog(I, T, C)
    a.client.send(h, "//t/Request", body)
    a.client.send(h, "//t/Request", '"small, after it"')
    a.client.flush()
    got = receive_all(b.client, "TargetQueue", 2, timeout_s=60)
    assert [m.message_body for m in got] == [body.encode(), b'"small, after it"']
    kinds = [
        json.loads(v or b"{}")["kind"]
        for _k, v in read_topic(
            b.settings, Names(b.settings.instance).inbound_from(a.settings.instance)
        )
    ]
    assert kinds.count("fragment") >= 4 and kinds.count("inbound") >= 1
    _wait_view_empty(a.settings)


@pytest.fixture
def solo(stack: Stack, unique: str) -> Iterator[Instance]:
    """One instance with a transmitter: local dialogs whose target queue gets disabled."""
    s = stack.deployment(instance=f"t{unique}S", lock_ttl_ms=15_000)
    inst = Instance(s, _with_target_queue(BASIC_CATALOG, "OFF"))
    try:
        yield inst
    finally:
        inst.close()


def _with_target_queue(catalog: dict[str, Any], status: str) -> dict[str, Any]:
    queues = [
        {**q, "status": status} if q["name"] == "TargetQueue" else q for q in catalog["queues"]
    ]
    return {**catalog, "queues": queues}


def _enabled(inst: Instance) -> bool:
    """Whether RECEIVE on the target queue is no longer refused (the queue service reads a
    new catalog on its own time); what it received is given back."""
    tx = inst.client.transaction()
    try:
        tx.receive("TargetQueue", waitfor_ms=0)
    except QueueDisabled:
        return False
    finally:
        tx.rollback()
    return True


def test_local_messages_wait_in_the_transmission_queue_while_the_target_queue_is_disabled(
    solo: Instance,
) -> None:
    """Issue 3: a local message that cannot be delivered waits in the transmission queue with the
    reason, ordered by its level, and is delivered exactly once, in order, after ALTER QUEUE ON."""
    handles = _flow(solo, 4, 5)
    rows = _wait_view(solo.settings, lambda v: len(v["messages"]) == 20)["messages"]
    assert {r["status"] for r in rows} == {"QUEUE_DISABLED"}
    assert all("'TargetQueue'" in r["last_failure"] for r in rows)
    assert {r["to_instance"] for r in rows} == {solo.settings.instance}
    # RECEIVE on a disabled queue fails, as SQL Server's does (error 9617)
    tx = solo.client.transaction()
    with pytest.raises(QueueDisabled):
        tx.receive("TargetQueue", waitfor_ms=300)
    tx.rollback()
    # and nothing reached the queue
    assert not [m for m, _ in queue_receipts(solo.settings, "TargetQueue").values() if m]
    # For the sender nothing failed: its SENDs were accepted, the dialog goes on.
    assert endpoints(solo.settings)[handles[0]].state.name == "CONVERSING"
    apply_catalog(solo.settings, parse_catalog(_with_target_queue(BASIC_CATALOG, "ON")))
    # Sent after the queue came back, but behind the held ones of its conversation.
    solo.client.send(handles[0], "//t/Request", json.dumps({"conv": 0, "n": 5}))
    solo.client.flush()
    wait_for("the queue service to take the queue's STATUS ON", lambda: _enabled(solo), 30)
    got = receive_all(solo.client, "TargetQueue", 21, timeout_s=60)
    bodies = [json.loads(m.message_body) for m in got]
    assert [b["n"] for b in bodies if b["conv"] == 0] == [0, 1, 2, 3, 4, 5]
    check_exactly_once_in_order([b for b in bodies if b["n"] < 5], 4, 5)
    assert len({m.message_id for m in got}) == 21
    _wait_view_empty(solo.settings)


@pytest.fixture
def tight_pair(stack: Stack, unique: str) -> Iterator[tuple[Instance, Instance]]:
    """A's transmitter may hold only ~16 messages of 1 KB in memory."""
    with _two_instances(stack, unique, transmitter_memory_bytes=24_576) as both:
        yield both


def test_memory_limit_unclassifies_dialogs_and_loses_nothing(
    tight_pair: tuple[Instance, Instance],
) -> None:
    """Issue 5: over its memory budget the transmitter sets dialogs aside (WAITING_FOR_MEMORY in
    the view) and re-registers them from the topic as acks free memory: exactly once, in order."""
    a, b = tight_pair
    pad = "x" * 1_000
    handles = [a.client.begin_dialog(I, T, C) for _ in range(10)]
    for k in range(20):
        for i, h in enumerate(handles):
            a.client.send(h, "//t/Request", json.dumps({"conv": i, "n": k, "pad": pad}))
    a.client.flush()
    seen = _wait_view(
        a.settings,
        lambda v: any(m["status"] == "WAITING_FOR_MEMORY" for m in v["messages"]),
    )
    waiting = [m for m in seen["messages"] if m["status"] == "WAITING_FOR_MEMORY"]
    assert waiting and "memory limit" in waiting[0]["last_failure"]
    got = receive_all(b.client, "TargetQueue", 200, timeout_s=120)
    bodies = [json.loads(m.message_body) for m in got]
    check_exactly_once_in_order([{"conv": x["conv"], "n": x["n"]} for x in bodies], 10, 20)
    assert len({m.message_id for m in got}) == 200
    _wait_view_empty(a.settings, timeout_s=60)
