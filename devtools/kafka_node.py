"""The local stack's Kafka: KRaft nodes (each broker and controller) from Maven Central's jars.

`make setup` fetches the jars into .cache/kafka/libs; a node runs as ``java -cp libs/* kafka.Kafka``
on free 127.0.0.1 ports with its data under the stack's directory, formatted fresh each time. One
node is the default; a cluster of several (`KafkaLayout.voters`, `replication_settings`) is how
the tests show KSB on Kafka's own replication: every topic on three brokers, a broker killed.

Secured (the default, `devtools.stack_security`): the client listener takes SASL/SCRAM-SHA-512
(over TLS in ``tls`` mode), the StandardAuthorizer refuses whatever no ACL allows, and only
``broker`` and ``admin`` (and the broker's certificate, below) are super users. The controller
listener takes mutual TLS: each node presents the broker's certificate (``CN=broker``, signed
by the stack's CA) and accepts only certificates the CA signed. Left PLAINTEXT, the broker would
reach its controller as ANONYMOUS, which would then have to be a super user, and any local
process could rewrite the ACLs through the controller port; SCRAM is not supported on
controllers (KAFKA-15513), and SASL/PLAIN, what this listener took before, sends the broker's
password in clear on every connection. A certificate sends no secret at all. The ``broker`` and
``admin`` SCRAM users are written into the metadata by the storage format (``--add-scram``),
since nobody could log in to create them otherwise.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devtools.processes import REPO_ROOT, STACK_UMASK, LocalStackError, register_child, tail
from devtools.stack_security import BROKER_CERT_CN, KEY_PASSWORD_NAME, StackSecurity
from ksb.runtime.credentials import KafkaLogin
from ksb.security.principals import ADMIN, BROKER

__all__ = [
    "ASSIGNOR_JAR",
    "KAFKA_BROKER_SETTINGS",
    "KafkaLayout",
    "format_kafka_storage",
    "java_binary",
    "kafka_cluster_id",
    "kafka_libs_dir",
    "kafka_ready",
    "replication_settings",
    "start_kafka",
    "write_kafka_properties",
]

LOG4J2_CONFIG = REPO_ROOT / "infra" / "local" / "log4j2.properties"

# Fixed per-stack settings. Replication factors and ISR of 1 because there is one broker;
# small internal-topic partition counts because creating 50 partitions per internal topic
# is most of a cold broker's start-up time; no auto-creation so a typo in a topic name is
# an error instead of a silently created topic; a short abort-cleanup interval so tests of
# timed-out transactions do not wait a minute.
KAFKA_BROKER_SETTINGS: dict[str, str] = {
    "offsets.topic.replication.factor": "1",
    "offsets.topic.num.partitions": "4",
    "transaction.state.log.replication.factor": "1",
    "transaction.state.log.min.isr": "1",
    "transaction.state.log.num.partitions": "4",
    "min.insync.replicas": "1",
    "group.initial.rebalance.delay.ms": "0",
    "group.min.session.timeout.ms": "500",
    "auto.create.topics.enable": "false",
    "message.max.bytes": "8388608",
    "transaction.abort.timed.out.transaction.cleanup.interval.ms": "2000",
    # The dispatchers' consumer group (KIP-848 protocol): a member that stops heartbeating loses
    # its shards after 6 s, not the broker default of 45 s.
    "group.consumer.session.timeout.ms": "6000",
    "group.consumer.min.session.timeout.ms": "1000",
    "group.consumer.heartbeat.interval.ms": "500",
    "group.consumer.min.heartbeat.interval.ms": "100",
    # KSB's shard assignor for the dispatchers' group (infra/kafka/assignor), after Kafka's own:
    # the first is every other group's default.
    "group.consumer.assignors": "uniform,range,dev.ksb.kafka.StickyShardAssignor",
}
ASSIGNOR_JAR = "ksb-kafka-assignor.jar"
"""The broker plugin `make setup` builds beside Kafka's jars (infra/kafka/assignor)."""
KAFKA_JVM_OPTS: tuple[str, ...] = ("-Xms256m", "-Xmx768m", "-Djava.awt.headless=true")


