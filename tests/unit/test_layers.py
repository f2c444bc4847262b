"""The architecture's import rules hold: pyproject's [tool.importlinter] contracts, checked by
import-linter over the real import graph (type-only imports included)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_import_contract_is_kept() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    run = subprocess.run(
        [str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0 and "BROKEN" not in run.stdout, run.stdout[-4000:] + run.stderr
    assert "KEPT" in run.stdout  # the contracts were read and checked
