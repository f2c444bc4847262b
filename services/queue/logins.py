"""Who is calling: a caller's login, checked against Kafka's own users.

Every call to the queue service carries its principal and that principal's Kafka password as gRPC
metadata (`ksb-principal`, `ksb-password`). The service keeps no copy of anyone's password: it
logs in to Kafka with the caller's, and Kafka's SCRAM exchange says yes or no. The answer is
remembered (`ksb.queue.logins`), so only the first call of a client (or of a new password) pays
for the login. On a stack without security nobody's identity is checked, by the queue service as
by the dispatcher (whose shared requests topic names nobody): every caller is "".
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence

from confluent_kafka import KafkaError, Producer

from ksb.clock import Clock
from ksb.errors import SecurityError
from ksb.queue.logins import LoginMemory
from ksb.runtime.credentials import KafkaLogin
from ksb.runtime.kafka_logs import client_log
from ksb.security.principals import PRINCIPAL_PATTERN
from ksb.settings import QueueServiceSettings

__all__ = ["LOGIN_TIMEOUT_S", "PASSWORD_KEY", "PRINCIPAL_KEY", "Logins", "Unauthenticated"]

log = logging.getLogger("ksb.queue")

PRINCIPAL_KEY = "ksb-principal"
PASSWORD_KEY = "ksb-password"
LOGIN_TIMEOUT_S = 5.0
"""How long a login to Kafka may take before the caller is refused (Kafka may be slow to answer,
but a wrong password is refused in milliseconds)."""


class Unauthenticated(SecurityError):
    """A call without a login the service accepts."""

    code = "unauthenticated"


class Logins:
    """Checks each call's login; one lock, so a burst of new clients asks Kafka once each."""

    def __init__(self, settings: QueueServiceSettings, clock: Clock) -> None:
        self._settings = settings
        self._secured = settings.kafka_security_protocol != "PLAINTEXT"
        self._memory = LoginMemory(clock, accepted_ms=settings.login_cache_ms)
        self._lock = threading.Lock()

    def principal(self, metadata: Sequence[tuple[str, str | bytes]]) -> str:
        """The caller's principal, once its login is good; `Unauthenticated` otherwise."""
        if not self._secured:
            return ""  # as the dispatcher takes a request on the shared topic: nobody's
        found: Mapping[str, str | bytes] = dict(metadata)
        principal = _text(found.get(PRINCIPAL_KEY))
        if not principal:
            raise Unauthenticated(f"no {PRINCIPAL_KEY} in the call's metadata")
        if not PRINCIPAL_PATTERN.match(principal):
            raise Unauthenticated(f"{principal!r} is not a principal's name")
        password = _text(found.get(PASSWORD_KEY))
        if not password:
            raise Unauthenticated(f"no {PASSWORD_KEY} for principal {principal!r}")
        with self._lock:
            known = self._memory.known(principal, password)
            if known is None:
                known = self._kafka_accepts(principal, password)
                if known is None:
                    raise Unauthenticated(
                        f"the login of principal {principal!r} could not be checked: Kafka did "
                        f"not answer in {LOGIN_TIMEOUT_S:.0f} s"
                    )
                self._memory.note(principal, password, known)
        if not known:
            raise Unauthenticated(f"Kafka refused the login of principal {principal!r}")
        return principal

    def _kafka_accepts(self, principal: str, password: str) -> bool | None:
        """Log in to Kafka as `principal`: the SCRAM exchange is the check. A metadata request
        answered means accepted; an authentication error means refused; neither in
        `LOGIN_TIMEOUT_S`, None (not remembered: Kafka may just be slow)."""
        s = self._settings
        login = KafkaLogin(
            s.kafka_security_protocol,
            s.kafka_sasl_mechanism,
            username=principal,
            password=password,
            ssl_ca=s.kafka_ssl_ca,
        )
        refused: list[KafkaError] = []
        logs = client_log("login")
        log_error = logs["error_cb"]

        def on_error(err: KafkaError) -> None:
            if err.code() == KafkaError._AUTHENTICATION:
                refused.append(err)
            log_error(err)

        probe = Producer(
            {
                "bootstrap.servers": s.kafka_bootstrap,
                **logs,
                "error_cb": on_error,
                **login.librdkafka(),
            }
        )
        deadline = time.monotonic() + LOGIN_TIMEOUT_S
        try:
            while time.monotonic() < deadline and not refused:
                try:
                    probe.list_topics(timeout=0.2)
                    return True
                except Exception:  # not answered yet: transport still up, or refused
                    probe.poll(0)
            if refused:
                log.info("login of %s refused by Kafka: %s", principal, refused[0].str())
                return False
            log.warning("login of %s: Kafka did not answer in %.0f s", principal, LOGIN_TIMEOUT_S)
            return None
        finally:
            probe.flush(0)


def _text(value: str | bytes | None) -> str:
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return value or ""
