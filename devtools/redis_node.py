"""The local stack's Redis: a plain ``redis-server`` process on a free 127.0.0.1 port.

No persistence (``--save ''``, no AOF): the stack is throwaway and fsyncs cost latency.

Secured (the default), it starts from an ACL file with the ``default`` user off and one user,
``admin``, allowed everything: the tool that gives every principal its own ACL user
(`ksb.security.apply`). Nobody else can log in until it has. The file holds only the password's
SHA-256, as Redis's own ``ACL SAVE`` would write it.

A stack with several Redis nodes runs them as one Redis Cluster (`form_cluster`): every node
starts cluster-enabled from the same ACL file (a cluster keeps its users per node), the slots
are split evenly over the primaries, and any replica nodes follow a primary each.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import redis

from devtools.processes import LocalStackError, free_port, register_child
from devtools.stack_security import StackSecurity
from ksb.security.credentials import write_private
from ksb.security.principals import ADMIN

__all__ = ["form_cluster", "redis_ready", "start_redis"]

SLOTS = 16_384
"""Redis Cluster's hash slots."""


def _redis_server() -> str:
    found = shutil.which("redis-server") or (
        "/usr/bin/redis-server" if Path("/usr/bin/redis-server").is_file() else None
    )
    if found is None:
        raise LocalStackError("`redis-server` not found; run `make setup`")
    return found


def _write_acl_file(root: Path, security: StackSecurity) -> Path:
    digest = hashlib.sha256(security.password(ADMIN).encode()).hexdigest()
    path = root / "users.acl"
    write_private(path, f"user default off\nuser {ADMIN} on #{digest} ~* &* +@all\n")
    return path


def start_redis(
    root: Path, port: int, security: StackSecurity, *, cluster: bool = False
) -> subprocess.Popen[bytes]:
    """One ``redis-server``; with `cluster`, a node of a Redis Cluster still to be formed
    (`form_cluster`), its cluster bus on a free port of its own (Redis's default, `port` +
    10000, is past 65535 for half the ports a free-port search returns)."""
    root.mkdir(parents=True, exist_ok=True)
    cmd = [
        _redis_server(),
        "--port", str(port),
        "--bind", "127.0.0.1",
        "--save", "",
        "--appendonly", "no",
        "--dir", str(root),
        "--logfile", str(root / "redis.log"),
        "--daemonize", "no",
    ]  # fmt: skip
    if security.enabled:
        cmd += ["--aclfile", str(_write_acl_file(root, security))]
    if cluster:
        cmd += [
            "--cluster-enabled", "yes",
            "--cluster-config-file", str(root / "nodes.conf"),
            "--cluster-node-timeout", "5000",
            "--cluster-port", str(free_port()),
        ]  # fmt: skip
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=root,
        start_new_session=True,
    )
    register_child(proc)
    return proc


def _admin(url: str, security: StackSecurity) -> redis.Redis:
    auth = {"username": ADMIN, "password": security.password(ADMIN)} if security.enabled else {}
    return redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=1.0, **auth)


def redis_ready(url: str, deadline: float, security: StackSecurity) -> None:
    """PING answered, logged in as ``admin`` when secured."""
    client = _admin(url, security)
    try:
        while True:
            try:
                if client.ping():
                    return
            except redis.AuthenticationError as exc:
                raise LocalStackError(f"Redis at {url} refused the admin login: {exc}") from exc
            except redis.RedisError:
                pass
            if time.monotonic() >= deadline:
                raise TimeoutError(f"Redis at {url} did not answer PING in time")
            time.sleep(0.05)
    finally:
        client.close()


def form_cluster(
    urls: list[str], deadline: float, security: StackSecurity, replicas: Sequence[str] = ()
) -> None:
    """Make the ready nodes at `urls` one Redis Cluster: each takes an even, contiguous share of
    the slots, the first meets the others, and it returns once every node reports the cluster
    ok (all slots served). Each node of `replicas` replicates a primary, in turn (the i-th the
    primary i modulo their count), and is in sync with it before this returns: a primary that
    dies is replaced by its replica (Redis's own failover, after ``cluster-node-timeout``)."""
    clients = [_admin(url, security) for url in urls]
    followers = [_admin(url, security) for url in replicas]
    everyone = clients + followers
    try:
        share = -(-SLOTS // len(clients))
        for i, c in enumerate(clients):
            first, last = i * share, min(SLOTS, (i + 1) * share) - 1
            c.execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)  # type: ignore[no-untyped-call]
        for c in everyone[1:]:
            kwargs = c.connection_pool.connection_kwargs
            bus = c.config_get("cluster-port")["cluster-port"]  # MEET assumes port + 10000
            clients[0].execute_command("CLUSTER", "MEET", kwargs["host"], kwargs["port"], bus)  # type: ignore[no-untyped-call]
        if followers and security.enabled:
            for c in everyone:  # a replica logs in to its primary; any node may become one
                c.config_set("masteruser", ADMIN)
                c.config_set("masterauth", security.password(ADMIN))
        _wait(
            deadline, urls, lambda: all(_knows(_cluster_info(c), len(everyone)) for c in everyone)
        )
        for i, f in enumerate(followers):
            primary = clients[i % len(clients)].execute_command("CLUSTER", "MYID")  # type: ignore[no-untyped-call]
            f.execute_command("CLUSTER", "REPLICATE", primary)  # type: ignore[no-untyped-call]
        _wait(
            deadline,
            urls,
            lambda: (
                all(_formed(_cluster_info(c), len(everyone)) for c in everyone)
                and all(f.info("replication").get("master_link_status") == "up" for f in followers)
            ),
        )
    finally:
        for c in everyone:
            c.close()


def _wait(deadline: float, urls: list[str], done: Callable[[], bool]) -> None:
    while not done():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"Redis Cluster of {urls} did not report ok in time")
        time.sleep(0.05)


def _knows(info: dict[str, str], nodes: int) -> bool:
    return info.get("cluster_known_nodes") == str(nodes)


def _formed(info: dict[str, str], nodes: int) -> bool:
    return info.get("cluster_state") == "ok" and _knows(info, nodes)


def _cluster_info(client: redis.Redis) -> dict[str, str]:
    raw = client.execute_command("CLUSTER", "INFO")  # type: ignore[no-untyped-call]
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    return dict(line.split(":", 1) for line in text.split() if ":" in line)
