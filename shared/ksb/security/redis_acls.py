"""The Redis ACL rules of one instance: each principal's keys and commands, from the code's use.

The queue service holds the group locks: it touches every queue's lock, fence, waiting,
activity, rollback and message-rollback keys (`ksb.queue.locks`, `services.queue`) and reads the
queues' disabled flags and the dead-letter policies. Applications have no Redis user at all: they
RECEIVE through the queue service, so no call their grants allow can shorten, take over or forge
a lock, or disable a queue. The activation service reads the readers' traces and writes the task
heartbeats, the disabled flags and the monitor rows. Three Redis facts shape the rules (measured
on Redis 7.0):

* keys passed to EVAL/EVALSHA are checked as read-write, so a queue's disabled flag, which the
  lock script only tests, needs ``~`` (not ``%R~``): a receiver could write it with the
  commands it has, but only its own queues' flags (one key per queue, `ksb.names`);
* every command a script calls needs its own grant (TIME included), and redis-py's scripts need
  ``script|load`` besides EVALSHA (on a cold script cache);
* a MULTI/EXEC pipeline from a user without ``+multi +exec`` runs its commands one by one,
  non-atomically: who uses transactions (the activation service, for its dead-letter
  policies) gets them; the views are plain pipelines (`ksb.runtime.redis_view`).

The dispatcher and the Spark job do not use Redis and get no Redis user. The principal an
activated task logs in as (``EXECUTE AS``) may write its queues' task heartbeats and nothing else.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ksb.names import Names
from ksb.security.access import ALL_QUEUES, Access
from ksb.security.principals import Role

__all__ = ["RedisRules", "instance_rules", "rules_of"]

CONNECT = ("ping", "cluster|slots", "command", "asking")
"""Besides AUTH and HELLO, which need no grant (redis-py also sends CLIENT SETINFO, which
Redis 7.0 does not know and redis-py ignores failing). redis-py's cluster client asks a node for
the slot map (CLUSTER SLOTS) and the commands' key positions (COMMAND) when it connects: both
read-only, and what any client of a Redis Cluster (``KSB_REDIS_CLUSTER``) needs. While a slot
moves between nodes (resharding), a key already moved is answered with an ASK redirect, which
the client follows by sending ASKING, then the command, to the new node; without ``asking``
every such command failed NOPERM until the move ended (tests/integration/test_kafka_cluster.py)."""
RECEIVER = (
    "evalsha", "script|load", "script|exists", "exists", "time", "hget", "hset", "hdel", "incr", "incrby", "set",
    "pexpire", "zadd", "zrem", "hincrby",
)  # fmt: skip
QUEUE = (*RECEIVER, "zcount", "hgetall", "get")
ACTIVATION = (
    "set", "del", "zadd", "zrem", "multi", "exec", "discard", "zcount", "zremrangebyscore",
    "zcard", "hgetall", "hset", "get",
)  # fmt: skip
HEARTBEAT = ("zadd", "zrem")
VIEW = ("set", "del")
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


def _tagged(queue: str) -> str:
    """A queue as it goes into a key pattern: every queue is ``*``, which matches inside the hash
    tag `ksb.names` puts on each queue key (braces are plain characters in an ACL pattern)."""
    return "*" if queue == ALL_QUEUES else queue


def _receiver(names: Names, queue: str) -> RedisRules:
    q = _tagged(queue)
    keys = {
        names.disabled_key(q),
        names.activity_key(q),
        names.waiting_key(q),
        names.rollbacks_key(q),
        names.message_rollbacks_key(q),
        names.lock_key(q, "*"),
        names.fence_key(q, "*"),
    }
    return RedisRules(
        frozenset(keys),
        frozenset({names.dead_letter_policy_key}),
        frozenset((*CONNECT, *QUEUE)),
    )


def rules_of(instance: str, a: Access) -> RedisRules:
    """`a`'s Redis rules in `instance` (empty for a principal that needs no Redis)."""
    prefix = f"ksb:{instance}:"
    names = Names(instance)
    rules = RedisRules()
    if a.role is Role.QUEUE:
        rules |= _receiver(names, ALL_QUEUES)
    elif a.role is Role.ACTIVATION:
        keys = {
            f"{prefix}{k}" for k in ("tasks:*", "disabled:*", "monitors", "dlpolicy", "rollbacks:*")
        }
        traces = {names.activity_key("*"), names.waiting_key("*")}
        rules |= RedisRules(frozenset(keys), frozenset(traces), frozenset((*CONNECT, *ACTIVATION)))
    elif a.role is Role.EXTERNAL_ACTIVATOR:  # its readers heartbeat as activated tasks do
        keys = {names.tasks_key(_tagged(q)) for q in a.receives}
        rules |= RedisRules(frozenset(keys), commands=frozenset((*CONNECT, *HEARTBEAT)))
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
    if a.heartbeats:  # the principal of activated tasks: their heartbeats, nothing else
        keys = {names.tasks_key(q) for q in a.heartbeats}
        rules |= RedisRules(frozenset(keys), commands=frozenset((*CONNECT, *HEARTBEAT)))
    return rules


def _view(prefix: str, keys: list[str], commands: Iterable[str]) -> RedisRules:
    return RedisRules(
        frozenset(f"{prefix}{k}" for k in keys), commands=frozenset((*CONNECT, *commands))
    )


def instance_rules(instance: str, accesses: Iterable[Access]) -> dict[str, RedisRules]:
    """Principal -> its rules, for the principals of `instance` that use Redis."""
    out = {a.principal: rules_of(instance, a) for a in accesses}
    return {p: r for p, r in out.items() if not r.empty}
