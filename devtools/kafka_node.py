"""The local stack's Kafka: one KRaft node (broker and controller) from Maven Central's jars.

`make setup` fetches the jars into .cache/kafka/libs; the node runs as ``java -cp libs/* kafka.Kafka``
on free 127.0.0.1 ports with its data under the stack's directory, formatted fresh each time.
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

from devtools.processes import REPO_ROOT, LocalStackError, register_child, tail

__all__ = [
    "KAFKA_BROKER_SETTINGS",
    "KafkaLayout",
    "format_kafka_storage",
    "kafka_libs_dir",
    "kafka_ready",
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
}
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
    return libs


def _java() -> str:
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


def write_kafka_properties(k: KafkaLayout) -> None:
    """Static voters, not a dynamic quorum: one node never changes membership, and with
    static voters `StorageTool format` needs neither --standalone nor --initial-controllers.
    """
    settings = {
        "process.roles": "broker,controller",
        "node.id": "1",
        "controller.quorum.voters": f"1@127.0.0.1:{k.controller_port}",
        "listeners": f"PLAINTEXT://127.0.0.1:{k.port},CONTROLLER://127.0.0.1:{k.controller_port}",
        "advertised.listeners": f"PLAINTEXT://127.0.0.1:{k.port}",
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": "PLAINTEXT",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "log.dirs": str(k.data),
        **KAFKA_BROKER_SETTINGS,
    }
    k.properties.write_text("".join(f"{key}={value}\n" for key, value in settings.items()))


def _java_cmd(libs: Path, k: KafkaLayout, main: str, *args: str) -> list[str]:
    return [
        _java(),
        *KAFKA_JVM_OPTS,
        f"-Dlog4j2.configurationFile={LOG4J2_CONFIG}",
        f"-Dkafka.logs.dir={k.logs}",
        "-cp",
        f"{libs}/*",
        main,
        *args,
    ]


def format_kafka_storage(libs: Path, k: KafkaLayout) -> None:
    cluster_id = _kafka_cluster_id()
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
    )
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    if result.returncode != 0:
        raise LocalStackError(
            f"Kafka storage format failed (exit {result.returncode}):\n"
            f"{result.stdout}\n{result.stderr}"
        )


def _kafka_cluster_id() -> str:
    """What `StorageTool random-uuid` prints, without paying for a second JVM start."""
    import base64

    return base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")


def start_kafka(libs: Path, k: KafkaLayout) -> subprocess.Popen[bytes]:
    with k.console.open("ab") as out:
        proc = subprocess.Popen(
            _java_cmd(libs, k, "kafka.Kafka", str(k.properties)),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=k.root,
            start_new_session=True,
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


def kafka_ready(bootstrap: str, deadline: float) -> None:
    """Wait for metadata AND a working transaction coordinator.

    A broker that answers metadata may still fail the first `init_transactions` while it
    creates __transaction_state; tests that start with a transaction would flake on that,
    so readiness includes one successful init_transactions.
    """
    from confluent_kafka import KafkaException, Producer
    from confluent_kafka.admin import AdminClient

    logger = _quiet_logger()
    admin = AdminClient({"bootstrap.servers": bootstrap, "logger": logger})
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"Kafka at {bootstrap} did not report a broker in time")
        try:
            if admin.list_topics(timeout=min(2.0, remaining)).brokers:
                break
        except KafkaException:
            pass
        time.sleep(0.1)

    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "transactional.id": f"ksb-localstack-probe-{uuid.uuid4().hex}",
            "logger": logger,
        }
    )
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"Kafka at {bootstrap} could not init a transaction in time")
        try:
            producer.init_transactions(min(10.0, remaining))
            break
        except KafkaException as exc:
            err = exc.args[0] if exc.args else None
            retriable = getattr(err, "retriable", lambda: True)()
            if not retriable:
                raise LocalStackError(f"init_transactions failed: {exc}") from exc
            time.sleep(0.1)
    producer.flush(1.0)
