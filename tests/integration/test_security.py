"""Security against the real secured stack: every refusal, its clear error, and nothing lost.

Each case runs beside a real dialog of the test's owner (`flow`): after the refused attempt the
dialog's messages are all there, once and in order (`Flow.check`), so a refusal never costs a
legitimate message. The grant-level cases (BEGIN from a service not granted, SEND on another
service's endpoint, commit on a queue without RECEIVE) belong to the dispatcher and reuse
`make_application` from `tests.integration.conftest`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import redis
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from devtools.deployment import Deployment
from ksb.activation import activated
from ksb.catalog.model import Catalog, Grant
from ksb.cli.readers import read_endpoints
from ksb.errors import NotAuthorized, SecurityError
from ksb.names import Names
from ksb.runtime import kafka
from ksb.runtime.catalog_store import load_catalog
from ksb.runtime.redis_client import redis_client
from ksb.sdk.client import KsbClient, Transaction
from ksb.security.principals import Role
from ksb.settings import ActivatedTaskSettings, ClientSettings, settings_env
from ksb.wire.protocol import CommitRequest, QueueMessage, Receipt, dumps
from tests.conftest import Stack
from tests.integration.conftest import ThreadDispatcher, make_application, serving
from tests.integration.support import receive_all, wait_error

pytestmark = pytest.mark.integration

I, T, C = "//t/Initiator", "//t/Target", "//t/Contract"  # noqa: E741
TARGET_QUEUE, INITIATOR_QUEUE = "TargetQueue", "InitiatorQueue"


@pytest.fixture(autouse=True)
def _secured(stack: Stack) -> None:
    if not stack.security.enabled:
        pytest.skip("the stack runs without security (KSB_STACK_SECURITY=plaintext)")


# ----------------------------------------------------------------- helpers
@dataclass
class Flow:
    """A dialog of the owner's with messages sent before and after an attack."""

    client: KsbClient
    handle: str
    sent: list[int] = field(default_factory=list)

    def send(self, n: int) -> None:
        for _ in range(n):
            k = len(self.sent)
            self.client.send(self.handle, "//t/Request", json.dumps({"n": k}))
            self.sent.append(k)
        self.client.flush()

    def check(self) -> None:
        """Everything sent is in the target queue once and in order (then received)."""
        self.send(2)
        got = receive_all(self.client, TARGET_QUEUE, len(self.sent), timeout_s=60)
        assert [json.loads(m.message_body)["n"] for m in got] == self.sent


@pytest.fixture
def flow(catalog: Catalog, dispatcher: ThreadDispatcher, client: KsbClient) -> Flow:
    f = Flow(client, client.begin_dialog(I, T, C))
    f.send(3)
    return f


def _conf(settings: Deployment, **extra: Any) -> dict[str, Any]:
    return {
        "bootstrap.servers": settings.kafka_bootstrap,
        **kafka.client_security(settings, settings.kafka_bootstrap),
        **extra,
    }


def _refused_write(settings: Deployment, topic: str) -> KafkaError:
    """Produce one record as `settings`' principal; the delivery error it gets."""
    reports: list[KafkaError | None] = []
    p = Producer(_conf(settings, **{"enable.idempotence": False, "message.timeout.ms": 10_000}))
    p.produce(topic, value=b'{"v":1,"kind":"x"}', on_delivery=lambda e, _m: reports.append(e))
    p.flush(15)
    assert reports and reports[0] is not None, f"{topic} accepted a write it should refuse"
    return reports[0]