def kafka_libs_dir() -> Path:
    """Where the Kafka jars are: `KSB_KAFKA_LIBS` or the `make setup` cache.

    Raises rather than downloading: fetching jars is `make setup`'s job, and a test run
    should fail fast with the fix in the message.
    """
    env = os.environ.get("KSB_KAFKA_LIBS")
    libs = Path(env) if env else REPO_ROOT / ".cache" / "kafka" / "libs"
    if not libs.is_dir() or not any(libs.glob("kafka_2.13-*.jar")):
        raise LocalStackError(
            f"Kafka jars not found in {libs} (no kafka_2.13-*.jar). "
            "Run `make setup` (or set KSB_KAFKA_LIBS to a directory of Kafka 4.2 jars)."
        )
    if not (libs / ASSIGNOR_JAR).is_file():
        raise LocalStackError(
            f"KSB's partition assignor ({ASSIGNOR_JAR}) is not in {libs}: run `make setup`, which "
            "builds it from infra/kafka/assignor."
        )
    return libs


def java_binary() -> str:
    """JAVA_HOME's java, else the one on PATH."""
    java_home = os.environ.get("JAVA_HOME")
    if java_home and (Path(java_home) / "bin" / "java").is_file():
        return str(Path(java_home) / "bin" / "java")
    found = shutil.which("java")
    if found is None:
        raise LocalStackError("`java` not found on PATH (Java 17+ is needed for Kafka 4.2)")
    return found


@dataclass(frozen=True)
class KafkaLayout:
    root: Path
    port: int
    controller_port: int
    security: StackSecurity
    node_id: int = 1
    voters: str = ""
    """The cluster's ``controller.quorum.voters`` (``id@host:port,...``); empty: this node alone."""

    @property
    def nodes(self) -> int:
        """How many nodes the cluster has: every node votes (`replication_settings`)."""
        return len(self.voters.split(",")) if self.voters else 1

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def properties(self) -> Path:
        return self.root / "server.properties"

    @property
    def console(self) -> Path:
        return self.logs / "kafka.out"

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log_tails(self) -> str:
        return (
            f"--- {self.console} ---\n{tail(self.console)}\n"
            f"--- {self.logs / 'server.log'} ---\n{tail(self.logs / 'server.log')}"
        )


def replication_settings(nodes: int) -> dict[str, str]:
    """Replication of a cluster of `nodes`: three copies of every partition where there are three
    brokers (internal topics and, by `default.replication.factor`, every topic KSB creates), and a
    write acknowledged once two have it, so one broker may fail without losing an acknowledged
    record or refusing a write. One node keeps one copy (KAFKA_BROKER_SETTINGS)."""
    if nodes <= 1:
        return {}
    copies = min(3, nodes)
    in_sync = str(max(1, copies - 1))
    return {
        "default.replication.factor": str(copies),
        "offsets.topic.replication.factor": str(copies),
        "transaction.state.log.replication.factor": str(copies),
        "transaction.state.log.min.isr": in_sync,
        "min.insync.replicas": in_sync,
    }


