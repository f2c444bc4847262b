"""Regression tests for what the reference model (tests/model) found the engine doing differently.

Each test drives the engine through its public API only (requests in, `Outputs` and endpoint
states out) and names the rule it holds the engine to.
"""

from __future__ import annotations

from typing import Any

import pytest

from ksb.catalog.model import CatalogView, parse_catalog
from ksb.dialog.engine import Engine
from ksb.dialog.outputs import Outputs
from ksb.wire.protocol import (
    Action,
    BeginRequest,
    CommitRequest,
    EndRequest,
    QueueMessage,
    SendRequest,
)

CATALOG: dict[str, Any] = {
    "contracts": [{"name": "C", "messages": [{"type": "DEFAULT", "sent_by": "ANY"}]}],
    "queues": [{"name": "IQ"}, {"name": "TQ"}],
    "services": [
        {"name": "Init", "queue": "IQ"},
        {"name": "Tgt", "queue": "TQ", "contracts": ["C"]},
    ],
}


@pytest.fixture
def engine() -> Engine:
    return Engine(CatalogView(parse_catalog(CATALOG)), instance="u", max_body_bytes=100)


def _begin(engine: Engine, handle: str) -> None:
    out = engine.handle(
        BeginRequest(
            kind="begin", handle=handle, from_service="Init", to_service="Tgt", contract="C"
        ),
        0,
    )
    assert not out.errors


def _commit(engine: Engine, *actions: Action) -> Outputs:
    return engine.handle(CommitRequest(kind="commit", actions=actions), 1)


def _messages(out: Outputs) -> list[QueueMessage]:
    return [w.value for w in out.queue if isinstance(w.value, QueueMessage)]


@pytest.mark.parametrize(
    "then",
    [
        SendRequest(kind="send", handles=("h",), body="x"),
        EndRequest(kind="end", handle="h", cleanup=True),
        EndRequest(kind="end", handle="h"),
    ],
    ids=["send", "end-with-cleanup", "end"],
)
def test_an_action_on_an_endpoint_an_earlier_action_of_the_same_commit_closed_is_refused(
    engine: Engine, then: Action
) -> None:
    """An initiator that never sent closes at its END; within the same commit it is then as
    unknown as any CLOSED endpoint, and the whole commit is refused."""
    _begin(engine, "h")
    out = _commit(engine, EndRequest(kind="end", handle="h"), then)
    assert [e.code for e in out.errors] == ["unknown_conversation"]
    assert engine.endpoints["h"].state.name == "STARTED_OUTBOUND"  # nothing of it happened
    assert not out.endpoints and not _messages(out)
