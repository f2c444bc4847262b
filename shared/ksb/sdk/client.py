"""The Python SDK: BEGIN DIALOG, SEND, END CONVERSATION, timers, RECEIVE and transactions.

Every call is a request record on the instance's requests topic (docs/protocol.md), so a program in any
language can do the same with a plain Kafka producer. A `Transaction` buffers its actions and sends them,
with what it received, as ONE commit record: the dispatcher applies it all or not at all.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import redis
from confluent_kafka import KafkaError, Message

from ksb.audit import Audit, BatchedAudit, KafkaAudit
from ksb.errors import KsbError, LockLost, LockStoreUnavailable, NotAuthorized
from ksb.names import Names
from ksb.runtime import kafka
from ksb.runtime.redis_client import redis_client
from ksb.sdk.backpressure import Backpressure, CommittedOffsets
from ksb.sdk.depth import DepthWatch
from ksb.sdk.groups import GroupDirectory
from ksb.sdk.locks import Lease
from ksb.sdk.reader import QueueReader
from ksb.settings import ClientSettings
from ksb.wire.audit import AuditEvent
from ksb.wire.protocol import (
    Action,
    BeginRequest,
    CommitOutcome,
    CommitRequest,
    DeadLetterRequest,
    EndRequest,
    QueueMessage,
    Receipt,
    SendRequest,
    TimerRequest,
    dumps,
    encode_body,
    replace,
)

__all__ = ["KsbClient", "Transaction"]


_AUDIT_EVERY_S = 0.05
"""How often the client writes the audit events it has gathered (`ksb.audit.BatchedAudit`)."""


def _as_bytes(body: bytes | str) -> bytes:
    return body.encode() if isinstance(body, str) else body


class KsbClient:
    """A connection to one broker instance: a request producer, Redis, and per-queue readers."""

    def __init__(self, settings: ClientSettings | None = None) -> None:
        self.settings = settings or ClientSettings.from_env()
        self.names = Names(self.settings.instance)
        self._requests_topic = self.names.requests_for(self.settings.sender)
        self._producer = kafka.request_producer(self.settings)
        self._offsets = CommittedOffsets(self.settings)
        self.backpressure = Backpressure(self.settings, self._offsets)
        self.depths = DepthWatch(self.settings)
        self._audit_buffer = BatchedAudit(KafkaAudit(self._producer, self.names))
        self.audit = Audit(self._audit_buffer)
        self._redis: redis.Redis | None = None
        self._readers: dict[str, QueueReader] = {}
        self.groups = GroupDirectory()
        """The groups of the handles this client began or received on: a request's key."""
        self._lock = threading.Lock()
        # Delivery reports resolve request futures; one thread serves them so waiters just block.
        self._closing = threading.Event()
        self._poller = threading.Thread(target=self._serve_reports, name="ksb-client", daemon=True)
        self._poller.start()

    def _serve_reports(self) -> None:
        drain_at = 0.0
        while not self._closing.is_set():
            self._producer.poll(0.05)
            now = time.monotonic()
            if now >= drain_at:  # the audit events of many RECEIVEs, one record per queue
                self._audit_buffer.drain()
                drain_at = now + _AUDIT_EVERY_S

    # ----------------------------------------------------------------- plumbing
    @property
    def redis(self) -> redis.Redis:
        if self._redis is None:
            self._redis = redis_client(self.settings)
        return self._redis

    def reader(self, queue: str) -> QueueReader:
        with self._lock:
            r = self._readers.get(queue)
            if r is None:
                r = self._readers[queue] = QueueReader(self.settings, queue, self.redis)
            return r

    def _produce(self, request: Any, key: str) -> Future[None]:
        """Hand one request to the producer, first waiting while too many are not applied yet
        (`ksb.sdk.backpressure`)."""
        done: Future[None] = Future()
        pressure = self.backpressure

        def on_delivery(err: KafkaError | None, msg: Message) -> None:
            if err is not None:
                pressure.failed()
                done.set_exception(KsbError(f"request not stored in Kafka: {err}"))
            else:
                pressure.delivered(msg.topic() or "", msg.partition() or 0, msg.offset() or 0)
                done.set_result(None)

        pressure.before_send()
        try:
            self._producer.produce(
                self._requests_topic,
                key=key.encode(),
                value=dumps(request),
                on_delivery=on_delivery,
            )
        except BaseException:
            pressure.failed()
            raise
        return done

    def wait(self, fut: Future[Any], timeout_s: float = 30) -> Any:
        return fut.result(timeout_s)

    def flush(self, timeout_s: float = 30) -> None:
        self._audit_buffer.drain()
        if self._producer.flush(timeout_s) != 0:
            raise KsbError("requests not acknowledged by Kafka in time")

    def close(self) -> None:
        for r in self._readers.values():
            r.close()
        self._readers.clear()
        self._audit_buffer.drain()
        self._producer.flush(10)
        self._closing.set()
        self._poller.join(2)
        self._offsets.close()
        self.depths.close()
        if self._redis is not None:
            self._redis.close()

    def __enter__(self) -> KsbClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # ----------------------------------------------------------------- outside a transaction
    def begin_dialog(
        self,
        from_service: str,
        to_service: str,
        contract: str = "DEFAULT",
        *,
        lifetime_s: int | None = None,
        related_conversation: str | None = None,
        conversation_group_id: str | None = None,
    ) -> str:
        """Returns the new conversation handle; errors arrive on the error topic."""
        req = self._begin(
            from_service,
            to_service,
            contract,
            lifetime_s,
            related_conversation,
            conversation_group_id,
        )
        self._produce(req, self.groups.begun(req))
        self.depths.rule.began(req.handle, to_service)
        return req.handle

    def send(
        self, handles: str | Sequence[str], message_type: str = "DEFAULT", body: bytes | str = b""
    ) -> str:
        req = send_request(handles, message_type, body)
        for h in req.handles:  # queue-depth back-pressure (`ksb.sdk.depth`); a no-op without it
            self.depths.before_send(h, self.groups.of(h))
        self._produce(req, self.groups.of(req.handles[0]))
        return req.request_id

    def end_conversation(
        self,
        handle: str,
        *,
        error_code: int | None = None,
        error_description: str | None = None,
        cleanup: bool = False,
    ) -> str:
        req = EndRequest(
            handle=handle,
            error_code=error_code,
            error_description=error_description,
            cleanup=cleanup,
        )
        self._produce(req, self.groups.of(handle))
        return req.request_id

    def begin_conversation_timer(self, handle: str, timeout_s: float) -> str:
        req = TimerRequest(handle=handle, timeout_s=timeout_s)
        self._produce(req, self.groups.of(handle))
        return req.request_id

    def _begin(
        self,
        from_service: str,
        to_service: str,
        contract: str,
        lifetime_s: int | None,
        related_conversation: str | None,
        conversation_group_id: str | None,
    ) -> BeginRequest:
        """A BEGIN; one related to a conversation whose group this client knows also names that
        group, so a commit's BEGIN reaches the group's owner (`ksb.dialog.receipts`)."""
        if related_conversation is not None and conversation_group_id is None:
            conversation_group_id = self.groups.hint(related_conversation)
        return begin_request(
            from_service,
            to_service,
            contract,
            lifetime_s,
            related_conversation,
            conversation_group_id,
        )

    def transaction(self) -> Transaction:
        return Transaction(self)