def _refused_read(settings: Deployment, topic: str) -> KafkaError:
    """Read `topic` from its start as `settings`' principal; the error it gets."""
    c = Consumer(_conf(settings, **{"group.id": Names(settings.instance).reader_group}))
    try:
        # A topic the principal may not even see answers its metadata request with the refusal
        # (and so does one that does not exist: existence does not leak).
        error: KafkaError | None = c.list_topics(topic, timeout=15).topics[topic].error
        if error is not None:
            return error
        c.assign([TopicPartition(topic, 0, -2)])
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            m = c.poll(0.5)
            if m is None:
                continue
            err = m.error()
            assert err is not None, f"{topic}: read a record it should not"
            if err.code() != KafkaError._PARTITION_EOF:
                return err
        raise AssertionError(f"{topic}: no refusal within 15 s")
    finally:
        c.close()


def _login_errors(conf: dict[str, Any]) -> tuple[KafkaException, list[KafkaError]]:
    """What a client with `conf` gets: the exception of a metadata request, and what librdkafka
    reported through its error callback (the only place the reason shows)."""
    seen: list[KafkaError] = []
    p = Producer({**conf, "error_cb": seen.append})
    with pytest.raises(KafkaException) as refused:
        p.list_topics(timeout=3)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not any(
        e.code() in (KafkaError._AUTHENTICATION, KafkaError._ALL_BROKERS_DOWN) for e in seen
    ):
        p.poll(0.2)
    return refused.value, seen


@pytest.fixture
def alice(settings: Deployment, catalog: Catalog) -> Deployment:
    """An application that is the initiator's service (RECEIVE on its queue) and may begin
    dialogs with the target (SEND on it), as SQL Server grants them."""
    return make_application(
        settings,
        "alice",
        [
            Grant(permission="RECEIVE", target=INITIATOR_QUEUE, principal="alice"),
            Grant(permission="SEND", target=T, principal="alice"),
        ],
    )


# ----------------------------------------------------------------- no or wrong credentials
def test_no_credentials_are_refused_by_kafka_and_named_by_ksb(
    settings: Deployment, flow: Flow
) -> None:
    anonymous = {"bootstrap.servers": settings.kafka_bootstrap, "security.protocol": "PLAINTEXT"}
    refused, _ = _login_errors(anonymous)
    assert refused.args[0].code() == KafkaError._TRANSPORT
    # KSB itself never gets that far: a process without credentials is told which are missing.
    nobody = ClientSettings(instance=settings.instance, kafka_bootstrap=settings.kafka_bootstrap)
    with pytest.raises(SecurityError, match="KSB_KAFKA_USERNAME"):
        KsbClient(nobody)
    flow.check()


def test_a_wrong_kafka_password_is_refused_with_the_reason(
    settings: Deployment, flow: Flow
) -> None:
    conf = _conf(settings)
    conf["sasl.password"] = "not-the-password"
    refused, seen = _login_errors(conf)
    assert refused.args[0].code() == KafkaError._TRANSPORT
    reasons = " ".join(e.str() for e in seen)
    assert "Authentication failed" in reasons and "SCRAM-SHA-512" in reasons, reasons
    flow.check()


def test_redis_refuses_no_credentials_and_a_wrong_password(
    settings: Deployment, flow: Flow
) -> None:
    anonymous = redis.Redis.from_url(settings.redis_url)
    with pytest.raises(redis.AuthenticationError):  # `default` is off
        anonymous.ping()
    wrong = redis.Redis.from_url(settings.redis_url, username=settings.redis_username, password="x")
    with pytest.raises(redis.AuthenticationError, match="invalid username-password pair"):
        wrong.ping()
    flow.check()


# ----------------------------------------------------------------- topics of others
def test_a_principal_cannot_read_another_queue(alice: Deployment, flow: Flow) -> None:
    """RECEIVE is the queue service's: an application reads no queue topic itself, not even
    its own queue's, and the service refuses a RECEIVE on a queue it has no grant for."""
    names = Names(alice.instance)
    for queue in (TARGET_QUEUE, INITIATOR_QUEUE):
        err = _refused_read(alice, names.queue(queue))
        assert err.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED, queue
    with (
        KsbClient(alice) as client,
        pytest.raises(NotAuthorized, match=f"lacks RECEIVE on {TARGET_QUEUE}"),
        client.transaction() as tx,
    ):
        tx.receive(TARGET_QUEUE, waitfor_ms=500)
    with KsbClient(alice) as client, client.transaction() as tx:  # its own queue it may read
        assert tx.receive(INITIATOR_QUEUE, waitfor_ms=300) == []
    flow.check()


