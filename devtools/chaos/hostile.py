"""Hostile and malformed records, written into a round as an attacker with a login would.

Each volley (`Volley.fire`, one per ``hostile`` fault) writes one record of every class of the
trust-boundary issue (issue 38) while the round's traffic flows:

* as **mallory**, an application of instance A whose only grants are RECEIVE on its own queue
  and SEND on its own service (`MALLORY`), on its own requests topic: an ``inbound`` record, a
  ``replay`` and a ``fence`` (kinds an application may not send); a BEGIN from a service it does
  not own and one to a local service it has no SEND grant for; a SEND on an endpoint of A's
  initiator service (not its own); a body past ``max_body_bytes``, one near the broker's 8 MB
  record limit, one that breaks its type's validation; commits under a forged lease with token
  2^62 and with token 0 and no lease; truncated JSON, a version-2 record, an unknown kind;
* as **B's transport** (a peer: its login may write ``ksb.<A>.inbound.<B>``): a message whose
  origin is an instance no route of A names, and one claiming F's origin that B may not carry.

Every record carries a request id of its own, so its refusal is found on A's errors topics by id
(or, where the record cannot be parsed, in the refusal's ``raw`` copy of its first bytes). The
legitimate traffic of the round must be untouched: its invariants are checked as in any round.
Mallory's dialogs are with its own service (`MALLORY`) and stay open; the round's drain leaves
endpoints of that service out (`is_hostile_endpoint`).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from devtools.chaos.workload import CONTRACT, INITIATOR, INITIATOR_QUEUE, REQUEST
from devtools.deployment import Deployment
from ksb.catalog.model import ERROR
from ksb.dialog.system_messages import VALIDATION_ERROR
from ksb.names import Names
from ksb.runtime import kafka
from ksb.runtime.kafka import MAX_RECORD_BYTES
from ksb.security.principals import ADMIN, Role
from ksb.wire.protocol import QueueMessage, parse_queue_record

__all__ = [
    "MALLORY",
    "MALLORY_PRINCIPAL",
    "MALLORY_QUEUE",
    "Refusal",
    "Volley",
    "is_hostile_endpoint",
    "mallory_catalog_part",
]

log = logging.getLogger("devtools.chaos")

MALLORY = "//chaos/Mallory"
MALLORY_QUEUE = "MalloryQueue"
MALLORY_PRINCIPAL = "mallory"
BAD_BODY = "{not json"
"""A body its type's validation (WELL_FORMED_JSON) refuses."""
DIALOG_FAILED = "dialog_failed"
"""Not an error record: the dialog failed with a validation Error to its sender."""
REFUSAL_TIMEOUT_S = 180.0
"""How long a volley's refusals may take to appear (a fault may hold the dispatchers)."""


def mallory_catalog_part() -> dict[str, Any]:
    """What A's catalog adds for mallory: its queue, its service, and its only grants."""
    return {
        "queues": [{"name": MALLORY_QUEUE, "partitions": 1}],
        "services": [{"name": MALLORY, "queue": MALLORY_QUEUE, "contracts": [CONTRACT]}],
        "grants": [
            {"permission": "RECEIVE", "target": MALLORY_QUEUE, "principal": MALLORY_PRINCIPAL},
            {"permission": "SEND", "target": MALLORY, "principal": MALLORY_PRINCIPAL},
        ],
    }


def is_hostile_endpoint(record: dict[str, Any]) -> bool:
    """An endpoint a volley made (mallory's own dialogs), which the round's drain leaves out."""
    return MALLORY in (record.get("local_service"), record.get("remote_service"))


@dataclass(frozen=True)
class Refusal:
    """One hostile record: its class, the codes that refuse it, and what became of it."""

    name: str
    request_id: str
    expected: frozenset[str]
    got: str | None = None
    """The refusal's code, or None when none was found in time."""

    @property
    def ok(self) -> bool:
        return self.got in self.expected


def _rid() -> str:
    return f"hostile-{uuid.uuid4().hex}"


