"""`python -m bench --quick` runs end to end: its own stack, both benchmarks, the ratio line.

Speed is never asserted: only that the run completes, verifies exactly-once delivery (exit 0),
and prints and writes its figures.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_bench_quick_runs_and_prints_the_ratio(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    # --no-spark: the Spark section starts two JVMs cold (over a minute on a loaded machine), more
    # than this run's time limit allows; the audit job has its own tests (marker `spark`).
    result = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--no-spark", "--out", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert any(line.startswith("ratio KSB/raw:") for line in result.stdout.splitlines())
    figures = json.loads(out.read_text())
    assert figures["ksb"]["verified_exactly_once_in_order"] is True
    assert set(figures["ratio_ksb_over_raw"]) >= {"throughput", "latency_loaded_p50"}
