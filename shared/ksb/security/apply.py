"""Making Kafka and Redis match a `SecurityPlan`: users, topics, ACLs. The only I/O of the package.

Run as ``admin`` (a Kafka super user and the one unrestricted Redis user). Idempotent: applying
the same plan twice changes nothing the second time.

* SCRAM users: a principal missing from Kafka is created with the password in the credential
  store, generated there if it has none. An existing user keeps its password (another
  instance's plan, or another operator, may have made it): rotation is `rotate_password`.
* Topics: created when missing, with the plan's partition counts.
* Kafka ACLs: the plan's bindings are added, and the bindings the plan owns but no longer has
  are deleted; live clients feel both within about 65 ms (measured), with no restart.
* Redis: each principal's rules for this instance are kept in Redis (``ksb-acl:user:<p>``, one
  field per instance, readable by ``admin`` only), and the user is set to the union over its
  instances, since one Redis user serves an application granted on several instances.
  A Redis user's password is the principal's Redis password (``<p>.redis.password`` in the
  store, generated there if new), never its Kafka one.
  ``ACL SETUSER`` with ``resetkeys``/``-@all`` replaces keys and commands in one call, so a
  connection never sees a half-applied rule set; a connection already open keeps its login and
  is checked against the new rules on its next command. The users are then saved (``ACL
  SAVE``) where Redis keeps them in an ACL file, so a restart of Redis does not drop them.

SCRAM users get 4096 iterations (Kafka's minimum): the passwords are 256 random bits, which
iterations do not make harder to guess, while every new connection pays for them.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any, cast

import redis
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient
from confluent_kafka.admin._acl import (
    AclBinding,
    AclBindingFilter,
    AclOperation,
    AclPermissionType,
)
from confluent_kafka.admin._resource import ResourcePatternType, ResourceType
from confluent_kafka.admin._scram import (
    ScramCredentialInfo,
    ScramMechanism,
    UserScramCredentialAlteration,
    UserScramCredentialUpsertion,
)
from redis.cluster import RedisCluster

from ksb.errors import SecurityError
from ksb.runtime import kafka
from ksb.runtime.credentials import CredentialStore, generate_password
from ksb.runtime.redis_client import redis_client
from ksb.security.kafka_acls import KafkaAcl, Operation, Pattern, Resource
from ksb.security.plan import SecurityPlan
from ksb.security.principals import check_principal
from ksb.security.redis_acls import RedisRules
from ksb.settings import KsbSettings

__all__ = [
    "SCRAM_ITERATIONS",
    "ApplyReport",
    "add_principal",
    "apply_plan",
    "remove_instance",
    "rotate_password",
]

SCRAM_ITERATIONS = 4096
TIMEOUT_S = 30.0

_RESOURCES = {
    Resource.TOPIC: ResourceType.TOPIC,
    Resource.GROUP: ResourceType.GROUP,
    Resource.TRANSACTIONAL_ID: ResourceType.TRANSACTIONAL_ID,
    Resource.CLUSTER: ResourceType.BROKER,  # librdkafka's name for the cluster resource
}
_PATTERNS = {
    Pattern.LITERAL: ResourcePatternType.LITERAL,
    Pattern.PREFIXED: ResourcePatternType.PREFIXED,
}
_OPERATIONS = {
    Operation.READ: AclOperation.READ,
    Operation.WRITE: AclOperation.WRITE,
    Operation.DESCRIBE: AclOperation.DESCRIBE,
    Operation.CREATE: AclOperation.CREATE,
    Operation.IDEMPOTENT_WRITE: AclOperation.IDEMPOTENT_WRITE,
    Operation.DESCRIBE_CONFIGS: AclOperation.DESCRIBE_CONFIGS,
}


@dataclass
class ApplyReport:
    users_created: list[str] = field(default_factory=list)
    users_elsewhere: list[str] = field(default_factory=list)
    """Users that exist in Kafka with a password this store does not have (made elsewhere)."""
    topics: int = 0
    acls_added: list[str] = field(default_factory=list)
    acls_removed: list[str] = field(default_factory=list)
    redis_users: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def lines(self) -> list[str]:
        out = [f"users created: {', '.join(self.users_created) or '-'}"]
        if self.users_elsewhere:
            out.append(
                f"users made elsewhere (passwords not here): {', '.join(self.users_elsewhere)}"
            )
        out.append(f"topics: {self.topics} in the plan, missing ones created")
        out += [f"acl added:   {a}" for a in self.acls_added]
        out += [f"acl removed: {a}" for a in self.acls_removed]
        out.append(f"redis users set: {', '.join(self.redis_users) or '-'}")
        out.append(f"applied in {self.seconds:.2f}s")
        return out


def apply_plan(
    plan: SecurityPlan, admin: KsbSettings, store: CredentialStore, *, redis_acls: bool = True
) -> ApplyReport:
    """Make Kafka (and Redis, unless `redis_acls` is off) match `plan`, logged in as `admin`.

    The ACL change goes first and is waited for last: the broker takes up to a second to put it
    in force (measured), time the users, topics and Redis rules are made in.
    """
    started = time.monotonic()
    report = ApplyReport(topics=len(plan.topics))
    client = kafka.admin(admin)
    added, removed = _change_acls(client, plan, report)
    _ensure_users(client, store, plan.principals, report)
    store.lease_key(plan.instance)
    kafka.ensure_topics(client, plan.topics, timeout_s=TIMEOUT_S)
    if redis_acls:
        r = redis_client(admin)
        try:
            _sync_redis(r, plan.instance, plan.redis, store, report)
        finally:
            r.close()
    if added or removed:
        _wait_effective(client, added, removed)
    report.seconds = time.monotonic() - started
    return report


# ----------------------------------------------------------------- users
_USER_ADMIN = (AclOperation.DESCRIBE, AclOperation.ALTER)


def _check_user_admin(client: AdminClient) -> None:
    """Refuse a login that may not describe and alter SCRAM users before it asks Kafka to.

    Not a courtesy: when a DescribeUserScramCredentials response carries a request-level error,
    such as the CLUSTER_AUTHORIZATION_FAILED every login but ``admin`` gets, librdkafka (2.16,
    and its current source) frees an error string it does not own, and the process aborts
    (``munmap_chunk(): invalid pointer``, exit 134) just after the error reaches Python. So
    the request is never sent by a login that would be refused. DescribeCluster needs no right
    and lists the cluster operations this login has (all of them on a broker without an
    authorizer); DESCRIBE and ALTER on the cluster are what the SCRAM requests are checked for.
    """
    cluster = client.describe_cluster(
        include_authorized_operations=True, request_timeout=TIMEOUT_S
    ).result(TIMEOUT_S)
    granted = set(cluster.authorized_operations or ())
    missing = [op.name for op in _USER_ADMIN if op not in granted]
    if missing:
        raise SecurityError(
            f"this Kafka login may not manage users (it lacks {' and '.join(missing)} on the "
            "cluster): run it as admin (KSB_KAFKA_USERNAME=admin, KSB_REDIS_USERNAME=admin)"
        )


def _existing_users(client: AdminClient, users: list[str]) -> set[str]:
    if not users:
        return set()
    _check_user_admin(client)
    found: set[str] = set()
    futures = cast(dict[str, Any], client.describe_user_scram_credentials(users))
    for user, fut in futures.items():
        try:
            fut.result(TIMEOUT_S)
            found.add(user)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.RESOURCE_NOT_FOUND:
                raise
    return found


def _upsert(client: AdminClient, passwords: dict[str, str]) -> None:
    if not passwords:
        return
    info = ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, SCRAM_ITERATIONS)
    upserts: list[UserScramCredentialAlteration] = [
        UserScramCredentialUpsertion(u, info, pw.encode()) for u, pw in passwords.items()
    ]
    for fut in client.alter_user_scram_credentials(upserts).values():
        fut.result(TIMEOUT_S)


def _ensure_users(
    client: AdminClient, store: CredentialStore, principals: tuple[str, ...], report: ApplyReport
) -> None:
    existing = _existing_users(client, list(principals))
    new: dict[str, str] = {}
    for p in principals:
        if p in existing:
            if store.get(p) is None:
                report.users_elsewhere.append(p)
            continue
        new[p], _ = store.ensure(p)
    _upsert(client, new)
    report.users_created = sorted(new)


# ----------------------------------------------------------------- Kafka ACLs
def _binding(acl: KafkaAcl) -> AclBinding:
    return AclBinding(
        _RESOURCES[acl.resource],
        acl.name,
        _PATTERNS[acl.pattern],
        f"User:{acl.principal}",
        "*",
        _OPERATIONS[acl.operation],
        AclPermissionType.ALLOW,
    )


def _from_binding(b: AclBinding) -> KafkaAcl | None:
    """Our model of a binding, or None for one KSB never writes (DENY, a host, another kind)."""
    resources = {v: k for k, v in _RESOURCES.items()}
    patterns = {v: k for k, v in _PATTERNS.items()}
    operations = {v: k for k, v in _OPERATIONS.items()}
    if (
        b.permission_type != AclPermissionType.ALLOW
        or b.host != "*"
        or not b.principal.startswith("User:")
        or b.restype not in resources
        or b.resource_pattern_type not in patterns
        or b.operation not in operations
    ):
        return None
    return KafkaAcl(
        b.principal.removeprefix("User:"),
        resources[b.restype],
        b.name,
        patterns[b.resource_pattern_type],
        operations[b.operation],
    )


def _current_acls(client: AdminClient) -> set[KafkaAcl]:
    anything = cast(str, None)  # a filter's None matches any name, principal or host
    everything = AclBindingFilter(
        ResourceType.ANY,
        anything,
        ResourcePatternType.ANY,
        anything,
        anything,
        AclOperation.ANY,
        AclPermissionType.ANY,
    )
    found = client.describe_acls(everything).result(TIMEOUT_S)
    return {acl for b in found if (acl := _from_binding(b)) is not None}


def _change_acls(
    client: AdminClient, plan: SecurityPlan, report: ApplyReport
) -> tuple[set[KafkaAcl], set[KafkaAcl]]:
    """Add the plan's missing bindings and delete the owned ones it no longer has; returns them
    (acknowledged by the controller, not yet in force on the broker)."""
    current = _current_acls(client)
    wanted = set(plan.kafka_acls)
    stale = sorted(a for a in current - wanted if plan.owns(a))
    missing = sorted(wanted - current)
    if missing:
        for fut in client.create_acls([_binding(a) for a in missing]).values():
            fut.result(TIMEOUT_S)
    if stale:
        _delete(client, stale)
    report.acls_added = [str(a) for a in missing]
    report.acls_removed = [str(a) for a in stale]
    return set(missing), set(stale)


def _wait_effective(client: AdminClient, added: set[KafkaAcl], removed: set[KafkaAcl]) -> None:
    """Wait until the broker's authorizer has the change (describe_acls reads the same cache).

    The controller acknowledges an ACL change before the broker has replayed it: measured, a
    binding shows up to a second later, and a client that starts in between is refused (a
    transactional producer fatally). So an apply returns only once its change is in force.
    """
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        current = _current_acls(client)
        if added <= current and not (removed & current):
            return
        if time.monotonic() > deadline:
            raise SecurityError(
                f"ACL change not in force after {TIMEOUT_S:.0f}s: "
                f"{len(added - current)} binding(s) missing, {len(removed & current)} still there"
            )
        time.sleep(0.05)


def _delete(client: AdminClient, acls: list[KafkaAcl]) -> None:
    filters = [_filter(a) for a in acls]
    for fut in client.delete_acls(filters).values():
        fut.result(TIMEOUT_S)


def _filter(acl: KafkaAcl) -> AclBindingFilter:
    """The filter that matches exactly `acl`'s binding."""
    return AclBindingFilter(
        _RESOURCES[acl.resource],
        acl.name,
        _PATTERNS[acl.pattern],
        f"User:{acl.principal}",
        "*",
        _OPERATIONS[acl.operation],
        AclPermissionType.ALLOW,
    )