def write_kafka_properties(k: KafkaLayout) -> None:
    """Static voters, not a dynamic quorum: the local cluster never changes membership, and with
    static voters `StorageTool format` needs neither --standalone nor --initial-controllers.

    The file holds the broker's password (its JAAS login) when secured, so it is 0600.
    """
    listener = k.security.protocol
    controller = "SSL" if k.security.enabled else "PLAINTEXT"
    settings = {
        "process.roles": "broker,controller",
        "node.id": str(k.node_id),
        "controller.quorum.voters": k.voters or f"{k.node_id}@127.0.0.1:{k.controller_port}",
        "listeners": f"{listener}://127.0.0.1:{k.port},CONTROLLER://127.0.0.1:{k.controller_port}",
        "advertised.listeners": f"{listener}://127.0.0.1:{k.port}",
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": listener,
        "listener.security.protocol.map": f"{listener}:{listener},CONTROLLER:{controller}",
        "log.dirs": str(k.data),
        **_security_properties(k.security),
        **KAFKA_BROKER_SETTINGS,
        **replication_settings(k.nodes),
    }
    text = "".join(f"{key}={value}\n" for key, value in settings.items())
    fd = os.open(k.properties, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _security_properties(security: StackSecurity) -> dict[str, str]:
    """SCRAM on the client listener, mutual TLS on the controller's, the authorizer, TLS if asked.

    All three SASL settings are needed: without `sasl.enabled.mechanisms` and
    `sasl.mechanism.inter.broker.protocol` the format fails (GSSAPI is the default), and the
    JAAS login must be prefixed with the listener and mechanism (an unprefixed one is ignored).
    """
    if not security.enabled:
        return {}
    password = security.password(BROKER)
    listener = security.protocol.lower()
    props = {
        "sasl.enabled.mechanisms": "SCRAM-SHA-512",
        "sasl.mechanism.inter.broker.protocol": "SCRAM-SHA-512",
        f"listener.name.{listener}.scram-sha-512.sasl.jaas.config": (
            "org.apache.kafka.common.security.scram.ScramLoginModule required "
            f'username="{BROKER}" password="{password}";'
        ),
        # The controller listener: mutual TLS, the broker's certificate both ways (no password).
        "listener.name.controller.ssl.keystore.type": "PEM",
        "listener.name.controller.ssl.keystore.location": str(security.keystore),
        "listener.name.controller.ssl.key.password": security.password(KEY_PASSWORD_NAME),
        "listener.name.controller.ssl.truststore.type": "PEM",
        "listener.name.controller.ssl.truststore.location": str(security.stack_ca),
        "listener.name.controller.ssl.client.auth": "required",
        "listener.name.controller.ssl.endpoint.identification.algorithm": "https",
        "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        "allow.everyone.if.no.acl.found": "false",
        "super.users": f"User:{BROKER};User:{ADMIN};User:CN={BROKER_CERT_CN}",
        # Off, Kafka's default: a rotated password reaches new connections only, and live ones
        # keep theirs. With re-authentication on, librdkafka clients stall silently at their next
        # re-authentication after a rotation until they are restarted (measured), which would
        # turn every rotation into an outage; ACL changes reach live connections at once anyway.
        "connections.max.reauth.ms": "0",
    }
    if security.mode == "tls":
        props.update(
            {
                "ssl.keystore.type": "PEM",
                "ssl.keystore.location": str(security.keystore),
                "ssl.key.password": security.password(KEY_PASSWORD_NAME),
                "ssl.truststore.type": "PEM",
                "ssl.truststore.location": str(security.tls_dir / "ca.crt"),
                "ssl.endpoint.identification.algorithm": "https",
                "ssl.client.auth": "none",
            }
        )
    return props


def _java_cmd(libs: Path, k: KafkaLayout, main: str, *args: str) -> list[str]:
    return [
        java_binary(),
        *KAFKA_JVM_OPTS,
        f"-Dlog4j2.configurationFile={LOG4J2_CONFIG}",
        f"-Dkafka.logs.dir={k.logs}",
        "-cp",
        f"{libs}/*",
        main,
        *args,
    ]


def format_kafka_storage(libs: Path, k: KafkaLayout, cluster_id: str | None = None) -> None:
    """Format the node's storage; secured, with the ``broker`` and ``admin`` SCRAM users in it.
    The nodes of one cluster are formatted with one `cluster_id` (default: a new one).

    The format prints the bootstrap metadata, SCRAM salts and keys included, so its output is
    never kept; on failure only its error stream is shown. The passwords are in its argv for the
    second or two it runs (the tool has no other way to take them).
    """
    cluster_id = cluster_id or kafka_cluster_id()
    scram: list[str] = []
    if k.security.enabled:
        for user in (BROKER, ADMIN):
            password = k.security.password(user)
            scram += ["--add-scram", f"SCRAM-SHA-512=[name={user},password={password}]"]
    cmd = _java_cmd(
        # `--cluster-id=ID`, not `-t ID`: a random id starting with "-" (1 in 64) would be read as
        # an option and the format would fail.
        libs,
        k,
        "kafka.tools.StorageTool",
        "format",
        f"--cluster-id={cluster_id}",
        "-c",
        str(k.properties),
        *scram,
    )
    result = subprocess.run(
        cmd, capture_output=True, text=True, timeout=60, check=False, umask=STACK_UMASK
    )
    if result.returncode != 0:
        raise LocalStackError(
            f"Kafka storage format failed (exit {result.returncode}):\n{result.stderr}"
        )


def kafka_cluster_id() -> str:
    """What `StorageTool random-uuid` prints, without paying for a second JVM start."""
    import base64

    return base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")


def start_kafka(libs: Path, k: KafkaLayout) -> subprocess.Popen[bytes]:
    fd = os.open(k.console, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "ab") as out:
        proc = subprocess.Popen(
            _java_cmd(libs, k, "kafka.Kafka", str(k.properties)),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=k.root,
            start_new_session=True,
            umask=STACK_UMASK,
        )
    register_child(proc)
    return proc


def _quiet_logger() -> Any:
    """librdkafka logs every refused connection; during start-up those are expected."""
    import logging

    logger = logging.getLogger("devtools.localstack.kafka-probe")
    logger.propagate = False
    if not logger.handlers:
        logger.addHandler(logging.NullHandler())
    return logger


PROBE_TOPIC = "ksb-localstack.probe"
"""Where readiness commits its transaction (the stack's own; no instance uses it)."""


def kafka_ready(bootstrap: str, deadline: float, login: KafkaLogin, brokers: int = 1) -> None:
    """Wait for metadata listing `brokers` brokers, a working transaction coordinator AND a
    committed transaction.

    A broker that answers metadata may still fail the first `init_transactions` while it
    creates __transaction_state; tests that start with a transaction would flake on that. And a
    broker whose inter-broker password is wrong answers metadata and `init_transactions` as if
    healthy, then fails the first transactional produce (it verifies the transaction by
    connecting to itself), so readiness commits one transaction, logged in as `login`.
    """
    from confluent_kafka import KafkaException, Producer
    from confluent_kafka.admin import AdminClient
    from confluent_kafka.cimpl import NewTopic

    logger = _quiet_logger()
    conf: dict[str, Any] = {"bootstrap.servers": bootstrap, "logger": logger, **login.librdkafka()}
    admin = AdminClient(conf)
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"Kafka at {bootstrap} did not report {brokers} broker(s) in time")
        try:
            if len(admin.list_topics(timeout=min(2.0, remaining)).brokers) >= brokers:
                break
        except KafkaException:
            pass
        time.sleep(0.1)
    # -1: the cluster's default.replication.factor, as KSB's own topics are made.
    for fut in admin.create_topics([NewTopic(PROBE_TOPIC, 1, -1)]).values():
        try:
            fut.result(max(1.0, deadline - time.monotonic()))
        except KafkaException as exc:
            if "already exists" not in str(exc).lower():
                raise LocalStackError(f"could not create {PROBE_TOPIC}: {exc}") from exc

    producer = Producer({**conf, "transactional.id": f"ksb-localstack-probe-{uuid.uuid4().hex}"})
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"Kafka at {bootstrap} could not commit a transaction in time")
        try:
            producer.init_transactions(min(10.0, remaining))
            break
        except KafkaException as exc:
            err = exc.args[0] if exc.args else None
            retriable = getattr(err, "retriable", lambda: True)()
            if not retriable:
                raise LocalStackError(f"init_transactions failed: {exc}") from exc
            time.sleep(0.1)
    _commit_probe(producer, deadline)


def _commit_probe(producer: Any, deadline: float) -> None:
    """One record in one transaction, committed, retried while the topic's leader settles."""
    from confluent_kafka import KafkaException

    while True:
        producer.begin_transaction()
        producer.produce(PROBE_TOPIC, value=b"ready")
        try:
            producer.commit_transaction(max(1.0, min(10.0, deadline - time.monotonic())))
            return
        except KafkaException as exc:
            err = exc.args[0]
            if err.txn_requires_abort():
                producer.abort_transaction(10)
            if not (err.retriable() or err.txn_requires_abort()) or err.fatal():
                raise LocalStackError(f"the readiness transaction failed: {exc}") from exc
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the readiness transaction did not commit: {exc}") from exc
            time.sleep(0.2)
