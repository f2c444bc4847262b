"""When a dispatcher pool's assignment is done (`devtools.dispatchers.shares_settled`): every
shard owned once, and each member at its fair share, as the shard assignor hands them out."""

from __future__ import annotations

from devtools.dispatchers import shares_settled


def test_fair_shares_of_every_shard_are_settled() -> None:
    assert shares_settled({"d1": {0, 1}, "d2": {2, 3}, "d3": {4, 5}, "d4": {6, 7}}, 8)
    assert shares_settled({"d1": {0, 1, 2}, "d2": {3, 4, 5}, "d3": {6, 7}}, 8)


def test_a_member_still_over_its_share_is_not() -> None:
    """The start of a `make bench` 4-dispatcher run: every shard owned, mid-move."""
    assert not shares_settled({"d1": {0, 1, 2, 3}, "d2": {7}, "d3": {4, 5}, "d4": {6}}, 8)


def test_a_shard_without_an_owner_or_with_two_is_not() -> None:
    assert not shares_settled({"d1": {0, 1}, "d2": {2}}, 4)
    assert not shares_settled({"d1": {0, 1}, "d2": {1, 2, 3}}, 4)


def test_an_empty_member_is_not_unless_members_outnumber_shards() -> None:
    assert not shares_settled({"d1": {0, 1}, "d2": set()}, 2)
    assert shares_settled({"d1": {0}, "d2": {1}, "d3": set()}, 2)
