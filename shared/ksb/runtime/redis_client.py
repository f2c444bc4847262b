"""The one way KSB makes a Redis client: the instance's Redis, logged in as the process's ACL user.

Redis's ACL users carry the same names as the Kafka principals (`ksb.security`), so a process is
the same principal in both. Without a username the client logs in as Redis's ``default`` user,
which the secured stack turns off: only a development stack started without security has one.

With ``redis_cluster`` the client is redis-py's `RedisCluster`, typed as `redis.Redis`: it answers
every command KSB uses alike (keys one slot per call, `ksb.names`; EVALSHA outside pipelines,
`ksb.sdk.locks`), which tests/integration/test_kafka_cluster.py runs against a real cluster.
"""

from __future__ import annotations

from typing import Any, cast

import redis
from redis.cluster import RedisCluster

from ksb.security.credentials import redis_login
from ksb.settings import KsbSettings

__all__ = ["redis_client"]


def redis_client(settings: KsbSettings, **options: Any) -> redis.Redis:
    """A client of `settings.redis_url` with the process's Redis login; `options` go to redis-py
    (timeouts, ...). The URL's own user and password, if any, are overridden by the settings'."""
    username, password = redis_login(settings)
    if username is not None:
        options["username"] = username
    if password is not None:
        options["password"] = password
    if settings.redis_cluster:
        return cast(redis.Redis, RedisCluster.from_url(settings.redis_url, **options))
    return redis.Redis.from_url(settings.redis_url, **options)
