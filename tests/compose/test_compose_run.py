"""docker-compose.yml, run: every service healthy, each container holding only its own secrets and
none in any environment, dialogs flowing exactly once and in order through the queue service and
through the death of a dispatcher and of a queue service replica and a Redis restart, Prometheus
scraping everything, the Spark job's SLA output, and nothing left after ``down -v``.

The checks run in this file's order on one stack (`stack` in conftest.py): the faults come after
the checks of the healthy stack. Every check is generic over the compose config where it can be
(a new service needs only its compose block); the order application (`orders`, apps/orders.py)
is the one client, whose /stats says what it saw.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from devtools.containers.compose import ComposeRun
from devtools.containers.podman import inspect, podman
from devtools.processes import REPO_ROOT
from tests.compose.conftest import say

pytestmark = pytest.mark.timeout(900)

CLIENT = "orders"
ROUNDS_TO_SEE = 3
FAULT_ROUNDS = 5
WAIT_S = 180.0
QUEUE_PORT = 7070
LEASE_KEY = "lease-key"
KSB_USER = "ksb"


def _one(run: ComposeRun, service: str) -> str:
    running = [c.name for c in run.containers(service) if c.running]
    assert running, f"no running container of {service}"
    return running[0]


def _get(run: ComposeRun, service: str, url: str) -> str:
    """GET `url` from inside `service`'s container (the network is internal: nothing outside
    reaches it)."""
    code = (
        f"import urllib.request; print(urllib.request.urlopen({url!r}, timeout=10).read().decode())"
    )
    return run.exec(_one(run, service), "python", "-c", code)


def _stats(run: ComposeRun) -> dict[str, Any]:
    stats: dict[str, Any] = json.loads(_get(run, CLIENT, "http://127.0.0.1:9100/stats"))
    return stats


def _clean(stats: dict[str, Any]) -> None:
    """Every line of every round came back once, in order, and every round completed."""
    anomalies = ("duplicates", "out_of_order", "strays", "missing", "errors", "unknown_outcomes")
    assert not any(stats[k] for k in anomalies), json.dumps(stats)
    assert stats["rounds_complete"] == stats["rounds"], json.dumps(stats)


def _wait_rounds(run: ComposeRun, at_least: int, timeout_s: float = WAIT_S) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = _stats(run)
        if stats["rounds_complete"] >= at_least:
            return stats
        if time.monotonic() > deadline:
            pytest.fail(
                f"the client completed {stats['rounds_complete']} rounds, not {at_least}: {stats}"
            )
        time.sleep(2)


def test_every_service_is_healthy(stack: ComposeRun) -> None:
    """Each long-running service has its replicas running and passing their health checks; each
    one-shot exited 0."""
    for name in stack.services():
        containers = stack.containers(name)
        if stack.one_shot(name):
            assert containers and all(c.exit_code == 0 and not c.running for c in containers), (
                name,
                containers,
            )
            continue
        assert len(containers) == stack.replicas(name), (name, containers)
        for c in containers:
            assert c.running and stack.healthy(c.name), f"{c.name}:\n{stack.logs(c.name)}"
    say(f"healthy: {', '.join(f'{n} x{len(stack.containers(n))}' for n in stack.services())}")


def test_published_ports_bind_loopback_only(stack: ComposeRun) -> None:
    bound = []
    for c in stack.containers():
        (info,) = inspect(c.name)
        for port, bindings in (info["HostConfig"].get("PortBindings") or {}).items():
            for b in bindings or []:
                assert b["HostIp"] == "127.0.0.1", (c.name, port, b)
                bound.append(f"{c.service} {b['HostIp']}:{b['HostPort']}")
    assert bound, "the compose file publishes ports; none found"
    say(f"published ports: {', '.join(sorted(bound))}")


def test_the_client_runs_dialogs_exactly_once_and_in_order(stack: ComposeRun) -> None:
    stats = _wait_rounds(stack, ROUNDS_TO_SEE)
    _clean(stats)
    assert stats["replies"] == stats["lines_sent"] > 0, stats
    say(
        f"client: {stats['rounds']} rounds, {stats['dialogs_complete']} dialogs, "
        f"{stats['replies']} replies of {stats['lines_sent']} lines, no duplicate, none out of order"
    )


def _queue_replicas(run: ComposeRun) -> list[str]:
    """The services that are replicas of the queue service."""
    command = ["python", "-m", "services.queue"]
    return sorted(n for n, svc in run.services().items() if svc.get("command") == command)


def _service_by_ip(run: ComposeRun) -> dict[str, str]:
    """Each running container's address on the run's network -> its service."""
    found = {}
    for c in run.containers():
        if c.running:
            (info,) = inspect(c.name)
            net = (info["NetworkSettings"].get("Networks") or {}).get(run.network) or {}
            if net.get("IPAddress"):
                found[net["IPAddress"]] = c.service
    return found


def _peers_on(run: ComposeRun, container: str, port: int) -> list[str]:
    """The IPv4 addresses of the peers of the established TCP connections to `port` in
    `container`, from /proc/net/tcp and tcp6 (gRPC listens on both; an IPv4 peer of an IPv6
    socket is IPv4-mapped, its address the last 8 hex digits): each address in hex, byte-swapped
    per 32-bit word, state 01 established."""
    table = run.exec(container, "cat", "/proc/net/tcp", "/proc/net/tcp6")
    peers = []
    for line in table.splitlines():
        fields = line.split()
        if len(fields) < 4 or fields[3] != "01" or ":" not in fields[1]:
            continue
        local, remote = fields[1], fields[2]
        if int(local.rsplit(":", 1)[1], 16) == port:
            raw = remote.rsplit(":", 1)[0][-8:]
            peers.append(".".join(str(int(raw[i : i + 2], 16)) for i in (6, 4, 2, 0)))
    return peers


def _queue_clients(run: ComposeRun) -> dict[str, set[str]]:
    """Each running queue replica's container -> the services connected to its gRPC port."""
    by_ip = _service_by_ip(run)
    return {
        c.name: {by_ip.get(ip, ip) for ip in _peers_on(run, c.name, QUEUE_PORT)}
        for replica in _queue_replicas(run)
        for c in run.containers(replica)
        if c.running
    }


