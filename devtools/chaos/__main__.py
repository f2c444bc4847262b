"""`make chaos`: rounds of traffic across two instances while faults hit every part of it.

``python -m devtools.chaos [--rounds R] [--messages M] [--seed S] ...``: round ``i`` uses seed
``S + i`` for its workload and its fault schedule, so ``--seed <a round's seed> --rounds 1``
replays that round's schedule (with the same ``--messages``, ``--dialogs`` and ``--faults``).
Prints a row per round as it ends, then the table, writes ``<workdir>/results.json``, and exits 1
when any round broke an invariant or could not be run to the end, naming the seeds to replay.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import signal
import sys
import time
import uuid
from pathlib import Path
from types import FrameType

from devtools.chaos.report import HEADER, as_json, details, table
from devtools.chaos.round import RoundOptions, RoundResult, run_round
from devtools.chaos.stack import ChaosStack
from devtools.processes import REPO_ROOT

__all__ = ["main", "run"]

DEFAULT_ROUNDS = 4
DEFAULT_MESSAGES = 4_000


def run(
    opts: RoundOptions, *, rounds: int, seed: int, workdir: Path, out: object = sys.stdout
) -> list[RoundResult]:
    """Start a stack under `workdir`, run the rounds on it, stop it; prints as it goes."""

    def say(text: str) -> None:
        print(text, file=out, flush=True)  # type: ignore[call-overload]

    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    run_id = uuid.uuid4().hex[:6]
    results: list[RoundResult] = []
    started = time.monotonic()
    with ChaosStack(workdir / "stack") as stack:
        say(
            f"stack up in {time.monotonic() - started:.0f}s: kafka {stack.kafka_bootstrap}, "
            f"redis {stack.redis_url}; {rounds} rounds of {opts.messages} messages over "
            f"{opts.dialogs} dialogs, {opts.faults} faults each, first seed {seed}"
        )
        say("  ".join(HEADER))
        for i in range(rounds):
            result = run_round(stack, opts, i + 1, seed + i, workdir, run_id)
            results.append(result)
            say(table([result]).splitlines()[1])
            text = details(result)
            if text:
                say(text)
    (workdir / "results.json").write_text(
        json.dumps([as_json(r) for r in results], indent=2) + "\n"
    )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.chaos", description=__doc__)
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS)
    parser.add_argument(
        "--messages",
        type=int,
        default=DEFAULT_MESSAGES,
        help="requests per round (each also gets a reply)",
    )
    parser.add_argument("--dialogs", type=int, default=1_000)
    parser.add_argument(
        "--seed", type=int, default=None, help="the first round's seed (default: random, printed)"
    )
    parser.add_argument("--faults", type=int, default=16, help="faults per round")
    parser.add_argument(
        "--shards",
        type=int,
        default=2,
        help="request partitions per instance, shared by its 2 dispatchers",
    )
    parser.add_argument("--workdir", type=Path, default=REPO_ROOT / "var" / "chaos")
    parser.add_argument("-v", "--verbose", action="store_true", help="log every fault as it hits")
    args = parser.parse_args(argv)
    if not 1 <= args.dialogs <= args.messages:  # said now, not after the stack has started
        parser.error("--dialogs must be at least 1 and at most --messages (one request each)")
    # SIGTERM (`timeout`, CI) unwinds like Ctrl-C, so every process this run started is stopped.
    signal.signal(signal.SIGTERM, _interrupt)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    seed = args.seed if args.seed is not None else random.Random(os.urandom(8)).randrange(10**6)
    opts = RoundOptions(
        messages=args.messages, dialogs=args.dialogs, faults=args.faults, shards=args.shards
    )
    results = run(opts, rounds=args.rounds, seed=seed, workdir=args.workdir)
    print()
    print(table(results))
    failed = [r for r in results if not r.ok]
    print(f"\nlogs and results.json in {args.workdir}")
    if failed:
        for r in failed:
            print(
                f"round {r.round_no} FAILED; replay: python -m devtools.chaos --seed {r.seed} "
                f"--rounds 1 --messages {args.messages} --dialogs {args.dialogs} "
                f"--faults {args.faults} --shards {args.shards}"
            )
        return 1
    print("every round kept every invariant")
    return 0


def _interrupt(_signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    raise SystemExit(main())
