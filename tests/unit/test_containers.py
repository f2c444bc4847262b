"""The pure parts of devtools.containers: image names as Docker resolves them, which images need a
stand-in, the machine's extra certificate authorities, compose durations and start order."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from devtools.containers.compose import duration_s, start_order
from devtools.containers.images import (
    STAND_INS,
    check_stand_ins,
    compose_builds,
    extra_cas,
    named_images,
    normalise,
)
from devtools.containers.podman import PodmanError
from devtools.processes import REPO_ROOT


def test_short_image_names_resolve_as_docker_resolves_them() -> None:
    assert normalise("redis:7-alpine") == "docker.io/library/redis:7-alpine"
    assert normalise("apache/kafka:4.2.0") == "docker.io/apache/kafka:4.2.0"
    assert normalise("prom/prometheus") == "docker.io/prom/prometheus:latest"
    assert normalise("localhost/ksb:local") == "localhost/ksb:local"
    assert normalise("quay.io/x/y:1") == "quay.io/x/y:1"
    assert normalise("registry:5000/x") == "registry:5000/x:latest"


def test_named_images_are_the_pulled_ones_and_the_dockerfiles_bases() -> None:
    compose = {
        "services": {
            "app": {"build": ".", "image": "app:local"},
            "db": {"image": "redis:7"},
            "ui": {"image": "grafana/grafana:11"},
        }
    }
    dockerfile = (
        "FROM maven:3 AS jars\nRUN x\nFROM python:3.11\nCOPY --from=jars /a /a\nFROM jars\n"
    )
    assert named_images(compose, dockerfile, skipped=["ui"]) == {
        "docker.io/library/redis:7",
        "docker.io/library/maven:3",
        "docker.io/library/python:3.11",
    }


def test_every_image_the_compose_file_names_has_a_stand_in() -> None:
    compose = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())
    check_stand_ins(compose, ["grafana"])  # raises, naming the image, on one without
    with pytest.raises(PodmanError, match="grafana"):
        check_stand_ins(compose, [])
    built = compose_builds(compose)
    assert set(built) == {"ksb:local", "ksb-kafka:local"}
    assert all(f.is_file() for _, f in built.values())
    assert len({s.name for s in STAND_INS}) == len(STAND_INS)


def _pem(body: str) -> str:
    return f"-----BEGIN CERTIFICATE-----\n{body}\n-----END CERTIFICATE-----\n"


def test_extra_cas_are_the_bundles_certificates_debian_does_not_ship() -> None:
    debian = [_pem("QUFB"), _pem("QkJC")]
    bundle = _pem("QUFB") + _pem("Q0ND") + _pem("QkJC")
    assert extra_cas(bundle, debian) == [_pem("Q0ND")]
    assert extra_cas(bundle, [bundle]) == []


def test_compose_durations() -> None:
    assert duration_s("10s", 0) == 10
    assert duration_s("1m30s", 0) == 90
    assert duration_s("500ms", 0) == 0.5
    assert duration_s(None, 30) == 30


def test_services_start_after_their_dependencies() -> None:
    services: dict[str, dict[str, Any]] = {
        "app": {"depends_on": {"db": {"condition": "service_healthy"}, "init": {}}},
        "init": {"depends_on": ["db"]},
        "db": {},
        "metrics": {},
    }
    assert start_order(services) == ["db", "metrics", "init", "app"]
    with pytest.raises(ValueError, match="cycle"):
        start_order({"a": {"depends_on": ["b"]}, "b": {"depends_on": ["a"]}})
    with pytest.raises(ValueError, match="lacks"):
        start_order({"a": {"depends_on": ["nobody"]}})


def test_the_compose_file_has_a_start_order() -> None:
    compose = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())
    order = start_order(compose["services"])
    assert order.index("security-init") < order.index("dispatcher")
    assert order.index("kafka") < order.index("security-init")