def test_a_principal_cannot_write_the_catalog(
    settings: Deployment, alice: Deployment, flow: Flow
) -> None:
    before = load_catalog(settings).version
    err = _refused_write(alice, Names(alice.instance).catalog)
    assert err.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED
    assert "Topic authorization failed" in err.str()
    assert load_catalog(settings).version == before
    flow.check()


@pytest.mark.parametrize("topic", ["inbound", "acks"])
def test_a_principal_cannot_write_an_instances_inbound_or_acks(
    alice: Deployment, flow: Flow, topic: str
) -> None:
    err = _refused_write(alice, getattr(Names(alice.instance), topic))
    assert err.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED
    flow.check()


def test_a_principal_cannot_write_another_principals_requests_topic(
    settings: Deployment, alice: Deployment, flow: Flow
) -> None:
    names = Names(alice.instance)
    bob = make_application(settings, "bob", [Grant(permission="SEND", target=I, principal="bob")])
    err = _refused_write(alice, names.requests_of(bob.acting_principal))
    assert err.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED
    # Its own is open to it, and to it only.
    p = Producer(_conf(alice))
    p.produce(names.requests_of("alice"), value=b"{}")
    assert p.flush(15) == 0
    flow.check()


def test_a_service_is_confined_to_its_role(settings: Deployment, flow: Flow) -> None:
    """Least privilege holds for the services too: the transmitter may not write queues or
    the catalog, the dispatcher may not write the catalog nor read the operator's errors."""
    names = Names(settings.instance)
    transmitter = settings.as_service(Role.TRANSMITTER)
    for topic in (names.queue(TARGET_QUEUE), names.catalog, names.requests):
        assert _refused_write(transmitter, topic).code() == KafkaError.TOPIC_AUTHORIZATION_FAILED
    dispatcher = settings.as_service(Role.DISPATCHER)
    assert _refused_write(dispatcher, names.catalog).code() == KafkaError.TOPIC_AUTHORIZATION_FAILED
    operator_errors = names.errors_of(f"ksb-{settings.instance}-operator")
    assert _refused_read(dispatcher, operator_errors).code() in (
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
    )
    flow.check()


def test_an_instances_principals_cannot_reach_another_instance(
    stack: Stack, settings: Deployment, flow: Flow, unique: str
) -> None:
    other = Names(f"t{unique}other")
    for role in (Role.DISPATCHER, Role.OPERATOR):
        who = settings.as_service(role)
        err = _refused_write(who, other.requests)
        assert err.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED, role
    flow.check()


# ----------------------------------------------------------------- Redis keys
def test_an_application_has_no_redis_login(alice: Deployment, flow: Flow) -> None:
    """Locks are the queue service's: an application's password opens no Redis connection."""
    password = kafka.client_security(alice, alice.kafka_bootstrap)["sasl.password"]
    r = redis.Redis.from_url(alice.redis_url, username="alice", password=password)
    with pytest.raises(redis.AuthenticationError, match="invalid username-password pair"):
        r.ping()
    flow.check()


def test_redis_keys_outside_a_services_own_are_refused(
    settings: Deployment, flow: Flow, unique: str
) -> None:
    """The queue service, which holds the locks, reaches its own instance's keys only."""
    names = Names(settings.instance)
    r = redis_client(settings.as_service(Role.QUEUE))
    try:
        r.hset(names.lock_key(INITIATOR_QUEUE, "probe"), "holder", "")  # its instance: allowed
        r.hdel(names.lock_key(INITIATOR_QUEUE, "probe"), "holder")
        with pytest.raises(redis.exceptions.NoPermissionError, match="keys used as arguments"):
            r.hget(Names(f"t{unique}other").lock_key(INITIATOR_QUEUE, "g"), "holder")
        with pytest.raises(redis.exceptions.NoPermissionError, match="'flushall' command"):
            r.flushall()
    finally:
        r.close()
    flow.check()