def remove_instance(plan: SecurityPlan, admin: KsbSettings, *, wait: bool = True) -> int:
    """Delete every binding the plan owns and its Redis rules (an instance taken down; the
    tests' per-test instances, which do not wait for the broker). Users and topics stay.
    Returns the bindings deleted."""
    client = kafka.admin(admin)
    owned = sorted(a for a in _current_acls(client) if plan.owns(a))
    if owned:
        _delete(client, owned)
        if wait:
            _wait_effective(client, set(), set(owned))
    r = redis_client(admin)
    try:
        _sync_redis(r, plan.instance, {}, None, ApplyReport())
    finally:
        r.close()
    return len(owned)


# ----------------------------------------------------------------- Redis
def _user_key(principal: str) -> str:
    return f"ksb-acl:user:{principal}"


def _instance_key(instance: str) -> str:
    return f"ksb-acl:instance:{instance}"


def _encode(rules: RedisRules) -> str:
    return json.dumps(
        {
            "keys": sorted(rules.keys),
            "read": sorted(rules.read_keys),
            "cmds": sorted(rules.commands),
        }
    )


def _decode(raw: bytes | str) -> RedisRules:
    d = json.loads(raw)
    return RedisRules(frozenset(d["keys"]), frozenset(d["read"]), frozenset(d["cmds"]))


