"""The protocol from another language: the Go client of clients/go against a real instance.

A second language is the proof that docs/protocol.md is enough to write a client: `ksbgo` BEGINs
and SENDs with nothing but JSON records on its principal's requests topic (franz-go, SCRAM, a
CRC-32 partitioner), and RECEIVEs, COMMITs and ROLLs BACK through the queue service's gRPC API
with group locks, its leases in its commit records. What it does is checked from Python: the
messages arrive exactly once and in order, the replies it committed reach the initiator's queue,
every request sits in its group's shard, and what another principal must not do is refused.

The binary is built once per session (`go build`, its modules from the Go proxy: about 70 s with
cold caches on this project's 2-CPU machine, 2 s warm); without a Go toolchain the tests skip.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devtools.deployment import Deployment, instance_plan, secure_instance
from devtools.processes import free_port
from devtools.queue_services import ThreadQueueService, with_queues
from ksb.catalog.model import Catalog, Grant
from ksb.dialog.shards import colocated_group
from ksb.names import Names
from ksb.runtime import kafka
from ksb.runtime.credentials import kafka_login
from ksb.sdk.client import KsbClient
from ksb.security.apply import remove_instance
from ksb.wire.partitioning import shard_of, target_handle
from tests.conftest import Stack
from tests.integration.conftest import ThreadDispatcher, make_application
from tests.integration.support import check_exactly_once_in_order, read_topic, receive_all

# The first test builds the binary: about 2 minutes with cold Go caches on a busy 2-CPU machine.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

GO_MODULE = Path(__file__).resolve().parents[2] / "clients" / "go"
I, T, C = "//t/Initiator", "//t/Target", "//t/Contract"  # noqa: E741
SHARDS = 2
"""Two shards, so a request in the wrong partition would show (franz-go's default partitioner
hashes with murmur2, and would put about half of them in the other shard)."""
LOCK_TTL_MS = 4_000
RENEW_MS = 1_000
DIALOGS, MESSAGES = 8, 5


@pytest.fixture(scope="session")
def ksbgo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `ksbgo` binary, built once per session from clients/go."""
    go = shutil.which("go")
    if go is None:
        pytest.skip("no Go toolchain (`go`) on PATH: the Go client is not built nor tested")
    binary = tmp_path_factory.mktemp("ksbgo") / "ksbgo"
    built = subprocess.run(
        [go, "build", "-o", str(binary), "./cmd/ksbgo"],
        cwd=GO_MODULE,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert built.returncode == 0, f"go build failed:\n{built.stderr}"
    return binary


@pytest.fixture
def settings(stack: Stack, unique: str, tmp_path: Path) -> Iterator[Deployment]:
    """conftest's `settings`, with two shards and locks short enough that a transaction can
    outlive one in seconds (the Go client must renew it)."""
    base = stack.deployment(
        instance=f"t{unique}",
        request_partitions=SHARDS,
        lock_ttl_ms=LOCK_TTL_MS,
        lock_renew_ms=RENEW_MS,
    )
    secured = secure_instance(base)
    queues = ThreadQueueService(secured, tmp_path / "queue-store")
    try:
        yield with_queues(secured, [queues.address])
    finally:
        queues.stop()
        if base.secured:
            remove_instance(instance_plan(base), stack.admin(), wait=False)


def _env(settings: Deployment, **extra: str) -> dict[str, str]:
    """The Go client's login: the same KSB_* variables a Python client reads."""
    login = kafka_login(settings)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KSB_")}
    env.update(
        {
            "KSB_INSTANCE": settings.instance,
            "KSB_KAFKA_BOOTSTRAP": settings.kafka_bootstrap,
            "KSB_KAFKA_SECURITY_PROTOCOL": login.security_protocol,
            "KSB_KAFKA_SASL_MECHANISM": login.mechanism,
            "KSB_KAFKA_USERNAME": login.username,
            "KSB_KAFKA_PASSWORD_FILE": settings.kafka_password_file,
            "KSB_KAFKA_PASSWORD": settings.kafka_password,
            "KSB_KAFKA_SSL_CA": login.ssl_ca,
            "KSB_QUEUE_ADDRESSES": settings.queue_addresses,
            "KSB_LOCK_RENEW_MS": str(settings.lock_renew_ms),
            **extra,
        }
    )
    return env


def run_ksbgo(
    binary: Path, settings: Deployment, *args: str, timeout_s: float = 120, **env: str
) -> tuple[dict[str, Any], str]:
    """Run one `ksbgo` command as `settings`' principal: its JSON summary, and its log."""
    proc = subprocess.Popen(
        [str(binary), *args],
        env=_env(settings, **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"ksbgo {args[0]} hung\nstdout:\n{out}\nstderr:\n{err}")
    assert proc.returncode == 0, f"ksbgo {args[0]}: exit {proc.returncode}\n{err}"
    return json.loads(out), err


def _records_by_partition(settings: Deployment, topic: str) -> list[tuple[str, int]]:
    """(key, partition) of every record of `topic` (read as the cluster's admin)."""
    got: list[tuple[str, int]] = []
    c = kafka.consumer(settings)
    try:
        kafka.read_to_end(
            c, topic, lambda m: got.append(((m.key() or b"").decode(), m.partition() or 0))
        )
    finally:
        c.close()
    return got


def test_go_dialogs_are_received_once_in_order_and_answered(
    ksbgo: Path,
    stack: Stack,
    settings: Deployment,
    catalog: Catalog,
    dispatcher: ThreadDispatcher,
    client: KsbClient,
) -> None:
    dispatcher.wait_owning_every_shard()
    initiator = make_application(  # the initiator's service (its queue), SEND on the target
        settings,
        "go-initiator",
        [
            Grant(permission="RECEIVE", target="InitiatorQueue", principal="go-initiator"),
            Grant(permission="SEND", target=T, principal="go-initiator"),
        ],
    )
    target = make_application(
        settings,
        "go-target",
        [Grant(permission="RECEIVE", target="TargetQueue", principal="go-target")],
    )
    began, _ = run_ksbgo(
        ksbgo, initiator, "initiate", "--dialogs", str(DIALOGS), "--messages", str(MESSAGES)
    )
    assert began["sent"] == DIALOGS * MESSAGES and len(began["dialogs"]) == DIALOGS
    # The first replica listed is down: every call moves on to the next, as the Python client's.
    down = f"127.0.0.1:{free_port()}"
    served, log = run_ksbgo(
        ksbgo,
        target,
        "serve",
        "--expect",
        str(DIALOGS * MESSAGES),
        "--linger",
        f"{LOCK_TTL_MS + 2 * RENEW_MS}ms",
        KSB_QUEUE_ADDRESSES=f"{down},{settings.queue_addresses}",
    )
    assert f"queue service {down}: Unavailable; trying {settings.queue_addresses}" in log

    # Exactly once, in order per dialog, every commit applied, each on the dialog's target side.
    received = served["received"]
    check_exactly_once_in_order(received, DIALOGS, MESSAGES)
    assert served["refused"] == []
    dialogs = began["dialogs"]
    for m in received:
        assert m["conversation_id"] == dialogs[m["conv"]]
        conversation = m["conversation_id"]
        assert m["handle"] == target_handle(conversation)
        assert m["group"] == colocated_group(conversation, shard_of(conversation, SHARDS), SHARDS)
    assert len({m["id"] for m in received}) == DIALOGS * MESSAGES

    # ROLLBACK: the messages came back untouched, found again WHERE conversation_group_id.
    rollback = served["rollback"]
    assert rollback["before"] and rollback["after"][: len(rollback["before"])] == rollback["before"]
    assert rollback["after_all_of_group"] and rollback["dead_lettered"] == []
    # GET CONVERSATION GROUP locked a group; RECEIVE TOP 1 then RECEIVE again in the same
    # transaction returned that group's messages, none twice.
    group = served["get_conversation_group"]
    assert group["group"] and group["all_of_group"] and group["messages"] == 1
    assert group["second_receive_duplicates"] == 0
    # A transaction held past the lock's TTL still committed: the client renewed its lock.
    linger = served["linger"]
    assert linger["held_ms"] > LOCK_TTL_MS and linger["messages"] > 0 and linger["applied"]

    # The replies committed with the receipts reached the initiator's queue, once, in order.
    assert served["replies"] == DIALOGS * MESSAGES
    replies = receive_all(client, "InitiatorQueue", DIALOGS * MESSAGES)
    assert {m.message_type_name for m in replies} == {"//t/Reply"}
    assert {m.conversation_handle for m in replies} == set(dialogs)
    check_exactly_once_in_order([json.loads(m.message_body) for m in replies], DIALOGS, MESSAGES)
    assert client.queue_state("TargetQueue").ready_messages == 0

    # Every request went to its group's shard: no relay hop, as with librdkafka's partitioner.
    names, admin = Names(settings.instance), stack.admin(instance=settings.instance)
    for app, count in ((initiator, DIALOGS * (1 + MESSAGES)), (target, None)):
        placed = _records_by_partition(admin, names.requests_for(app.sender))
        assert placed and (count is None or not app.secured or len(placed) == count)
        wrong = [(k, p) for k, p in placed if p != shard_of(k, SHARDS)]
        assert not wrong, f"{app.sender}: requests outside their group's shard: {wrong[:5]}"


@pytest.fixture
def secured(stack: Stack) -> None:
    """What must be refused is refused by a secured stack only."""
    if not stack.security.enabled:
        pytest.skip("the stack runs without security (KSB_STACK_SECURITY=plaintext)")


def test_what_go_must_not_do_is_refused(
    secured: None,
    ksbgo: Path,
    stack: Stack,
    settings: Deployment,
    catalog: Catalog,
    dispatcher: ThreadDispatcher,
    client: KsbClient,
) -> None:
    thief = make_application(
        settings,
        "go-thief",
        [Grant(permission="RECEIVE", target="TargetQueue", principal="go-thief")],
    )
    dialogs = [client.begin_dialog(I, T, C) for _ in range(2)]
    for h in dialogs:
        for n in range(2):
            client.send(h, "//t/Request", json.dumps({"conv": dialogs.index(h), "n": n}))
    client.flush()
    victim = client.transaction()
    held = victim.receive("TargetQueue", waitfor_ms=15_000)
    assert held and victim.lease

    got, _ = run_ksbgo(
        ksbgo,
        thief,
        "attack",
        "--stolen-lease",
        victim.lease,
        "--stolen-ids",
        ",".join(m.message_id for m in held),
    )
    owner = settings.acting_principal

    # Another principal's lease, in the thief's commit record: refused by the dispatcher, and
    # by the queue service when the thief asks for the outcome or renews it.
    stolen = got["stolen_commit"]
    assert stolen["error_code"] == "bad_lease", stolen
    assert f"granted to principal {owner!r}, not 'go-thief'" in stolen["error_reason"]
    for call in (got["stolen_outcome_call"], got["stolen_renew"]):
        assert (call["grpc"], call["kind"]) == ("PermissionDenied", "bad_lease"), call
        assert f"issued to principal {owner!r}" in call["reason"]
    # ...and its outcome record on the queue topic says so, for whoever waits on the group.
    outcomes = [
        json.loads(v)
        for k, v in read_topic(
            stack.admin(instance=settings.instance), Names(settings.instance).queue("TargetQueue")
        )
        if k == f"commit/{victim.group}".encode() and v
    ]
    [refused] = [o for o in outcomes if o["request_id"] == stolen["request_id"]]
    assert refused["applied"] is False and refused["reason"].startswith("bad_lease: ")

    # Its own lease with a raised token, or with one character of the seal changed: the seal
    # no longer matches, for the dispatcher and for the queue service.
    assert got["own_group"] and got["own_group"] != victim.group
    for forged in (got["forged_claims_commit"], got["forged_seal_commit"]):
        assert forged["error_code"] == "bad_lease", forged
        assert "seal does not match" in forged["error_reason"]
    for call in (got["forged_claims_receive"], got["forged_seal_outcome_call"]):
        assert (call["grpc"], call["kind"]) == ("PermissionDenied", "bad_lease"), call

    # No password, a wrong one, no principal: UNAUTHENTICATED. A queue without a RECEIVE
    # grant: PERMISSION_DENIED.
    assert got["no_password"]["grpc"] == "Unauthenticated"
    assert "no ksb-password" in got["no_password"]["reason"]
    assert got["wrong_password"]["grpc"] == "Unauthenticated"
    assert "Kafka refused the login" in got["wrong_password"]["reason"]
    assert got["no_principal"]["grpc"] == "Unauthenticated"
    denied = got["not_granted"]
    assert (denied["grpc"], denied["kind"]) == ("PermissionDenied", "not_authorized"), denied
    assert "InitiatorQueue" in denied["reason"]

    # Nothing of it got through: every message is still there, once, for the owner (the
    # victim lets its group go: the refused commit freed its lock, see the test below).
    victim.rollback()
    rest = receive_all(client, "TargetQueue", 4)
    ids = [m.message_id for m in rest]
    assert len(ids) == 4 and len(set(ids)) == 4
    assert {m.message_id for m in held} <= set(ids)


def _one_dialog(client: KsbClient, messages: int) -> None:
    handle = client.begin_dialog(I, T, C)
    for n in range(messages):
        client.send(handle, "//t/Request", json.dumps({"conv": 0, "n": n}))
    client.flush()


def test_a_refused_commit_record_leaves_anothers_lock_held(
    secured: None,
    ksbgo: Path,
    settings: Deployment,
    catalog: Catalog,
    dispatcher: ThreadDispatcher,
    client: KsbClient,
) -> None:
    # A principal with no RECEIVE grant at all: its commit is refused not_authorized.
    stranger = make_application(
        settings, "go-stranger", [Grant(permission="SEND", target=T, principal="go-stranger")]
    )
    _one_dialog(client, 2)
    victim = client.transaction()
    assert victim.receive("TargetQueue", waitfor_ms=15_000)
    got, _ = run_ksbgo(
        ksbgo,
        stranger,
        "commit-record",
        "--group",
        victim.group or "",
        "--token",
        str(victim.token),
        "--lease",
        "not.a-lease",
    )
    assert got["error_code"] == "not_authorized", got
    with KsbClient(settings) as other:
        intruder = other.transaction()
        try:
            taken = intruder.receive(
                "TargetQueue", conversation_group_id=victim.group, waitfor_ms=3_000
            )
        finally:
            intruder.rollback()
    assert taken == [], "a second reader locked the group the victim holds"
    victim.commit()


def test_a_rolled_back_lease_no_longer_commits(
    secured: None,
    ksbgo: Path,
    settings: Deployment,
    catalog: Catalog,
    dispatcher: ThreadDispatcher,
    client: KsbClient,
) -> None:
    thief = make_application(
        settings,
        "go-thief",
        [Grant(permission="RECEIVE", target="TargetQueue", principal="go-thief")],
    )
    _one_dialog(client, 2)
    earlier, _ = run_ksbgo(ksbgo, thief, "receive")  # locks the group, then rolls back
    assert len(earlier["ids"]) == 2
    victim = client.transaction()
    held = victim.receive("TargetQueue", conversation_group_id=earlier["group"], waitfor_ms=15_000)
    assert [m.message_id for m in held] == earlier["ids"] and victim.token > earlier["token"]
    got, _ = run_ksbgo(
        ksbgo,
        thief,
        "commit-record",
        "--group",
        earlier["group"],
        "--token",
        str(earlier["token"]),
        "--lease",
        earlier["lease"],
        "--ids",
        ",".join(earlier["ids"]),
        "--outcome",
    )
    assert got["applied"] is False, got
    victim.commit()


def test_go_unit_tests(ksbgo: Path) -> None:
    """The Go package's own tests (partitioner and target handle against Python's figures, the
    records' fields): run here, where the toolchain and the module cache are warm."""
    go = shutil.which("go")
    assert go is not None
    ran = subprocess.run(
        [go, "test", "./..."],
        cwd=GO_MODULE,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert ran.returncode == 0, f"go test failed:\n{ran.stdout}\n{ran.stderr}"
    assert "ok  \tksb/clients/go/ksb" in ran.stdout
