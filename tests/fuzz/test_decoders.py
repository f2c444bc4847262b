"""Every decoder of outside input either decodes it or refuses it with a named KsbError, in bounded time.

The contract (`tests.fuzz.contract`) is checked over real records mutated by hypothesis
(`tests.fuzz.strategies`); `make test` runs a few hundred inputs per decoder, `make fuzz` 10,000.
A few properties of what does decode are checked too: fragments of any message join back into it
whatever their order, and endpoint records read back as they were written, with their types.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import msgspec
import yaml
from hypothesis import strategies as st

from ksb.catalog.model import parse_catalog
from ksb.settings import PREFIX
from ksb.wire.endpoint import Endpoint, State, decode_endpoint, encode_endpoint
from ksb.wire.fragments import Reassembler, wire_records
from ksb.wire.protocol import FragmentRecord, InboundMessage, parse_inbound
from tests.fuzz import corpus
from tests.fuzz.conftest import Budget
from tests.fuzz.contract import check
from tests.fuzz.strategies import (
    json_values,
    mutated_json,
    mutated_text,
    record_bytes,
    tricky_values,
)
from tests.fuzz.targets import (
    run_bcn,
    run_catalog_yaml,
    run_ddl,
    run_endpoint,
    run_fragments,
    run_inbound,
    run_queue_record,
    run_request,
    run_settings,
)


def test_request_records_decode_or_are_refused_with_a_named_error(budget: Budget) -> None:
    budget.run("request", record_bytes(corpus.request_records) | st.none(), run_request)


def test_inbound_records_decode_or_are_refused_with_a_named_error(budget: Budget) -> None:
    budget.run("inbound", record_bytes(corpus.inbound_records) | st.none(), run_inbound)


@st.composite
def _fragment_stream(draw: st.DrawFn) -> list[bytes]:
    """Real fragment records, some mutated, shuffled and repeated, sometimes with other records."""
    real = draw(st.sampled_from(corpus.fragment_streams()))
    seeds = [json.loads(r) for r in real]
    records = [
        draw(
            st.sampled_from([r])
            | mutated_json(seeds, max_mutations=2).map(lambda v: json.dumps(v).encode())
        )
        for r in real
    ]
    records += draw(st.lists(st.sampled_from(records) | record_bytes(lambda: real), max_size=3))
    return draw(st.permutations(records))


def test_fragment_streams_join_or_are_refused_with_a_named_error(budget: Budget) -> None:
    budget.run("fragments", _fragment_stream(), run_fragments)


def test_queue_records_decode_or_are_refused_with_a_named_error(budget: Budget) -> None:
    budget.run("queue_record", record_bytes(corpus.queue_records) | st.none(), run_queue_record)


def test_endpoint_records_decode_with_their_types_or_are_refused(budget: Budget) -> None:
    budget.run("endpoint", record_bytes(corpus.endpoint_records), run_endpoint)


_names = st.text(min_size=1, max_size=12)
_endpoints = st.builds(
    Endpoint,
    handle=_names,
    conversation_id=_names,
    is_initiator=st.booleans(),
    state=st.sampled_from(State),
    local_service=_names,
    remote_service=_names,
    contract=_names,
    queue=_names,
    group=_names,
    priority=st.integers(1, 10),
    far_handle=st.none() | _names,
    created_ms=st.integers(0, 2**53),
    updated_ms=st.integers(0, 2**53),
    send_seq=st.integers(0, 2**31),
    lifetime_deadline_ms=st.none() | st.integers(0, 2**53),
    timer_deadline_ms=st.none() | st.integers(0, 2**53),
    outstanding=st.integers(0, 2**31),
    error_code=st.none() | st.integers(-(2**31), 2**31),
    error_description=st.none() | st.text(max_size=20),
    far_instance=st.none() | _names,
    recv_seq=st.integers(0, 2**31),
)


def test_endpoint_records_read_back_as_written(budget: Budget) -> None:
    def prop(ep: Endpoint) -> None:
        assert decode_endpoint(encode_endpoint(ep)) == ep

    budget.run("endpoint_round_trip", _endpoints, prop)


def test_bcn_records_decode_or_are_refused_with_a_named_error(budget: Budget) -> None:
    budget.run("bcn", record_bytes(corpus.bcn_records) | st.none(), run_bcn)


@st.composite
def _message_in_pieces(draw: st.DrawFn) -> tuple[InboundMessage, list[FragmentRecord]]:
    base = parse_inbound(corpus.inbound_records()[0])
    assert isinstance(base, InboundMessage)
    body = draw(st.text(max_size=3000) | st.binary(max_size=3000))
    fields = (
        {"body": body, "body_b64": None}
        if isinstance(body, str)
        else {"body": None, "body_b64": base64.b64encode(body).decode()}
    )
    msg = msgspec.structs.replace(base, **fields)
    pieces = [parse_inbound(r) for r in wire_records(msg, draw(st.integers(1024, 4096)))]
    frags = [p for p in pieces if isinstance(p, FragmentRecord)]
    again = draw(st.lists(st.sampled_from(frags), max_size=3)) if frags else []
    return msg, draw(st.permutations(frags + again))


def test_fragments_of_any_message_join_back_into_it_in_any_order(budget: Budget) -> None:
    def prop(case: tuple[InboundMessage, list[FragmentRecord]]) -> None:
        msg, frags = case
        if not frags:  # small enough to travel whole
            return
        joiner = Reassembler()
        joined = [m for m in (joiner.offer(f, 0) for f in frags) if m is not None]
        assert joined[:1] == [msg] and len(joiner) <= 1

    budget.run("fragments_join", _message_in_pieces(), prop)


def _catalog_seeds() -> list[Any]:
    return [yaml.safe_load(text) for text in corpus.catalog_texts()]


@st.composite
def _catalog_file(draw: st.DrawFn) -> bytes:
    how = draw(st.sampled_from(["structure", "text", "bytes"]))
    if how == "structure":
        return yaml.safe_dump(draw(mutated_json(_catalog_seeds(), max_mutations=6))).encode()
    if how == "text":
        texts = [t.decode() for t in corpus.catalog_texts()]
        return draw(mutated_text(lambda: texts)).encode("utf-8", "surrogatepass")
    return draw(st.binary(max_size=200))


def test_catalog_files_load_or_are_refused_with_a_named_error(budget: Budget) -> None:
    budget.run("catalog_yaml", _catalog_file(), run_catalog_yaml)


def test_catalog_records_parse_or_are_refused_with_a_named_error(budget: Budget) -> None:
    """The catalog topic's records, once JSON-decoded: every service parses them on each change."""

    def prop(data: Any) -> None:
        check(lambda: parse_catalog(data), what="parse_catalog")

    budget.run("catalog_mapping", mutated_json(_catalog_seeds(), max_mutations=6), prop)


def test_ddl_scripts_parse_or_are_refused_with_a_named_error(budget: Budget) -> None:
    texts = st.one_of(
        mutated_text(corpus.ddl_texts),
        mutated_text(corpus.ddl_texts),
        st.text(max_size=200),
    )
    budget.run("ddl", texts, run_ddl)


@st.composite
def _environment(draw: st.DrawFn) -> dict[str, str]:
    env = dict(draw(st.sampled_from(corpus.environments())))
    known = sorted({k for e in corpus.environments() for k in e})
    values = st.text(max_size=30) | tricky_values.map(str) | json_values.map(json.dumps)
    for _ in range(draw(st.integers(0, 4))):
        op = draw(st.sampled_from(["set", "unknown", "drop"]))
        if op == "set":
            env[draw(st.sampled_from(known))] = draw(values)
        elif op == "unknown":
            env[PREFIX + draw(st.text(max_size=10))] = draw(values)
        elif env:
            del env[draw(st.sampled_from(sorted(env)))]
    return env


def test_settings_from_any_environment_load_or_are_refused_with_a_named_error(
    budget: Budget,
) -> None:
    budget.run("settings", _environment(), run_settings)