def test_a_lua_script_cannot_reach_keys_outside_a_services_own(
    settings: Deployment, flow: Flow, unique: str
) -> None:
    names = Names(settings.instance)
    r = redis_client(settings.as_service(Role.QUEUE))
    own = names.lock_key(INITIATOR_QUEUE, "lua-probe")
    other = Names(f"t{unique}other").lock_key(INITIATOR_QUEUE, "g")
    try:
        touch = r.register_script("return redis.call('HSET', KEYS[1], 'holder', 'me')")
        assert touch(keys=[own]) in (0, 1)
        # A key passed to the script is checked before the script runs ...
        with pytest.raises(redis.exceptions.NoPermissionError, match="keys used as arguments"):
            touch(keys=[other])
        # ... and one the script names itself is refused when it is touched.
        sneak = r.register_script(f"return redis.call('HSET', '{other}', 'holder', 'me')")
        with pytest.raises(redis.exceptions.ResponseError, match="script can't access"):
            sneak(keys=[own])
        r.hdel(own, "holder")
    finally:
        r.close()
    admin = redis_client(settings.as_principal("admin"))
    try:
        assert admin.hget(other, "holder") is None
    finally:
        admin.close()
    flow.check()


# ----------------------------------------------------------------- grants (the dispatcher's)
def _catalog_taken(dispatcher: ThreadDispatcher, settings: Deployment) -> None:
    """Wait until the dispatcher runs the newest catalog (grants change with it)."""
    want = load_catalog(settings).version
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        engine = dispatcher.dispatcher.engine
        if engine is not None and engine.catalog.version >= want:
            return
        time.sleep(0.05)
    raise AssertionError(f"the dispatcher did not take catalog v{want} in 15 s")


def _not_authorized(who: Deployment, handle: str, *words: str) -> dict[str, Any]:
    """The refusal of `who`'s request on `handle`, from `who`'s own errors topic."""
    err = wait_error(who, lambda r: r.get("handle") == handle)
    assert err["code"] == "not_authorized", err
    for w in (repr(who.acting_principal), *words):
        assert w in err["reason"], err
    return err


def _target_of(settings: Deployment, initiator: str) -> str:
    """The handle of the target endpoint of the dialog `initiator` began (endpoints topic)."""
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        for ep in read_endpoints(settings).values():
            if ep.conversation_id == initiator and not ep.is_initiator:
                return ep.handle
        time.sleep(0.1)
    raise AssertionError(f"no target endpoint for {initiator} in 15 s")


def _receive_on(client: KsbClient, handle: str) -> list[str]:
    """The bodies waiting on one conversation of the target queue, received and committed."""
    with client.transaction() as tx:
        got = tx.receive(TARGET_QUEUE, conversation_handle=handle, waitfor_ms=10_000)
    return [json.loads(m.message_body)["n"] for m in got]


def test_a_begin_from_a_service_not_granted_is_refused_to_its_sender_only(
    settings: Deployment, alice: Deployment, dispatcher: ThreadDispatcher, flow: Flow
) -> None:
    _catalog_taken(dispatcher, settings)
    with KsbClient(alice) as client:
        handle = client.begin_dialog(T, I, C)  # alice is I's, not T's
        client.flush()
        _not_authorized(alice, handle, f"as service {T!r}", "RECEIVE ON [TargetQueue]")
        granted = client.begin_dialog(I, T, C)
        client.send(granted, "//t/Request", json.dumps({"n": "alice"}))
        client.flush()
    assert _receive_on(flow.client, _target_of(settings, granted)) == ["alice"]
    names = Names(settings.instance)
    bob = make_application(settings, "bob", [Grant(permission="SEND", target=I, principal="bob")])
    err = _refused_read(bob, names.errors_of("alice"))  # only alice reads alice's refusals
    assert err.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED
    flow.check()