def _wait_clients(
    run: ComposeRun, services: set[str], timeout_s: float = 60
) -> dict[str, set[str]]:
    """The queue replicas' clients once every one of `services` is connected to one of them."""
    deadline = time.monotonic() + timeout_s
    while True:
        clients = _queue_clients(run)
        if services <= set().union(*clients.values()):
            return clients
        if time.monotonic() > deadline:
            pytest.fail(f"not every one of {sorted(services)} reaches a queue replica: {clients}")
        time.sleep(2)


def test_every_client_receives_through_the_queue_service(stack: ComposeRun) -> None:
    """RECEIVE is a call to the queue service: the order client and the activation service's
    monitors hold a connection to a replica, and the order service's side, the external
    activator's readers, took every line the client sent and replied (the client's rounds are
    complete) with no way to RECEIVE but the queue service: their principal reads no queue
    topic and, like every client, has no lock of its own in Redis."""
    replicas = _queue_replicas(stack)
    assert len(replicas) >= 2, replicas
    clients = _wait_clients(stack, {CLIENT, "activation"})
    readers = json.loads(_get(stack, "external_activator", "http://127.0.0.1:9100/readers"))
    started = {r["queue"]: r["started"] for r in readers}
    assert started.get("OrderServiceQueue", 0) > 0, readers
    _clean(_stats(stack))
    say(
        "queue service: "
        + "; ".join(f"{c} serves {', '.join(sorted(s)) or 'nobody'}" for c, s in clients.items())
        + f"; the external activator started {started['OrderServiceQueue']} readers"
    )


def _secret_values(run: ComposeRun) -> dict[str, str]:
    return {p.name: p.read_text().strip() for p in sorted(run.secrets_dir.iterdir())}


def _secret_of(principal: str, instance: str) -> str:
    """The secret holding a principal's password: ``ksb-<instance>-<role>`` -> <role>-password."""
    return f"{principal.removeprefix(f'ksb-{instance}-')}-password"


