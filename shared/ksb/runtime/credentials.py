"""Who a process is to Kafka and Redis: its login, read from its settings, and where secrets live.

A process's own login comes from its ``KSB_KAFKA_*`` / ``KSB_REDIS_*`` settings. A password is
given either as a file (preferred: a file never shows in the process's environment, is what the
tools and the credential store hand out, and is re-read whenever a client is made, so a rotated
password reaches new connections without a restart) or as the value itself (for deployments that
pass secrets as variables, such as compose's git-ignored env file).

A transport or forwarder that crosses to another Kafka cluster logs in there with credentials
issued by *that* cluster's operator. They live in the file named by ``KSB_KAFKA_REMOTE_CREDENTIALS``,
keyed by the cluster's bootstrap list, exactly the address a route names: the catalog holds
addresses, never secrets, and the same cluster is the same SCRAM user database whichever route
leads there, so a login belongs to a cluster, not to a route.

`CredentialStore` is the admin's side: 0600 files under a 0700 directory, two per principal:
its Kafka password (``<principal>.password``, what ``KSB_KAFKA_PASSWORD_FILE`` names) and its
Redis password (``<principal>.redis.password``, ``KSB_REDIS_PASSWORD_FILE``), both generated.
They differ, so that Redis, which keeps only a hash but is reached by fewer processes, and
Kafka do not share one secret: a password read off one does not open the other.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ksb.errors import SecurityError
from ksb.settings import KsbSettings

__all__ = [
    "CredentialStore",
    "KafkaLogin",
    "RemoteLogin",
    "generate_password",
    "kafka_login",
    "read_secret",
    "redis_login",
    "remote_logins",
    "write_private",
]

PASSWORD_BYTES = 32
"""Generated passwords carry 256 bits; URL-safe text, so they need no quoting in any file format."""


@dataclass(frozen=True)
class KafkaLogin:
    """How to authenticate to one Kafka cluster."""

    security_protocol: str
    mechanism: str = "SCRAM-SHA-512"
    username: str = ""
    password: str = ""
    ssl_ca: str = ""

    @property
    def sasl(self) -> bool:
        return self.security_protocol.startswith("SASL_")

    def librdkafka(self) -> dict[str, str]:
        """The librdkafka (confluent-kafka) properties for this login."""
        conf = {"security.protocol": self.security_protocol}
        if self.sasl:
            conf.update(
                {
                    "sasl.mechanism": self.mechanism,
                    "sasl.username": self.username,
                    "sasl.password": self.password,
                }
            )
        if self.ssl_ca:
            conf["ssl.ca.location"] = self.ssl_ca
        return conf

    def java(self) -> dict[str, str]:
        """The same login as Java client properties (the Spark Kafka source, Kafka's tools)."""
        conf = {"security.protocol": self.security_protocol}
        if self.sasl:
            conf["sasl.mechanism"] = self.mechanism
            conf["sasl.jaas.config"] = (
                "org.apache.kafka.common.security.scram.ScramLoginModule required "
                f'username="{self.username}" password="{self.password}";'
            )
        if self.ssl_ca:
            conf["ssl.truststore.type"] = "PEM"
            conf["ssl.truststore.location"] = self.ssl_ca
        return conf


class RemoteLogin(BaseModel):
    """One entry of the remote credentials file: how this process logs in to one far cluster."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    security_protocol: Literal["SASL_PLAINTEXT", "SASL_SSL", "PLAINTEXT"] = "SASL_SSL"
    sasl_mechanism: Literal["SCRAM-SHA-512", "SCRAM-SHA-256"] = "SCRAM-SHA-512"
    username: str = ""
    password: str = Field("", repr=False)
    password_file: str = ""
    ssl_ca: str = ""

    def login(self, where: str) -> KafkaLogin:
        password = self.password or (
            read_secret(self.password_file, where) if self.password_file else ""
        )
        login = KafkaLogin(
            self.security_protocol, self.sasl_mechanism, self.username, password, self.ssl_ca
        )
        _check_complete(login, where)
        return login


def read_secret(path: str, what: str) -> str:
    """The first line of a secret file (a trailing newline from an editor is not the secret's)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise SecurityError(f"{what}: cannot read {path}: {exc.strerror}") from None
    secret = text.splitlines()[0] if text else ""
    if not secret:
        raise SecurityError(f"{what}: {path} is empty")
    return secret


def remote_logins(settings: KsbSettings) -> dict[str, RemoteLogin]:
    """The far clusters this process has credentials for, by bootstrap list."""
    path = settings.kafka_remote_credentials
    if not path:
        return {}
    where = f"KSB_KAFKA_REMOTE_CREDENTIALS ({path})"
    try:
        raw = json.loads(Path(path).read_text())
    except OSError as exc:
        raise SecurityError(f"{where}: {exc.strerror}") from None
    except ValueError as exc:
        raise SecurityError(f"{where}: not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise SecurityError(f"{where}: a JSON object of bootstrap list -> login expected")
    try:
        return {str(k): RemoteLogin.model_validate(v) for k, v in raw.items()}
    except ValidationError as exc:
        raise SecurityError(
            f"{where}: {exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}"
        ) from None


def kafka_login(settings: KsbSettings, bootstrap: str | None = None) -> KafkaLogin:
    """The login for the cluster at `bootstrap` (default: the process's own cluster).

    A bootstrap list named in the remote credentials file takes that entry; any other is the
    process's own cluster, and takes its own ``KSB_KAFKA_*`` login.
    """
    address = bootstrap or settings.kafka_bootstrap
    remote = remote_logins(settings).get(address)
    if remote is not None:
        return remote.login(f"remote credentials for {address}")
    password = settings.kafka_password
    if not password and settings.kafka_password_file:
        password = read_secret(settings.kafka_password_file, "KSB_KAFKA_PASSWORD_FILE")
    login = KafkaLogin(
        settings.kafka_security_protocol,
        settings.kafka_sasl_mechanism,
        settings.kafka_username,
        password,
        settings.kafka_ssl_ca,
    )
    _check_complete(login, "KSB_KAFKA_USERNAME / KSB_KAFKA_PASSWORD(_FILE)")
    return login


def redis_login(settings: KsbSettings) -> tuple[str | None, str | None]:
    """(username, password) for Redis; (None, None) logs in as the `default` user."""
    password = settings.redis_password
    if not password and settings.redis_password_file:
        password = read_secret(settings.redis_password_file, "KSB_REDIS_PASSWORD_FILE")
    return (settings.redis_username or None, password or None)


def _check_complete(login: KafkaLogin, where: str) -> None:
    if login.sasl and not (login.username and login.password):
        raise SecurityError(
            f"{where}: security protocol {login.security_protocol} needs a username and a "
            "password (or KSB_KAFKA_SECURITY_PROTOCOL=PLAINTEXT for a development stack "
            "started without security)"
        )


def generate_password() -> str:
    return secrets.token_urlsafe(PASSWORD_BYTES)


def write_private(path: Path, text: str) -> None:
    """Write a secret readable by its owner only (0600), replacing any earlier file atomically."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o600)
    tmp.replace(path)


@dataclass(frozen=True)
class CredentialStore:
    """The passwords the admin generated, 0600 files: ``<name>.password`` (Kafka, a process's
    ``KSB_KAFKA_PASSWORD_FILE``) and ``<name>.redis.password`` (Redis, its
    ``KSB_REDIS_PASSWORD_FILE``). A principal's two passwords differ."""

    root: Path

    def path(self, principal: str) -> Path:
        return self.root / f"{principal}.password"

    def redis_path(self, principal: str) -> Path:
        """The principal's Redis password file (a principal's name has no dot, so no Kafka
        password file is ever named so)."""
        return self.root / f"{principal}.redis.password"

    def get(self, principal: str) -> str | None:
        p = self.path(principal)
        return read_secret(str(p), f"password of {principal}") if p.exists() else None

    def get_redis(self, principal: str) -> str | None:
        p = self.redis_path(principal)
        return read_secret(str(p), f"Redis password of {principal}") if p.exists() else None

    def put(self, principal: str, password: str) -> Path:
        write_private(self.path(principal), password + "\n")
        return self.path(principal)

    def put_redis(self, principal: str, password: str) -> Path:
        write_private(self.redis_path(principal), password + "\n")
        return self.redis_path(principal)

    def ensure_redis(self, principal: str) -> str:
        """The principal's stored Redis password, generated and stored now if it has none."""
        known = self.get_redis(principal)
        if known is not None:
            return known
        password = generate_password()
        self.put_redis(principal, password)
        return password

    def lease_key(self, instance: str) -> Path:
        """The instance's lease key (`ksb.security.leases`): for its queue service and its
        dispatchers only. Generated here the first time it is asked for."""
        path = self.root / f"{instance}.lease-key"
        if not path.exists():
            write_private(path, generate_password() + "\n")
        return path

    def ensure(self, principal: str) -> tuple[str, bool]:
        """The principal's stored password, generated and stored now if it has none; and
        whether it was generated now."""
        known = self.get(principal)
        if known is not None:
            return known, False
        password = generate_password()
        self.put(principal, password)
        return password, True
