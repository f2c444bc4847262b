"""The security plan: principals' names, least privilege per role, grants, routes, Redis rules."""

from __future__ import annotations

import fnmatch
from typing import Any

import pytest

from ksb.catalog.model import Catalog, parse_catalog
from ksb.errors import SecurityError
from ksb.names import Names
from ksb.security.kafka_acls import KafkaAcl, Operation, Pattern, Resource
from ksb.security.plan import SecurityPlan, plan_instance
from ksb.security.principals import Role, check_principal, role_of, service_principal
from ksb.settings import KsbSettings

INST = "inst"
N = Names(INST)


def _catalog(**extra: Any) -> Catalog:
    base: dict[str, Any] = {
        "message_types": [{"name": "//m", "validation": "NONE"}],
        "contracts": [{"name": "//c", "messages": [{"type": "//m", "sent_by": "ANY"}]}],
        "queues": [{"name": "QA"}, {"name": "QB"}, {"name": "QN"}],
        "services": [
            {"name": "//a", "queue": "QA", "contracts": ["//c"]},
            {"name": "//b", "queue": "QB", "contracts": ["//c"]},
        ],
        "event_notifications": [{"name": "n", "queue": "QN"}],
        "grants": [
            {"permission": "SEND", "target": "//b", "principal": "alice"},
            {"permission": "RECEIVE", "target": "QA", "principal": "alice"},
            {"permission": "SEND", "target": "//a", "principal": "bob"},
        ],
    }
    base.update(extra)
    return parse_catalog(base)


def _plan(catalog: Catalog | None = None, **kw: Any) -> SecurityPlan:
    return plan_instance(
        KsbSettings(instance=INST, request_partitions=3), catalog or _catalog(), **kw
    )


def _of(plan: SecurityPlan, principal: str) -> set[KafkaAcl]:
    return {a for a in plan.kafka_acls if a.principal == principal}


def _grants(plan: SecurityPlan, principal: str, op: Operation, topic: str) -> bool:
    """Whether `principal` may do `op` on `topic` (literal or through a prefix)."""
    for a in _of(plan, principal):
        if a.resource is not Resource.TOPIC or a.operation is not op:
            continue
        if a.name == topic or (a.pattern is Pattern.PREFIXED and topic.startswith(a.name)):
            return True
    return False


def svc(role: Role) -> str:
    return service_principal(INST, role)


# ----------------------------------------------------------------- principals
@pytest.mark.parametrize("name", ["alice", "App_1", "a-b", "x" * 64])
def test_a_principal_name_is_letters_digits_underscore_dash(name: str) -> None:
    assert check_principal(name) == name


@pytest.mark.parametrize("name", ["", "a.b", "a b", "x" * 65, "a*", "ümlaut", "admin", "broker"])
def test_other_principal_names_are_refused_with_the_reason(name: str) -> None:
    with pytest.raises(SecurityError, match="principal"):
        check_principal(name)


def test_each_service_of_an_instance_has_its_own_principal() -> None:
    assert svc(Role.DISPATCHER) == "ksb-inst-dispatcher"
    assert svc(Role.EXTERNAL_ACTIVATOR) == "ksb-inst-external-activator"
    assert role_of(INST, "ksb-inst-spark") is Role.SPARK
    assert role_of(INST, "alice") is None


def test_an_instance_name_too_long_for_its_principals_is_refused() -> None:
    with pytest.raises(SecurityError):
        service_principal("i" * 60, Role.DISPATCHER)


# ----------------------------------------------------------------- identity binding
def test_only_a_principal_may_write_its_own_requests_topic() -> None:
    plan = _plan(owners=["own"])
    writers: dict[str, set[str]] = {}
    for a in plan.kafka_acls:
        if a.operation is Operation.WRITE and a.name.startswith(f"{N.prefix}.requests."):
            assert a.pattern is Pattern.LITERAL, a
            writers.setdefault(a.name, set()).add(a.principal)
    assert writers[N.requests_of("alice")] == {"alice"}
    assert writers[N.requests_of("bob")] == {"bob"}
    assert all(ps == {t.rsplit(".", 1)[1]} for t, ps in writers.items())


def test_only_a_principal_and_the_operators_read_its_errors_topic() -> None:
    plan = _plan(owners=["own"])
    readers = {p for p in plan.principals if _grants(plan, p, Operation.READ, N.errors_of("alice"))}
    assert readers == {"alice", svc(Role.OPERATOR), "own"}


