"""The local Kafka's node settings: one node keeps one copy of everything, a cluster of three
keeps three with two in sync, and every node of a cluster names the same controller quorum."""

from __future__ import annotations

from pathlib import Path

from devtools.kafka_node import KafkaLayout, replication_settings, write_kafka_properties
from devtools.stack_security import StackSecurity


def _properties(path: Path) -> dict[str, str]:
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if line)
    return {k: v for k, v in pairs}


def test_one_node_changes_nothing_of_the_one_copy_defaults() -> None:
    assert replication_settings(1) == {}


def test_three_nodes_keep_three_copies_and_acknowledge_at_two() -> None:
    assert replication_settings(3) == {
        "default.replication.factor": "3",
        "offsets.topic.replication.factor": "3",
        "transaction.state.log.replication.factor": "3",
        "transaction.state.log.min.isr": "2",
        "min.insync.replicas": "2",
    }


def test_more_nodes_still_keep_three_copies_and_two_nodes_keep_two() -> None:
    assert replication_settings(5)["default.replication.factor"] == "3"
    assert replication_settings(2)["default.replication.factor"] == "2"
    assert replication_settings(2)["min.insync.replicas"] == "1"


def test_a_cluster_node_names_itself_and_the_whole_quorum(tmp_path: Path) -> None:
    voters = "1@127.0.0.1:9101,2@127.0.0.1:9102,3@127.0.0.1:9103"
    node = KafkaLayout(
        root=tmp_path,
        port=9002,
        controller_port=9102,
        security=StackSecurity("plaintext", tmp_path / "security"),
        node_id=2,
        voters=voters,
    )
    write_kafka_properties(node)
    props = _properties(node.properties)
    assert props["node.id"] == "2"
    assert props["controller.quorum.voters"] == voters
    assert props["listeners"] == "PLAINTEXT://127.0.0.1:9002,CONTROLLER://127.0.0.1:9102"
    assert props["min.insync.replicas"] == "2"  # the cluster's, not the one-node default
    assert props["transaction.state.log.replication.factor"] == "3"


def test_a_lone_node_votes_for_itself_with_one_copy(tmp_path: Path) -> None:
    node = KafkaLayout(
        root=tmp_path,
        port=9001,
        controller_port=9101,
        security=StackSecurity("plaintext", tmp_path / "security"),
    )
    write_kafka_properties(node)
    props = _properties(node.properties)
    assert props["node.id"] == "1"
    assert props["controller.quorum.voters"] == "1@127.0.0.1:9101"
    assert props["min.insync.replicas"] == "1"
    assert "default.replication.factor" not in props