def _sync_redis(
    r: redis.Redis,
    instance: str,
    wanted: dict[str, RedisRules],
    store: CredentialStore | None,
    report: ApplyReport,
) -> None:
    """Record `wanted` as `instance`'s rules, drop the instance's rules of principals no longer
    in it, and set each touched user to the union of its rules over all instances."""
    before = {_text(m) for m in cast(set[bytes], r.smembers(_instance_key(instance)))}
    # Not a MULTI: the user and instance keys lie in different slots on a Redis Cluster. A
    # failure part-way is mended by applying again, which writes them all once more.
    pipe = r.pipeline(transaction=False)
    for p, rules in wanted.items():
        pipe.hset(_user_key(p), instance, _encode(rules))
        pipe.sadd(_instance_key(instance), p)
    for p in before - set(wanted):
        pipe.hdel(_user_key(p), instance)
        pipe.srem(_instance_key(instance), p)
    pipe.execute()
    touched = sorted(set(wanted) | before)
    for p in touched:
        union = RedisRules()
        for raw in cast(list[bytes], r.hvals(_user_key(p))):
            union |= _decode(raw)
        login = ["on"] if not union.empty else ["off"]
        password = store.ensure_redis(p) if store is not None and not union.empty else None
        if password is not None:
            login += ["resetpass", f"#{_sha256(password)}"]
        _acl_command(r, "SETUSER", p, *login, *union.acl())
    _save_users(r)
    report.redis_users = touched


