"""The SDK's connection to the queue service: one replica at a time, the next when one fails.

RECEIVE, a commit's outcome and ROLLBACK are the queue service's (`services.queue`); the client
sends them over gRPC to the first replica of `ClientSettings.queue_addresses` that answers, with
its principal's login in every call's metadata. A replica that does not answer (UNAVAILABLE, or
no answer within the call's time) is left for the next one: every call carries all it needs (the
lease, what the transaction received), so a transaction goes on on another replica. Locks its
open transactions hold are renewed from a thread of its own every `lock_renew_ms`; a commit
confirms its lock first only when the last grant or renewal is older than `lock_confirm_age_ms`,
and the login read from a password file is reused for `login_reuse_ms`. With
`QueueClientSettings.queue_ssl_ca` the channels are TLS and the replicas are verified against
that CA: the login in each call's metadata then never crosses the network in clear.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import grpc

from ksb.api.queue.v1 import queue_pb2 as pb
from ksb.api.queue.v1 import queue_pb2_grpc as pb_grpc
from ksb.errors import (
    KsbError,
    LeaseInvalid,
    LockLost,
    LockStoreUnavailable,
    NotAuthorized,
    ProtocolError,
    QueueDisabled,
    QueueServiceUnavailable,
)
from ksb.runtime.credentials import kafka_login
from ksb.settings import QueueClientSettings

__all__ = ["QueueServiceClient", "error_of"]

log = logging.getLogger("ksb.sdk")

_MOVE_ON = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
"""A replica that answers so (or not at all) is left for the next one."""
_RETRY_BUDGET = 2
"""Rounds over every replica a call makes before it gives up."""


def _move_on(exc: grpc.RpcError) -> bool:
    """Whether another replica may answer what this one could not: not when the replica
    answered that Redis, which every replica shares, is failing."""
    details = str(exc.details() or "")
    return exc.code() in _MOVE_ON and not details.startswith("lock_store_unavailable")


def error_of(exc: grpc.RpcError) -> KsbError:
    """The SDK's error for a call the queue service refused (its details: ``<code>: <reason>``)."""
    code = exc.code()
    details = str(exc.details() or "")
    kind, _, reason = details.partition(": ")
    text = reason or details
    if code is grpc.StatusCode.PERMISSION_DENIED:
        return LeaseInvalid(text) if kind == "bad_lease" else NotAuthorized(text)
    if code is grpc.StatusCode.UNAUTHENTICATED:
        return NotAuthorized(f"the queue service refused this login: {text}")
    if code is grpc.StatusCode.FAILED_PRECONDITION:
        return QueueDisabled(text) if kind == "queue_disabled" else LockLost(text)
    if code is grpc.StatusCode.UNAVAILABLE and kind == "lock_store_unavailable":
        return LockStoreUnavailable(text)
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND):
        return ProtocolError(text)
    return QueueServiceUnavailable(f"queue service: {code.name}: {details}")


