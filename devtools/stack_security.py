"""The local stack's security: which mode, and the secrets generated for one stack.

Security is on by default (``sasl``: SASL_PLAINTEXT listeners with SCRAM-SHA-512, Kafka's
StandardAuthorizer denying whatever no ACL allows, Redis with ACL users and ``default`` off).
``tls`` adds TLS with a CA made for the stack to every connection a client makes: Kafka's
(SASL_SSL), Redis's (``rediss://``, Redis's TLS port only) and the queue service's gRPC;
``plaintext`` is the development switch, no authentication at all. The mode comes from
``--security`` or ``KSB_STACK_SECURITY``. In both secured modes the Kafka nodes reach their
controllers over mutual TLS, authenticated by the broker's certificate (no password on that
listener at all: SCRAM is not supported there, KAFKA-15513, and PLAIN would send the broker's
password in clear), so the stack always has its CA.

Every secret is generated per stack into ``<workdir>/security`` (0700; files 0600), which lives
under the stack's work directory and so is never committed (``var/`` and pytest's temporary
directories are not in the repository): the inter-broker user ``broker`` and the ACL tool's user
``admin`` (Kafka's only super users, and ``admin`` is Redis's only unrestricted user), then every
principal's password as `ksb acl apply` creates it, in a `ksb.runtime.credentials.CredentialStore`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from devtools.processes import LocalStackError
from ksb.runtime.credentials import CredentialStore, KafkaLogin, write_private
from ksb.security.principals import ADMIN, BROKER

__all__ = ["MODES", "SecurityMode", "StackSecurity", "security_mode"]

SecurityMode = Literal["sasl", "tls", "plaintext"]
MODES: tuple[SecurityMode, ...] = ("sasl", "tls", "plaintext")
PROTOCOL: dict[SecurityMode, str] = {
    "sasl": "SASL_PLAINTEXT",
    "tls": "SASL_SSL",
    "plaintext": "PLAINTEXT",
}
KEY_PASSWORD_NAME = "broker-key"
"""The broker's TLS key is stored encrypted; its password is one more generated secret."""
BROKER_CERT_CN = BROKER
"""The subject (``CN=broker``) of the broker's certificate: its principal on the controller
listener, which authenticates by certificate (``User:CN=broker``, a super user)."""
TLS_SERVERS = ("redis", "queue")
"""The stack's other TLS servers in TLS mode: Redis, and the queue service's gRPC."""


def security_mode(given: str | None = None) -> SecurityMode:
    """`given`, else ``KSB_STACK_SECURITY``, else ``sasl``; anything else is refused by name."""
    raw = given or os.environ.get("KSB_STACK_SECURITY") or "sasl"
    for mode in MODES:
        if raw == mode:
            return mode
    raise LocalStackError(f"KSB_STACK_SECURITY / --security: {raw!r} is not one of {MODES}")


@dataclass(frozen=True)
class StackSecurity:
    """One stack's mode and where its secrets are."""

    mode: SecurityMode
    root: Path
    """``<workdir>/security``: ``credentials/`` (passwords) and ``tls/`` (CA, broker keystore)."""

    @property
    def enabled(self) -> bool:
        return self.mode != "plaintext"

    @property
    def protocol(self) -> str:
        """The clients' ``security.protocol`` (and the broker listener's name)."""
        return PROTOCOL[self.mode]

    @property
    def store(self) -> CredentialStore:
        return CredentialStore(self.root / "credentials")

    @property
    def tls_dir(self) -> Path:
        return self.root / "tls"

    @property
    def ca(self) -> Path | None:
        """The CA clients trust (TLS mode only)."""
        return self.tls_dir / "ca.crt" if self.mode == "tls" else None

    @property
    def stack_ca(self) -> Path:
        """The stack's CA, in every secured mode (the controller listener's mutual TLS)."""
        return self.tls_dir / "ca.crt"

    @property
    def keystore(self) -> Path:
        return self.tls_dir / "broker-keystore.pem"

    def server_pair(self, server: str) -> tuple[Path, Path]:
        """(certificate, unencrypted key) of a TLS server of the stack (``redis``, ``queue``),
        made in TLS mode; the key readable by its owner only."""
        return self.tls_dir / f"{server}.crt", self.tls_dir / f"{server}.key"

    def password(self, principal: str) -> str:
        found = self.store.get(principal)
        if found is None:
            raise LocalStackError(f"no password of {principal} in {self.store.root}")
        return found

    def redis_password(self, principal: str) -> str:
        """`principal`'s Redis password (not its Kafka one: `ksb.runtime.credentials`)."""
        found = self.store.get_redis(principal)
        if found is None:
            raise LocalStackError(f"no Redis password of {principal} in {self.store.root}")
        return found

    def login(self, principal: str = ADMIN) -> KafkaLogin:
        """How `principal` logs in to this stack's Kafka (no credentials in plaintext mode)."""
        if not self.enabled:
            return KafkaLogin("PLAINTEXT")
        return KafkaLogin(
            self.protocol,
            "SCRAM-SHA-512",
            principal,
            self.password(principal),
            str(self.ca) if self.ca else "",
        )

    def generate(self) -> None:
        """The stack's own secrets: broker and admin passwords, and in TLS mode its CA and the
        broker's certificate. Nothing to make in plaintext mode."""
        if not self.enabled:
            return
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        for name in (BROKER, ADMIN):
            self.store.ensure(name)
        self.store.ensure_redis(ADMIN)
        self.store.ensure(KEY_PASSWORD_NAME)
        _make_certificates(self.tls_dir, self.store.path(KEY_PASSWORD_NAME))
        if self.mode == "tls":
            for server in TLS_SERVERS:
                _server_certificate(self.tls_dir, server)
        os.remove(self.tls_dir / "ca.key")  # nothing is signed after this


