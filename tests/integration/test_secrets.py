"""Issue 38, "files and wire": each attack on the local stack's secrets, as its attacker makes it.

The attacks: `make up` left the stack's directory, Kafka's data and segments world-readable, so
any local user read queue bodies and the SCRAM records; the controller listener took SASL/PLAIN
without TLS, the broker's password in clear on every connection; Redis never used TLS, and each
principal's Redis password was its Kafka one; every process of the stack could read every
secret. Each test below tries one of them with what its attacker has (another local user, a
client on the loopback, a password read off one store, a service of the stack) and meets the
refusal; each passed before the fix, where the attacker got through.
"""

from __future__ import annotations

import shutil
import socket
import ssl
import stat
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
from confluent_kafka import KafkaException, Producer

from devtools.confined import confined
from devtools.deployment import Deployment, owner_of, process_settings, secure_instance
from devtools.localstack import LocalStack, start_stack
from devtools.queue_services import ThreadQueueService, with_queues
from ksb.api.queue.v1 import queue_pb2 as pb
from ksb.api.queue.v1 import queue_pb2_grpc as pb_grpc
from ksb.catalog.model import parse_catalog
from ksb.runtime import confinement
from ksb.runtime.catalog_store import apply_catalog
from ksb.runtime.credentials import CredentialStore
from ksb.sdk.client import KsbClient
from ksb.security.principals import ADMIN, BROKER, Role, service_principal
from ksb.settings import DispatcherSettings
from tests.conftest import Stack
from tests.integration.conftest import BASIC_CATALOG

pytestmark = pytest.mark.integration

NOBODY = 65534
"""Another local user (``nobody``): what any account on the machine could read."""


@pytest.fixture(autouse=True)
def _secured(stack: Stack) -> None:
    if not stack.security.enabled:
        pytest.skip("the stack runs without security (KSB_STACK_SECURITY=plaintext)")


@pytest.fixture(scope="module")
def open_parent() -> Iterator[Path]:
    """A directory every local user may enter, as the repository's ``var/`` is (pytest's own
    temporary directories are private, which would hide the stack's modes)."""
    parent = Path(tempfile.mkdtemp(prefix="ksb-secrets-"))
    parent.chmod(0o755)
    try:
        yield parent
    finally:
        shutil.rmtree(parent, ignore_errors=True)


@pytest.fixture(scope="module")
def tls_stack(open_parent: Path) -> Iterator[LocalStack]:
    """A TLS stack of its own (as `make up` makes ``var/stack``), in a directory all may enter."""
    running = start_stack(open_parent / "stack", security="tls")
    try:
        yield running
    finally:
        running.stop()


def _as_nobody(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, user=NOBODY, group=NOBODY, extra_groups=[], capture_output=True, text=True,
        timeout=30, check=False,
    )  # fmt: skip


# ----------------------------------------------------------------- files
def test_another_local_user_reads_nothing_of_the_stack(tls_stack: LocalStack) -> None:
    workdir = tls_stack.workdir
    segments = sorted((workdir / "kafka" / "data").glob("__cluster_metadata-0/*.log"))
    assert segments, "no metadata segment (it holds the SCRAM records)"
    targets = [
        segments[0],
        workdir / "redis" / "users.acl",
        tls_stack.security.store.path(ADMIN),
        workdir / "kafka" / "logs" / "kafka.out",
    ]
    for path in targets:
        refused = _as_nobody("cat", str(path))
        assert refused.returncode != 0 and "Permission denied" in refused.stderr, path
    # And by their modes, were the directory ever opened: the stack's owner's alone, but the
    # certificates, which are public.
    loose = [
        str(p.relative_to(workdir))
        for p in [workdir, *workdir.rglob("*")]
        if p.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO) and p.suffix != ".crt"
    ]
    assert loose == []


# ----------------------------------------------------------------- the controller listener
def _sasl_handshake(sock: socket.socket) -> bytes:
    """A Kafka SaslHandshake (v1) asking for PLAIN; the raw answer (empty when none)."""
    client = b"attacker"
    body = struct.pack(">hhih", 17, 1, 7, len(client)) + client + struct.pack(">h", 5) + b"PLAIN"
    sock.sendall(struct.pack(">i", len(body)) + body)
    try:
        return sock.recv(4096)
    except (ConnectionError, ssl.SSLError, TimeoutError):
        return b""


def test_the_controller_listener_takes_no_password_and_no_stranger(tls_stack: LocalStack) -> None:
    """The broker reached its controller with SASL/PLAIN, its password in clear. Now the
    listener speaks TLS and wants the broker's certificate: a client on the loopback offering
    PLAIN gets no answer, and one that speaks TLS without a certificate is cut off."""
    props = (tls_stack.workdir / "kafka" / "server.properties").read_text()
    assert "PlainLoginModule" not in props and "CONTROLLER:SSL" in props
    port = int(props.split("CONTROLLER://127.0.0.1:")[1].split()[0])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as plain:
        assert b"PLAIN" not in _sasl_handshake(plain)
    context = ssl.create_default_context(cafile=str(tls_stack.security.stack_ca))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        try:
            with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
                answer = _sasl_handshake(tls)
        except (ssl.SSLError, ConnectionError):
            answer = b""
    assert answer == b"", "the controller answered a client without the broker's certificate"


