"""Conversation priorities: which rule sets the level of a new conversation endpoint.

Matching is pure and tiny on purpose: the dispatcher runs it once per endpoint, when the endpoint
is created, and the endpoint keeps that level until the conversation ends. A rule edited later
therefore never touches live conversations, so nothing here needs to be reactive.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Final

from pydantic import BaseModel, ConfigDict, Field

from ksb.errors import CatalogError

__all__ = [
    "ANY",
    "DEFAULT_LEVEL",
    "MAX_LEVEL",
    "MIN_LEVEL",
    "PRECEDENCE",
    "BrokerPriority",
    "PriorityTable",
    "endpoint_levels",
    "match_level",
    "match_rule",
]

ANY: Final = "ANY"
DEFAULT_LEVEL: Final = 5
MIN_LEVEL: Final = 1
MAX_LEVEL: Final = 10

_Name = Annotated[str, Field(min_length=1)]
_Criteria = tuple[str, str, str]

# One row per step of the search, most specific first. Each flag says whether that position of
# the rule must equal the endpoint's own name (True) or must be the ANY wildcard (False). Keeping
# the order as data means the table can be read against the Service Broker docs line by line.
PRECEDENCE: Final[tuple[tuple[bool, bool, bool], ...]] = (
    (True, True, True),
    (True, True, False),
    (True, False, True),
    (True, False, False),
    (False, True, True),
    (False, True, False),
    (False, False, True),
    (False, False, False),
)


class BrokerPriority(BaseModel):
    """One CREATE BROKER PRIORITY rule; frozen so a table built from it can never go stale.

    Names compare exactly (case-sensitive) because Service Broker names are binary-compared;
    the literal `ANY` is the wildcard.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: _Name
    contract: _Name = ANY
    local_service: _Name = ANY
    remote_service: _Name = ANY
    level: Annotated[int, Field(ge=MIN_LEVEL, le=MAX_LEVEL, strict=True)] = DEFAULT_LEVEL

    @property
    def criteria(self) -> _Criteria:
        """The key a rule is indexed under; two rules may not share it, or matching is a tie."""
        return (self.contract, self.local_service, self.remote_service)


def _probe(row: tuple[bool, bool, bool], endpoint: _Criteria) -> _Criteria:
    """The exact rule key that one precedence row would accept for this endpoint."""
    contract, local, remote = (
        name if exact else ANY for exact, name in zip(row, endpoint, strict=True)
    )
    return (contract, local, remote)


class PriorityTable:
    """Rules indexed by their criteria, so a lookup is at most eight dict probes.

    Building refuses duplicate names and duplicate criteria: either would make the winner depend
    on the order rules happened to be loaded in, which a restart could change.
    """

    __slots__ = ("_by_criteria", "_rules")

    def __init__(self, rules: Iterable[BrokerPriority] = ()) -> None:
        self._rules = tuple(rules)
        self._by_criteria: dict[_Criteria, BrokerPriority] = {}
        names: set[str] = set()
        for rule in self._rules:
            self._add(rule, names)

    def _add(self, rule: BrokerPriority, names: set[str]) -> None:
        if rule.name in names:
            raise CatalogError(f"duplicate broker priority name {rule.name!r}")
        clash = self._by_criteria.get(rule.criteria)
        if clash is not None:
            raise CatalogError(
                f"broker priority {rule.name!r} has the same contract and services as "
                f"{clash.name!r}"
            )
        names.add(rule.name)
        self._by_criteria[rule.criteria] = rule

    @property
    def rules(self) -> tuple[BrokerPriority, ...]:
        """The rules in load order, for listing them back to an operator."""
        return self._rules

    def rule(self, contract: str, local_service: str, remote_service: str) -> BrokerPriority | None:
        """The most specific applicable rule, or None when the default level applies."""
        endpoint = (contract, local_service, remote_service)
        for row in PRECEDENCE:
            found = self._by_criteria.get(_probe(row, endpoint))
            if found is not None:
                return found
        return None

    def level(self, contract: str, local_service: str, remote_service: str) -> int:
        """The level a new endpoint gets; 5 when no rule applies, as in an empty database."""
        found = self.rule(contract, local_service, remote_service)
        return DEFAULT_LEVEL if found is None else found.level


def match_rule(
    rules: Iterable[BrokerPriority], *, contract: str, local_service: str, remote_service: str
) -> BrokerPriority | None:
    """One-shot form of `PriorityTable.rule`; build a table instead when matching repeatedly."""
    return PriorityTable(rules).rule(contract, local_service, remote_service)


def match_level(
    rules: Iterable[BrokerPriority], *, contract: str, local_service: str, remote_service: str
) -> int:
    """One-shot form of `PriorityTable.level`; build a table instead when matching repeatedly."""
    return PriorityTable(rules).level(contract, local_service, remote_service)


def endpoint_levels(
    table: PriorityTable, *, contract: str, initiator_service: str, target_service: str
) -> tuple[int, int]:
    """(initiator level, target level) for one conversation.

    Each endpoint sees itself as local and its peer as remote, and levels are never sent across,
    so the two ends are matched independently and may differ.
    """
    initiator = table.level(contract, initiator_service, target_service)
    target = table.level(contract, target_service, initiator_service)
    return (initiator, target)
