"""The Redis ACL rules of one instance: each principal's keys and commands, from the code's use.

A principal that RECEIVEs touches its queues' lock, fence, waiting, activity, rollback and
message-rollback keys (`ksb.sdk.locks`, `ksb.sdk.reader`) and reads the disabled set and the
dead-letter policies. Three Redis facts shape the rules (measured on Redis 7.0):

* keys passed to EVAL/EVALSHA are checked as read-write, so the disabled set, which the lock
  script only tests, needs ``~`` (not ``%R~``): a receiver can reach it with the commands it
  has (SET included, which would overwrite the set: one shared key for all queues, listed in
  the docs as a known limit);
* every command a script calls needs its own grant (TIME included), and redis-py's scripts need
  ``script|load`` besides EVALSHA (on a cold script cache);
* a MULTI/EXEC pipeline from a user without ``+multi +exec`` runs its commands one by one,
  non-atomically: who uses transactions (the views, the activation service) gets them.

The dispatcher and the Spark job do not use Redis and get no Redis user.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ksb.security.access import ALL_QUEUES, Access
from ksb.security.principals import Role

__all__ = ["RedisRules", "instance_rules", "rules_of"]

CONNECT = ("ping",)
"""Besides AUTH and HELLO, which need no grant (redis-py also sends CLIENT SETINFO, which
Redis 7.0 does not know and redis-py ignores failing)."""
RECEIVER = (
    "evalsha", "script|load", "script|exists", "sismember", "time", "hget", "hset", "hdel", "incr", "incrby", "set",
    "pexpire", "zadd", "zrem", "hincrby",
)  # fmt: skip
ACTIVATION = (
    *RECEIVER, "multi", "exec", "discard", "del", "sadd", "zcount", "zremrangebyscore", "zcard",
    "hgetall", "get",
)  # fmt: skip
VIEW = ("set", "del", "multi", "exec", "discard")
TRANSPORT = (*VIEW, "zadd", "zrange")
READER = (
    "get", "mget", "exists", "type", "ttl", "pttl", "scan", "hget", "hmget", "hgetall", "hlen",
    "smembers", "scard", "sismember", "zrange", "zrangebyscore", "zcount", "zcard", "zscore",
)  # fmt: skip


@dataclass(frozen=True)
class RedisRules:
    """What one principal may do in Redis for one instance."""

    keys: frozenset[str] = field(default_factory=frozenset)
    """Key patterns it may read and write (``~pattern``)."""
    read_keys: frozenset[str] = field(default_factory=frozenset)
    """Key patterns it may only read (``%R~pattern``)."""
    commands: frozenset[str] = field(default_factory=frozenset)

    def __or__(self, other: RedisRules) -> RedisRules:
        return RedisRules(
            self.keys | other.keys,
            self.read_keys | other.read_keys,
            self.commands | other.commands,
        )

    @property
    def empty(self) -> bool:
        return not (self.keys or self.read_keys or self.commands)

    def acl(self) -> list[str]:
        """``ACL SETUSER`` rules that replace the user's keys, channels and commands with these
        (passwords and on/off are not touched). No pub/sub channels: nothing uses them."""
        rules = ["resetkeys", "resetchannels", "-@all"]
        rules += [f"~{k}" for k in sorted(self.keys)]
        rules += [f"%R~{k}" for k in sorted(self.read_keys - self.keys)]
        rules += [f"+{c}" for c in sorted(self.commands)]
        return rules


def _receiver(prefix: str, queue: str) -> RedisRules:
    q = "*" if queue == ALL_QUEUES else queue
    keys = {
        f"{prefix}disabled",
        f"{prefix}activity:{q}",
        f"{prefix}lock:{q}:*",
        f"{prefix}fence:{q}:*",
        f"{prefix}waiting:{q}",
        f"{prefix}rollbacks:{q}",
        f"{prefix}msgrb:{q}",
    }
    return RedisRules(
        frozenset(keys), frozenset({f"{prefix}dlpolicy"}), frozenset((*CONNECT, *RECEIVER))
    )


def rules_of(instance: str, a: Access) -> RedisRules:
    """`a`'s Redis rules in `instance` (empty for a principal that needs no Redis)."""
    prefix = f"ksb:{instance}:"
    rules = RedisRules()
    for q in sorted(a.receives):
        rules |= _receiver(prefix, q)
    if a.role is Role.ACTIVATION:
        keys = {f"{prefix}{k}" for k in ("tasks:*", "monitors", "dlpolicy")}
        rules |= RedisRules(frozenset(keys), commands=frozenset((*CONNECT, *ACTIVATION)))
    elif a.role is Role.EXTERNAL_ACTIVATOR:  # its readers are activated tasks: heartbeats
        keys = {f"{prefix}tasks:{q}" for q in a.receives}
        rules |= RedisRules(frozenset(keys), commands=frozenset(CONNECT))
    elif a.role is Role.TRANSMITTER:
        rules |= _view(prefix, ["transmission"], VIEW)
    elif a.role is Role.TRANSPORT:
        rules |= _view(prefix, ["connections", "suppress"], TRANSPORT)
    elif a.role is Role.FORWARDER:
        rules |= _view(prefix, ["forwarded"], VIEW)
    if a.role is Role.OPERATOR or a.owner:
        rules |= RedisRules(
            read_keys=frozenset({f"{prefix}*"}), commands=frozenset((*CONNECT, *READER))
        )
    return rules


def _view(prefix: str, keys: list[str], commands: Iterable[str]) -> RedisRules:
    return RedisRules(
        frozenset(f"{prefix}{k}" for k in keys), commands=frozenset((*CONNECT, *commands))
    )


def instance_rules(instance: str, accesses: Iterable[Access]) -> dict[str, RedisRules]:
    """Principal -> its rules, for the principals of `instance` that use Redis."""
    out = {a.principal: rules_of(instance, a) for a in accesses}
    return {p: r for p, r in out.items() if not r.empty}
