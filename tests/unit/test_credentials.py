"""A process's login from its settings, remote clusters' logins, and the credential store."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from ksb.errors import SecurityError
from ksb.runtime.credentials import CredentialStore, kafka_login, redis_login
from ksb.runtime.kafka import client_security
from ksb.settings import KsbSettings


def test_security_is_on_by_default_and_a_missing_login_is_named() -> None:
    s = KsbSettings()
    assert s.kafka_security_protocol == "SASL_PLAINTEXT"
    with pytest.raises(SecurityError, match="KSB_KAFKA_USERNAME"):
        client_security(s, s.kafka_bootstrap)


def test_plaintext_is_an_explicit_switch_with_no_login() -> None:
    s = KsbSettings(kafka_security_protocol="PLAINTEXT")
    assert client_security(s, s.kafka_bootstrap) == {"security.protocol": "PLAINTEXT"}


def test_a_password_file_is_read_and_its_trailing_newline_dropped(tmp_path: Path) -> None:
    (tmp_path / "pw").write_text("s3cret\n")
    s = KsbSettings(kafka_username="app", kafka_password_file=str(tmp_path / "pw"))
    assert client_security(s, s.kafka_bootstrap) == {
        "security.protocol": "SASL_PLAINTEXT",
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": "app",
        "sasl.password": "s3cret",
    }
    assert s.acting_principal == "app"
    assert "s3cret" not in repr(KsbSettings(kafka_username="a", kafka_password="s3cret"))


def test_a_missing_password_file_is_named(tmp_path: Path) -> None:
    s = KsbSettings(kafka_username="app", kafka_password_file=str(tmp_path / "nope"))
    with pytest.raises(SecurityError, match="KSB_KAFKA_PASSWORD_FILE"):
        kafka_login(s)


def test_tls_adds_the_ca_for_librdkafka_and_java() -> None:
    s = KsbSettings(
        kafka_security_protocol="SASL_SSL",
        kafka_username="app",
        kafka_password="pw",
        kafka_ssl_ca="/ca.pem",
    )
    login = kafka_login(s)
    assert login.librdkafka()["ssl.ca.location"] == "/ca.pem"
    java = login.java()
    assert java["ssl.truststore.location"] == "/ca.pem" and java["ssl.truststore.type"] == "PEM"
    assert 'username="app" password="pw"' in java["sasl.jaas.config"]


def test_a_far_cluster_takes_its_own_login_from_the_remote_file(tmp_path: Path) -> None:
    (tmp_path / "far.pw").write_text("far-secret\n")
    remote = tmp_path / "remote.json"
    remote.write_text(
        json.dumps(
            {
                "far:9093": {
                    "security_protocol": "SASL_SSL",
                    "username": "ksb-a-transport",
                    "password_file": str(tmp_path / "far.pw"),
                    "ssl_ca": "/far-ca.pem",
                }
            }
        )
    )
    s = KsbSettings(
        kafka_bootstrap="near:9092",
        kafka_username="ksb-a-transport",
        kafka_password="near-secret",
        kafka_remote_credentials=str(remote),
    )
    assert client_security(s, "near:9092")["sasl.password"] == "near-secret"
    far = client_security(s, "far:9093")
    assert far["sasl.password"] == "far-secret" and far["security.protocol"] == "SASL_SSL"
    assert far["ssl.ca.location"] == "/far-ca.pem"


def test_a_bad_remote_file_is_refused_by_name(tmp_path: Path) -> None:
    remote = tmp_path / "remote.json"
    remote.write_text(json.dumps({"far:1": {"usernme": "x"}}))
    s = KsbSettings(kafka_username="a", kafka_password="p", kafka_remote_credentials=str(remote))
    with pytest.raises(SecurityError, match="KSB_KAFKA_REMOTE_CREDENTIALS"):
        kafka_login(s)


def test_redis_login_without_a_user_is_the_default_user(tmp_path: Path) -> None:
    assert redis_login(KsbSettings()) == (None, None)
    (tmp_path / "pw").write_text("r\n")
    s = KsbSettings(redis_username="app", redis_password_file=str(tmp_path / "pw"))
    assert redis_login(s) == ("app", "r")


def test_the_store_keeps_one_private_password_per_principal(tmp_path: Path) -> None:
    store = CredentialStore(tmp_path / "creds")
    password, created = store.ensure("app")
    assert created and len(password) >= 40
    assert store.ensure("app") == (password, False)
    assert stat.S_IMODE(store.path("app").stat().st_mode) == 0o600
    assert stat.S_IMODE(store.root.stat().st_mode) == 0o700
    store.put("app", "new")
    assert store.get("app") == "new"
    assert store.get("nobody") is None
