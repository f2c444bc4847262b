"""Lock leases: what the queue service seals, only its key opens, and no byte of it may change;
and the dispatcher's rule that a receipt applies only under a lease granting it."""

from __future__ import annotations

import base64

import pytest

from ksb.dialog.leases import leased
from ksb.errors import ConversationError, LeaseInvalid, SecurityError
from ksb.security.leases import LeaseClaims, LeaseSeal
from ksb.wire.protocol import Receipt

KEY = b"k" * 32
CLAIMS = LeaseClaims(
    instance="i1",
    queue="Q",
    group="g1",
    token=7,
    principal="alice",
    holder="queue-1",
    received_ms=1_000,
    level=5,
)


def _receipt(lease: str | None, *, group: str = "g1", token: int = 0) -> Receipt:
    return Receipt(queue="Q", group=group, message_ids=("h:0",), token=token, lease=lease)


def test_a_sealed_lease_opens_to_its_claims_with_the_same_key() -> None:
    assert LeaseSeal(KEY).open(LeaseSeal(KEY).seal(CLAIMS)) == CLAIMS


@pytest.mark.parametrize(
    "forge",
    [
        lambda lease: LeaseSeal(b"x" * 32).seal(CLAIMS),  # another instance's key
        lambda lease: LeaseSeal(None).seal(CLAIMS),  # unsealed
        lambda lease: lease.replace(".", "..", 1),
        lambda lease: lease[:-2] + ("AA" if lease[-2:] != "AA" else "BB"),
        lambda lease: "not a lease",
    ],
)
def test_a_lease_not_sealed_by_this_key_or_changed_is_refused(forge: object) -> None:
    lease = LeaseSeal(KEY).seal(CLAIMS)
    with pytest.raises(LeaseInvalid):
        LeaseSeal(KEY).open(forge(lease))  # type: ignore[operator]


def test_raising_the_token_inside_a_lease_breaks_its_seal() -> None:
    head, _, mac = LeaseSeal(KEY).seal(CLAIMS).partition(".")
    payload = base64.urlsafe_b64decode(head + "=" * (-len(head) % 4))
    raised = payload.replace(b'"token":7', b'"token":4611686018427387904')
    forged = base64.urlsafe_b64encode(raised).rstrip(b"=").decode() + "." + mac
    with pytest.raises(LeaseInvalid, match="seal"):
        LeaseSeal(KEY).open(forged)


def test_a_short_key_is_refused() -> None:
    with pytest.raises(SecurityError):
        LeaseSeal(b"short")


def test_a_secured_receipt_fences_with_the_leases_token_not_its_own() -> None:
    seal = LeaseSeal(KEY)
    token, claims = leased(seal, "i1", "alice", _receipt(seal.seal(CLAIMS), token=2**62))
    assert (token, claims) == (7, CLAIMS)


@pytest.mark.parametrize(
    ("principal", "receipt", "why"),
    [
        ("alice", _receipt(None, token=2**62), "without a lease"),
        ("mallory", _receipt(LeaseSeal(KEY).seal(CLAIMS)), "granted to principal 'alice'"),
        ("alice", _receipt(LeaseSeal(KEY).seal(CLAIMS), group="g2"), "locks group g1"),
        ("alice", _receipt(LeaseSeal(b"x" * 32).seal(CLAIMS)), "not issued by this instance"),
    ],
)
def test_a_secured_receipt_without_its_own_lease_is_refused(
    principal: str, receipt: Receipt, why: str
) -> None:
    with pytest.raises(ConversationError, match=why) as refused:
        leased(LeaseSeal(KEY), "i1", principal, receipt)
    assert refused.value.code == "bad_lease"


def test_another_instances_lease_is_refused_even_with_the_same_key() -> None:
    with pytest.raises(ConversationError, match="instance 'i1'"):
        leased(LeaseSeal(KEY), "i2", "alice", _receipt(LeaseSeal(KEY).seal(CLAIMS)))


def test_without_security_the_receipts_own_token_counts() -> None:
    assert leased(LeaseSeal(None), "i1", None, _receipt(None, token=3)) == (3, None)
