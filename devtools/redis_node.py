"""The local stack's Redis: a plain ``redis-server`` process on a free 127.0.0.1 port.

No persistence (``--save ''``, no AOF): the stack is throwaway and fsyncs cost latency.

Secured (the default), it starts from an ACL file with the ``default`` user off and one user,
``admin``, allowed everything: the tool that gives every principal its own ACL user
(`ksb.security.apply`). Nobody else can log in until it has. The file holds only the password's
SHA-256, as Redis's own ``ACL SAVE`` would write it.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import time
from pathlib import Path

from devtools.processes import LocalStackError, register_child
from devtools.stack_security import StackSecurity
from ksb.security.credentials import write_private
from ksb.security.principals import ADMIN

__all__ = ["redis_ready", "start_redis"]


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


def start_redis(root: Path, port: int, security: StackSecurity) -> subprocess.Popen[bytes]:
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


def redis_ready(url: str, deadline: float, security: StackSecurity) -> None:
    """PING answered, logged in as ``admin`` when secured."""
    import redis

    auth = {"username": ADMIN, "password": security.password(ADMIN)} if security.enabled else {}
    client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=1.0, **auth)
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
