"""The local stack's Redis: a plain ``redis-server`` process on a free 127.0.0.1 port.

No persistence (``--save ''``, no AOF): the stack is throwaway and fsyncs cost latency.

In the stack's TLS mode it listens on a TLS port only (``rediss://``), with a certificate the
stack's CA signed. Secured (the default), it starts from an ACL file with the ``default`` user off and one user,
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
from typing import Any, Self

import redis

from devtools.processes import STACK_UMASK, LocalStackError, free_port, register_child
from devtools.stack_security import StackSecurity
from ksb.runtime.credentials import write_private
from ksb.security.principals import ADMIN

__all__ = ["SlotMove", "form_cluster", "move_slot", "redis_ready", "start_redis"]

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
    digest = hashlib.sha256(security.redis_password(ADMIN).encode()).hexdigest()
    path = root / "users.acl"
    write_private(path, f"user default off\nuser {ADMIN} on #{digest} ~* &* +@all\n")
    return path


def start_redis(
    root: Path,
    port: int,
    security: StackSecurity,
    *,
    cluster: bool = False,
    appendonly: bool = False,
) -> subprocess.Popen[bytes]:
    """One ``redis-server``; with `cluster`, a node of a Redis Cluster still to be formed
    (`form_cluster`), its cluster bus on a free port of its own (Redis's default, `port` +
    10000, is past 65535 for half the ports a free-port search returns); with `appendonly`, its
    data kept in an append-only file under `root` and loaded from it at a start (fsync every
    second, Redis's default)."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    cmd = [
        _redis_server(),
        "--port", str(port),
        "--bind", "127.0.0.1",
        "--save", "",
        "--appendonly", "yes" if appendonly else "no",
        "--dir", str(root),
        "--logfile", str(root / "redis.log"),
        "--daemonize", "no",
    ]  # fmt: skip
    if security.enabled:
        cmd += ["--aclfile", str(_write_acl_file(root, security))]
    if security.mode == "tls":  # TLS only: the plain port is closed
        cert, key = security.server_pair("redis")
        cmd[cmd.index("--port") + 1] = "0"
        cmd += [
            "--tls-port", str(port),
            "--tls-cert-file", str(cert),
            "--tls-key-file", str(key),
            "--tls-ca-cert-file", str(security.stack_ca),
            "--tls-auth-clients", "no",
        ]  # fmt: skip
        if cluster:
            cmd += ["--tls-cluster", "yes", "--tls-replication", "yes"]
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
        umask=STACK_UMASK,
    )
    register_child(proc)
    return proc


def _admin(url: str, security: StackSecurity) -> redis.Redis:
    auth: dict[str, Any] = (
        {"username": ADMIN, "password": security.redis_password(ADMIN)} if security.enabled else {}
    )
    if security.mode == "tls":
        auth["ssl_ca_certs"] = str(security.stack_ca)
    return redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=1.0, **auth)


def persist_redis(url: str, security: StackSecurity, deadline: float) -> None:
    """Turn the append-only file on in a running Redis and wait until it holds the data set
    (Redis writes it by a rewrite in the background)."""
    client = _admin(url, security)
    try:
        client.config_set("appendonly", "yes")
        while True:
            info = client.info("persistence")
            busy = info.get("aof_rewrite_in_progress") or info.get("aof_rewrite_scheduled")
            if info.get("aof_enabled") and not busy:
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(f"Redis at {url} did not write its append-only file in time")
            time.sleep(0.05)
    finally:
        client.close()


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
            _cluster(c, "ADDSLOTSRANGE", first, last)
        for c in everyone[1:]:
            kwargs = c.connection_pool.connection_kwargs
            bus = c.config_get("cluster-port")["cluster-port"]  # MEET assumes port + 10000
            _cluster(clients[0], "MEET", kwargs["host"], kwargs["port"], bus)
        if followers and security.enabled:
            for c in everyone:  # a replica logs in to its primary; any node may become one
                c.config_set("masteruser", ADMIN)
                c.config_set("masterauth", security.redis_password(ADMIN))
        _wait(
            deadline, urls, lambda: all(_knows(_cluster_info(c), len(everyone)) for c in everyone)
        )
        for i, f in enumerate(followers):
            primary = _cluster(clients[i % len(clients)], "MYID")
            _cluster(f, "REPLICATE", primary)
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


class SlotMove:
    """Moving hash `slot` and its keys from the primary at `source_url` to the one at
    `target_url` while clients go on using it, in the steps ``redis-cli --cluster reshard``
    takes: `begin` (the target IMPORTING, the source MIGRATING), `migrate` (keys MIGRATEd, a
    batch at a time), `finish` (the slot given to the target, first on the target, then on the
    source; gossip tells the rest). In between, a command on keys all moved or missing is sent on
    to the target with ASK (the client then sends ASKING), and a multi-key one over moved and
    unmoved or missing keys (a lock script's) is answered TRYAGAIN."""

    def __init__(self, source_url: str, target_url: str, slot: int, security: StackSecurity):
        self.slot = slot
        self._source, self._target = _admin(source_url, security), _admin(target_url, security)
        self._auth = ["AUTH2", ADMIN, security.redis_password(ADMIN)] if security.enabled else []
        self._target_id = _cluster(self._target, "MYID")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_exc: object) -> None:
        self._source.close()
        self._target.close()

    def begin(self) -> None:
        _cluster(self._target, "SETSLOT", self.slot, "IMPORTING", _cluster(self._source, "MYID"))
        _cluster(self._source, "SETSLOT", self.slot, "MIGRATING", self._target_id)

    def migrate(self, keys: Sequence[str | bytes]) -> None:
        to = self._target.connection_pool.connection_kwargs
        cmd = ("MIGRATE", to["host"], to["port"], "", 0, 5_000, *self._auth, "KEYS", *keys)
        self._source.execute_command(*cmd)  # type: ignore[no-untyped-call]

    def migrate_all(self, *, batch: int = 10, pause_s: float = 0.0) -> int:
        """Every key left in the slot, `batch` at a time, `pause_s` apart (a test holds the
        slot half-moved under load that way); how many moved."""
        moved = 0
        while keys := _cluster(self._source, "GETKEYSINSLOT", self.slot, batch):
            self.migrate(keys)
            moved += len(keys)
            time.sleep(pause_s)
        return moved

    def finish(self) -> None:
        for c in (self._target, self._source):
            _cluster(c, "SETSLOT", self.slot, "NODE", self._target_id)


def move_slot(
    source_url: str,
    target_url: str,
    slot: int,
    security: StackSecurity,
    *,
    batch: int = 10,
    pause_s: float = 0.0,
) -> int:
    """Reshard: move `slot` and all its keys (`SlotMove`); returns how many keys moved."""
    with SlotMove(source_url, target_url, slot, security) as move:
        move.begin()
        moved = move.migrate_all(batch=batch, pause_s=pause_s)
        move.finish()
    return moved


def _cluster(client: redis.Redis, *args: object) -> Any:
    return client.execute_command("CLUSTER", *args)  # type: ignore[no-untyped-call]


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
    raw = _cluster(client, "INFO")
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    return dict(line.split(":", 1) for line in text.split() if ":" in line)
