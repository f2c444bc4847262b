"""Settings: one typed model per service, on one shared base, read from ``KSB_*`` variables.

Each process reads exactly the variables of its own model (`KsbSettings.from_env`): a ``KSB_*``
variable that the model does not have stops the start with the variable named, so a typo, or a
setting given to the wrong service, is an error instead of a silently ignored default. Every field
is read where it is used (a unit test checks that each one is), and every timing rule of the seeds
is a field with its unit in its name, so a rule is found from its setting. Constructing a model
reads nothing from the environment; only `from_env` does.

`KsbSettings.narrow` turns one process's settings into another's (the same deployment's variables
as that process reads them): the way a tool that starts several services, or an activated task,
hands each one what it needs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal, Self, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ksb.errors import KsbError

__all__ = [
    "STICKY_SHARDS",
    "ActivatedTaskSettings",
    "ActivationSettings",
    "CliSettings",
    "ClientSettings",
    "DispatcherSettings",
    "ExternalActivatorSettings",
    "ForwarderSettings",
    "KsbSettings",
    "QueueClientSettings",
    "QueueServiceSettings",
    "ServiceSettings",
    "SettingsError",
    "SparkSettings",
    "TransmitterSettings",
    "TransportSettings",
    "settings_env",
]

PREFIX = "KSB_"
TOOLING_VARIABLES = frozenset({"KSB_KAFKA_LIBS", "KSB_STACK_SECURITY"})
"""Variables of the development tools (where the Kafka jars are, whether the local stack is
secured), not of a process's settings: a service started from a shell that has them still
starts."""

S = TypeVar("S", bound="KsbSettings")

STICKY_SHARDS = "ksb-sticky-shards"
"""KSB's partition assignor's name (infra/kafka/assignor: every topic split alike, shards kept by
their owners); a broker must list it in ``group.consumer.assignors``."""


class SettingsError(KsbError):
    """A ``KSB_*`` variable that the process does not read, or a value it cannot take."""

    code = "invalid_setting"


class KsbSettings(BaseModel):
    """What every KSB process needs: which broker instance, and how to reach Kafka and Redis."""

    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True)

    instance: str = Field("local", pattern=r"^[A-Za-z0-9_-]+$")
    kafka_bootstrap: str = "127.0.0.1:9092"
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_cluster: bool = False
    """`redis_url` names nodes of a Redis Cluster, one or several comma-separated (a client
    starts from the first that answers): clients find the others from it and send each key to
    the node that holds its slot (`ksb.runtime.redis_client`)."""
    redis_timeout_ms: int = Field(5_000, ge=100)
    """How long connecting to Redis or one Redis command may take before it fails, where a
    stalled Redis would hold the caller forever: in the SDK a RECEIVE then fails with
    `LockStoreUnavailable` and a commit with `LockLost`; a service logs it and tries again on
    its next tick."""
    fetch_wait_max_ms: int = Field(10, ge=0)
    """How long a consumer's fetch may wait for data (librdkafka's 500 ms would be most of a hop)."""
    session_timeout_ms: int = Field(6_000, ge=500)
    kafka_debug: str = Field("", pattern=r"^[a-z,]*$")
    """librdkafka debug contexts for consumer-group members (``cgrp``: every heartbeat and
    assignment, logged at DEBUG on ``ksb.kafka.group``, which they turn on); empty, off. For
    diagnosing a group that does not settle."""
    batch_linger_ms: int = Field(5, ge=0)
    kafka_compression: Literal["none", "lz4", "zstd", "snappy", "gzip"] = "lz4"
    """Every KSB producer's ``compression.type``. lz4 by default: message bodies (XML, JSON)
    compress well, and a queue's compacted topic holds its whole backlog. On this project's
    2-CPU machine it cost KSB nothing measurable against none, with the bench's random bodies
    that do not compress (three alternating pairs of quick `make bench` runs, 2026-11-27:
    median 3,536 against 3,516 msg/s, dispatcher CPU 0.123 ms per message either way; the
    broker's JIT compiler moved the figures by more, 0.07-0.15 ms). zstd compresses further for
    links between instances over a WAN; none saves the producers' and consumers' CPU where
    bodies do not compress."""
    request_partitions: int = Field(1, ge=1)
    """Partitions of the instance's requests topic, when a process has to create it."""

    # Security (`ksb.runtime.kafka.client_security`, `ksb.runtime.redis_client`). On by default:
    # PLAINTEXT is the explicit development switch, never a fallback.
    kafka_security_protocol: Literal["SASL_PLAINTEXT", "SASL_SSL", "PLAINTEXT"] = "SASL_PLAINTEXT"
    """SASL_SSL for any connection that leaves the machine; PLAINTEXT only for a development stack
    started without security."""
    kafka_sasl_mechanism: Literal["SCRAM-SHA-512", "SCRAM-SHA-256"] = "SCRAM-SHA-512"
    kafka_username: str = ""
    """The Kafka principal (a SCRAM user) this process logs in as."""
    kafka_password: str = Field("", repr=False)
    """The password itself, for deployments that hand secrets over as variables (compose's env
    file); a password file is preferred: it never shows in a process's environment."""
    kafka_password_file: str = ""
    """A file holding the password (re-read whenever a client is made, so a rotation reaches new
    connections without a restart)."""
    kafka_ssl_ca: str = ""
    """PEM file of the CA that signed the brokers' certificates (SASL_SSL)."""
    kafka_remote_credentials: str = ""
    """A JSON file: far cluster bootstrap list -> the credentials this process uses there
    (transports and forwarders crossing to another cluster; `ksb.runtime.credentials`)."""
    redis_ssl_ca: str = ""
    """PEM file of the CA that signed Redis's certificate: with a ``rediss://`` `redis_url` the
    client verifies Redis against it (the local stack's TLS mode serves Redis over TLS only)."""
    redis_username: str = ""
    """The Redis ACL user; empty means Redis's `default` user (a stack without ACLs)."""
    redis_password: str = Field("", repr=False)
    redis_password_file: str = ""
    principal: str = Field("", pattern=r"^([A-Za-z0-9_-]{1,64})?$")
    """The principal this process acts as (its requests and errors topics); empty means its Kafka
    username."""

    @property
    def acting_principal(self) -> str:
        """Who this process is to KSB: `principal`, or its Kafka username when that is unset."""
        return self.principal or self.kafka_username

    @property
    def sender(self) -> str | None:
        """The principal whose requests and errors topics this process uses (`Names.requests_for`);
        None on a stack without security, where the instance's shared topics serve everyone."""
        if self.kafka_security_protocol == "PLAINTEXT":
            return None
        return self.acting_principal or None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Self:
        """This model's settings from ``KSB_*`` variables; any other ``KSB_*`` variable is refused."""
        env = os.environ if environ is None else environ
        known = {f"{PREFIX}{name.upper()}" for name in cls.model_fields}
        unknown = sorted(
            k for k in env if k.startswith(PREFIX) and k not in known and k not in TOOLING_VARIABLES
        )
        if unknown:
            raise SettingsError(
                f"{cls.__name__} does not read {', '.join(unknown)} "
                f"(it reads {', '.join(sorted(known))})"
            )
        values = {
            name: env[var] for name in cls.model_fields if (var := f"{PREFIX}{name.upper()}") in env
        }
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            raise SettingsError(_reasons(exc)) from None

    def narrow(self, model: type[S], **overrides: Any) -> S:
        """These settings as `model`: the fields both have are copied, `overrides` win, the rest
        keep `model`'s defaults (one deployment's variables, as another process reads them)."""
        shared = {k: getattr(self, k) for k in model.model_fields if k in type(self).model_fields}
        try:
            return model(**{**shared, **overrides})
        except ValidationError as exc:
            raise SettingsError(_reasons(exc)) from None


MIN_QUEUE_TIMEOUT_MS = 100
"""The shortest `QueueClientSettings.queue_timeout_ms`: the queue service takes pings that often."""


class QueueClientSettings(KsbSettings):
    """What a client of the queue service needs: the SDK, activated tasks, the activation
    service's monitors, the external activator's readers."""

    queue_addresses: str = "127.0.0.1:7070"
    """The queue service's replicas, ``host:port`` comma-separated: RECEIVE, COMMIT's outcome
    and ROLLBACK go to the first that answers, and move to the next when it fails."""
    queue_timeout_ms: int = Field(10_000, ge=MIN_QUEUE_TIMEOUT_MS)
    """How long a call to the queue service may take beyond its own wait (WAITFOR, a commit's
    outcome) before the client tries another replica; also how often a client pings a replica
    while a call waits, and how long it waits for the answer (a stopped replica is left within
    twice this, even by a call that waits longer)."""
    lock_renew_ms: int = Field(5_000, ge=100)
    """How often the client renews the locks its open transactions hold (keep it well under
    the queue service's `lock_ttl_ms`)."""
    queue_ssl_ca: str = ""
    """PEM file of the CA that signed the queue service's certificate: set, the client talks to
    it over TLS (a gRPC secure channel) and verifies it; empty, in the clear."""
    lock_confirm_age_ms: int = Field(2_500, ge=0)
    """A commit confirms its lock with a RenewLocks call first unless the lock was granted or
    renewed less than this long ago (counted from when that call was sent); 0: always. Half a
    renewal period by default: such a lock has most of the service's `lock_ttl_ms` (six renewal
    periods) left, and the dispatcher refuses a stale holder's commit by its fencing token
    whatever the client believes. The round trip took as long as the RECEIVE itself in a
    receiver's wall time (docs/benchmarks.md, 2026-11-28). The price: a lock Redis loses
    (a flush, a restart without its data) less than this long after its grant is not noticed by
    its holder, whose commit is then applied on its lease and the next holder's refused (exactly
    once either way)."""
    login_reuse_ms: int = Field(1_000, ge=0)
    """How long the login read from `kafka_password_file` is reused for the queue service's
    calls before the file is read again (a rotated password is taken within this); 0: read on
    every call. Reading it on every call was 12 % of a receiving client's Python."""


class ClientSettings(QueueClientSettings):
    """An application using the SDK (`ksb.sdk`): it sends over Kafka and RECEIVEs through the
    queue service."""

    stalled_commit_ms: int = Field(200, ge=0)
    """Back-pressure counts a partition's requests apart once another partition's committed
    offset moved this long after its own last did: its dispatcher may be gone
    (`ksb.sdk.inflight`). 0: never."""
    max_inflight_requests: int = Field(2_000, ge=0)
    """Back-pressure: requests this client sent that the dispatchers have not applied yet, at
    most; a request beyond it waits for them (`ksb.sdk.backpressure`). 0: no limit."""
    max_queue_depth: int = Field(0, ge=0)
    """Back-pressure on the readers: a SEND on a dialog this client began waits while the target
    queue holds this many unreceived messages, counted per shard, each shard its even share
    (`ksb.sdk.depth`). 0: no limit (Service Broker's queues take any backlog)."""
    backpressure_timeout_s: float = Field(30.0, gt=0)
    """How long a request may wait for the dispatchers (or, with `max_queue_depth`, the target
    queue's readers) to catch up before it fails."""
    request_linger_ms: int = Field(0, ge=0)
    """The request producer's ``linger.ms``. 0: a request leaves at once, and librdkafka still
    batches what queues up while earlier produce requests are in flight. Measured with `make
    bench` (the raw baseline with the same value): against 2 ms, one-at-a-time p50 24.6 -> 16.3
    ms, and under load more throughput and less CPU per message, not less."""


class CliSettings(ClientSettings):
    """The `ksb` command line."""

    leak_idle_s: int = Field(3600, ge=1)
    """`ksb endpoints --leaked`: an endpoint idle this long counts as leaked."""


class TaskHeartbeatSettings(KsbSettings):
    """How an activated task tells the activation service it lives (both read these)."""

    activated_heartbeat_ms: int = Field(1_000, ge=10)
    """A running task writes its heartbeat into Redis this often."""
    activated_heartbeat_ttl_ms: int = Field(5_000, ge=100)
    """A heartbeat older than this counts the task as gone (the monitor's running count)."""


class ActivatedTaskSettings(ClientSettings, TaskHeartbeatSettings):
    """A task started by internal activation (`python -m ksb.activation.activated`)."""

    activated_idle_ms: int = Field(2_000, ge=0)
    """The task returns once RECEIVE has found nothing for this long."""


class AuthoritySettings(KsbSettings):
    """What a service that grants or checks authority needs: the deployment's owners, and the
    key that seals lock leases (the queue service seals them, the dispatcher opens them)."""

    owners: str = ""
    """Principals, comma-separated, that may act for every service and queue without grants
    (the deployment's owners, as `ksb acl apply --owner` gave them Kafka's rights;
    `ksb.dialog.permissions`)."""

    lease_key_file: str = ""
    """The instance's lease key (`ksb.security.leases`), shared by the queue service and the
    dispatchers only; empty on a stack without security."""

    @property
    def owner_names(self) -> tuple[str, ...]:
        return tuple(n.strip() for n in self.owners.split(",") if n.strip())


class ServiceSettings(KsbSettings):
    """What every long-running service has: metrics, health, the broker's periodic timer."""

    metrics_port: int = Field(0, ge=0)
    metrics_host: str = "127.0.0.1"
    tick_ms: int = Field(5_000, ge=1)
    """The periodic timer: housekeeping runs every tick, every 2nd and every 5th."""
    task_handlers: int | None = Field(None, ge=1)
    """Threads for asynchronous tasks; unset means 2 x CPUs."""
    log_format: Literal["text", "json"] = "text"
    """One line of text per record, or one JSON object with the service, instance and, where
    known, shard, conversation, group, queue (`ksb.runtime.log_format`), for log pipelines."""


class QueueServiceSettings(ServiceSettings, AuthoritySettings):
    """The queue service (`services.queue`): it holds every queue's index and bodies and the
    conversation-group locks, and serves RECEIVE to clients in any language."""

    queue_host: str = "127.0.0.1"
    queue_port: int = Field(7070, ge=0)
    """Where clients reach this replica (0: a free port, logged at start)."""
    queue_ssl_cert: str = ""
    """PEM certificate chain this replica serves gRPC with: set (with `queue_ssl_key`), it
    serves TLS only, and its clients need `QueueClientSettings.queue_ssl_ca`."""
    queue_ssl_key: str = ""
    """PEM private key of `queue_ssl_cert` (unencrypted; readable by this service only)."""
    queue_workers: int = Field(64, ge=2)
    """Calls served at once; a RECEIVE that waits (WAITFOR) or a commit waiting for its outcome
    holds one while it waits."""
    lock_ttl_ms: int = Field(30_000, ge=100)
    """A group lock lasts this long unless its client renews it: a client or replica that dies
    holding one frees it within this."""
    stalled_commit_ms: int = Field(200, ge=0)
    """A partition whose commits fall this far behind the others' answers may have lost its
    dispatcher: RECEIVE tries its groups last in their level (`ksb.queue.stalls`). 0: never."""
    queue_store_dir: str = "var/queue-store"
    """Where the store of ready records lives (`ksb.queue.bodies`): wiped at every start."""
    queue_store_max_bytes: int = Field(64 * 1024**3, ge=1024**2)
    """How large the store may grow (a sparse file: it takes what the backlog takes)."""
    commit_wait_ms: int = Field(30_000, ge=100)
    """How long a Commit call waits for its outcome when the client gives no time."""
    outcome_memory: int = Field(100_000, ge=100)
    """Commit outcomes remembered by request id for a Commit call that comes after its outcome
    (a client that moved to this replica from one that failed)."""
    login_cache_ms: int = Field(300_000, ge=0)
    """A principal's password, once Kafka accepted it, is accepted again without asking Kafka
    for this long (a refused one is refused again without asking for a tenth of it)."""


class DispatcherSettings(ServiceSettings, AuthoritySettings):
    max_body_bytes: int = Field(1_048_576, ge=0)
    max_output_bytes: int = Field(16 * 1_048_576, ge=0)
    """The message bytes one request may put in queues and transmissions: a SEND on many
    conversations, or a commit's SENDs, is refused past it (``request_too_large``), so no request
    makes a transaction of any size."""
    replay_read_timeout_ms: int = Field(5_000, ge=100)
    """How long a replay waits at most for its dead letter to be read from the dead-letter
    topic (`services.dispatcher.dead_letter_reader`) before it is refused."""
    record_headroom_bytes: int = Field(16_384, ge=0)
    """Room kept in a queue topic's record size limit for the record around a body (its
    envelope, headers, batch overhead): a body longer than the limit less this is refused at
    SEND (`services.dispatcher.topic_limits`)."""
    txn_timeout_ms: int = Field(4_000, ge=1000)
    """Kafka aborts a transaction open this long. Kept under the consumer group's session timeout
    (6 s in the local stack, Kafka's default 45 s), as Kafka Streams keeps its own: a member that
    died inside a transaction then leaves nothing pending by the time its shards move, and their
    new owners wait for its session alone (with 10 s they waited up to 5 s more)."""
    batch_max: int = Field(500, ge=1)
    """Requests applied in one Kafka transaction at most."""
    poison_failures: int = Field(2, ge=1)
    """A record whose transaction Kafka refused this many times, for a reason a record can
    cause, is refused and skipped (`services.dispatcher.isolation`)."""
    depth_every_ms: int = Field(100, ge=0)
    """How often at most the queue depths that changed are written (`ksb.wire.depth`): senders
    with a queue-depth limit see a count this much later at worst (0: with every transaction)."""
    inbound_stale_ms: int = Field(10_000, ge=1)
    """Early arrivals from other instances older than this are dropped on the next tick."""
    reassembly_stale_ms: int = Field(60_000, ge=1)
    """A large inbound message still missing fragments this long after its first is forgotten."""
    broker_retry_every: int = Field(5, ge=1)
    """A broker that failed to start is retried every this many ticks."""
    rebalance_timeout_ms: int = Field(30_000, ge=1000)
    """How long a dispatcher may stay away from its poll loop, and so take to give up shards the
    group coordinator moves (librdkafka's ``max.poll.interval.ms``, which the consumer protocol
    sends as the member's rebalance timeout); past it the coordinator fences the member and it
    joins afresh. Kafka's 5 minutes let a shard stand still that long when the heartbeat answer
    revoking it was lost to a request timeout: librdkafka 2.16 goes on heartbeating without its
    owned partitions, and the coordinator never repeats the revocation (found by the chaos
    harness, reproduced by a broker stall just as a killed member's session expires)."""
    assignment_stall_ms: int = Field(15_000, ge=100)
    """How long this dispatcher and the group coordinator may disagree on a shard (held here
    though the coordinator moved it away, or sent here and not given) before the dispatcher
    rejoins the group (`services.dispatcher.assignment_watch`): several of the broker's heartbeat
    intervals (``group.consumer.heartbeat.interval.ms``, Kafka's default 5 s: a revocation
    reaches a member with its next heartbeat), and below `rebalance_timeout_ms`, the bound on a
    lost revocation until then. The local stack heartbeats every 500 ms, and the chaos harness
    runs with 3 s."""
    assignment_check_ms: int = Field(1_000, ge=100)
    """How often a dispatcher asks the coordinator what it says of it, from a thread of its own."""
    group_assignor: str = STICKY_SHARDS
    """The server-side assignor the dispatchers' group asks for: KSB's broker plugin
    (infra/kafka/assignor), which keeps each dispatcher's shards while others join or leave, or
    ``range`` on a broker without it (it splits every topic alike too, but moves survivors'
    shards, and each shard that moves stands still while it is rebuilt)."""
    stuck_txn_s: float = Field(45.0, gt=0)
    """A Kafka transaction call still running after this long ends the process, so a fresh
    dispatcher takes its shards over (`services.dispatcher.watchdog`). The calls are given 30 s;
    librdkafka does not always honour that (confluentinc/librdkafka#5456: the coordinator
    request's timeout is never checked), so past 45 s the call is taken to be stuck. It was 120 s:
    a broker restart in the chaos harness left three of four dispatchers stuck at once, and their
    shards stood still for those two minutes."""
    member: str | None = None
    """This dispatcher's name among the instance's dispatchers (its transactional id's suffix);
    unset means a fresh random one per process. A fixed name lets a restarted dispatcher fence
    its own previous incarnation at once instead of waiting out its transaction timeout."""


class TransmitterSettings(ServiceSettings):
    transmitter_memory_bytes: int = Field(64 * 1024 * 1024, ge=4096)
    """What the transmitter may hold; beyond it, dialogs wait unclassified until memory frees."""
    batch: int = Field(500, ge=1)
    view_every_ms: int = Field(500, ge=1)
    max_wait_ms: int = Field(10_000, ge=1)
    """Starvation prevention: no level waits longer than this for a transmission slot."""
    retry_initial_ms: int = Field(2_000, ge=1)
    retry_max_ms: int = Field(60_000, ge=1)
    """Retransmission of what is not acknowledged backs off from the first to the second."""
    reclassify_every_ticks: int = Field(2, ge=1)
    """Routes and HONOR_BROKER_PRIORITY are re-resolved, dialogs set aside for memory taken back
    and caches trimmed every this many ticks."""
    acked_cleanup_every_ticks: int = Field(5, ge=1)
    """Acknowledged messages are folded away every this many ticks."""


class TransportSettings(ServiceSettings):
    fragment_bytes: int = Field(262_144, ge=1024)
    """Inbound records longer than this cross instances as fragments (`ksb.wire.fragments`)."""
    batch: int = Field(500, ge=1)
    connect_timeout_ms: int = Field(3_000, ge=1)
    delivery_timeout_ms: int = Field(5_000, ge=1)
    view_every_ms: int = Field(500, ge=1)
    packet_ttl_ms: int = Field(30_000, ge=1)
    """Older packets are not sent: the transmitter has queued them again by then."""
    suppress_after_disconnect_ms: int = Field(15_000, ge=1)
    suppress_after_failed_connect_ms: int = Field(60_000, ge=1)
    idle_connection_ms: int = Field(90_000, ge=1)
    reroute_every_ticks: int = Field(2, ge=1)
    """Connections whose route changed or expired are closed every this many ticks."""
    idle_check_every_ticks: int = Field(5, ge=1)
    """Connections idle for `idle_connection_ms` are closed every this many ticks."""


class ForwarderSettings(ServiceSettings):
    fragment_bytes: int = Field(262_144, ge=1024)
    batch: int = Field(500, ge=1)
    delivery_timeout_ms: int = Field(5_000, ge=1)
    view_every_ms: int = Field(500, ge=1)
    forwarder_stale_ms: int = Field(60_000, ge=1)
    """What could not be forwarded within this is dropped (checked every
    `stale_check_every_ticks`)."""
    stale_check_every_ticks: int = Field(5, ge=1)


class ActivationSettings(ServiceSettings, QueueClientSettings, TaskHeartbeatSettings):
    activation_config: str = ""
    """The activation host's YAML file (`ksb.activation.host`): the commands the catalog may
    name (``COMMAND = 'name'``) and the logins of the principals tasks run as (``EXECUTE AS``).
    Empty: this host runs no task."""
    activation_check_ms: int = Field(100, ge=10)
    """How often each queue monitor looks at its queue."""
    activation_empty_grace_ms: int = Field(5_000, ge=0)
    """An empty RECEIVE this recent means a reader is keeping up: no activation."""
    activation_starting_hold_ms: int = Field(5_000, ge=0)
    """After a task is started, no other is started for runnable work alone until the first
    RECEIVEs, the tasks exit, or this passes (`ksb.activation.monitor`)."""
    activated_idle_ms: int = Field(2_000, ge=0)
    """Passed to the tasks it starts (`ActivatedTaskSettings.activated_idle_ms`)."""
    poison_rollbacks: int = Field(5, ge=1)
    """Rollbacks in a row that disable a queue (poison-message handling)."""
    activation_retry_ms: int = Field(1_000, ge=1)
    """After an activated task exits with a failure status, no task is started on its queue for
    this long, doubled with each failure in a row up to `activation_retry_max_ms`; a task that
    ends normally, or an ALTER QUEUE, clears it (`ksb.activation.monitor`)."""
    activation_retry_max_ms: int = Field(60_000, ge=1)


class ExternalActivatorSettings(ServiceSettings, QueueClientSettings, TaskHeartbeatSettings):
    external_activator_config: str = ""
    """The YAML file of per-queue reader commands."""
    restart_initial_ms: int = Field(500, ge=1)
    """A command that failed is started again this much later, doubled with each failure in a
    row up to `restart_max_ms`; one that ends normally starts the curve over."""
    restart_max_ms: int = Field(30_000, ge=1)
    faust_replication_factor: int = Field(1, ge=1)
    """Copies of faust's own internal topic (its assignor's leader topic, which holds no
    records). faust creates topics with a protocol version that cannot ask for the cluster's
    default, as KSB's other topics do: on a cluster of three brokers, set it to 3 so the
    activator does not depend on one broker."""


class SparkSettings(KsbSettings):
    """The audit and SLA job (`python -m ksb.spark`)."""

    metrics_port: int = Field(0, ge=0)
    metrics_host: str = "127.0.0.1"
    spark_checkpoint_dir: str = "var/spark/checkpoints"
    spark_master: str = "local[2]"
    spark_driver_host: str = "127.0.0.1"
    spark_output_dir: str = "var/spark"
    spark_window_s: int = Field(10, ge=1)
    spark_watermark_s: int = Field(30, ge=0)
    spark_trigger_ms: int = Field(1_000, ge=100)
    """How often a micro-batch starts: part of an event's delay before its metric shows."""
    spark_jars: str = ".cache/spark/jars"
    """The Spark Kafka connector's jars (`make .cache/spark/jars/.fetched` puts them there)."""


def settings_env(settings: KsbSettings, **extra: str) -> dict[str, str]:
    """The environment a child process (a service, an activated task) reads `settings` from: the
    parent's variables without its own ``KSB_*`` ones, then one ``KSB_*`` variable per field."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(PREFIX)}
    for name, value in settings.model_dump().items():
        if value is not None:
            env[f"{PREFIX}{name.upper()}"] = str(value)
    env.update(extra)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _reasons(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        field = ".".join(str(p) for p in err["loc"]) or "(settings)"
        parts.append(f"{PREFIX}{field.upper()}: {err['msg']}")
    return "invalid settings: " + "; ".join(parts)