def _acl_command(r: redis.Redis, *args: str) -> list[Any]:
    """``ACL <args>`` on every node, each node's answer. Sent raw: redis-py's `acl_setuser` turns
    a user off unless told not to. A Redis Cluster keeps its ACL users per node, and redis-py's
    cluster client sends ACL commands to one node unless told to send them to all (it then
    answers with a dict by node)."""
    if not isinstance(r, RedisCluster):
        return [r.execute_command("ACL", *args)]  # type: ignore[no-untyped-call]
    answer = r.execute_command("ACL", *args, target_nodes=RedisCluster.ALL_NODES)
    return list(answer.values()) if isinstance(answer, dict) else [answer]


def _save_users(r: redis.Redis) -> None:
    """``ACL SAVE``: a Redis that loads its users from an ACL file (the local stack's, compose's)
    forgets every ``ACL SETUSER`` at its next restart unless they are saved into that file. A
    Redis whose users are kept some other way has no file and says so; that answer is left alone.
    """
    try:
        _acl_command(r, "SAVE")
    except redis.ResponseError as exc:
        if "not configured to use an ACL file" not in str(exc):
            raise


def _text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


def _sha256(password: str) -> str:
    return hashlib.sha256(password.encode()).hexdigest()


# ----------------------------------------------------------------- principals
def add_principal(admin: KsbSettings, store: CredentialStore, name: str) -> tuple[str, bool]:
    """Make principal `name` (a SCRAM user and a Redis user, no rights yet) unless it exists;
    returns the path of its password file and whether it was created now."""
    check_principal(name)
    client = kafka.admin(admin)
    created = False
    if name not in _existing_users(client, [name]):
        password, _ = store.ensure(name)
        _upsert(client, {name: password})
        created = True
    if store.get(name) is None:
        raise SecurityError(f"{name} exists in Kafka but its password is not in {store.root}")
    redis_password = store.ensure_redis(name)
    r = redis_client(admin)
    try:
        _acl_command(r, "SETUSER", name, "on", "resetpass", f"#{_sha256(redis_password)}")
        _save_users(r)
    finally:
        r.close()
    return str(store.path(name)), created


def rotate_password(admin: KsbSettings, store: CredentialStore, name: str) -> str:
    """New passwords for `name`, Kafka's and Redis's, in Kafka and Redis, then the store. New
    connections need the new ones at once; open ones keep working (docs/security.md)."""
    check_principal(name)
    client = kafka.admin(admin)
    if name not in _existing_users(client, [name]):
        raise SecurityError(f"principal {name} does not exist (ksb principal add {name})")
    password, redis_password = generate_password(), generate_password()
    _upsert(client, {name: password})
    r = redis_client(admin)
    try:
        if any(user is not None for user in _acl_command(r, "GETUSER", name)):
            _acl_command(r, "SETUSER", name, "resetpass", f"#{_sha256(redis_password)}")
            _save_users(r)
            store.put_redis(name, redis_password)
    finally:
        r.close()
    return str(store.put(name, password))
