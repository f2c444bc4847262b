"""Real records to start fuzzing from: what KSB itself writes and reads, made by KSB's own code.

Mutating real records reaches far deeper into a decoder than random bytes do (random bytes rarely
get past ``json.loads``), so both fuzzers start from these: the requests an SDK sends, the queue
records, endpoint records, commit outcomes and transmissions the engine writes, the fragments of
a large inbound message, a BCN, the demo catalogs, the DDL scripts of the tests, and the
environment a deployment hands its services. They are made by calling the code, not copied into
files, so they stay real when the wire codec changes.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import msgspec

from ksb.catalog.model import CatalogView, parse_catalog
from ksb.dialog.engine import Engine
from ksb.dialog.outputs import Outputs
from ksb.settings import (
    ActivatedTaskSettings,
    ActivationSettings,
    ClientSettings,
    CliSettings,
    DispatcherSettings,
    ExternalActivatorSettings,
    ForwarderSettings,
    KsbSettings,
    SparkSettings,
    TransmitterSettings,
    TransportSettings,
)
from ksb.wire.endpoint import encode_endpoint
from ksb.wire.fragments import wire_records
from ksb.wire.protocol import (
    AnyRequest,
    BeginRequest,
    BrokerNotification,
    CommitRequest,
    EndRequest,
    InboundMessage,
    QueueMessage,
    Receipt,
    SendRequest,
    TimerRequest,
    dumps,
)

__all__ = [
    "ROOT",
    "SETTINGS_MODELS",
    "bcn_records",
    "catalog_texts",
    "ddl_texts",
    "endpoint_records",
    "environments",
    "fragment_streams",
    "inbound_records",
    "queue_records",
    "request_records",
]

ROOT = Path(__file__).resolve().parents[2]

SETTINGS_MODELS: tuple[type[KsbSettings], ...] = (
    KsbSettings,
    ClientSettings,
    CliSettings,
    ActivatedTaskSettings,
    DispatcherSettings,
    TransmitterSettings,
    TransportSettings,
    ForwarderSettings,
    ActivationSettings,
    ExternalActivatorSettings,
    SparkSettings,
)

_CATALOG: dict[str, Any] = {
    "message_types": [
        {"name": "Req", "validation": "WELL_FORMED_JSON"},
        {"name": "Rep"},
        {
            "name": "Order",
            "validation": "SCHEMA",
            "schema": {"type": "object", "required": ["qty"]},
        },
    ],
    "contracts": [
        {
            "name": "C",
            "messages": [
                {"type": "Req", "sent_by": "INITIATOR"},
                {"type": "Order", "sent_by": "INITIATOR"},
                {"type": "Rep", "sent_by": "TARGET"},
            ],
        }
    ],
    "queues": [{"name": "IQ"}, {"name": "TQ", "partitions": 3, "retention": "ON"}],
    "services": [
        {"name": "Init", "queue": "IQ"},
        {"name": "Tgt", "queue": "TQ", "contracts": ["C"]},
    ],
    "routes": [{"name": "far", "service_name": "Far", "broker_instance": "other"}],
    "priorities": [{"name": "hi", "local_service": "Tgt", "level": 8}],
}


def _requests() -> list[AnyRequest]:
    return [
        BeginRequest(
            request_id="r-begin",
            handle="5d1c3a8e-0b7f-4c2a-9e61-3f2d8a4b7c10",
            from_service="Init",
            to_service="Tgt",
            contract="C",
            lifetime_s=600,
        ),
        BeginRequest(handle="far-1", from_service="Init", to_service="Far"),
        SendRequest(
            request_id="r-send",
            handles=("5d1c3a8e-0b7f-4c2a-9e61-3f2d8a4b7c10",),
            message_type="Req",
            body='{"hello": "kafka"}',
        ),
        SendRequest(handles=("far-1",), body_b64="AAEC/w=="),
        TimerRequest(handle="5d1c3a8e-0b7f-4c2a-9e61-3f2d8a4b7c10", timeout_s=1.5),
        EndRequest(
            handle="5d1c3a8e-0b7f-4c2a-9e61-3f2d8a4b7c10",
            error_code=42,
            error_description="boom",
        ),
    ]


@functools.cache
def _traffic() -> tuple[list[AnyRequest], Outputs]:
    """A short dialog run through the real engine: its requests and everything it wrote."""
    engine = Engine(CatalogView(parse_catalog(_CATALOG)), instance="fuzz", max_body_bytes=4096)
    requests = _requests()
    out = Outputs()
    for i, request in enumerate(requests[:4]):
        out.extend(engine.handle(request, 1_000 + i))
    msgs = [w.value for w in out.queue if isinstance(w.value, QueueMessage)]
    commit = CommitRequest(
        request_id="r-commit",
        reader="fuzz",
        receipt=Receipt(
            queue=msgs[0].queue,
            group=msgs[0].conversation_group_id,
            token=7,
            message_ids=(msgs[0].message_id,),
        ),
        actions=(
            SendRequest(handles=(msgs[0].conversation_handle,), message_type="Rep", body="ok"),
            EndRequest(handle=msgs[0].conversation_handle),
        ),
    )
    requests.append(commit)
    for i, request in enumerate([commit, *requests[4:]]):
        out.extend(engine.handle(request, 2_000 + i))
    out.extend(engine.tick(10_000_000))
    return requests, out


def request_records() -> list[bytes]:
    requests, out = _traffic()
    return [dumps(r) for r in requests] + [dumps(t) for t in out.transmissions]


def queue_records() -> list[bytes]:
    _, out = _traffic()
    return [dumps(w.value) for w in out.queue if w.value is not None]


def endpoint_records() -> list[bytes]:
    _, out = _traffic()
    return [encode_endpoint(ep) for ep in out.endpoints]


def inbound_records() -> list[bytes]:
    _, out = _traffic()
    return [dumps(t) for t in out.transmissions]


def _large_inbound() -> InboundMessage:
    _, out = _traffic()
    base = out.transmissions[0]
    return msgspec.structs.replace(base, body="é" * 700 + "x" * 900, body_b64=None)


def fragment_streams() -> list[list[bytes]]:
    """Fragment records of large messages, as the transport would send them."""
    large = _large_inbound()
    pieces = wire_records(large, 1024)
    return [pieces, list(reversed(pieces)), pieces + pieces[:1], inbound_records()]


def bcn_records() -> list[bytes]:
    return [
        dumps(
            BrokerNotification(
                event="start_failed",
                instance="orders",
                service="dispatcher",
                catalog_version=0,
                attempt=1,
                code="no_catalog",
                reason="no catalog applied to instance orders",
                at_ms=1_767_225_600_000,
            )
        ),
        dumps(
            BrokerNotification(
                event="started",
                instance="orders",
                service="dispatcher",
                catalog_version=3,
                attempt=1,
                at_ms=1,
            )
        ),
    ]


def catalog_texts() -> list[bytes]:
    return [p.read_bytes() for p in sorted((ROOT / "infra" / "demo").glob("catalog*.yaml"))]


def ddl_texts() -> list[str]:
    return [p.read_text() for p in sorted((ROOT / "tests" / "data" / "sql").glob("*.sql"))]


def environments() -> list[dict[str, str]]:
    """The ``KSB_*`` variables a deployment gives each service (every field set)."""
    out: list[dict[str, str]] = []
    for model in SETTINGS_MODELS:
        values = model().model_dump()
        out.append({f"KSB_{k.upper()}": str(v) for k, v in values.items() if v is not None})
    return out