# ----------------------------------------------------------------- Redis
def test_redis_speaks_tls_only_and_its_passwords_are_not_kafkas(tls_stack: LocalStack) -> None:
    sec = tls_stack.security
    host, port = tls_stack.redis_url.removeprefix("rediss://").split("/")[0].split(":")
    admin: dict[str, Any] = {"username": ADMIN, "password": sec.redis_password(ADMIN)}
    with pytest.raises((redis.ConnectionError, redis.TimeoutError)):  # in clear: no answer
        redis.Redis(host=host, port=int(port), socket_timeout=5, **admin).ping()
    with pytest.raises(redis.ConnectionError, match="certificate verify failed"):
        redis.Redis.from_url(tls_stack.redis_url, socket_timeout=5, **admin).ping()
    trusted = redis.Redis.from_url(
        tls_stack.redis_url, socket_timeout=5, ssl_ca_certs=str(sec.stack_ca), **admin
    )
    assert trusted.ping()
    # The admin's Kafka password, read off the store, does not open Redis.
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(
            tls_stack.redis_url,
            socket_timeout=5,
            ssl_ca_certs=str(sec.stack_ca),
            username=ADMIN,
            password=sec.password(ADMIN),
        ).ping()
    trusted.close()


def test_a_principals_redis_password_does_not_open_kafka_and_the_reverse(
    settings: Deployment,
) -> None:
    """Each principal has two passwords: a service's Redis one (what the queue service holds for
    its locks) is no Kafka login, and a Kafka one is no Redis login."""
    queue = settings.as_service(Role.QUEUE)
    store = CredentialStore(Path(settings.credentials_dir))
    name = service_principal(settings.instance, Role.QUEUE)
    kafka_pw, redis_pw = store.get(name), store.get_redis(name)
    assert kafka_pw and redis_pw and kafka_pw != redis_pw
    with pytest.raises(redis.AuthenticationError):
        redis.Redis.from_url(queue.redis_url, username=name, password=kafka_pw).ping()
    assert redis.Redis.from_url(queue.redis_url, username=name, password=redis_pw).ping()
    conf = {
        "bootstrap.servers": settings.kafka_bootstrap,
        "security.protocol": settings.kafka_security_protocol,
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": name,
        "sasl.password": redis_pw,
        **({"ssl.ca.location": settings.kafka_ssl_ca} if settings.kafka_ssl_ca else {}),
    }
    with pytest.raises(KafkaException):
        Producer(conf).list_topics(timeout=5)


# ----------------------------------------------------------------- the queue service's gRPC
def test_the_queue_service_answers_only_over_tls_in_tls_mode(
    tls_stack: LocalStack, tmp_path: Path, unique: str
) -> None:
    """Every call carries its caller's Kafka password; in TLS mode it never travels in clear."""
    from tests.conftest import Stack as TestStack

    base = TestStack(tls_stack.kafka_bootstrap, tls_stack.redis_url, tls_stack.security)
    owner = secure_instance(base.deployment(instance=f"t{unique}grpc"))
    apply_catalog(owner, parse_catalog(BASIC_CATALOG))
    queues = ThreadQueueService(owner, tmp_path / "store")
    try:
        settings = with_queues(owner, [queues.address])
        with grpc.insecure_channel(queues.address) as channel:
            stub = pb_grpc.QueueServiceStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                stub.QueueState(pb.QueueStateRequest(queue="TargetQueue"), timeout=5)
            assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
        with KsbClient(settings) as client, client.transaction() as tx:  # queue_ssl_ca set
            assert tx.receive("TargetQueue", waitfor_ms=100) == []
    finally:
        queues.stop()


# ----------------------------------------------------------------- each process's own secret
PROBE = """
import sys
for path in sys.argv[1:]:
    try:
        open(path).read()
        print("read", path)
    except PermissionError:
        print("refused", path)
"""


@pytest.mark.skipif(not confinement.available(), reason="this kernel has no Landlock")
def test_a_service_the_runner_starts_reads_its_own_secret_and_no_other(
    stack: Stack, settings: Deployment
) -> None:
    """What `devtools.runner` starts a service as (its settings, confined to the files they
    name): such a process, compromised, looks for the other principals' secrets."""
    store = stack.security.store
    dispatcher = process_settings(settings, "services.dispatcher")
    assert isinstance(dispatcher, DispatcherSettings)
    mine = [dispatcher.kafka_password_file, dispatcher.lease_key_file]
    others = [
        str(store.path(ADMIN)),
        str(store.path(BROKER)),
        str(store.path(owner_of(settings.instance))),
        str(store.path(service_principal(settings.instance, Role.ACTIVATION))),
        str(store.redis_path(service_principal(settings.instance, Role.QUEUE))),
        str(stack.security.root.parent / "kafka" / "server.properties"),
    ]
    argv = confined(
        [sys.executable, "-c", PROBE, *mine, *others],
        "services.dispatcher",
        dispatcher,
        settings.private_dirs.split(","),
    )
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True).stdout
    seen: dict[str, str] = {}
    for line in out.splitlines():
        verdict, path = line.split(" ", 1)
        seen[path] = verdict
    assert {p: seen[p] for p in mine} == dict.fromkeys(mine, "read")
    assert {p: seen[p] for p in others} == dict.fromkeys(others, "refused")
