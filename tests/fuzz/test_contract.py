"""The fuzzers' judge: it passes what keeps the contract and catches each way of breaking it."""

from __future__ import annotations

import pytest

from ksb.errors import KsbError, ProtocolError
from tests.fuzz.contract import ContractViolation, check


def _refuse() -> None:
    raise ProtocolError("field x: required")


def _crash() -> None:
    raise KeyError("state")


def _mute() -> None:
    raise KsbError("  ")


def _spin() -> None:
    while True:
        pass


def test_a_value_or_a_named_error_keeps_the_contract() -> None:
    assert check(lambda: 42, what="ok").value == 42
    outcome = check(_refuse, what="refuse")
    assert isinstance(outcome.error, ProtocolError) and outcome.value is None


@pytest.mark.parametrize(
    ("decode", "words"),
    [
        (_crash, "raised builtins.KeyError instead of a KsbError"),
        (_mute, "with an empty reason"),
        (_spin, "used more than 0.2 s of CPU"),
    ],
    ids=["foreign-exception", "empty-reason", "runaway"],
)
def test_each_way_of_breaking_the_contract_is_caught(decode: object, words: str) -> None:
    assert callable(decode)
    with pytest.raises(ContractViolation, match=words):
        check(decode, what="decoder", limit_s=0.2)