def _redis_secret_of(principal: str, instance: str) -> str:
    """The secret holding a principal's Redis password (another than its Kafka one)."""
    return _secret_of(principal, instance).replace("-password", "-redis-password")


def _readers_logins(env: dict[str, Any]) -> set[str]:
    """The secrets an external activator holds for its readers (its configuration's `logins`,
    each the password file of the principal its readers run as)."""
    config = env.get("KSB_EXTERNAL_ACTIVATOR_CONFIG")
    if config is None:
        return set()
    logins = yaml.safe_load((REPO_ROOT / config.removeprefix("/app/")).read_text())["logins"]
    return {login["kafka_password_file"].rsplit("/", 1)[-1] for login in logins.values()}


def _secrets_needed(svc: dict[str, Any], every: set[str], instance: str) -> set[str]:
    """What a container's role needs, by the rule the compose file must follow: a KSB process
    its principal's passwords, Kafka's and, with a Redis user, Redis's (admin: both of admin's,
    and every principal's to make their users), plus the lease key for the services that seal
    or open leases, and an external activator its readers' logins; Kafka the broker's and
    admin's Kafka passwords; Redis admin's; nothing for anyone else."""
    env = svc.get("environment") or {}
    user = env.get("KSB_KAFKA_USERNAME")
    command = svc.get("command") or []
    if user == "admin":
        return {s for s in every if s.endswith("-password")} - {
            "broker-password",
            "grafana-admin-password",
        }
    if user is not None:
        lease = (
            {LEASE_KEY} if command[2:3] in (["services.dispatcher"], ["services.queue"]) else set()
        )
        redis = {_redis_secret_of(user, instance)} if "KSB_REDIS_USERNAME" in env else set()
        return {_secret_of(user, instance)} | redis | lease | _readers_logins(env)
    image = str(svc.get("image", ""))
    if "kafka" in image:
        return {"broker-password", "admin-kafka-password"}
    if image.startswith("redis"):
        return {"admin-redis-password"}
    return set()


def _mounted_secrets(info: dict[str, Any]) -> set[str]:
    """The secrets compose mounted into a container (from its `inspect`)."""
    return {
        m["Destination"].removeprefix("/run/secrets/")
        for m in info.get("Mounts") or []
        if m["Destination"].startswith("/run/secrets/")
    }


def _as_owner_of_pid_1(container: str, *command: str) -> str:
    """`command` in the container as the user its first process runs as: root may not read
    another user's /proc/<pid>/environ without CAP_SYS_PTRACE, which containers lack."""
    uid = podman("exec", "--user", "0", container, "stat", "-c", "%u", "/proc/1").stdout.strip()
    return podman("exec", "--user", uid, container, *command).stdout


READ_PID_1 = "<pid 1 read>"
"""Printed once the first process's environment was read: the reads below are not vacuous."""


def _processes(container: str) -> tuple[str, list[list[str]], list[str]]:
    """As root, in one call: the first process's user, the users of every process, and the
    KSB secrets' copies (name, owner, mode)."""
    # Each process's real uid from its status, with shell builtins only, so that this shell
    # (skipped) is the one process of the call.
    uids = (
        'for p in /proc/[0-9]*; do [ "$p" = /proc/$$ ] && continue; '
        'while read -r k v _; do [ "$k" = Uid: ] && echo "$v"; done < "$p/status"; '
        "done 2>/dev/null; "
    )
    script = (
        f"stat -c %u /proc/1; {uids}echo --; "
        "stat -c '%n %U %a' /run/ksb/secrets/* 2>/dev/null; true"
    )
    out = podman("exec", "--user", "0", container, "sh", "-c", script).stdout
    head, _, copies = out.partition("--\n")
    first, *owners = head.split()
    return first, [line.split() for line in copies.splitlines() if line], sorted(set(owners))


