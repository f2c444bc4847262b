"""The Python SDK: BEGIN DIALOG, SEND, END CONVERSATION, timers, RECEIVE and transactions.

Every action is a request record on the principal's requests topic (docs/protocol.md), so a
program in any language can do the same with a plain Kafka producer. RECEIVE is the queue
service's (`ksb.sdk.queue_service`): it locks a group and hands back a lease. A `Transaction`
buffers its actions and sends them, with the lease and what it received, as ONE commit record:
the dispatcher applies it all or not at all, then the queue service answers with the outcome.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from confluent_kafka import KafkaError, Message

from ksb.api.messages import from_api
from ksb.api.queue.v1 import queue_pb2 as pb
from ksb.errors import CommitRefused, KsbError, LockLost
from ksb.names import Names
from ksb.runtime import kafka
from ksb.sdk.backpressure import Backpressure, CommittedOffsets
from ksb.sdk.depth import DepthWatch
from ksb.sdk.groups import GroupDirectory
from ksb.sdk.queue_service import QueueServiceClient
from ksb.settings import ClientSettings
from ksb.wire.protocol import (
    Action,
    BeginRequest,
    CommitRequest,
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

log = logging.getLogger("ksb.sdk")


_POLL_S = 0.05
"""How long the producer's thread waits for delivery reports in one turn."""


def _as_bytes(body: bytes | str) -> bytes:
    return body.encode() if isinstance(body, str) else body