@dataclass
class Volley:
    """One volley against instance A (`owner_a`: A's owner; `b`: instance B's deployment)."""

    owner_a: Deployment
    b: Deployment
    f_instance: str
    handles: list[str]
    """A's workload dialog handles as begun so far (one is the victim of a SEND not its own)."""
    records: list[tuple[str, str, frozenset[str], str, bytes, str]] = field(default_factory=list)
    """(class, request id, expected codes, topic, value, key) as written."""
    _validated: str = ""
    """Mallory's dialog, which the body breaking its type's validation must fail."""

    def fire(self) -> list[Refusal]:
        """Write every hostile record, then wait for each one's refusal."""
        mallory = self.owner_a.as_principal(MALLORY_PRINCIPAL)
        names = Names(self.owner_a.instance)
        own = names.requests_of(MALLORY_PRINCIPAL)
        handle = self._mallory_dialog(mallory)
        self._application_records(own, handle)
        self._write(mallory, [r for r in self.records if r[3] == own])
        peer = self.b.as_service(Role.TRANSPORT)
        inbound = names.inbound_from(self.b.instance)
        self._peer_records(inbound)
        self._write(peer, [r for r in self.records if r[3] == inbound])
        return self._refusals()

    # ----------------------------------------------------------------- records
    def _add(
        self,
        name: str,
        expected: set[str],
        topic: str,
        value: dict[str, Any] | bytes,
        key: str = "",
        rid: str = "",
    ) -> str:
        rid = value["request_id"] if isinstance(value, dict) else rid
        raw = value if isinstance(value, bytes) else json.dumps(value).encode()
        self.records.append((name, rid, frozenset(expected), topic, raw, key or rid))
        return rid

    def _mallory_dialog(self, mallory: Deployment) -> str:
        """Mallory's own dialog with its own service: where its bodies are sent."""
        handle = str(uuid.uuid4())
        begin = _req("begin", handle=handle, from_service=MALLORY, to_service=MALLORY)
        begin["contract"] = CONTRACT
        self._write(mallory, [], begin)
        return handle

    def _application_records(self, topic: str, handle: str) -> None:
        def send(body: str, handles: tuple[str, ...] = (handle,)) -> dict[str, Any]:
            return {
                "v": 1,
                "kind": "send",
                "request_id": _rid(),
                "handles": list(handles),
                "message_type": REQUEST,
                "body": body,
            }

        victim = self.handles[-1] if self.handles else str(uuid.uuid4())
        add = self._add
        add("inbound on a requests topic", {"kind_not_allowed"}, topic, self._inbound("x"), handle)
        add(
            "replay by an application",
            {"kind_not_allowed"},
            topic,
            # Naming a made-up dead letter: the dispatcher would read it from the dead-letter
            # topic, but an application's replay is refused before that.
            _req("replay", queue=INITIATOR_QUEUE, message_id="forged:0", offset=0),
        )
        add(
            "fence by an application",
            {"kind_not_allowed"},
            topic,
            _req("fence", queue=INITIATOR_QUEUE, group=victim, below=2**62),
        )
        add(
            "BEGIN as a service not its own",
            {"not_authorized"},
            topic,
            _req(
                "begin",
                handle=str(uuid.uuid4()),
                from_service=INITIATOR,
                to_service=MALLORY,
                contract=CONTRACT,
            ),
        )
        add(
            "BEGIN with a target not granted",
            {"not_authorized"},
            topic,
            _req(
                "begin",
                handle=str(uuid.uuid4()),
                from_service=MALLORY,
                to_service=INITIATOR,
                contract=CONTRACT,
            ),
        )
        # A workload endpoint (its dialog may have closed already: then it is not found at all).
        add(
            "SEND on an endpoint not its own",
            {"not_authorized", "unknown_conversation"},
            topic,
            send("{}", (victim,)),
            victim,
        )
        add(
            "body past max_body_bytes",
            {"body_too_large"},
            topic,
            send(json.dumps({"pad": "x" * (self.owner_a.max_body_bytes + 10)})),
            handle,
        )
        near = MAX_RECORD_BYTES - 4_096  # the envelope fits under the broker's record limit
        add("record near 8 MB", {"body_too_large"}, topic, send("x" * near), handle)
        # Not an error record: as Service Broker's target does, the receiving side refuses the
        # message and fails the dialog with an Error to the sender (`ksb.dialog.send`).
        add("body breaking its type's validation", {DIALOG_FAILED}, topic, send(BAD_BODY), handle)
        self._validated = handle
        for name, token, lease in (
            ("commit under a forged lease, token 2^62", 2**62, "Zm9yZ2Vk"),
            ("commit with token 0 and no lease", 0, None),
        ):
            receipt: dict[str, Any] = {
                "queue": MALLORY_QUEUE,
                "group": handle,
                "message_ids": [f"{handle}:0"],
                "token": token,
            }
            if lease is not None:
                receipt["lease"] = lease
            add(
                name,
                {"bad_lease"},
                topic,
                _req("commit", reader="mallory", receipt=receipt),
                handle,
            )
        rid = _rid()
        cut = f'{{"v":1,"kind":"send","request_id":"{rid}","handles":["{handle}"],"bo'
        add("truncated JSON", {"malformed_record"}, topic, cut.encode(), handle, rid)
        add("wrong version", {"malformed_record"}, topic, {**send("{}"), "v": 2})
        add("unknown kind", {"malformed_record"}, topic, _req("teleport", handle=handle))

    def _inbound(self, origin: str) -> dict[str, Any]:
        conversation = str(uuid.uuid4())
        return {
            "v": 1,
            "kind": "inbound",
            "request_id": _rid(),
            "message_id": f"{conversation}:0",
            "conversation_id": conversation,
            "from_instance": origin,
            "to_instance": self.owner_a.instance,
            "from_service": "//chaos/Target",
            "to_service": INITIATOR,
            "contract": CONTRACT,
            "message_type": REQUEST,
            "from_initiator": True,
            "seq": 0,
            "priority": 5,
            "enqueued_ms": 0,
            "body": "{}",
        }

    def _peer_records(self, topic: str) -> None:
        self._add(
            "inbound from an unknown instance", {"unknown_peer"}, topic, self._inbound("nowhere")
        )
        self._add(
            "inbound of F's carried by B", {"unknown_peer"}, topic, self._inbound(self.f_instance)
        )

    # ----------------------------------------------------------------- I/O
    def _write(
        self,
        settings: Deployment,
        records: list[tuple[str, str, frozenset[str], str, bytes, str]],
        setup: dict[str, Any] | None = None,
    ) -> None:
        producer = kafka.producer(settings)
        failed: list[str] = []

        def report(err: Any, _msg: Any) -> None:
            if err is not None:
                failed.append(str(err))

        if setup is not None:
            topic = Names(settings.instance).requests_of(MALLORY_PRINCIPAL)
            producer.produce(
                topic,
                key=setup["handle"].encode(),
                value=json.dumps(setup).encode(),
                on_delivery=report,
            )
        for record in records:
            topic, value, key = record[3:]
            if topic:
                producer.produce(topic, key=key.encode(), value=value, on_delivery=report)
                producer.poll(0)
        if producer.flush(60) != 0 or failed:
            raise RuntimeError(f"hostile records not stored: {failed or 'flush timed out'}")

    def _refusals(self) -> list[Refusal]:
        """Each written record's refusal, read from every errors topic of A as the admin (and,
        for the body its type's validation refuses, from mallory's queue)."""
        wanted = {rid: (name, exp) for name, rid, exp, topic, _v, _k in self.records if topic}
        found: dict[str, str] = {}
        admin = self.owner_a.as_principal(ADMIN)
        names = Names(self.owner_a.instance)
        prefix = names.errors
        deadline = time.monotonic() + REFUSAL_TIMEOUT_S
        while len(found) < len(wanted) and time.monotonic() < deadline:
            failed = _dialog_failed(admin, names.queue(MALLORY_QUEUE), self._validated)
            if failed is not None:
                found.update({r: failed for r, (_n, e) in wanted.items() if DIALOG_FAILED in e})
            for rec in _error_records(admin, prefix):
                rid = rec.get("request_id")
                if rid not in wanted:  # a record that could not be parsed: its copy names it
                    rid = next((r for r in wanted if r in str(rec.get("raw", ""))), None)
                if rid is not None and rid not in found:
                    found[rid] = str(rec.get("code"))
            if len(found) < len(wanted):
                time.sleep(2.0)
        return [Refusal(name, rid, exp, found.get(rid)) for rid, (name, exp) in wanted.items()]