def _everything_visible(info: dict[str, Any], owners: list[str], first: str) -> Iterator[str]:
    """What `docker inspect` and the container's processes show: its configured environment,
    then (running) every process's environment and command line, read as each user that runs
    one (a process's environment is readable by its own user only)."""
    yield "\n".join(info["Config"].get("Env") or [])
    if not info["State"]["Running"]:
        return
    script = "cat /proc/[0-9]*/environ /proc/[0-9]*/cmdline 2>/dev/null; true"
    for uid in owners:
        check = f"cat /proc/1/environ > /dev/null && echo '{READ_PID_1}'; " if uid == first else ""
        seen = podman("exec", "--user", uid, info["Name"], "sh", "-c", check + script).stdout
        assert uid != first or READ_PID_1 in seen, f"{info['Name']}: pid 1's environment unread"
        yield seen


def test_secrets_are_files_and_each_container_holds_only_its_own(stack: ComposeRun) -> None:
    """Generated 0600 (the folder 0700, .env 0600); mounted into exactly the containers whose
    role needs them, the lease key into the dispatchers and the queue service's replicas only;
    copied for the image's user alone (0400) in the KSB containers, whose processes run as that
    user; and no secret's value in any container's environment, nor in any process's
    environment or command line."""
    values = _secret_values(stack)
    assert stack.secrets_dir.stat().st_mode & 0o777 == 0o700
    for path in [stack.env_file, *stack.secrets_dir.iterdir()]:
        assert path.stat().st_mode & 0o777 == 0o600, path
    instance = stack.services()[CLIENT]["environment"]["KSB_INSTANCE"]
    services = stack.services()
    containers = stack.containers()
    infos = {i["Name"]: i for i in inspect(*(c.name for c in containers))}
    ksb_uid = stack.exec(_one(stack, CLIENT), "id", "-u", KSB_USER).strip()
    holders: dict[str, set[str]] = {}
    for c in containers:
        svc, info = services[c.service], infos[c.name]
        mounted = _mounted_secrets(info)
        assert mounted == _secrets_needed(svc, set(values), instance), c.name
        for name in mounted:
            holders.setdefault(name, set()).add(c.service)
        first, copies, owners = _processes(c.name) if c.running else ("", [], [])
        for seen in _everything_visible(info, owners, first):
            leaked = sorted(name for name, value in values.items() if value in seen)
            assert not leaked, f"{c.name} shows the value of {leaked}"
        if c.running and svc.get("entrypoint") == ["sh", "/app/infra/compose/entrypoint.sh"]:
            assert {f[0].rsplit("/", 1)[1] for f in copies} == mounted, (c.name, copies)
            assert all(f[1:] == [KSB_USER, "400"] for f in copies), (c.name, copies)
            assert owners == [ksb_uid] == [first], (c.name, owners)  # every process is ksb's
    lease_holders = {"dispatcher", *_queue_replicas(stack)}
    assert holders[LEASE_KEY] == lease_holders, holders[LEASE_KEY]
    say(
        f"secrets: {len(values)} files (0600), each container holding only its own, the lease key "
        f"only in {', '.join(sorted(lease_holders))}; no value in any environment or command line"
    )


def _lease_key_digest(container: str) -> str:
    """The SHA-256 of the lease key file the container's service process reads (its
    KSB_LEASE_KEY_FILE), computed inside the container."""
    environ = _as_owner_of_pid_1(container, "cat", "/proc/1/environ").split("\0")
    path = dict(v.split("=", 1) for v in environ if "=" in v)["KSB_LEASE_KEY_FILE"]
    digest = _as_owner_of_pid_1(container, "sh", "-c", f'printf %s "$(cat {path})" | sha256sum')
    return digest.split()[0]


def test_the_dispatchers_and_the_queue_service_seal_and_open_leases_with_one_key(
    stack: ComposeRun,
) -> None:
    """Every dispatcher and queue replica process reads the same lease key, the secret's: with
    no key on one side only, every commit would be refused (a sealed lease opened without a key,
    or an unsealed one where a key is set), and with none on both, leases would be unsealed and a
    forged one believed. The rounds completing shows both sides use the key they read."""
    want = hashlib.sha256(_secret_values(stack)[LEASE_KEY].encode()).hexdigest()
    readers = [
        c.name
        for service in ("dispatcher", *_queue_replicas(stack))
        for c in stack.containers(service)
        if c.running
    ]
    assert len(readers) == stack.replicas("dispatcher") + len(_queue_replicas(stack)), readers
    for name in readers:
        assert _lease_key_digest(name) == want, name
    _clean(_wait_rounds(stack, _stats(stack)["rounds_complete"] + 1))
    say(f"lease key: the same in {len(readers)} processes ({', '.join(readers)})")