def begin_request(
    from_service: str,
    to_service: str,
    contract: str,
    lifetime_s: int | None,
    related_conversation: str | None,
    conversation_group_id: str | None,
) -> BeginRequest:
    return BeginRequest(
        handle=str(uuid.uuid4()),
        from_service=from_service,
        to_service=to_service,
        contract=contract,
        lifetime_s=lifetime_s,
        related_conversation=related_conversation,
        conversation_group_id=conversation_group_id,
    )


def send_request(handles: str | Sequence[str], message_type: str, body: bytes | str) -> SendRequest:
    hs = (handles,) if isinstance(handles, str) else tuple(handles)
    text, b64 = encode_body(_as_bytes(body))
    return SendRequest(handles=hs, message_type=message_type, body=text, body_b64=b64)


class Transaction:
    """RECEIVE under a group lock, act, then commit (one record) or roll back (release the lock).

    A transaction holds at most one conversation-group lock; a second RECEIVE in it continues with
    the group it already holds.
    """

    def __init__(self, client: KsbClient) -> None:
        self._client = client
        self._actions: list[Action] = []
        self._reader: QueueReader | None = None
        self._lease: Lease | None = None
        self._received: dict[str, QueueMessage] = {}
        self.done = False

    @property
    def group(self) -> str | None:
        return self._lease.group if self._lease else None

    def _lock(
        self, queue: str, waitfor_ms: int, group: str | None, handle: str | None
    ) -> QueueReader | None:
        if self._lease is not None:
            assert self._reader is not None
            if self._reader.queue != queue:
                raise KsbError("a transaction receives from one queue")
            return self._reader
        reader = self._client.reader(queue)
        try:
            lease = reader.lock_group(waitfor_ms=waitfor_ms, group=group, handle=handle)
        except redis.RedisError as exc:
            raise _lock_failure(f"RECEIVE on {queue} locked no group", exc) from exc
        if lease is None:
            return None
        self._reader, self._lease = reader, lease
        return reader

    def receive(
        self,
        queue: str,
        *,
        top: int | None = None,
        waitfor_ms: int = 0,
        conversation_group_id: str | None = None,
        conversation_handle: str | None = None,
    ) -> list[QueueMessage]:
        """Messages of exactly one conversation group, locked to this transaction until it ends."""
        reader = self._lock(queue, waitfor_ms, conversation_group_id, conversation_handle)
        if reader is None or self._lease is None:
            return []
        fresh = reader.messages(self._lease, top, conversation_handle, skip=self._received)
        for m in fresh:
            self._received[m.message_id] = m
        self._client.groups.learn_received(fresh)
        if fresh and self._client.audit.enabled:
            targeted = conversation_group_id is not None or conversation_handle is not None
            self._audit_receive(reader, self._lease.group, fresh, targeted)
        return fresh

    def _audit_receive(
        self, reader: QueueReader, group: str, got: list[QueueMessage], targeted: bool
    ) -> None:
        level, ready = reader.levels(group)
        first = got[0]
        event = AuditEvent(
            kind="receive",
            event_ms=int(time.time() * 1000),
            instance=self._client.settings.instance,
            queue=reader.queue,
            service=first.service_name,
            conversation_id=first.conversation_id,
            conversation_handle=first.conversation_handle,
            group=group,
            priority=level,
            ready_priority=ready,
            targeted=targeted,
            message_ids=tuple(m.message_id for m in got),
            count=len(got),
            reader=reader.holder,
        )
        self._client.audit.emit([event])

    def get_conversation_group(self, queue: str, *, waitfor_ms: int = 0) -> str | None:
        """Lock the highest-priority unlocked group with messages and return its id."""
        self._lock(queue, waitfor_ms, None, None)
        return self.group

    def begin_dialog(
        self,
        from_service: str,
        to_service: str,
        contract: str = "DEFAULT",
        *,
        lifetime_s: int | None = None,
        related_conversation: str | None = None,
        conversation_group_id: str | None = None,
    ) -> str:
        req = self._client._begin(
            from_service,
            to_service,
            contract,
            lifetime_s,
            related_conversation,
            conversation_group_id,
        )
        self._client.groups.begun(req)
        self._actions.append(req)
        return req.handle

    def send(
        self, handles: str | Sequence[str], message_type: str = "DEFAULT", body: bytes | str = b""
    ) -> None:
        req = send_request(handles, message_type, body)
        self._actions.append(replace(req, group=self._client.groups.hint(req.handles[0])))

    def end_conversation(
        self,
        handle: str,
        *,
        error_code: int | None = None,
        error_description: str | None = None,
        cleanup: bool = False,
    ) -> None:
        self._actions.append(
            EndRequest(
                handle=handle,
                error_code=error_code,
                error_description=error_description,
                cleanup=cleanup,
                group=self._client.groups.hint(handle),
            )
        )

    def begin_conversation_timer(self, handle: str, timeout_s: float) -> None:
        hint = self._client.groups.hint(handle)
        self._actions.append(TimerRequest(handle=handle, timeout_s=timeout_s, group=hint))

    def commit_async(self) -> Future[Any]:
        """Send the commit record; the future resolves with the dispatcher's outcome."""
        self._finish()
        receipt = None
        if self._lease is not None and self._reader is not None:
            self._confirm_lease(self._reader, self._lease)
            receipt = Receipt(
                queue=self._reader.queue,
                group=self._lease.group,
                token=self._lease.token,
                message_ids=tuple(self._received),
            )
        if receipt is None and not self._actions:
            done: Future[Any] = Future()
            done.set_result(None)
            return done
        req = CommitRequest(
            reader=self._reader.holder if self._reader else "",
            receipt=receipt,
            actions=tuple(self._actions),
        )
        key = receipt.group if receipt else self._client.groups.of(_action_key(self._actions[0]))
        if receipt is None or self._reader is None or self._lease is None:
            return self._client._produce(req, key)
        reader, lease, rid = self._reader, self._lease, req.request_id
        outcome: Future[CommitOutcome] = reader.expect_outcome(rid, lease)

        def give_up() -> None:
            # Not stored, so no outcome will come: the commit stops waiting and the group is
            # let go. Left waiting, its lock was renewed for as long as the reader lived and
            # its messages never came back.
            reader.forget(rid)
            reader.release(lease, None)

        try:
            delivered = self._client._produce(req, key)
        except BaseException:  # back-pressure timed out, the producer's queue is full
            give_up()
            raise

        def on_delivery(f: Future[None]) -> None:
            if f.exception() is not None:
                give_up()
                outcome.set_exception(f.exception() or KsbError("commit not stored"))

        delivered.add_done_callback(on_delivery)
        return outcome

    @staticmethod
    def _confirm_lease(reader: QueueReader, lease: Lease) -> None:
        """Renew the lease before committing under it, or give the group up and raise
        `LockLost`: a commit whose lock cannot be confirmed (lost, or Redis failing) must not go
        ahead, and its messages come back to the queue when the lock expires."""
        try:
            held = reader.locks.extend(lease)
            why = "lost the lock"
        except redis.RedisError as exc:
            held = False
            why = f"could not confirm the lock (Redis: {type(exc).__name__}: {exc})"
        if not held:
            reader.release(lease, None)
            raise LockLost(f"{why} on group {lease.group} before commit")

    def commit(self, timeout_s: float = 30) -> None:
        """Commit and wait for the outcome; raises CommitRefused or LockLost when it did not apply."""
        self._client.wait(self.commit_async(), timeout_s)

    def rollback(self) -> None:
        """Nothing was written: release the lock and the messages are there again, untouched."""
        self._finish()
        if self._lease is None or self._reader is None:
            return
        if self._received:
            if self._client.audit.enabled:
                self._audit_rollback(self._reader, self._lease.group)
            limit_reached = self._reader.note_rollback(list(self._received))
            if limit_reached:
                self._dead_letter(limit_reached)
        self._reader.release(self._lease, None)

    def _audit_rollback(self, reader: QueueReader, group: str) -> None:
        got = list(self._received.values())
        event = AuditEvent(
            kind="rollback",
            event_ms=int(time.time() * 1000),
            instance=self._client.settings.instance,
            queue=reader.queue,
            service=got[0].service_name,
            group=group,
            priority=max(m.priority for m in got),
            message_ids=tuple(self._received),
            count=len(got),
            reader=reader.holder,
        )
        self._client.audit.emit([event])

    def _dead_letter(self, message_ids: list[str]) -> None:
        """Still holding the lock: move messages past their rollback limit aside before anyone
        can receive them again."""
        assert self._reader is not None
        for mid in message_ids:
            req = DeadLetterRequest(
                message=self._received[mid],
                reason=f"rolled back {self._reader.queue} message the maximum number of times",
            )
            self._client._produce(req, self._received[mid].conversation_group_id)
        self._client.flush()
        self._reader.wait_gone(message_ids)

    def _finish(self) -> None:
        if self.done:
            raise KsbError("this transaction has already ended")
        self.done = True

    def __enter__(self) -> Transaction:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if self.done:
            return
        if exc_type is None:
            self.commit()
        else:
            self.rollback()


def _lock_failure(what: str, exc: redis.RedisError) -> KsbError:
    """A Redis failure under a RECEIVE as the SDK's error: `NotAuthorized` when Redis refused this
    principal (a grant revoked, a password rotated), else `LockStoreUnavailable`."""
    why = f"{what}: Redis {type(exc).__name__}: {exc}"
    if isinstance(exc, redis.exceptions.NoPermissionError | redis.exceptions.AuthenticationError):
        return NotAuthorized(why)
    return LockStoreUnavailable(why)


def _action_key(action: Action) -> str:
    if isinstance(action, SendRequest):
        return action.handles[0]
    return action.handle