def test_a_send_on_another_services_endpoint_is_refused(
    settings: Deployment, alice: Deployment, dispatcher: ThreadDispatcher, flow: Flow
) -> None:
    """Alice begins a dialog to T and tries to answer herself on T's side of it."""
    _catalog_taken(dispatcher, settings)
    with KsbClient(alice) as client:
        handle = client.begin_dialog(I, T, C)
        client.send(handle, "//t/Request", json.dumps({"n": "question"}))
        client.flush()
        target = _target_of(settings, handle)
        client.send(target, "//t/Request", json.dumps({"n": "forged"}))
        client.flush()
        _not_authorized(alice, target, f"as service {T!r}")
    assert _receive_on(flow.client, target) == ["question"]
    flow.check()


def test_a_receipt_on_a_queue_without_receive_is_refused(
    settings: Deployment, alice: Deployment, dispatcher: ThreadDispatcher, flow: Flow
) -> None:
    """Alice cannot read the target queue's topic, but message ids have a known shape
    (``<handle>:<n>``): she names the owner's waiting messages in a receipt of her own."""
    _catalog_taken(dispatcher, settings)
    target = _target_of(settings, flow.handle)
    guessed = tuple(f"{target}:{n}" for n in range(len(flow.sent)))
    request = CommitRequest(receipt=Receipt(queue=TARGET_QUEUE, group=target, message_ids=guessed))
    p = kafka.producer(alice)
    p.produce(
        Names(alice.instance).requests_for(alice.sender), key=target.encode(), value=dumps(request)
    )
    assert p.flush(15) == 0
    err = wait_error(alice, lambda r: r.get("request_id") == request.request_id)
    assert err["code"] == "not_authorized" and repr(TARGET_QUEUE) in err["reason"], err
    assert "RECEIVE" in err["reason"]
    flow.check()  # every message the receipt named is still there for the owner


def test_revoked_grants_are_refused_by_the_running_dispatcher(
    settings: Deployment, alice: Deployment, dispatcher: ThreadDispatcher, flow: Flow
) -> None:
    """SEND on the target revoked: no new dialog with it (the one begun goes on, as in SQL
    Server, where SEND is checked when a dialog begins); RECEIVE on the initiator's queue
    revoked: alice no longer acts as the initiator, not even on her own dialog."""
    _catalog_taken(dispatcher, settings)
    receive_iq = Grant(permission="RECEIVE", target=INITIATOR_QUEUE, principal="alice")
    with KsbClient(alice) as client:
        before = client.begin_dialog(I, T, C)
        client.flush()
        make_application(settings, "alice", [receive_iq])
        _catalog_taken(dispatcher, settings)
        late = client.begin_dialog(I, T, C)
        client.send(before, "//t/Request", json.dumps({"n": "on a dialog begun before"}))
        client.flush()
        _not_authorized(alice, late, f"to service {T!r}", "SEND on SERVICE::")
        make_application(settings, "alice", [Grant(permission="SEND", target=T, principal="alice")])
        _catalog_taken(dispatcher, settings)
        client.send(before, "//t/Request", json.dumps({"n": "after revoke"}))
        client.flush()
        _not_authorized(alice, before, f"as service {I!r}")
    assert _receive_on(flow.client, _target_of(settings, before)) == ["on a dialog begun before"]
    flow.check()


# ----------------------------------------------------------------- revocation
@pytest.fixture
def carol(settings: Deployment, catalog: Catalog) -> Iterator[Deployment]:
    yield make_application(
        settings,
        "carol",
        [
            Grant(permission="SEND", target=I, principal="carol"),
            Grant(permission="RECEIVE", target=TARGET_QUEUE, principal="carol"),
        ],
    )