def test_the_dispatcher_reads_every_requests_topic_and_writes_every_errors_topic() -> None:
    plan = _plan()
    d = svc(Role.DISPATCHER)
    for p in ("alice", "bob", "somebody-later"):
        assert _grants(plan, d, Operation.READ, N.requests_of(p))
        assert _grants(plan, d, Operation.WRITE, N.errors_of(p))
    assert _grants(plan, d, Operation.READ, N.relay)
    assert _grants(plan, d, Operation.WRITE, N.relay)
    assert not _grants(plan, d, Operation.WRITE, N.requests_of("alice"))


def test_nobody_may_write_the_unsuffixed_requests_topic() -> None:
    """A request there would carry no principal, which the dispatcher trusts (no security)."""
    plan = _plan(owners=["own"])
    assert not any(
        a.name == N.requests and a.operation is not Operation.READ for a in plan.kafka_acls
    )
    assert {a.principal for a in plan.kafka_acls if a.name == N.requests} == {svc(Role.DISPATCHER)}


def test_requests_relay_and_inbound_have_the_shard_count() -> None:
    topics = {t.name: t.partitions for t in _plan().topics}
    own_inbound = N.inbound_from(INST)
    for name in (N.requests, N.requests_of("alice"), N.requests_of("bob"), N.relay, own_inbound):
        assert topics[name] == 3, name
    assert N.requests_of(svc(Role.OPERATOR)) in topics
    assert N.errors_of("alice") in topics
    assert N.queue("QA") in topics and N.dead_letters("QB") in topics


# ----------------------------------------------------------------- applications
def test_an_application_reads_no_queue_topic_it_receives_through_the_queue_service() -> None:
    plan = _plan()
    for principal in ("alice", "bob"):
        assert not any(_grants(plan, principal, Operation.READ, N.queue(q)) for q in ("QA", "QB"))
    assert _grants(plan, svc(Role.QUEUE), Operation.READ, N.queue("QA"))
    assert _grants(plan, svc(Role.QUEUE), Operation.READ, N.queue("QB"))
    # It counts the dead letters (services.queue.dead_letters); nobody else but operators reads them.
    assert _grants(plan, svc(Role.QUEUE), Operation.READ, N.dead_letters("QB"))
    assert not any(_grants(plan, p, Operation.READ, N.dead_letters("QB")) for p in ("alice", "bob"))


def test_an_application_writes_nothing_but_its_requests() -> None:
    """Not the audit topic either: what it did is recorded by the services that carried it out."""
    plan = _plan()
    writes = {a.name for a in _of(plan, "alice") if a.operation is Operation.WRITE}
    assert writes == {N.requests_of("alice")}
    assert not any(a.operation is Operation.CREATE for a in _of(plan, "alice"))
    assert not any(a.pattern is Pattern.PREFIXED for a in _of(plan, "alice"))


def test_a_revoked_grant_leaves_the_plan() -> None:
    cat = _catalog()
    revoked = cat.model_copy(update={"grants": cat.grants[:1]})  # alice keeps only SEND
    assert _plan(revoked).accesses_of("alice").receives == frozenset()
    assert "bob" not in _plan(revoked).principals


def test_a_grant_to_public_is_refused() -> None:
    cat = _catalog(grants=[{"permission": "SEND", "target": "//a", "principal": "public"}])
    with pytest.raises(SecurityError, match="PUBLIC"):
        _plan(cat)


def test_a_peers_grant_makes_no_login_and_a_peer_never_receives() -> None:
    """``peer-<instance>`` is another broker instance, checked when its messages arrive: no
    SCRAM user, no topic, no ACL is made for it; RECEIVE to it is refused, with the reason."""
    grants = [{"permission": "SEND", "target": "//b", "principal": "peer-far"}]
    plan = _plan(_catalog(grants=grants))
    assert "peer-far" not in plan.principals and not _of(plan, "peer-far")
    assert not any("peer-far" in t.name for t in plan.topics)
    receive = [{"permission": "RECEIVE", "target": "QB", "principal": "peer-far"}]
    with pytest.raises(SecurityError, match="never receives"):
        _plan(_catalog(grants=receive))


def test_an_owner_receives_from_every_queue_and_applies_catalogs() -> None:
    plan = _plan(owners=["own"])
    assert _grants(plan, "own", Operation.READ, N.queue("any-later-queue"))
    assert _grants(plan, "own", Operation.WRITE, N.catalog)
    assert _grants(plan, "own", Operation.CREATE, N.queue("new"))
    assert not _grants(plan, "own", Operation.WRITE, N.queue("QA"))