class QueueServiceClient:
    """Calls to the queue service's replicas, and the renewal of the locks held."""

    def __init__(
        self, settings: QueueClientSettings, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.settings = settings
        self._clock = clock
        self._login: tuple[float, tuple[tuple[str, str | bytes], ...]] | None = None
        """When the login was read, and the metadata made of it (`login_reuse_ms`)."""
        self._addresses = [a.strip() for a in settings.queue_addresses.split(",") if a.strip()]
        if not self._addresses:
            raise ProtocolError("KSB_QUEUE_ADDRESSES names no queue service replica")
        self._current = 0
        self._channels: dict[int, tuple[grpc.Channel, pb_grpc.QueueServiceStub]] = {}
        """One channel per replica, opened at first use and kept until `close`: gRPC reconnects
        a channel by itself, and closing one at failover cancelled the calls still on it."""
        ping_ms = settings.queue_timeout_ms
        self._options = [
            ("grpc.keepalive_time_ms", ping_ms),
            ("grpc.keepalive_timeout_ms", ping_ms),
            ("grpc.http2.ping_timeout_ms", ping_ms),  # gRPC 1.85 waits this, not the above
            ("grpc.http2.max_pings_without_data", 0),
        ]
        """Pings while a call waits: a replica stopped (not dead: its connection stays open)
        fails the calls on it within twice `queue_timeout_ms`, a Commit waiting for its outcome
        too, instead of at their deadlines."""
        self._lock = threading.Lock()
        self._leases: dict[str, bool] = {}
        """The leases of open transactions -> still held (as the last renewal said)."""
        self._since: dict[str, float] = {}
        """The leases of open transactions -> when the call that granted or last renewed each
        was sent (`clock`): a lock lasts from then at least."""
        self._stop = threading.Event()
        self._renewer = threading.Thread(target=self._renew_loop, name="ksb-renew", daemon=True)
        self._renewer.start()

    @property
    def metadata(self) -> tuple[tuple[str, str | bytes], ...]:
        """The login every call carries, read again after `login_reuse_ms` (so a rotated
        password file is taken without a restart, but not read on every call)."""
        s = self.settings
        if s.kafka_security_protocol == "PLAINTEXT":
            return (("ksb-principal", s.acting_principal),) if s.acting_principal else ()
        now = self._clock()
        cached = self._login
        if cached is not None and now - cached[0] < s.login_reuse_ms / 1000:
            return cached[1]
        login = kafka_login(s, s.kafka_bootstrap)
        metadata = (("ksb-principal", login.username), ("ksb-password", login.password))
        self._login = (now, metadata)
        return metadata

    # ----------------------------------------------------------------- calls
    def call(self, method: str, request: Any, *, wait_s: float = 0.0) -> Any:
        """`method` on a replica, moving on past those that fail; the SDK's error if refused."""
        timeout = wait_s + self.settings.queue_timeout_ms / 1000
        last: grpc.RpcError | None = None
        for _attempt in range(_RETRY_BUDGET * len(self._addresses)):
            stub, at = self._stub_now()
            try:
                return getattr(stub, method)(request, timeout=timeout, metadata=self.metadata)
            except grpc.RpcError as exc:
                if not _move_on(exc):
                    raise error_of(exc) from None
                last = exc
                self._move_on(at, exc)
        assert last is not None
        raise QueueServiceUnavailable(
            f"no queue service replica answered {method} ({', '.join(self._addresses)}): "
            f"{error_of(last).reason}"
        )

    def commit_outcome(self, lease: str, request_id: str, wait_s: float) -> Future[pb.CommitReply]:
        """The outcome of a commit record already produced, as a future; its lock is released
        by the service when the outcome is read. A replica that fails meanwhile is left for the
        next (the outcome is remembered by request id on every replica)."""
        done: Future[pb.CommitReply] = Future()
        request = pb.CommitRequest(
            lease=lease, request_id=request_id, timeout_ms=int(wait_s * 1000)
        )
        timeout = wait_s + self.settings.queue_timeout_ms / 1000
        tries = [_RETRY_BUDGET * len(self._addresses)]

        def attempt() -> None:
            stub, at = self._stub_now()
            fut = stub.Commit.future(request, timeout=timeout, metadata=self.metadata)

            def answered(f: grpc.Future[pb.CommitReply]) -> None:
                try:
                    done.set_result(f.result())
                except grpc.RpcError as exc:
                    tries[0] -= 1
                    if _move_on(exc) and tries[0] > 0:
                        self._move_on(at, exc)
                        attempt()
                    else:
                        done.set_exception(error_of(exc))

            fut.add_done_callback(answered)

        attempt()
        return done

    def _stub_now(self) -> tuple[pb_grpc.QueueServiceStub, int]:
        with self._lock:
            at = self._current
            if at not in self._channels:
                channel = self._channel(self._addresses[at])
                self._channels[at] = (channel, pb_grpc.QueueServiceStub(channel))
            return self._channels[at][1], at

    def _channel(self, address: str) -> grpc.Channel:
        """A TLS channel verified against `queue_ssl_ca` when it is set, else a plain one."""
        ca = self.settings.queue_ssl_ca
        if not ca:
            return grpc.insecure_channel(address, options=self._options)
        try:
            roots = Path(ca).read_bytes()
        except OSError as exc:
            raise QueueServiceUnavailable(f"KSB_QUEUE_SSL_CA: cannot read {ca}: {exc}") from None
        credentials = grpc.ssl_channel_credentials(root_certificates=roots)
        return grpc.secure_channel(address, credentials, options=self._options)

    def _move_on(self, at: int, exc: grpc.RpcError) -> None:
        """Leave replica `at` for the next (once, however many calls saw it fail)."""
        with self._lock:
            if self._current != at:
                return
            log.warning(
                "queue service %s: %s; trying %s",
                self._addresses[at],
                exc.code().name,
                self._addresses[(at + 1) % len(self._addresses)],
            )
            self._current = (at + 1) % len(self._addresses)

    # ----------------------------------------------------------------- held locks
    def hold(self, lease: str, granted_at: float) -> None:
        """Renew `lease` from now until `let_go`; `granted_at` is when the call that granted it
        was sent (`now`)."""
        with self._lock:
            self._leases[lease] = True
            self._since[lease] = granted_at

    def let_go(self, lease: str) -> None:
        with self._lock:
            self._leases.pop(lease, None)
            self._since.pop(lease, None)

    def now(self) -> float:
        """The clock `hold`'s `granted_at` is read from."""
        return self._clock()

    def confirm(self, lease: str) -> bool:
        """Whether `lease`'s lock may be committed under: still held, and granted or renewed
        less than `lock_confirm_age_ms` ago, or else renewed now (a round trip). False when
        the lock is no longer held."""
        with self._lock:
            held, since = self._leases.get(lease, False), self._since.get(lease)
        if not held:
            return False
        age_s = self._clock() - since if since is not None else None
        if age_s is not None and age_s < self.settings.lock_confirm_age_ms / 1000:
            return True
        return self.renew(lease)

    def renew(self, lease: str) -> bool:
        """Renew one lease now: False when its lock is no longer held."""
        sent = self._clock()
        reply = self.call("RenewLocks", pb.RenewLocksRequest(leases=[lease]))
        held = bool(reply.held and reply.held[0])
        self._renewed({lease: held}, sent)
        return held

    def _renewed(self, held: dict[str, bool], sent: float) -> None:
        """What a RenewLocks call sent at `sent` said of each lease still open."""
        with self._lock:
            for lease, ok in held.items():
                if lease in self._leases:
                    self._leases[lease] = ok
                    if ok:
                        self._since[lease] = max(self._since.get(lease, sent), sent)

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.settings.lock_renew_ms / 1000):
            with self._lock:
                leases = list(self._leases)
            if not leases:
                continue
            sent = self._clock()
            try:
                reply = self.call("RenewLocks", pb.RenewLocksRequest(leases=leases))
            except KsbError as exc:
                log.warning("%d locks not renewed this time: %s", len(leases), exc.reason)
                continue
            self._renewed(dict(zip(leases, reply.held, strict=True)), sent)

    def close(self) -> None:
        self._stop.set()
        self._renewer.join(2)
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel, _stub in channels:
            channel.close()
