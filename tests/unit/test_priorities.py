"""Priority matching: the precedence table, the endpoint view of local/remote, rule validation."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from ksb.catalog.priorities import (
    ANY,
    DEFAULT_LEVEL,
    PRECEDENCE,
    BrokerPriority,
    PriorityTable,
    endpoint_levels,
    match_level,
    match_rule,
)
from ksb.errors import CatalogError

CONTRACT, LOCAL, REMOTE = "//shop/OrderContract", "OrderService", "ShippingService"


def _rule_for_row(index: int) -> BrokerPriority:
    """The rule that only precedence row `index` selects, at a level that identifies the row.

    Levels rise as precedence falls, so a matcher that picked the highest level would fail.
    """
    contract_exact, local_exact, remote_exact = PRECEDENCE[index]
    return BrokerPriority(
        name=f"row{index}",
        contract=CONTRACT if contract_exact else ANY,
        local_service=LOCAL if local_exact else ANY,
        remote_service=REMOTE if remote_exact else ANY,
        level=index + 1,
    )


def _decoys() -> list[BrokerPriority]:
    """Rules as specific as can be, but for some other contract or service: never applicable."""
    return [
        BrokerPriority(name="other-contract", contract="Other", level=10),
        BrokerPriority(name="other-local", local_service="Other", remote_service=REMOTE, level=10),
        BrokerPriority(name="other-remote", contract=CONTRACT, remote_service="Other", level=10),
        BrokerPriority(name="wrong-case", contract=CONTRACT.upper(), level=10),
    ]


def test_precedence_table_has_the_eight_documented_rows_in_order() -> None:
    assert PRECEDENCE == (
        (True, True, True),
        (True, True, False),
        (True, False, True),
        (True, False, False),
        (False, True, True),
        (False, True, False),
        (False, False, True),
        (False, False, False),
    )


@pytest.mark.parametrize("row", range(len(PRECEDENCE)))
def test_each_row_beats_every_lower_row(row: int) -> None:
    rules = [_rule_for_row(index) for index in range(row, len(PRECEDENCE))] + _decoys()
    winner = match_rule(rules, contract=CONTRACT, local_service=LOCAL, remote_service=REMOTE)
    assert winner == _rule_for_row(row)
    assert match_level(
        list(reversed(rules)), contract=CONTRACT, local_service=LOCAL, remote_service=REMOTE
    ) == (row + 1)


@pytest.mark.parametrize("rules", [[], _decoys()], ids=["no-rules", "only-decoys"])
def test_no_applicable_rule_gives_the_default_level(rules: list[BrokerPriority]) -> None:
    table = PriorityTable(rules)
    assert table.rule(CONTRACT, LOCAL, REMOTE) is None
    assert table.level(CONTRACT, LOCAL, REMOTE) == DEFAULT_LEVEL == 5


def test_separate_databases_each_cover_their_own_endpoint() -> None:
    orders_db = PriorityTable(
        [
            BrokerPriority(
                name="out", contract=CONTRACT, local_service=LOCAL, remote_service=REMOTE, level=3
            )
        ]
    )
    shipping_db = PriorityTable(
        [
            BrokerPriority(
                name="in", contract=CONTRACT, local_service=REMOTE, remote_service=LOCAL, level=3
            )
        ]
    )
    kwargs = {"contract": CONTRACT, "initiator_service": LOCAL, "target_service": REMOTE}
    assert endpoint_levels(orders_db, **kwargs) == (3, DEFAULT_LEVEL)
    assert endpoint_levels(shipping_db, **kwargs) == (DEFAULT_LEVEL, 3)


def test_one_contract_wide_rule_covers_both_endpoints_in_one_database() -> None:
    table = PriorityTable([BrokerPriority(name="orders", contract=CONTRACT, level=8)])
    assert endpoint_levels(
        table, contract=CONTRACT, initiator_service=LOCAL, target_service=REMOTE
    ) == (8, 8)


def test_two_rules_can_give_the_endpoints_different_levels() -> None:
    table = PriorityTable(
        [
            BrokerPriority(
                name="ini", contract=CONTRACT, local_service=LOCAL, remote_service=REMOTE, level=10
            ),
            BrokerPriority(
                name="tgt", contract=CONTRACT, local_service=REMOTE, remote_service=LOCAL, level=1
            ),
        ]
    )
    assert endpoint_levels(
        table, contract=CONTRACT, initiator_service=LOCAL, target_service=REMOTE
    ) == (10, 1)


def test_names_match_case_sensitively() -> None:
    table = PriorityTable([BrokerPriority(name="p", contract=CONTRACT, level=9)])
    assert table.level(CONTRACT.lower(), LOCAL, REMOTE) == DEFAULT_LEVEL


@pytest.mark.parametrize("level", [0, 11, -1])
def test_level_outside_one_to_ten_is_refused_naming_the_field(level: int) -> None:
    with pytest.raises(ValidationError, match="level"):
        BrokerPriority(name="p", level=level)


@pytest.mark.parametrize(
    "fields",
    [{"name": ""}, {"name": "p", "contract": ""}, {"name": "p", "levle": 3}],
    ids=["empty-name", "empty-contract", "unknown-field"],
)
def test_bad_rule_fields_are_refused(fields: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        BrokerPriority.model_validate(fields)


def test_rules_are_frozen() -> None:
    rule = BrokerPriority(name="p")
    with pytest.raises(ValidationError):
        setattr(rule, "level", 9)  # noqa: B010 - the point: assignment is refused


def test_table_refuses_duplicate_names_and_duplicate_criteria() -> None:
    with pytest.raises(CatalogError, match="'p'"):
        PriorityTable([BrokerPriority(name="p"), BrokerPriority(name="p", contract="x")])
    with pytest.raises(CatalogError, match="same contract and services"):
        PriorityTable([BrokerPriority(name="a", level=2), BrokerPriority(name="b", level=3)])


_CONTRACTS = ("c1", "c2")
_SERVICES = ("s1", "s2")
_rules = st.lists(
    st.builds(
        BrokerPriority,
        name=st.uuids().map(str),
        contract=st.sampled_from((*_CONTRACTS, ANY)),
        local_service=st.sampled_from((*_SERVICES, ANY)),
        remote_service=st.sampled_from((*_SERVICES, ANY)),
        level=st.integers(min_value=1, max_value=10),
    ),
    unique_by=lambda rule: rule.criteria,
    max_size=12,
)


def _most_specific(
    rules: list[BrokerPriority], endpoint: tuple[str, str, str]
) -> BrokerPriority | None:
    """Independent oracle: among applicable rules, an exact contract outranks anything the
    services do, then an exact local service, then an exact remote service."""
    applicable = [
        rule
        for rule in rules
        if all(want in (ANY, have) for want, have in zip(rule.criteria, endpoint, strict=True))
    ]
    if not applicable:
        return None
    return max(applicable, key=lambda rule: tuple(part != ANY for part in rule.criteria))


@given(
    rules=_rules,
    contract=st.sampled_from(_CONTRACTS),
    local=st.sampled_from(_SERVICES),
    remote=st.sampled_from(_SERVICES),
)
def test_winner_is_always_the_most_specific_applicable_rule(
    rules: list[BrokerPriority], contract: str, local: str, remote: str
) -> None:
    table = PriorityTable(rules)
    expected = _most_specific(rules, (contract, local, remote))
    assert table.rule(contract, local, remote) == expected
    expected_level = DEFAULT_LEVEL if expected is None else expected.level
    assert table.level(contract, local, remote) == expected_level


@given(rules=_rules, initiator=st.sampled_from(_SERVICES), target=st.sampled_from(_SERVICES))
def test_each_endpoint_sees_itself_as_local(
    rules: list[BrokerPriority], initiator: str, target: str
) -> None:
    table = PriorityTable(rules)
    levels = endpoint_levels(
        table, contract="c1", initiator_service=initiator, target_service=target
    )
    assert levels == (table.level("c1", initiator, target), table.level("c1", target, initiator))