# ----------------------------------------------------------------- services
def test_nobody_but_the_dispatcher_writes_queues_endpoints_or_the_transmission_queue() -> None:
    plan = _plan(owners=["own"])
    for topic in (N.queue("QA"), N.endpoints, N.transmission, N.dead_letters("QA"), N.bcn):
        writers = {p for p in plan.principals if _grants(plan, p, Operation.WRITE, topic)}
        assert writers == {svc(Role.DISPATCHER)}, topic


def test_the_catalog_is_written_by_the_operator_owners_and_the_poison_rule_only() -> None:
    plan = _plan(owners=["own"])
    writers = {p for p in plan.principals if _grants(plan, p, Operation.WRITE, N.catalog)}
    assert writers == {svc(Role.OPERATOR), svc(Role.ACTIVATION), "own"}


def test_only_the_transport_writes_our_inbound_and_only_the_transport_our_acks() -> None:
    plan = _plan()
    own = N.inbound_from(INST)
    inbound = {p for p in plan.principals if _grants(plan, p, Operation.WRITE, own)}
    acks = {p for p in plan.principals if _grants(plan, p, Operation.WRITE, N.acks)}
    assert inbound == {svc(Role.TRANSPORT)}
    assert acks == {svc(Role.TRANSPORT), svc(Role.DISPATCHER)}


def test_transactional_ids_and_groups_belong_to_their_service() -> None:
    plan = _plan()
    txn = [a for a in plan.kafka_acls if a.resource is Resource.TRANSACTIONAL_ID]
    assert {a.principal for a in txn} == {svc(Role.DISPATCHER)}
    assert all(N.dispatcher_txn_id.startswith(a.name) for a in txn)
    groups = {
        (a.principal, a.name)
        for a in plan.kafka_acls
        if a.resource is Resource.GROUP and a.operation is Operation.READ
    }
    assert (svc(Role.DISPATCHER), N.dispatcher_group) in groups
    assert (svc(Role.TRANSPORT), N.transport_group) in groups
    assert (svc(Role.EXTERNAL_ACTIVATOR), N.external_activator_app) in groups
    assert all(name.startswith(f"{N.prefix}.") for _p, name in groups)


def test_no_one_may_create_the_core_topics() -> None:
    plan = _plan(owners=["own"])
    creates = {a.name for a in plan.kafka_acls if a.operation is Operation.CREATE}
    assert creates == {f"{N.prefix}.queue.", f"{N.prefix}.dlq.", N.external_activator_app}


def test_activated_readers_receive_as_the_service_that_starts_them() -> None:
    """Through the queue service, which checks the grants: no queue topic of their own."""
    plan = _plan()
    assert plan.accesses_of(svc(Role.ACTIVATION)).receives_all
    ext = plan.accesses_of(svc(Role.EXTERNAL_ACTIVATOR))
    assert ext.receives == frozenset({"QN"})
    for role in (Role.ACTIVATION, Role.EXTERNAL_ACTIVATOR):
        assert not _grants(plan, svc(role), Operation.READ, N.queue("QN"))


def test_every_binding_is_in_the_instance_namespace_without_routes() -> None:
    plan = _plan(owners=["own"])
    assert all(plan.owns(a) for a in plan.kafka_acls)
    cluster = [a for a in plan.kafka_acls if a.resource is Resource.CLUSTER]
    assert all(a.name.startswith(f"{N.prefix}.") for a in plan.kafka_acls if a not in cluster)
    # The one cluster right: a producer id for the forwarder, which may have no topic to write.
    assert [(a.principal, a.operation) for a in cluster] == [
        (svc(Role.FORWARDER), Operation.IDEMPOTENT_WRITE)
    ]


# ----------------------------------------------------------------- routes
def _routed() -> Catalog:
    return _catalog(
        routes=[
            {"name": "r1", "service_name": "//far", "broker_instance": "b", "address": "LOCAL"},
            {"name": "r2", "service_name": "//farther", "broker_instance": "c", "via": "f"},
        ]
    )


