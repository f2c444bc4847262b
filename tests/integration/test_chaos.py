"""`make chaos` in small: one round of the chaos harness, hit by every kind of fault.

The harness starts its own stack (it kills Kafka and Redis, so it must not touch the session's):
a round of 400 requests over 150 dialogs across instances A, B and the forwarder F, hit once by
every kind of fault (`FaultKind`), the killed broker, the queue replicas and a volley of hostile
records included, then every invariant checked on what Kafka recorded (`devtools.chaos`;
docs/reliability.md, "Chaos harness"). One round, not two as until 2026-11-26: a round takes two
to three minutes and `make test` was near its 30 minutes; `make chaos` runs as many as asked. A
fixed seed keeps the schedule the same from run to run; the failure message names the seed of a
round that broke, to replay it with ``python -m devtools.chaos --seed <seed> --rounds 1
--messages 400 --dialogs 150 --faults 14``.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from devtools.chaos.__main__ import run
from devtools.chaos.report import details, table
from devtools.chaos.round import RoundOptions
from devtools.chaos.schedule import FaultKind

pytestmark = pytest.mark.integration

SEED = 1414
KINDS = tuple(FaultKind)
"""Every kind. After a broker restart a dispatcher can still block for good in librdkafka's
send_offsets_to_transaction (docs/reliability.md, "What the harness found"); its watchdog ends it after
`KSB_STUCK_TXN_S` and the harness starts it again, as a deployment's supervisor would, so a round
with the broker kill takes about two minutes instead of one."""


@pytest.mark.timeout(600)
def test_a_round_under_every_kind_of_fault_keeps_every_invariant(tmp_path: Path) -> None:
    opts = RoundOptions(
        messages=400,
        dialogs=150,
        faults=len(KINDS),
        kinds=KINDS,
        flow_timeout_s=240,
        drain_timeout_s=90,
    )
    out = io.StringIO()
    results = run(opts, rounds=1, seed=SEED, workdir=tmp_path / "chaos", out=out)
    report = table(results) + "\n" + "\n".join(details(r) for r in results)
    assert all(r.ok for r in results), f"seeds {[r.seed for r in results]}:\n{report}"
    for r in results:
        assert r.received >= r.workload.requests + r.workload.replies, report
        assert sum(r.injected.values()) >= len(KINDS) - 1, report  # one may find no target
        assert r.refusals, report  # the hostile volley ran (each refusal is an invariant)