class KsbClient:
    """A connection to one broker instance: a request producer, and the queue service."""

    def __init__(self, settings: ClientSettings | None = None) -> None:
        self.settings = settings or ClientSettings.from_env()
        self.names = Names(self.settings.instance)
        self._requests_topic = self.names.requests_for(self.settings.sender)
        self._producer = kafka.request_producer(self.settings)
        self._offsets = CommittedOffsets(self.settings)
        self.backpressure = Backpressure(self.settings, self._offsets)
        self.depths = DepthWatch(self.settings)
        self.queues = QueueServiceClient(self.settings)
        self.holder = f"client-{uuid.uuid4().hex[:12]}"
        """This client, as the commit records it sends name their reader."""
        self._pending: set[Future[Any]] = set()
        """Commits sent whose outcome has not come back yet."""
        self.groups = GroupDirectory()
        """The groups of the handles this client began or received on: a request's key."""
        self._lock = threading.Lock()
        # Delivery reports resolve request futures; one thread serves them so waiters just block.
        self._closing = threading.Event()
        self._poller = threading.Thread(target=self._serve_reports, name="ksb-client", daemon=True)
        self._poller.start()

    def _serve_reports(self) -> None:
        while not self._closing.is_set():
            self._producer.poll(_POLL_S)

    # ----------------------------------------------------------------- plumbing
    def pending(self, fut: Future[Any]) -> None:
        """A commit's outcome to wait for in `wait_idle`."""
        with self._lock:
            self._pending.add(fut)
        fut.add_done_callback(self._answered)

    def _answered(self, fut: Future[Any]) -> None:
        with self._lock:
            self._pending.discard(fut)

    def wait_idle(self, timeout_s: float = 30.0) -> None:
        """Block until every commit this client sent has its outcome."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                left = list(self._pending)
            if not left:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{len(left)} commits without an outcome")
            try:
                left[0].result(remaining)
            except Exception:  # a refused commit is still an answer
                continue

    def queue_state(self, queue: str) -> pb.QueueStateReply:
        """How much is ready in `queue` now, and how much of it nobody holds (the queue
        service's look at it; needs RECEIVE on the queue)."""
        reply: pb.QueueStateReply = self.queues.call(
            "QueueState", pb.QueueStateRequest(queue=queue)
        )
        return reply

    def describe(self) -> str:
        """What this client waits for, for a report on a run that stopped short."""
        with self._lock:
            return f"{len(self._pending)} commits waiting"

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
        if self._producer.flush(timeout_s) != 0:
            raise KsbError("requests not acknowledged by Kafka in time")

    def close(self) -> None:
        self._producer.flush(10)
        self._closing.set()
        self._poller.join(2)
        self.queues.close()
        self._offsets.close()
        self.depths.close()

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
        self._queue: str | None = None
        self._lease = ""
        self._group: str | None = None
        self._token = 0
        self._received: dict[str, QueueMessage] = {}
        self.done = False

    @property
    def group(self) -> str | None:
        return self._group

    @property
    def lease(self) -> str:
        """The lock's lease from the queue service ("" before a RECEIVE locked a group): what
        the commit record's receipt carries."""
        return self._lease

    @property
    def token(self) -> int:
        """The lock's fencing token (inside the lease; 0 before a RECEIVE locked a group)."""
        return self._token

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
        reply = self._receive(
            queue, top, waitfor_ms, conversation_group_id, conversation_handle, lock_only=False
        )
        fresh = [from_api(m) for m in reply.messages] if reply is not None else []
        for m in fresh:
            self._received[m.message_id] = m
        self._client.groups.learn_received(fresh)
        return fresh

    def get_conversation_group(self, queue: str, *, waitfor_ms: int = 0) -> str | None:
        """GET CONVERSATION GROUP: lock the highest-priority unlocked group with messages and
        return its id (None when none was ready in time); a later RECEIVE in this transaction
        returns that group's messages."""
        self._receive(queue, None, waitfor_ms, None, None, lock_only=True)
        return self.group

    def _receive(
        self,
        queue: str,
        top: int | None,
        waitfor_ms: int,
        group: str | None,
        handle: str | None,
        *,
        lock_only: bool,
    ) -> pb.ReceiveReply | None:
        if self._queue is not None and self._queue != queue:
            raise KsbError("a transaction receives from one queue")
        request = pb.ReceiveRequest(
            queue=queue,
            top=top or 0,
            waitfor_ms=waitfor_ms,
            conversation_group_id=group or "",
            conversation_handle=handle or "",
            lease=self._lease,
            received=list(self._received),
            lock_only=lock_only,
        )
        queues = self._client.queues
        sent = queues.now()
        reply: pb.ReceiveReply = queues.call("Receive", request, wait_s=waitfor_ms / 1000)
        if not reply.lease:
            return None
        if not self._lease:
            self._queue, self._lease = queue, reply.lease
            self._group, self._token = reply.conversation_group_id, reply.token
            queues.hold(self._lease, sent)
        return reply

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

    def commit_async(self, timeout_s: float = 30) -> Future[Any]:
        """Send the commit record; the future resolves with the dispatcher's outcome (it raises
        `CommitRefused` when the dispatcher refused the commit)."""
        self._finish()
        receipt = None
        if self._lease and self._queue is not None and self._group is not None:
            self._confirm_lock()
            receipt = Receipt(
                queue=self._queue,
                group=self._group,
                token=self._token,
                message_ids=tuple(self._received),
                lease=self._lease,
            )
        if receipt is None and not self._actions:
            done: Future[Any] = Future()
            done.set_result(None)
            return done
        req = CommitRequest(
            reader=self._client.holder, receipt=receipt, actions=tuple(self._actions)
        )
        key = receipt.group if receipt else self._client.groups.of(_action_key(self._actions[0]))
        if receipt is None:
            return self._client._produce(req, key)
        lease, queues = self._lease, self._client.queues
        outcome: Future[Any] = Future()
        self._client.pending(outcome)

        def answered(reply: Future[pb.CommitReply]) -> None:
            queues.let_go(lease)
            try:
                r = reply.result()
            except BaseException as exc:
                outcome.set_exception(exc)
                return
            if r.applied:
                outcome.set_result(r)
            else:
                outcome.set_exception(CommitRefused(r.reason))

        def stored(f: Future[None]) -> None:
            if f.exception() is not None:
                # Not stored, so no outcome will come: the group is let go at once.
                self._give_up()
                outcome.set_exception(f.exception() or KsbError("commit not stored"))
                return
            queues.commit_outcome(lease, req.request_id, timeout_s).add_done_callback(answered)

        try:
            delivered = self._client._produce(req, key)
        except BaseException:  # back-pressure timed out, the producer's queue is full
            self._give_up()
            outcome.set_exception(KsbError("commit not sent"))
            raise
        delivered.add_done_callback(stored)
        return outcome

    def _give_up(self) -> None:
        """A commit that will have no outcome: release the lock now, counting no rollback (its
        messages were not handled wrongly, the commit just never left). Left held, the group
        waited out its lease with nobody working on it."""
        queues, lease = self._client.queues, self._lease
        queues.let_go(lease)
        try:
            queues.call("Rollback", pb.RollbackRequest(lease=lease))
        except KsbError as exc:
            log.warning("group %s not let go (%s); its lock lapses", self._group, exc.reason)

    def _confirm_lock(self) -> None:
        """Confirm the lock before committing under it (a RenewLocks call unless it was granted
        or renewed a moment ago: `QueueServiceClient.confirm`), or give it up and raise
        `LockLost`: a commit whose lock cannot be confirmed must not go ahead, and its messages
        come back once the lock expires."""
        queues = self._client.queues
        try:
            held = queues.confirm(self._lease)
            why = "lost the lock"
        except KsbError as exc:
            held = False
            why = f"could not confirm the lock ({exc.reason})"
        if not held:
            queues.let_go(self._lease)
            raise LockLost(f"{why} on group {self._group} before commit")

    def commit(self, timeout_s: float = 30) -> None:
        """Commit and wait for the outcome; raises CommitRefused or LockLost when it did not apply."""
        self._client.wait(self.commit_async(timeout_s), timeout_s + 5)

    def rollback(self) -> None:
        """Nothing was written: the lock is released and the messages are there again,
        untouched (a dead-letter policy may move a message rolled back too often aside)."""
        self._finish()
        if not self._lease:
            return
        try:
            self._client.queues.call(
                "Rollback", pb.RollbackRequest(lease=self._lease, message_ids=list(self._received))
            )
        finally:
            self._client.queues.let_go(self._lease)

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


def _action_key(action: Action) -> str:
    if isinstance(action, SendRequest):
        return action.handles[0]
    return action.handle