def test_a_direct_peer_writes_its_own_inbound_topic_and_our_acks() -> None:
    plan = _plan(_routed())
    writers = {
        t: {p for p in plan.principals if _grants(plan, p, Operation.WRITE, t)}
        for t in (N.inbound_from("b"), N.inbound_from("f"), N.inbound_from(INST))
    }
    assert writers == {
        N.inbound_from("b"): {"ksb-b-transport"},
        N.inbound_from("f"): {"ksb-f-forwarder"},
        N.inbound_from(INST): {svc(Role.TRANSPORT)},
    }
    assert _grants(plan, "ksb-b-dispatcher", Operation.WRITE, N.acks)
    assert "ksb-b-transport" in plan.principals
    topics = {t.name: t.partitions for t in plan.topics}
    assert topics[N.inbound_from("b")] == topics[N.inbound_from("f")] == 3
    assert N.inbound_from("c") not in topics  # c's messages come through f


def test_a_plan_grants_nothing_on_a_near_peers_topics() -> None:
    """Routes are declared on both sides: b's own plan grants what b consents to on b's
    topics; ours binds and makes nothing of b's (b is on our cluster). Only c, behind the
    forwarder f (so on a cluster we cannot know), gets the mailbox of its acks here."""
    plan = _plan(_routed())
    topics = [a for a in plan.kafka_acls if a.resource is not Resource.CLUSTER]
    elsewhere = {a.name for a in topics if not a.name.startswith(f"{N.prefix}.")}
    assert elsewhere == {Names("c").acks, Names("f").reader_group}
    assert [t.name for t in plan.topics if not t.name.startswith(f"{N.prefix}.")] == [
        Names("c").acks
    ]


def test_a_far_peer_gets_the_mailbox_of_its_acks_here() -> None:
    """On another cluster b's plan cannot reach ours: the mailbox of its acks (written by our
    dispatcher, read and relayed home by its transport) is ours to make and bind."""
    far = _catalog(
        routes=[
            {"name": "r1", "service_name": "//far", "broker_instance": "b", "address": "k2:9092"}
        ]
    )
    plan = _plan(far)
    assert Names("b").acks in {t.name for t in plan.topics}
    assert _grants(plan, svc(Role.DISPATCHER), Operation.WRITE, Names("b").acks)
    assert _grants(plan, "ksb-b-transport", Operation.READ, Names("b").acks)
    mailbox = Names("b").acks
    assert plan.owns(
        KafkaAcl(svc(Role.DISPATCHER), Resource.TOPIC, mailbox, Pattern.LITERAL, Operation.WRITE)
    )


def test_two_instances_of_one_cluster_own_their_own_parts_of_a_far_peers_mailbox() -> None:
    """A reaches c through the forwarder f; f reaches c directly on another cluster. Both plans
    bind c's acks mailbox here; applying one must never remove what the other granted (found
    when A's plan removed c's transport's READ that f's plan had just granted)."""
    mailbox = Names("c").acks

    def acl(principal: str, op: Operation) -> KafkaAcl:
        return KafkaAcl(principal, Resource.TOPIC, mailbox, Pattern.LITERAL, op)

    a = _plan(
        _catalog(routes=[{"name": "r", "service_name": "//c", "broker_instance": "c", "via": "f"}])
    )
    f = plan_instance(
        KsbSettings(instance="f", request_partitions=3),
        _catalog(
            routes=[
                {"name": "r", "service_name": "//c", "broker_instance": "c", "address": "k2:9092"}
            ]
        ),
    )
    for plan in (a, f):
        theirs = a if plan is f else f
        for binding in theirs.kafka_acls:
            if binding.name == mailbox:
                assert not plan.owns(binding), (plan.instance, str(binding))
    assert f.owns(acl("ksb-c-transport", Operation.READ))
    assert a.owns(acl("ksb-f-forwarder", Operation.READ))
    assert not a.owns(acl("ksb-f-forwarder", Operation.WRITE))  # f's own plan grants it


def test_a_forwarder_carries_for_a_peer_behind_it() -> None:
    plan = _plan(_routed())
    assert _grants(plan, "ksb-f-forwarder", Operation.WRITE, N.inbound_from("f"))
    assert _grants(plan, "ksb-f-forwarder", Operation.WRITE, N.acks)
    assert not _grants(plan, "ksb-c-transport", Operation.WRITE, N.inbound_from("c"))
    assert not _grants(plan, "ksb-f-forwarder", Operation.WRITE, N.inbound_from("b"))


def test_a_peer_reads_nothing_of_ours() -> None:
    plan = _plan(_routed())
    for peer in ("ksb-b-transport", "ksb-b-dispatcher", "ksb-f-forwarder"):
        reads = {a.name for a in _of(plan, peer) if a.operation is Operation.READ}
        assert not [n for n in reads if n.startswith(f"{N.prefix}.")], (peer, reads)
    # f relays c's acks home from the mailbox here
    assert _grants(plan, "ksb-f-forwarder", Operation.READ, Names("c").acks)