def _openssl(*args: str, cwd: Path) -> None:
    exe = shutil.which("openssl")
    if exe is None:
        raise LocalStackError("`openssl` not found: it makes the TLS stack's CA")
    result = subprocess.run(
        [exe, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )
    if result.returncode != 0:
        raise LocalStackError(f"openssl {args[0]} failed: {result.stderr.strip()}")


def _make_certificates(tls: Path, key_password_file: Path) -> None:
    """A throwaway CA and a broker certificate for 127.0.0.1, as Java 17 can read them.

    The subject alternative names must hold ``IP:127.0.0.1``: clients verify the host name
    (librdkafka's default), and so does the broker's own inter-broker connection, which fails
    misleadingly (INVALID_CONFIG on transactional produce) without it. The key is encrypted with
    PBE-SHA1-3DES because Java 17 cannot read OpenSSL 3's default PBES2 encryption. The CA's key
    is left for `_server_certificate` (the caller removes it once the stack's certificates are
    made); the broker's subject is ``CN=broker``, its principal on the controller listener.
    """
    tls.mkdir(mode=0o700, parents=True, exist_ok=True)
    _openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-sha256", "-days", "3650", "-nodes",
        "-keyout", "ca.key", "-out", "ca.crt", "-subj", "/CN=ksb-local-stack-ca",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=tls,
    )  # fmt: skip
    _openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-keyout", "broker.key", "-out", "broker.csr",
        "-subj", f"/CN={BROKER_CERT_CN}",
        cwd=tls,
    )  # fmt: skip
    (tls / "broker.ext").write_text(
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth,clientAuth\n"
    )
    _openssl(
        "x509", "-req", "-in", "broker.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "broker.crt", "-days", "825", "-sha256",
        "-extfile", "broker.ext",
        cwd=tls,
    )  # fmt: skip
    _openssl(
        "pkcs8", "-topk8", "-v1", "PBE-SHA1-3DES", "-in", "broker.key",
        "-passout", f"file:{key_password_file}", "-out", "broker.p8",
        cwd=tls,
    )  # fmt: skip
    keystore = "".join((tls / n).read_text() for n in ("broker.p8", "broker.crt", "ca.crt"))
    write_private(tls / "broker-keystore.pem", keystore)
    for leftover in ("broker.key", "broker.csr", "ca.srl", "broker.ext"):
        (tls / leftover).unlink(missing_ok=True)
    for path in tls.iterdir():
        os.chmod(path, 0o600)
    os.chmod(tls / "ca.crt", 0o644)


def _server_certificate(tls: Path, server: str) -> None:
    """``<server>.crt`` and an unencrypted ``<server>.key`` (0600) for 127.0.0.1, signed by the
    stack's CA (whose key `_make_certificates` left): Redis and gRPC read PEM keys as they are."""
    _openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{server}.key",
        "-out", f"{server}.csr", "-subj", f"/CN={server}",
        cwd=tls,
    )  # fmt: skip
    (tls / f"{server}.ext").write_text(
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n"
    )
    _openssl(
        "x509", "-req", "-in", f"{server}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", f"{server}.crt", "-days", "825", "-sha256",
        "-extfile", f"{server}.ext",
        cwd=tls,
    )  # fmt: skip
    for leftover in (f"{server}.csr", f"{server}.ext", "ca.srl"):
        (tls / leftover).unlink(missing_ok=True)
    os.chmod(tls / f"{server}.key", 0o600)
    os.chmod(tls / f"{server}.crt", 0o644)
