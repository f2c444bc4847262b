"""The chaos harness's hostile volley, without Kafka: each record is what its class says, and each
one that parses at all reaches the check that must refuse it."""

from __future__ import annotations

import json

import pytest

from devtools.chaos.hostile import (
    MALLORY,
    MALLORY_PRINCIPAL,
    Volley,
    is_hostile_endpoint,
    mallory_catalog_part,
)
from devtools.chaos.topology import _with_mallory
from devtools.chaos.workload import INITIATOR, catalogs
from devtools.deployment import Deployment
from ksb.dialog.sources import KINDS, Source
from ksb.errors import ProtocolError
from ksb.wire.protocol import parse_request


def _volley() -> Volley:
    a = Deployment.model_validate({"instance": "ha"})
    b = Deployment.model_validate({"instance": "hb"})
    v = Volley(a, b, "hf", handles=["victim"])
    v._application_records("ksb.ha.requests.mallory", "h1")
    v._peer_records("ksb.ha.inbound.hb")
    return v


def test_every_class_has_a_record_of_its_own_and_the_codes_that_refuse_it() -> None:
    v = _volley()
    names = [r[0] for r in v.records]
    assert len(names) == len(set(names)) == 16
    assert len({r[1] for r in v.records}) == 16  # one request id each
    assert all(r[2] for r in v.records)


def test_each_record_that_parses_is_of_a_kind_its_source_may_not_send_or_is_checked_later() -> None:
    for name, rid, expected, topic, raw, _key in _volley().records:
        if "malformed_record" in expected:
            with pytest.raises(ProtocolError):
                parse_request(raw)
            assert rid.encode() in raw[:512]  # found by the refusal's copy of the record
            continue
        req = parse_request(raw)
        assert req.request_id == rid, name
        source = Source.PEER if ".inbound." in topic else Source.APPLICATION
        if "kind_not_allowed" in expected:
            assert req.kind not in KINDS[source], name
        else:
            assert req.kind in KINDS[source], name


def test_mallory_owns_only_its_own_service_and_its_dialogs_are_left_out_of_the_drain() -> None:
    ca, _cb, _cf = catalogs("ha", "hb", "hf", 2)
    cat = _with_mallory(ca)
    grants = [g for g in cat.grants if g.principal == MALLORY_PRINCIPAL]
    assert {(g.permission, g.target) for g in grants} == {
        (g["permission"], g["target"]) for g in mallory_catalog_part()["grants"]
    }
    assert MALLORY in {s.name for s in cat.services}
    assert is_hostile_endpoint({"local_service": INITIATOR, "remote_service": MALLORY})
    assert not is_hostile_endpoint(json.loads('{"local_service": "//chaos/Initiator"}'))