def _req(kind: str, **fields: Any) -> dict[str, Any]:
    return {"v": 1, "kind": kind, "request_id": _rid(), **fields}


def _dialog_failed(admin: Deployment, topic: str, handle: str) -> str | None:
    """`DIALOG_FAILED` once mallory's queue holds the validation Error for `handle` and not the
    body that broke it; ``enqueued`` when the body is there; None while neither is."""
    seen: list[str] = []

    def one(m: Any) -> None:
        rec = parse_queue_record(m.value())
        if isinstance(rec, QueueMessage) and rec.conversation_handle == handle:
            if rec.message_body == BAD_BODY.encode():
                seen.append("enqueued")
            elif (
                rec.message_type_name == ERROR
                and str(VALIDATION_ERROR) in rec.message_body.decode()
            ):
                seen.append(DIALOG_FAILED)

    c = kafka.consumer(admin)
    try:
        kafka.read_to_end(c, topic, one, timeout_s=30)
    finally:
        c.close()
    if "enqueued" in seen:
        return "enqueued"
    return DIALOG_FAILED if seen else None


def _error_records(admin: Deployment, prefix: str) -> list[dict[str, Any]]:
    """Every record of A's errors topics (the shared one and each principal's)."""
    out: list[dict[str, Any]] = []
    topics = [
        t
        for t in kafka.admin(admin).list_topics(timeout=30).topics
        if t == prefix or t.startswith(prefix + ".")
    ]
    c = kafka.consumer(admin)
    try:
        for topic in topics:
            kafka.read_to_end(c, topic, lambda m: out.append(_json(m.value())), timeout_s=30)
    finally:
        c.close()
    return out


def _json(raw: bytes | None) -> dict[str, Any]:
    try:
        value = json.loads(raw or b"{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
