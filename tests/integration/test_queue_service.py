"""The queue service under its clients: replicas that die or stop, and applications that attack.

Two replicas as child processes serve one instance; a flow of dialogs is received and committed
through them while one is SIGKILLed or SIGSTOPped: the clients move on to the other within
seconds, the dead replica's locks expire by their lease, and every message arrives exactly once
and in order. Then an application with a login of its own tries what it should not: no password,
a wrong one, a queue it may not RECEIVE from, another principal's lease, a forged lease, a commit
without one, limits past the API's bounds. Each is refused with its reason, and nothing else is
disturbed.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from devtools.deployment import Deployment
from devtools.queue_services import QueueReplicas
from ksb.api.queue.v1 import queue_pb2 as pb
from ksb.api.queue.v1 import queue_pb2_grpc as pb_grpc
from ksb.catalog.model import Catalog, Grant
from ksb.errors import NotAuthorized, ProtocolError
from ksb.names import Names
from ksb.runtime import kafka
from ksb.runtime.credentials import kafka_login
from ksb.sdk.client import KsbClient
from ksb.wire.protocol import CommitRequest, Receipt, dumps
from tests.integration.conftest import ThreadDispatcher, make_application
from tests.integration.support import Flow, receive_all, wait_error

pytestmark = pytest.mark.integration

I, T, C = "//t/Initiator", "//t/Target", "//t/Contract"  # noqa: E741
DIALOGS, PER_DIALOG = 20, 15


@pytest.fixture
def replicas(settings: Deployment, catalog: Catalog, tmp_path: Path) -> Iterator[QueueReplicas]:
    pool = QueueReplicas(settings, tmp_path / "queue").start(2)
    try:
        yield pool
    finally:
        pool.stop()


def _quick(settings: Deployment, pool: QueueReplicas) -> Deployment:
    """Clients of `pool` that give up on a silent replica after a second and a half."""
    return pool.client_settings(settings).model_copy(update={"queue_timeout_ms": 1500})


@pytest.mark.parametrize("fault", ["kill", "pause"])
def test_clients_go_on_on_the_other_replica_when_one_dies_or_stops(
    settings: Deployment, replicas: QueueReplicas, dispatcher: ThreadDispatcher, fault: str
) -> None:
    clients = _quick(settings, replicas)
    with KsbClient(clients) as sender:
        flow = Flow(clients, sender, dialogs=DIALOGS, per_dialog=PER_DIALOG, max_outstanding=8)
        flow.start()
        try:
            flow.wait_received(DIALOGS * PER_DIALOG // 3, timeout_s=60)
            first = replicas.members["q1"]  # every client starts on the first address
            if fault == "kill":
                first.kill()
            else:
                first.pause()
            at_fault = len(flow.received)
            started = time.monotonic()
            flow.wait_received(at_fault + 10, timeout_s=30)
            moved_s = time.monotonic() - started
            flow.wait_received(DIALOGS * PER_DIALOG, timeout_s=120)
        finally:
            replicas.members["q1"].resume()
            flow.close()
    flow.check_exactly_once_in_order()
    assert moved_s < 15, f"deliveries stood still {moved_s:.1f} s after the {fault}"


def _stub(pool: QueueReplicas) -> pb_grpc.QueueServiceStub:
    return pb_grpc.QueueServiceStub(grpc.insecure_channel(pool.addresses[1]))


def _login(settings: Deployment, *, password: str | None = None) -> tuple[tuple[str, str], ...]:
    login = kafka_login(settings, settings.kafka_bootstrap)
    return (("ksb-principal", login.username), ("ksb-password", password or login.password))


def _code(call: Callable[[], object]) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code()
    raise AssertionError("the call was not refused")


def _request(request_id: str) -> Callable[[dict[str, Any]], bool]:
    """Matches the error record of `request_id`."""
    return lambda record: record.get("request_id") == request_id


def _one_message(settings: Deployment) -> None:
    with KsbClient(settings) as client:
        h = client.begin_dialog(I, T, C)
        client.send(h, "//t/Request", json.dumps({"n": 0}))
        client.flush()


def test_no_anonymous_or_wrong_login_and_no_receive_without_the_grant(
    settings: Deployment, replicas: QueueReplicas, dispatcher: ThreadDispatcher
) -> None:
    if not settings.secured:
        pytest.skip("a stack without security checks no login")
    stub = _stub(replicas)
    receive = pb.ReceiveRequest(queue="TargetQueue", waitfor_ms=0)
    assert _code(lambda: stub.Receive(receive)) is grpc.StatusCode.UNAUTHENTICATED
    owner = _login(settings)
    nobody = (owner[0],)  # a principal, no password
    assert _code(lambda: stub.Receive(receive, metadata=nobody)) is grpc.StatusCode.UNAUTHENTICATED
    wrong = _login(settings, password="not-the-password")
    assert _code(lambda: stub.Receive(receive, metadata=wrong)) is grpc.StatusCode.UNAUTHENTICATED
    sender = make_application(
        settings, "senderonly", [Grant(permission="SEND", target=T, principal="senderonly")]
    )
    only_send = _login(sender)
    assert (
        _code(lambda: stub.Receive(receive, metadata=only_send))
        is grpc.StatusCode.PERMISSION_DENIED
    )
    with KsbClient(replicas.client_settings(sender)) as client, pytest.raises(NotAuthorized):
        client.transaction().receive("TargetQueue")


def test_a_lease_is_only_its_principals_and_cannot_be_forged(
    settings: Deployment, replicas: QueueReplicas, dispatcher: ThreadDispatcher
) -> None:
    """A second application, granted RECEIVE on the same queue, takes the owner's lease: the
    queue service will not renew or wait on it for another principal, and a commit record
    carrying it on the thief's own requests topic is refused `bad_lease`, as is one whose lease
    had its token raised, and one with no lease at all. The owner's commit then applies."""
    thief = make_application(
        settings,
        "thief",
        [
            Grant(permission="RECEIVE", target="TargetQueue", principal="thief"),
        ],
    )
    owner_settings = replicas.client_settings(settings)
    _one_message(owner_settings)
    with KsbClient(owner_settings) as owner:
        tx = owner.transaction()
        got = tx.receive("TargetQueue", waitfor_ms=10_000)
        assert len(got) == 1 and tx.lease
        stub = _stub(replicas)
        theirs = _login(thief)
        renew = pb.RenewLocksRequest(leases=[tx.lease])
        assert _code(lambda: stub.RenewLocks(renew, metadata=theirs)) is (
            grpc.StatusCode.PERMISSION_DENIED
        )
        wait = pb.CommitRequest(lease=tx.lease, request_id="x", timeout_ms=100)
        assert (
            _code(lambda: stub.Commit(wait, metadata=theirs)) is grpc.StatusCode.PERMISSION_DENIED
        )
        ids = tuple(m.message_id for m in got)
        group = got[0].conversation_group_id
        head, _, mac = tx.lease.partition(".")
        payload = base64.urlsafe_b64decode(head + "=" * (-len(head) % 4))
        raised = payload.replace(f'"token":{tx.token}'.encode(), b'"token":4611686018427387904')
        forged = base64.urlsafe_b64encode(raised).rstrip(b"=").decode() + "." + mac
        attempts = {
            "stolen": Receipt(queue="TargetQueue", group=group, message_ids=ids, lease=tx.lease),
            "forged": Receipt(queue="TargetQueue", group=group, message_ids=ids, lease=forged),
            "bare": Receipt(queue="TargetQueue", group=group, message_ids=ids, token=2**62),
        }
        producer = kafka.producer(thief)
        topic = Names(thief.instance).requests_for(thief.sender)
        for name, receipt in attempts.items():
            req = CommitRequest(request_id=f"attack-{name}", reader="thief", receipt=receipt)
            producer.produce(topic, key=group.encode(), value=dumps(req))
        assert producer.flush(10) == 0
        for name in attempts:
            refusal = wait_error(thief, _request(f"attack-{name}"))
            assert refusal["code"] == "bad_lease", (name, refusal)
        tx.commit()  # the rightful holder: its lock and its fence are untouched
    with KsbClient(owner_settings) as owner:
        assert receive_all(owner, "TargetQueue", 1, timeout_s=2) == []


def test_arguments_past_the_apis_bounds_are_refused_with_the_reason(
    settings: Deployment, replicas: QueueReplicas
) -> None:
    stub = _stub(replicas)
    login = _login(settings) if settings.secured else (("ksb-principal", settings.principal),)
    requests = [
        pb.ReceiveRequest(queue="TargetQueue", top=10**6),
        pb.ReceiveRequest(queue="TargetQueue", waitfor_ms=10**9),
        pb.ReceiveRequest(queue=""),
        pb.ReceiveRequest(queue="TargetQueue", lease="garbage"),
    ]
    for request in requests:

        def receive(r: pb.ReceiveRequest = request) -> object:
            return stub.Receive(r, metadata=login)

        code = _code(receive)
        assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED), (
            request,
            code,
        )
    assert _code(lambda: stub.Receive(pb.ReceiveRequest(queue="NoSuchQueue"), metadata=login)) in (
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.PERMISSION_DENIED,
    )
    with KsbClient(replicas.client_settings(settings)) as client, pytest.raises(ProtocolError):
        client.transaction().receive("TargetQueue", top=10**6)
