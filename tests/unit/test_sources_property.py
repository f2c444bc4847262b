"""Property: no record kind from any source reaches a rule unless that source may send it.

Every request kind the wire protocol has, from every source a topic can name (an application's
requests topic, the operator's, the queue service's, a peer's ``inbound.<peer>``, the shared topic
of an unsecured stack, a service that sends nothing), with any principal: a kind the source may
not send (`ksb.dialog.sources.KINDS`) is refused ``kind_not_allowed`` and no rule runs (every rule
the engine dispatches to is replaced by a spy), and the engine's state is as before. A kind the
source may send reaches exactly its one rule.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ksb.catalog.model import CatalogView, parse_catalog
from ksb.dialog import engine as engine_module
from ksb.dialog import receipts
from ksb.dialog.engine import Engine
from ksb.dialog.sources import KINDS, Source
from ksb.wire.protocol import (
    AnyRequest,
    BeginRequest,
    CommitRequest,
    DeadLetterRequest,
    EndRequest,
    FenceRequest,
    QueueMessage,
    ReplayRequest,
    SendRequest,
    TimerRequest,
)
from tests.unit.test_engine_remote import _from_a

CATALOG: dict[str, Any] = {
    "message_types": [{"name": "Req"}],
    "contracts": [{"name": "C", "messages": [{"type": "Req", "sent_by": "ANY"}]}],
    "queues": [{"name": "IQ"}, {"name": "TQ"}],
    "services": [
        {"name": "Init", "queue": "IQ"},
        {"name": "Tgt", "queue": "TQ", "contracts": ["C"]},
    ],
}


def _engine() -> Engine:
    return Engine(CatalogView(parse_catalog(CATALOG)), instance="u", max_body_bytes=1000)


def _a_queued_message() -> QueueMessage:
    e = _engine()
    e.handle(BeginRequest(handle="h", from_service="Init", to_service="Tgt", contract="C"), 0)
    out = e.handle(SendRequest(handles=("h",), message_type="Req", body="{}"), 0)
    return next(w.value for w in out.queue if isinstance(w.value, QueueMessage))


MESSAGE = _a_queued_message()
SAMPLES: dict[str, AnyRequest] = {
    "begin": BeginRequest(handle="h2", from_service="Init", to_service="Tgt", contract="C"),
    "send": SendRequest(handles=("h",), message_type="Req", body="{}"),
    "end": EndRequest(handle="h"),
    "timer": TimerRequest(handle="h", timeout_s=1),
    "commit": CommitRequest(),
    "dead_letter": DeadLetterRequest(message=MESSAGE, reason="r"),
    "fence": FenceRequest(queue="TQ", group="g", below=1),
    "replay": ReplayRequest(queue="TQ", message_id=MESSAGE.message_id, offset=0),
    "inbound": _from_a(0, "Req", "{}", to_instance="u"),
}
"""One request of every kind the dispatcher applies (fragments are joined into ``inbound``
before they are checked, and relayed records are checked where they were first read)."""

RULES = ("_commit", "apply_action")
MODULE_RULES = ("dead_letter", "replay", "inbound")


def test_every_kind_of_the_protocol_has_a_sample() -> None:
    every = set().union(*KINDS.values())
    assert every == set(SAMPLES)


@pytest.fixture(scope="module")
def spied() -> Any:
    """The engine's rules replaced by spies that record what reached them."""
    reached: list[str] = []
    patch = pytest.MonkeyPatch()
    for name in RULES:
        patch.setattr(Engine, name, lambda self, *a, _n=name, **kw: reached.append(_n))
    for name in MODULE_RULES:
        patch.setattr(engine_module, name, lambda *a, _n=name, **kw: reached.append(_n))
    patch.setattr(receipts, "fence", lambda *a, **kw: reached.append("fence"))
    yield reached
    patch.undo()


def _state(e: Engine) -> str:
    return json.dumps(
        [sorted(e.endpoints), sorted(e.waiting), e.last_order], default=str, sort_keys=True
    )


@settings(max_examples=300, deadline=None)
@given(
    source=st.sampled_from(list(Source)),
    kind=st.sampled_from(sorted(SAMPLES)),
    principal=st.one_of(st.none(), st.text(min_size=1, max_size=20)),
)
def test_a_kind_reaches_its_rule_only_from_a_source_that_may_send_it(
    spied: list[str], source: Source, kind: str, principal: str | None
) -> None:
    e = _engine()
    e.handle(BeginRequest(handle="h", from_service="Init", to_service="Tgt", contract="C"), 0)
    before = _state(e)
    spied.clear()
    out = e.handle(SAMPLES[kind], 1, principal=principal, source=source)
    if kind in KINDS[source]:
        assert len(spied) == 1, (source, kind, spied)
    else:
        assert spied == [], (source, kind, spied)
        assert [x.code for x in out.errors] == ["kind_not_allowed"]
        assert not out.queue and not out.transmissions and not out.acks
        assert _state(e) == before