def _procedure(_tx: Transaction, _msgs: list[QueueMessage]) -> None:
    raise AssertionError("a task that may not RECEIVE never runs its procedure")


def test_a_revoked_grant_stops_a_running_client_without_a_restart(
    settings: Deployment, carol: Deployment, flow: Flow, caplog: pytest.LogCaptureFixture
) -> None:
    client = KsbClient(carol)
    try:
        with client.transaction() as tx:  # granted: it RECEIVEs, then rolls back
            assert tx.receive(TARGET_QUEUE, waitfor_ms=10_000)
            tx.rollback()
        make_application(settings, "carol", [Grant(permission="SEND", target=I, principal="carol")])
        # The same client, refused at its next RECEIVE once the queue service has the catalog.
        deadline = time.monotonic() + 15
        refused: NotAuthorized | None = None
        while time.monotonic() < deadline and refused is None:
            try:
                with client.transaction() as tx:
                    tx.receive(TARGET_QUEUE, waitfor_ms=200)
                    tx.rollback()
            except NotAuthorized as exc:
                refused = exc
        assert refused is not None, "RECEIVE still allowed 15 s after the grant was revoked"
        assert f"lacks RECEIVE on {TARGET_QUEUE}" in str(refused)
        # An activated task logged in as carol ends saying so, with its own status, no traceback.
        env = settings_env(carol.narrow(ActivatedTaskSettings))
        with mock.patch.dict(os.environ, env, clear=True), caplog.at_level(logging.ERROR):
            status = activated.main([TARGET_QUEUE, f"{__name__}:_procedure", "t1"])
        assert status == activated.EXIT_NOT_AUTHORIZED
        [line] = [r for r in caplog.records if r.name == activated.log.name]
        assert "may not RECEIVE" in line.getMessage() and line.exc_info is None
    finally:
        client.close()
    flow.check()  # the rolled-back messages are all still there for the owner


# ----------------------------------------------------------------- rotation, the CLI
def test_a_rotated_password_refuses_new_logins_with_the_old_one_only(
    stack: Stack, settings: Deployment, alice: Deployment, flow: Flow
) -> None:
    from ksb.runtime.credentials import CredentialStore
    from ksb.security.apply import rotate_password

    old = kafka.client_security(alice, alice.kafka_bootstrap)
    live = Producer({"bootstrap.servers": alice.kafka_bootstrap, **old})
    live.produce(Names(alice.instance).requests_of("alice"), value=b"{}")
    assert live.flush(15) == 0
    rotate_password(stack.admin(), CredentialStore(stack.security.store.root), "alice")
    # A connection that is open keeps working (no re-authentication) ...
    live.produce(Names(alice.instance).requests_of("alice"), value=b"{}")
    assert live.flush(15) == 0
    # ... a new one needs the new password, which the password file now holds.
    _, seen = _login_errors({"bootstrap.servers": alice.kafka_bootstrap, **old})
    assert any("Authentication failed" in e.str() for e in seen), seen
    fresh = Producer(_conf(alice))
    assert fresh.list_topics(timeout=10) is not None
    # The queue service checks a caller's login with Kafka, so the old password is refused
    # there too (once its memory of the old login has lapsed: a refused one is asked again).
    stale = alice.model_copy(update={"kafka_password": old["sasl.password"]})
    with (
        pytest.raises(NotAuthorized, match="refused this login"),
        KsbClient(stale) as client,
        client.transaction() as tx,
    ):
        tx.receive(INITIATOR_QUEUE, waitfor_ms=100)
    with KsbClient(alice) as client, client.transaction() as tx:
        assert tx.receive(INITIATOR_QUEUE, waitfor_ms=100) == []
    flow.check()


