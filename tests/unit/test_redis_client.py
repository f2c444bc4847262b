"""How a Redis Cluster client is started: from every node `KSB_REDIS_URL` lists, so that one node
down (a primary replaced by its replica) does not keep a new client out. That a new client does
start while the first listed node is dead is tests/integration/test_kafka_cluster.py's."""

from __future__ import annotations

import pytest

from ksb.runtime.redis_client import cluster_urls
from ksb.settings import SettingsError


def test_cluster_urls_are_the_comma_separated_nodes_in_order() -> None:
    assert cluster_urls("redis://a:7000/0, redis://b:7001/0,") == [
        "redis://a:7000/0",
        "redis://b:7001/0",
    ]
    assert cluster_urls("redis://a:7000/0") == ["redis://a:7000/0"]
    with pytest.raises(SettingsError):
        cluster_urls(" , ")
