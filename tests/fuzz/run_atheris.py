"""Run the atheris harness over every decoder, one after another, and sum up (`make fuzz`).

    python -m tests.fuzz.run_atheris [--runs 10000] [--targets request,ddl] [--out var/fuzz]

Each target starts from its real records (`tests.fuzz.corpus`) plus whatever earlier runs kept in
``OUT/corpus/TARGET``, runs ``--runs`` inputs with a 30 s per-input backstop (the contract's own
bound is 2 s of CPU), and writes each distinct contract failure of this run to
``OUT/findings/TARGET``. The
targets run one at a time: the machine is shared. Exits 1 if any target found a failure.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tests.fuzz.targets import TARGETS

__all__ = ["main"]


def _run(name: str, runs: int, out: Path) -> tuple[int, int, int, float]:
    """Fuzz one target; returns (inputs run, distinct failures found, failures the harness could
    not reproduce uninstrumented, seconds)."""
    corpus, findings = out / "corpus" / name, out / "findings" / name
    corpus.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(findings, ignore_errors=True)  # this run's findings only; the corpus grows
    findings.mkdir(parents=True)
    seeds = TARGETS[name].seeds()
    for i, seed in enumerate(seeds):
        (corpus / f"seed-{i}").write_bytes(seed)
    max_len = max(4096, 2 * max(len(s) for s in seeds))
    command = [
        sys.executable,
        "-m",
        "tests.fuzz.atheris_harness",
        name,
        f"-runs={runs}",
        "-timeout=30",
        f"-max_len={max_len}",
        "-len_control=0",
        f"-artifact_prefix={findings}/",
        str(corpus),
    ]
    started = time.monotonic()
    log = out / f"{name}.log"
    with log.open("w") as sink:
        done = subprocess.run(
            command,
            stdout=sink,
            stderr=subprocess.STDOUT,
            env={**os.environ, "FUZZ_FINDINGS": str(findings)},
        )
    took = time.monotonic() - started
    text = log.read_text(errors="replace")
    ran = re.search(r"Done (\d+) runs", text)
    if done.returncode != 0 or ran is None:
        print(f"{name}: libFuzzer stopped (exit {done.returncode}); see {log}", file=sys.stderr)
    found = len(list(findings.glob("*.txt"))) + (done.returncode != 0)
    unconfirmed = len(list(findings.glob("*.unconfirmed")))
    return (int(ran.group(1)) if ran else 0), found, unconfirmed, took


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=10_000)
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--out", type=Path, default=Path("var/fuzz"))
    opts = parser.parse_args()
    names = [n for n in opts.targets.split(",") if n]
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        parser.error(f"unknown targets {unknown}; known: {', '.join(TARGETS)}")
    failed = 0
    print(f"{'target':<14} {'inputs':>8} {'failures':>9} {'unconfirmed':>12} {'seconds':>8}")
    for name in names:
        ran, found, unconfirmed, took = _run(name, opts.runs, opts.out)
        failed += found
        print(f"{name:<14} {ran:>8} {found:>9} {unconfirmed:>12} {took:>8.0f}", flush=True)
    if failed:
        print(f"{failed} failure(s): see {opts.out}/findings/*/*.txt", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