def test_prometheus_scrapes_every_target(stack: ComposeRun) -> None:
    """Every job of infra/prometheus/prometheus.yml has its targets up (the dispatcher's, one per
    replica; the queue service's, one per replica service)."""
    jobs = {
        j["job_name"]
        for j in yaml.safe_load((REPO_ROOT / "infra/prometheus/prometheus.yml").read_text())[
            "scrape_configs"
        ]
    }
    deadline = time.monotonic() + 120
    while True:
        raw = stack.exec(
            _one(stack, "prometheus"),
            "wget",
            "-q",
            "-O",
            "-",
            "http://127.0.0.1:9090/api/v1/targets",
        )
        targets = json.loads(raw)["data"]["activeTargets"]
        by_job: dict[str, list[str]] = {}
        for t in targets:
            by_job.setdefault(t["labels"]["job"], []).append(t["health"])
        up = {j for j, healths in by_job.items() if all(h == "up" for h in healths)}
        enough = len(by_job.get("dispatcher", [])) == stack.replicas("dispatcher") and len(
            by_job.get("queue", [])
        ) == len(_queue_replicas(stack))
        if up == jobs and enough:
            break
        if time.monotonic() > deadline:
            pytest.fail(f"targets not all up: {by_job} (jobs {sorted(jobs)})")
        time.sleep(3)
    say(f"prometheus: {len(targets)} targets up across jobs {', '.join(sorted(jobs))}")


def test_the_spark_job_writes_sla_metrics(stack: ComposeRun) -> None:
    """The audit job's SLA windows reach its Parquet output (the spark-data volume) and its
    exporter."""
    instance = stack.services()["spark"]["environment"]["KSB_INSTANCE"]
    container = _one(stack, "spark")
    deadline = time.monotonic() + 240
    while True:
        files = podman(
            "exec",
            container,
            "find",
            f"/var/lib/ksb/spark/{instance}/sla",
            "-name",
            "*.parquet",
            check=False,
        ).stdout.split()
        metrics = _get(stack, "spark", "http://127.0.0.1:9100/metrics")
        counted = sum(
            float(v) for v in re.findall(r"^ksb_sla_messages\{[^}]*\} (\S+)$", metrics, re.M)
        )
        if files and counted > 0:
            break
        if time.monotonic() > deadline:
            pytest.fail(f"no SLA output: {len(files)} parquet files, ksb_sla_messages {counted}")
        time.sleep(5)
    say(f"spark: {len(files)} SLA parquet files, {counted:.0f} messages in ksb_sla_messages")


def test_delivery_continues_when_a_dispatcher_is_killed(stack: ComposeRun) -> None:
    """One of the dispatchers dies (SIGKILL to its process, as a crash would: `podman kill`
    would count as stopping it on purpose); the others take its shards and every round still
    completes exactly once and in order; its restart policy brings it back."""
    dispatchers = [c.name for c in stack.containers("dispatcher") if c.running]
    assert len(dispatchers) == stack.replicas("dispatcher") >= 2, dispatchers
    before = _stats(stack)
    victim = dispatchers[-1]
    (info,) = inspect(victim)
    os.kill(int(info["State"]["Pid"]), signal.SIGKILL)
    killed_at = time.monotonic()
    after = _wait_rounds(stack, before["rounds_complete"] + FAULT_ROUNDS)
    _clean(after)
    took = time.monotonic() - killed_at
    stack.wait_healthy("dispatcher")  # every replica, the restarted one too
    (again,) = inspect(victim)
    assert again["RestartCount"] >= 1, again["RestartCount"]
    say(
        f"dispatcher {victim} killed: {after['rounds_complete'] - before['rounds_complete']} more "
        f"rounds complete in {took:.0f} s, all exactly once and in order; restarted by its "
        f"policy ({again['RestartCount']} restart) and healthy"
    )