def test_a_plan_owns_its_namespace_only() -> None:
    plan = _plan(_routed())
    other = KafkaAcl(
        "ksb-x-dispatcher", Resource.TOPIC, "ksb.x.acks", Pattern.LITERAL, Operation.WRITE
    )
    ours_elsewhere = KafkaAcl(
        svc(Role.DISPATCHER), Resource.TOPIC, "ksb.x.acks", Pattern.LITERAL, Operation.WRITE
    )
    assert not plan.owns(other)
    assert not plan.owns(ours_elsewhere)  # x's plan grants it, and removes it
    assert plan.owns(
        KafkaAcl("ksb-x-dispatcher", Resource.TOPIC, N.acks, Pattern.LITERAL, Operation.WRITE)
    )
    longer = KafkaAcl("p", Resource.TOPIC, "ksb.inst2.queue.q", Pattern.LITERAL, Operation.READ)
    assert not plan.owns(longer)


# ----------------------------------------------------------------- Redis
def _allowed(patterns: frozenset[str], key: str) -> bool:
    """Whether an ACL key pattern covers `key` (Redis's glob: ``*``, ``?``, ``[...]``)."""
    return any(fnmatch.fnmatchcase(key, p) for p in patterns)


def _queue_keys(queue: str) -> list[str]:
    """The keys a reader of `queue` touches, as the code names them."""
    n = Names(INST)
    return [
        n.lock_key(queue, "g"),
        n.fence_key(queue, "g"),
        n.disabled_key(queue),  # an EVAL key: Redis checks it as read-write
        n.activity_key(queue),
        n.waiting_key(queue),
        n.rollbacks_key(queue),
        n.message_rollbacks_key(queue),
    ]


def test_applications_have_no_redis_user_the_queue_service_holds_the_locks() -> None:
    """No call an application's grants allow can shorten, take over or forge a lock, or disable
    a queue: it has no Redis user at all."""
    plan = _plan()
    assert "alice" not in plan.redis and "bob" not in plan.redis
    rules = plan.redis[svc(Role.QUEUE)]
    assert all(_allowed(rules.keys, k) for q in ("QA", "QB") for k in _queue_keys(q))
    assert f"ksb:{INST}:dlpolicy" in rules.read_keys
    assert {"evalsha", "script|load", "time"} <= rules.commands
    assert not {"flushall", "keys", "del", "sadd", "srem", "eval"} & rules.commands


def test_services_without_redis_work_get_no_redis_user() -> None:
    redis = _plan().redis
    assert svc(Role.DISPATCHER) not in redis
    assert svc(Role.SPARK) not in redis
    assert "bob" not in redis  # SEND only: no lock ever taken


def test_the_operator_reads_redis_and_writes_nothing() -> None:
    rules = _plan().redis[svc(Role.OPERATOR)]
    assert rules.read_keys == {f"ksb:{INST}:*"} and not rules.keys
    assert not {"set", "hset", "del", "evalsha"} & rules.commands


def test_only_the_activation_service_uses_transactions() -> None:
    """Its dead-letter policies are replaced in one MULTI; the views are plain pipelines, since
    one may span several cluster slots."""
    redis = _plan().redis
    assert {"multi", "exec"} <= redis[svc(Role.ACTIVATION)].commands
    for role in (Role.TRANSMITTER, Role.TRANSPORT, Role.FORWARDER):
        assert not {"multi", "exec"} & redis[svc(role)].commands, role


def test_the_acl_rules_replace_keys_and_commands_in_one_setuser() -> None:
    acl = _plan().redis[svc(Role.QUEUE)].acl()
    assert acl[:3] == ["resetkeys", "resetchannels", "-@all"]
    assert f"~{Names(INST).lock_key('*', '*')}" in acl
    assert f"%R~ksb:{INST}:dlpolicy" in acl
    assert "+evalsha" in acl


def test_the_plan_prints() -> None:
    text = "\n".join(_plan(_routed(), owners=["own"]).lines())
    assert "User:alice WRITE topic:ksb.inst.requests.alice" in text
    assert "User:ksb-inst-dispatcher READ topic:ksb.inst.requests.*" in text
    assert f"{svc(Role.QUEUE)}: resetkeys" in text
