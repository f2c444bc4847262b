"""docker-compose.yml, run: every service healthy, dialogs flowing exactly once and in order through a
dispatcher's death and a Redis restart, Prometheus scraping everything, the Spark job's SLA output,
and nothing left after ``down -v``.

The checks run in this file's order on one stack (`stack` in conftest.py): the faults come after
the checks of the healthy stack. Every check is generic over the compose config where it can be
(a new service needs only its compose block); the order application (`orders`, apps/orders.py)
is the one client, whose /stats says what it saw.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
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
    assert not any(stats[k] for k in anomalies), stats
    assert stats["rounds_complete"] == stats["rounds"], stats


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


def test_prometheus_scrapes_every_target(stack: ComposeRun) -> None:
    """Every job of infra/prometheus/prometheus.yml has its targets up (the dispatcher's, one per
    replica)."""
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
        enough = len(by_job.get("dispatcher", [])) == stack.replicas("dispatcher")
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


def _redis_users(run: ComposeRun) -> list[str]:
    out = run.exec(
        _one(run, "redis"), "redis-cli", "--no-auth-warning", "--user", "admin", "ACL", "USERS"
    )
    return sorted(out.split())


def _password_of(env: dict[str, str], user: str, instance: str) -> str:
    """A Redis user's password from the run's .env: ``ksb-<instance>-<role>`` -> PASSWORD_<ROLE>."""
    name = user.removeprefix(f"ksb-{instance}-")
    return env["PASSWORD_" + name.upper().replace("-", "_")]


def test_every_principal_logs_in_to_redis_after_a_restart(stack: ComposeRun) -> None:
    users = _redis_users(stack)
    before = _stats(stack)
    podman("restart", "-t", "10", _one(stack, "redis"))
    stack.wait_healthy("redis")
    assert _redis_users(stack) == users
    env = dict(line.split("=", 1) for line in stack.env_file.read_text().splitlines() if line)
    instance = stack.services()[CLIENT]["environment"]["KSB_INSTANCE"]
    logged_in = []
    for user in users:
        if user == "default":
            continue  # off: nobody logs in as it
        answer = podman(
            "exec", "-e", f"REDISCLI_AUTH={_password_of(env, user, instance)}",
            _one(stack, "redis"), "redis-cli", "--no-auth-warning", "--user", user, "PING",
        ).stdout.strip()  # fmt: skip
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
