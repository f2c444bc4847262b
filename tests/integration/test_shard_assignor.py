"""KSB's partition assignor, the broker plugin in infra/kafka/assignor, placed alone: its `main`
prints where each shard goes given where each is now (`-1`: no owner) and the member count.

Its part in a real group (survivors keep their shards when a dispatcher dies, a new member takes
only shards others had over their share) is checked in `test_scale_out.py`.
"""

from __future__ import annotations

import subprocess

import pytest

from devtools.kafka_node import ASSIGNOR_JAR, java_binary, kafka_libs_dir

pytestmark = pytest.mark.integration


def place(current: list[int], members: int) -> list[int]:
    libs = kafka_libs_dir()
    out = subprocess.run(
        [
            java_binary(),
            "-cp",
            f"{libs / ASSIGNOR_JAR}:{libs}/*",
            "dev.ksb.kafka.StickyShardAssignor",
            ",".join(map(str, current)),
            str(members),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    line = out.stdout.strip()
    return [int(x) for x in line.split(",")] if line else []


def test_survivors_keep_their_shards_and_share_a_dead_members() -> None:
    # d1 held 0-1, d2 (dead) 2-3, d3 4-5; the survivors are members 0 and 1 now.
    assert place([0, 0, -1, -1, 1, 1], 2) == [0, 0, 0, 1, 1, 1]
    assert place([-1, -1, 0, 0, 1, 1], 2) == [0, 1, 0, 0, 1, 1]


def test_a_new_member_takes_only_what_others_hold_over_their_share() -> None:
    # Three members with 3, 3 and 2 of 8 shards; a fourth: each keeps 2, the fourth gets the rest.
    assert place([0, 0, 0, 1, 1, 1, 2, 2], 4) == [0, 0, 3, 1, 1, 3, 2, 2]


def test_every_shard_is_placed_evenly_from_nothing_and_with_more_members_than_shards() -> None:
    fresh = place([-1] * 8, 3)
    assert sorted(fresh.count(m) for m in range(3)) == [2, 3, 3]
    assert place([0, 0, 1, 1], 5) == [0, 2, 1, 3]  # one each; member 0 keeps one of its own
    assert place([], 3) == []


def test_shares_stay_even_when_one_member_held_everything() -> None:
    assert place([1, 1, 1, 1, 0, 0], 2) == [1, 1, 1, 0, 0, 0]