def test_redis_users_are_saved_to_its_acl_file(
    stack: Stack, settings: Deployment, flow: Flow
) -> None:
    """Redis reloads its users from its ACL file at a restart (``ACL LOAD`` does the same now):
    the principals `ksb acl apply` made, and a rotated password, must be in it. (The owner's:
    applications have no Redis user.)"""
    from ksb.runtime.credentials import CredentialStore
    from ksb.security.apply import rotate_password

    store = CredentialStore(stack.security.store.root)
    rotate_password(stack.admin(), store, settings.acting_principal)
    admin = redis_client(stack.admin())
    try:
        admin.execute_command("ACL", "LOAD")  # type: ignore[no-untyped-call]
    finally:
        admin.close()
    assert redis_client(settings).ping()  # the new password, read back from the file
    assert redis_client(settings.as_service(Role.QUEUE)).ping()
    flow.check()


def test_ksb_acl_and_principal_commands(stack: Stack, settings: Deployment, flow: Flow) -> None:
    from typer.testing import CliRunner

    from ksb.cli import app
    from ksb.settings import CliSettings, settings_env

    admin = stack.admin(instance=settings.instance).narrow(CliSettings)
    env = {k: v for k, v in settings_env(admin).items() if k.startswith("KSB_")}

    def ksb(*args: str) -> str:
        result = CliRunner().invoke(app, list(args), env=env)
        assert result.exit_code == 0, result.output
        return result.stdout

    added = ksb("principal", "add", "dave")
    assert "dave: created" in added and "dave.password" in added
    plan = ksb("acl", "plan", "--owner", settings.acting_principal)
    assert (
        f"User:ksb-{settings.instance}-dispatcher READ topic:ksb.{settings.instance}.requests.*"
        in plan
    )
    assert "dave" not in plan  # no grant yet: no rights
    applied = ksb("acl", "apply", "--owner", settings.acting_principal)
    assert "applied in" in applied
    again = ksb("acl", "apply", "--owner", settings.acting_principal)
    assert "acl added" not in again and "acl removed" not in again  # idempotent
    assert "dave: new password" in ksb("principal", "rotate", "dave")
    refused = CliRunner().invoke(app, ["principal", "add", "bad.name"], env=env)
    assert refused.exit_code == 2 and "1-64 letters" in refused.output
    flow.check()


# ----------------------------------------------------------------- TLS
@pytest.fixture(scope="module")
def tls_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A stack of its own with SASL_SSL listeners and a CA made for it."""
    from devtools.localstack import start_stack

    running = start_stack(tmp_path_factory.mktemp("tls"), security="tls")
    try:
        yield Stack(running.kafka_bootstrap, running.redis_url, running.security)
    finally:
        running.stop()


def test_a_tls_stack_carries_dialogs_and_refuses_a_client_that_does_not_trust_its_ca(
    tls_stack: Stack, unique: str, tmp_path: Path
) -> None:
    from devtools.deployment import secure_instance
    from ksb.catalog.model import parse_catalog
    from ksb.runtime.catalog_store import apply_catalog
    from tests.integration.conftest import BASIC_CATALOG

    base = tls_stack.deployment(instance=f"t{unique}tls", lock_ttl_ms=15_000)
    assert base.kafka_security_protocol == "SASL_SSL" and base.kafka_ssl_ca.endswith("ca.crt")
    owner = secure_instance(base)
    apply_catalog(owner, parse_catalog(BASIC_CATALOG))
    dispatcher = ThreadDispatcher(owner)
    try:
        with serving(owner, tmp_path) as settings, KsbClient(settings) as client:
            tls_flow = Flow(client, client.begin_dialog(I, T, C))
            tls_flow.send(3)
            tls_flow.check()
    finally:
        dispatcher.stop()
    settings = owner
    untrusting = _conf(settings)
    untrusting.pop("ssl.ca.location")
    _, seen = _login_errors(untrusting)
    assert any("certificate verify failed" in e.str() for e in seen), seen
