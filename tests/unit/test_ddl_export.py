"""`ksb catalog export --sql`: the script, applied to an empty catalog, gives the catalog back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ksb.catalog.ddl import parse
from ksb.catalog.ddl_apply import apply_script
from ksb.catalog.ddl_export import export_sql
from ksb.catalog.model import Catalog, load_catalog_file, parse_catalog
from ksb.errors import DdlError

ROOT = Path(__file__).parents[2]
XSD = (
    "<?xml version='1.0' encoding='UTF-16'?>\n"
    "<xsd:schema xmlns:xsd='http://www.w3.org/2001/XMLSchema'>\n"
    "  <xsd:element name='note' type='xsd:string'/>\n"
    "</xsd:schema>"
)


def round_trip(catalog: Catalog) -> Catalog:
    return apply_script(Catalog(), parse(export_sql(catalog)))


@pytest.mark.parametrize("name", ["catalog.yaml", "catalog-b.yaml"])
def test_demo_catalogs_round_trip(name: str) -> None:
    catalog = load_catalog_file(ROOT / "infra" / "demo" / name)
    assert round_trip(catalog) == catalog


def test_script_shape_uses_brackets_literals_and_extensions() -> None:
    catalog = parse_catalog(
        {
            "xml_schema_collections": [{"name": "Notes", "xsd": XSD}],
            "message_types": [
                {"name": "it's]", "validation": "VALID_XML", "xml_schema_collection": "Notes"}
            ],
            "contracts": [{"name": "C", "messages": [{"type": "it's]", "sent_by": "ANY"}]}],
            "queues": [
                {
                    "name": "Q",
                    "partitions": 3,
                    "activation": {"status": "ON", "command": "run 'it'", "execute_as": "bob"},
                    "dead_letter": {"max_rollbacks": 2},
                }
            ],
            "services": [{"name": "S", "queue": "Q", "contracts": ["C"]}],
            "routes": [
                {
                    "name": "R",
                    "service_name": "far",
                    "broker_instance": "b",
                    "address": "k:9092",
                    "via": "hop",
                    "lifetime_s": 5,
                }
            ],
            "grants": [{"permission": "RECEIVE", "target": "Q", "principal": "app"}],
            "honor_broker_priority": False,
        }
    )
    script = export_sql(catalog, header="version 3\nof demo")
    assert script.splitlines()[:3] == [
        "-- version 3",
        "-- of demo",
        "ALTER DATABASE CURRENT SET HONOR_BROKER_PRIORITY OFF;",
    ]
    assert (
        "CREATE MESSAGE TYPE [it's]]] VALIDATION = VALID_XML WITH SCHEMA COLLECTION [Notes];"
        in (script)
    )
    assert "COMMAND = N'run ''it''', MAX_QUEUE_READERS = 1, EXECUTE AS N'bob'" in script
    assert "DEAD_LETTER (MAX_ROLLBACKS = 2, ERROR_CODE = -1)" in script
    assert "LIFETIME = 5, ADDRESS = N'k:9092', VIA = N'hop'" in script
    assert "GRANT RECEIVE ON OBJECT::[Q] TO [app];" in script
    assert round_trip(catalog) == catalog


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"event_notifications": [{"name": "n", "queue": "Q"}]}, "event_notifications"),
        ({"sla_targets_ms": {10: 50}}, "sla_targets_ms"),
    ],
)
def test_parts_without_a_ddl_form_are_refused_not_dropped(
    extra: dict[str, Any], named: str
) -> None:
    catalog = parse_catalog({"queues": [{"name": "Q"}], **extra})
    with pytest.raises(DdlError, match=f"{named}, which have no DDL form"):
        export_sql(catalog)


# --- generated catalogs --------------------------------------------------------------------------

# Names may hold the characters T-SQL quoting has to get right.
_NAME = st.text(alphabet="abcXYZ019/:_-.]' [", min_size=1, max_size=12).filter(
    lambda n: n.strip() == n and n.upper() not in {"ANY", "DEFAULT"}
)
_QUEUE = st.from_regex(r"[A-Za-z0-9_.-]{1,10}", fullmatch=True)
_USER = st.one_of(st.sampled_from(["SELF", "OWNER"]), _NAME)
_ON_OFF = st.sampled_from(["ON", "OFF"])


@st.composite
def catalogs(draw: st.DrawFn) -> Catalog:
    """A valid catalog whose parts all have a DDL form: every reference resolves."""
    collections = draw(st.lists(_NAME, max_size=2, unique=True))
    type_names = draw(st.lists(_NAME, min_size=1, max_size=4, unique=True))
    message_types = []
    for name in type_names:
        kind = draw(
            st.sampled_from(
                ["NONE", "EMPTY", "WELL_FORMED_XML", "WELL_FORMED_JSON"] * 2
                + ["SCHEMA", "VALID_XML"]
            )
        )
        entry: dict[str, Any] = {"name": name, "validation": kind}
        if kind == "SCHEMA":
            entry["schema"] = {"type": draw(st.sampled_from(["object", "string"]))}
        if kind == "VALID_XML":
            if not collections:
                entry["validation"] = "NONE"
            else:
                entry["xml_schema_collection"] = draw(st.sampled_from(collections))
        message_types.append(entry)
    contracts = []
    for name in draw(st.lists(_NAME, max_size=3, unique=True)):
        types = draw(
            st.lists(st.sampled_from([*type_names, "DEFAULT"]), min_size=1, max_size=3, unique=True)
        )
        sent_by = [draw(st.sampled_from(["INITIATOR", "TARGET", "ANY"])) for _ in types]
        sent_by[0] = draw(st.sampled_from(["INITIATOR", "ANY"]))
        contracts.append(
            {
                "name": name,
                "messages": [
                    {"type": t, "sent_by": s} for t, s in zip(types, sent_by, strict=True)
                ],
            }
        )
    queue_names = draw(st.lists(_QUEUE, min_size=1, max_size=3, unique=True))
    queues = []
    for name in queue_names:
        program = draw(st.sampled_from(["procedure", "command", None]))
        activation: dict[str, Any] = {
            "status": "ON" if program else "OFF",
            "max_queue_readers": draw(st.integers(0, 32767)),
            "execute_as": draw(_USER),
        }
        if program:
            activation[program] = draw(_NAME)
        queue: dict[str, Any] = {
            "name": name,
            "status": draw(_ON_OFF),
            "retention": draw(_ON_OFF),
            "partitions": draw(st.integers(1, 64)),
            "poison_message_handling": draw(_ON_OFF),
            "activation": draw(st.sampled_from([activation, {}])),
        }
        if draw(st.booleans()):
            queue["dead_letter"] = {
                "max_rollbacks": draw(st.integers(1, 9)),
                "error_code": draw(st.integers(-9, 9)),
            }
        queues.append(queue)
    contract_names = [c["name"] for c in contracts] + ["DEFAULT"]
    services = [
        {
            "name": name,
            "queue": draw(st.sampled_from(queue_names)),
            "contracts": draw(st.lists(st.sampled_from(contract_names), max_size=2, unique=True)),
        }
        for name in draw(st.lists(_NAME, max_size=3, unique=True))
    ]
    routes = [
        {
            "name": name,
            "service_name": draw(_NAME),
            "broker_instance": draw(_QUEUE),
            "address": draw(st.sampled_from(["LOCAL", "k1:9092", "k1:9092,k2:9093"])),
            "lifetime_s": draw(st.none() | st.integers(1, 10**6)),
            "via": draw(st.none() | _QUEUE),
        }
        for name in draw(st.lists(_NAME, max_size=2, unique=True))
    ]
    criteria = st.tuples(*(st.one_of(st.just("ANY"), _NAME) for _ in range(3)))
    picked = draw(st.lists(criteria, max_size=3, unique=True))
    priorities = [
        {
            "name": f"p{i}",
            "contract": c,
            "local_service": local,
            "remote_service": r,
            "level": draw(st.integers(1, 10)),
        }
        for i, (c, local, r) in enumerate(picked)
    ]
    targets = [("SEND", s["name"]) for s in services] + [("RECEIVE", q) for q in queue_names]
    chosen = draw(st.lists(st.tuples(st.sampled_from(targets), _NAME), max_size=4, unique=True))
    grants = [{"permission": p, "target": t, "principal": who} for (p, t), who in chosen]
    return parse_catalog(
        {
            "xml_schema_collections": [{"name": n, "xsd": XSD} for n in collections],
            "message_types": message_types,
            "contracts": contracts,
            "queues": queues,
            "services": services,
            "routes": routes,
            "priorities": priorities,
            "grants": grants,
            "honor_broker_priority": draw(st.booleans()),
        }
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(catalogs())
def test_export_parse_apply_gives_the_catalog_back(catalog: Catalog) -> None:
    assert round_trip(catalog) == catalog
