"""The one way KSB makes a Redis client: the instance's Redis, logged in as the process's ACL user.

Redis's ACL users carry the same names as the Kafka principals (`ksb.security`), so a process is
the same principal in both (with a password of its own in each, `ksb.runtime.credentials`). A
``rediss://`` URL is Redis over TLS: the client verifies the server against
`KsbSettings.redis_ssl_ca` (the system's CAs without it). Without a username the client logs in as Redis's ``default`` user,
which the secured stack turns off: only a development stack started without security has one.

With ``redis_cluster`` the client is redis-py's `RedisCluster`, typed as `redis.Redis` (`redis_url`
may then list several nodes, comma-separated, any of which it can start from): it answers
every command KSB uses alike (keys one slot per call, `ksb.names`; EVALSHA outside pipelines,
`ksb.queue.locks`), which tests/integration/test_kafka_cluster.py runs against a real cluster.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast
from urllib.parse import urlsplit

import redis
from redis.cluster import ClusterNode, RedisCluster

from ksb.runtime.credentials import redis_login
from ksb.settings import KsbSettings, SettingsError

__all__ = ["best_effort", "cluster_urls", "redis_client"]


def redis_client(settings: KsbSettings, **options: Any) -> redis.Redis:
    """A client of `settings.redis_url` with the process's Redis login, connecting and answering
    within `settings.redis_timeout_ms`; `options` go to redis-py (other timeouts, ...). The
    URL's own user and password, if any, are overridden by the settings'."""
    timeout_s = settings.redis_timeout_ms / 1000
    options.setdefault("socket_timeout", timeout_s)
    options.setdefault("socket_connect_timeout", timeout_s)
    username, password = redis_login(settings)
    if username is not None:
        options["username"] = username
    if password is not None:
        options["password"] = password
    if settings.redis_ssl_ca and settings.redis_url.startswith("rediss://"):
        options.setdefault("ssl_ca_certs", settings.redis_ssl_ca)
    if settings.redis_cluster:
        first, *others = cluster_urls(settings.redis_url)
        seeds = [_node(u) for u in others]
        return cast(redis.Redis, RedisCluster.from_url(first, startup_nodes=seeds, **options))
    return redis.Redis.from_url(settings.redis_url, **options)


def _node(url: str) -> ClusterNode:
    parts = urlsplit(url)
    return ClusterNode(parts.hostname, parts.port or 6379)  # type: ignore[no-untyped-call]


def cluster_urls(redis_url: str) -> list[str]:
    """The nodes a Redis Cluster client may start from: `redis_url` split at commas. It asks them
    in turn for the cluster's layout, so one that is down (a primary since replaced by its
    replica) does not keep a new client out, as Kafka's bootstrap list does for brokers."""
    urls = [u.strip() for u in redis_url.split(",") if u.strip()]
    if not urls:
        raise SettingsError("KSB_REDIS_URL names no Redis node")
    return urls


@contextmanager
def best_effort(log: logging.Logger, what: str) -> Iterator[None]:
    """A Redis write the caller can go on without (a lock left to expire, a heartbeat left to
    lapse): a Redis failure inside is logged as `what` and swallowed, anything else raised."""
    try:
        yield
    except redis.RedisError as exc:
        log.warning("%s (Redis: %s)", what, exc)