def test_delivery_continues_when_a_queue_service_replica_is_killed(stack: ComposeRun) -> None:
    """The replica the order client is connected to dies (SIGKILL to its process); the client
    moves to the other one, which answers its calls (every call carries its lease, the group
    locks are in Redis), and every round still completes exactly once and in order; the
    replica's restart policy brings it back, healthy."""
    clients = _wait_clients(stack, {CLIENT})
    victim = next(c for c, services in clients.items() if CLIENT in services)
    service = next(c.service for c in stack.containers() if c.name == victim)
    before = _stats(stack)
    (info,) = inspect(victim)
    os.kill(int(info["State"]["Pid"]), signal.SIGKILL)
    killed_at = time.monotonic()
    after = _wait_rounds(stack, before["rounds_complete"] + FAULT_ROUNDS)
    _clean(after)
    took = time.monotonic() - killed_at
    stack.wait_healthy(service)
    (again,) = inspect(victim)
    assert again["RestartCount"] >= 1, again["RestartCount"]
    moved = _wait_clients(stack, {CLIENT})
    assert any(CLIENT in s for c, s in moved.items() if c != victim), moved
    say(
        f"queue replica {victim} killed: {after['rounds_complete'] - before['rounds_complete']} "
        f"more rounds complete in {took:.0f} s, all exactly once and in order "
        f"({after['retries'] - before['retries']} calls tried again); the client moved to "
        f"{', '.join(c for c, s in moved.items() if CLIENT in s)}; restarted by its policy "
        f"({again['RestartCount']} restart) and healthy"
    )


def _redis(run: ComposeRun, user: str, password: str, *command: str) -> str:
    """A redis-cli command as `user`, its password given on standard input (never on a command
    line or in an environment podman shows)."""
    script = 'REDISCLI_AUTH="$(cat)" exec redis-cli --no-auth-warning --user "$0" "$@"'
    return podman(
        "exec", "-i", _one(run, "redis"), "sh", "-c", script, user, *command,
        stdin=password.encode(),
    ).stdout.strip()  # fmt: skip


def _redis_password(values: dict[str, str], user: str, instance: str) -> str:
    """A Redis user's password: admin's Redis one, else its principal's Redis one."""
    return values["admin-redis-password" if user == "admin" else _redis_secret_of(user, instance)]


def test_every_principal_logs_in_to_redis_after_a_restart(stack: ComposeRun) -> None:
    """Redis restarted keeps every user (ACL SAVE into its volume), each logs in with its
    secret, and delivery goes on. No application has a Redis user: RECEIVE is the queue
    service's."""
    values = _secret_values(stack)
    instance = stack.services()[CLIENT]["environment"]["KSB_INSTANCE"]
    admin = _redis_password(values, "admin", instance)
    users = sorted(_redis(stack, "admin", admin, "ACL", "USERS").split())
    assert CLIENT not in users, users
    assert f"ksb-{instance}-queue" in users, users
    before = _stats(stack)
    podman("restart", "-t", "10", _one(stack, "redis"))
    stack.wait_healthy("redis")
    assert sorted(_redis(stack, "admin", admin, "ACL", "USERS").split()) == users
    logged_in = []
    for user in users:
        if user == "default":
            continue  # off: nobody logs in as it
        answer = _redis(stack, user, _redis_password(values, user, instance), "PING")
        assert answer == "PONG", (user, answer)
        logged_in.append(user)
    after = _wait_rounds(stack, before["rounds_complete"] + FAULT_ROUNDS)
    _clean(after)
    say(
        f"redis restarted: {len(logged_in)} users log in ({', '.join(logged_in)}); delivery goes on"
    )


def test_down_leaves_nothing(stack: ComposeRun) -> None:
    left = stack.down()
    assert left == [], f"`down -v` left {left}"
    remaining = podman(
        "ps", "-a", "-q", "--filter", "label=io.podman.compose.project=ksbtest"
    ).stdout.split()
    assert remaining == []
    say("down -v: no container, volume or network of the run left")
