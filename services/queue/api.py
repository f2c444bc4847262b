"""The queue service's gRPC API (proto/ksb/api/queue/v1/queue.proto): calls in, rules out.

Each call is authenticated (`services.queue.logins`), checked against the catalog's RECEIVE
grants (`ksb.dialog.permissions`: there is no anonymous RECEIVE on a secured stack), and handed to
`Receiving` or `Rollbacks`. A KSB error becomes the gRPC status a client in any language can act
on, with ``<code>: <reason>`` as its details: a bad argument is INVALID_ARGUMENT, an unknown
queue NOT_FOUND, a missing grant or someone else's lease PERMISSION_DENIED, a disabled queue or a
lost lock FAILED_PRECONDITION, Redis failing UNAVAILABLE (another replica may answer).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NoReturn, TypeVar

import grpc
import redis

from ksb.api.messages import to_api
from ksb.api.queue.v1 import queue_pb2 as pb
from ksb.api.queue.v1 import queue_pb2_grpc as pb_grpc
from ksb.dialog.permissions import Permissions
from ksb.errors import (
    CatalogError,
    KsbError,
    LeaseInvalid,
    LockLost,
    LockStoreUnavailable,
    NotAuthorized,
    QueueDisabled,
)
from ksb.queue.outcomes import Outcomes
from ksb.runtime.log_format import log_fields
from ksb.wire.partitioning import partition_for
from services.queue.fencing import Fencing
from services.queue.logins import Logins, Unauthenticated
from services.queue.receiving import NEW_QUEUE_WAIT_S, Receiving
from services.queue.rollbacks import Rollbacks

__all__ = ["QueueApi"]

log = logging.getLogger("ksb.queue")

R = TypeVar("R")

MAX_TOP = 10_000
"""Messages one RECEIVE returns at most (a bound on a reply's size; TOP 0 means up to this)."""
MAX_WAIT_MS = 3_600_000
"""The longest WAITFOR or commit wait a call may ask for."""
MAX_IDS = 10_000
"""Message ids or leases one call may carry at most."""


class BadArgument(KsbError):
    code = "invalid_argument"


class CommitNotAnswered(KsbError):
    """No outcome of the commit was read in the time the call gave: the commit record may not
    be stored, or the dispatcher of its shard is failing over. Asking again is safe."""

    code = "no_outcome"


_STATUS: list[tuple[type[KsbError], grpc.StatusCode]] = [
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (NotAuthorized, grpc.StatusCode.PERMISSION_DENIED),
    (LeaseInvalid, grpc.StatusCode.PERMISSION_DENIED),
    (QueueDisabled, grpc.StatusCode.FAILED_PRECONDITION),
    (LockLost, grpc.StatusCode.FAILED_PRECONDITION),
    (LockStoreUnavailable, grpc.StatusCode.UNAVAILABLE),
    (CommitNotAnswered, grpc.StatusCode.DEADLINE_EXCEEDED),
]


class QueueApi(pb_grpc.QueueServiceServicer):
    """The servicer: one instance serves every call of this replica."""

    def __init__(
        self,
        logins: Logins,
        receiving: Receiving,
        rollbacks: Rollbacks,
        fencing: Fencing,
        outcomes: Outcomes,
        permissions: Callable[[], Permissions],
        *,
        commit_wait_ms: int,
    ) -> None:
        self._logins = logins
        self._receiving = receiving
        self._rollbacks = rollbacks
        self._fencing = fencing
        self._outcomes = outcomes
        self._permissions = permissions
        self._commit_wait_ms = commit_wait_ms

    # ----------------------------------------------------------------- the calls
    def Receive(self, request: pb.ReceiveRequest, context: grpc.ServicerContext) -> pb.ReceiveReply:
        def call() -> pb.ReceiveReply:
            principal = self._caller(context)
            queue = _name(request.queue, "queue")
            self._receiving.queues.get(queue, wait_s=NEW_QUEUE_WAIT_S)  # its catalog first
            self._permissions().check_receive(principal or None, queue, "RECEIVE")
            granted = self._receiving.receive(
                principal,
                queue,
                top=_bounded(request.top, MAX_TOP, "top") or MAX_TOP,
                waitfor_ms=_bounded(request.waitfor_ms, MAX_WAIT_MS, "waitfor_ms"),
                group=request.conversation_group_id or None,
                handle=request.conversation_handle or None,
                lease=request.lease or None,
                received=_ids(request.received),
                lock_only=request.lock_only,
            )
            if granted is None:
                return pb.ReceiveReply()
            return pb.ReceiveReply(
                lease=granted.lease,
                conversation_group_id=granted.claims.group,
                messages=[to_api(m) for m in granted.messages],
                token=granted.claims.token,
            )

        handle = request.conversation_handle or None
        with log_fields(queue=request.queue, conversation=handle):
            return self._serve(context, call, f"RECEIVE on {request.queue} locked no group")

    def Commit(self, request: pb.CommitRequest, context: grpc.ServicerContext) -> pb.CommitReply:
        def call() -> pb.CommitReply:
            principal = self._caller(context)
            claims = self._receiving.opened(principal, _given(request.lease, "lease"))
            request_id = _given(request.request_id, "request_id")
            wait_ms = (
                _bounded(request.timeout_ms, MAX_WAIT_MS, "timeout_ms") or self._commit_wait_ms
            )
            fold = self._receiving.queues.get(claims.queue)
            partition = partition_for(claims.group, fold.partitions)
            stalls = self._receiving.stalls(claims.queue)
            with self._receiving.queues.cond:
                stalls.sent(partition, self._receiving.now_ms())
            try:
                outcome = self._outcomes.wait(request_id, wait_ms / 1000)
            finally:
                with self._receiving.queues.cond:
                    stalls.answered(partition)
            if outcome is None:
                raise CommitNotAnswered(f"no outcome for commit {request_id} in {wait_ms} ms")
            if outcome.record.group != claims.group or outcome.queue != claims.queue:
                raise LeaseInvalid("the commit's outcome is of another group than the lease's")
            # The replica that took the lock released it when it read the outcome; one that
            # died did not: release here (the token decides, so this never frees a newer lock).
            if claims.holder != self._receiving.replica:
                at = (outcome.partition, outcome.offset)
                self._receiving.release(claims, at, committed=outcome.record.applied)
            r = outcome.record
            return pb.CommitReply(applied=r.applied, reason=r.reason, fence=r.fence)

        return self._serve(context, call, "the commit's lock")

    def Rollback(
        self, request: pb.RollbackRequest, context: grpc.ServicerContext
    ) -> pb.RollbackReply:
        def call() -> pb.RollbackReply:
            principal = self._caller(context)
            claims = self._receiving.opened(principal, _given(request.lease, "lease"))
            try:
                dead = self._rollbacks.rolled_back(claims, _ids(request.message_ids))
                # Its lease commits nothing once the group can be someone else's.
                self._fencing.fence(claims.queue, claims.group, claims.token + 1, wait=True)
            finally:
                self._receiving.release(claims, claims.after, committed=False)
            return pb.RollbackReply(dead_lettered=dead)

        return self._serve(context, call, "ROLLBACK")

    def RenewLocks(
        self, request: pb.RenewLocksRequest, context: grpc.ServicerContext
    ) -> pb.RenewLocksReply:
        def call() -> pb.RenewLocksReply:
            principal = self._caller(context)
            return pb.RenewLocksReply(held=self._receiving.renew(principal, _ids(request.leases)))

        return self._serve(context, call, "lock renewal")

    def Peek(self, request: pb.PeekRequest, context: grpc.ServicerContext) -> pb.PeekReply:
        def call() -> pb.PeekReply:
            principal = self._caller(context)
            queue = _name(request.queue, "queue")
            self._permissions().check_receive(principal or None, queue, "peek at")
            top = _bounded(request.top, MAX_TOP, "top") or MAX_TOP
            return pb.PeekReply(messages=[to_api(m) for m in self._receiving.peek(queue, top)])

        return self._serve(context, call, f"peek at {request.queue}")

    def QueueState(
        self, request: pb.QueueStateRequest, context: grpc.ServicerContext
    ) -> pb.QueueStateReply:
        def call() -> pb.QueueStateReply:
            principal = self._caller(context)
            queue = _name(request.queue, "queue")
            self._permissions().check_receive(principal or None, queue, "look at")
            s = self._receiving.state(queue)
            return pb.QueueStateReply(
                ready_messages=s.ready_messages,
                ready_groups=s.ready_groups,
                runnable_groups=s.runnable_groups,
                locked_groups=s.locked_groups,
                oldest_ready_ms=s.oldest_ready_ms or 0,
                caught_up=s.caught_up,
            )

        return self._serve(context, call, f"the state of {request.queue}")

    # ----------------------------------------------------------------- plumbing
    def _caller(self, context: grpc.ServicerContext) -> str:
        return self._logins.principal(list(context.invocation_metadata()))

    def _serve(self, context: grpc.ServicerContext, call: Callable[[], R], what: str) -> R:
        """Run `call` (`what` the caller asked, for the reasons of refusals) and turn what it
        raises into the call's status."""
        try:
            return call()
        except CatalogError as exc:
            code = (
                grpc.StatusCode.NOT_FOUND
                if exc.code == "unknown_queue"
                else grpc.StatusCode.INVALID_ARGUMENT
            )
            _abort(context, code, exc)
        except BadArgument as exc:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, exc)
        except KsbError as exc:
            for kind, code in _STATUS:
                if isinstance(exc, kind):
                    _abort(context, code, exc)
            _abort(context, grpc.StatusCode.INTERNAL, exc)
        except redis.RedisError as exc:
            err = LockStoreUnavailable(f"{what}: Redis {type(exc).__name__}: {exc}")
            _abort(context, grpc.StatusCode.UNAVAILABLE, err)


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, exc: KsbError) -> NoReturn:
    context.abort(code, f"{exc.code}: {exc.reason}")
    raise AssertionError("unreachable: abort raises")


def _name(value: str, what: str) -> str:
    if not value or len(value) > 255:
        raise BadArgument(f"{what} must be a name of 1 to 255 characters")
    return value


def _given(value: str, what: str) -> str:
    if not value:
        raise BadArgument(f"{what} is required")
    if len(value) > 4096:
        raise BadArgument(f"{what} is longer than 4096 characters")
    return value


def _bounded(value: int, most: int, what: str) -> int:
    if value > most:
        raise BadArgument(f"{what} is {value}, over the most a call may ask for ({most})")
    return value


def _ids(values: object) -> list[str]:
    ids = list(values)  # type: ignore[call-overload]
    if len(ids) > MAX_IDS:
        raise BadArgument(f"{len(ids)} ids in one call, over {MAX_IDS}")
    return [str(i) for i in ids]
