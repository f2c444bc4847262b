"""Replay inputs through a fuzz target, uninstrumented: how a finding is reproduced and confirmed.

    python -m tests.fuzz.replay TARGET FILE [FILE ...]

Prints each file's outcome and exits 1 if any input breaks the contract. The atheris harness
confirms every finding this way before it counts it, because its bytecode instrumentation can
itself make instrumented code fail (it once made PyYAML's scanner raise an AttributeError that
the same input never raises uninstrumented).
"""

from __future__ import annotations

import sys
from pathlib import Path

from tests.fuzz.contract import ContractViolation
from tests.fuzz.targets import TARGETS

__all__ = ["main"]


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in TARGETS:
        print(f"usage: python -m tests.fuzz.replay TARGET FILE...; targets: {', '.join(TARGETS)}")
        return 2
    target, broken = TARGETS[argv[0]], 0
    for name in argv[1:]:
        try:
            target.run(Path(name).read_bytes())
        except ContractViolation as violation:
            broken += 1
            print(f"{name}: {violation}")
        else:
            print(f"{name}: keeps the contract")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
