"""The committed Python of the queue service's API is what `make proto` makes of proto/ now."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO = "ksb/api/queue/v1/queue.proto"


def test_the_generated_api_is_current(tmp_path: Path) -> None:
    bin_dir = Path(sys.executable).parent
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I",
            str(ROOT / "proto"),
            f"--python_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            f"--mypy_out={tmp_path}",
            f"--mypy_grpc_out={tmp_path}",
            f"--plugin=protoc-gen-mypy={bin_dir / 'protoc-gen-mypy'}",
            f"--plugin=protoc-gen-mypy_grpc={bin_dir / 'protoc-gen-mypy_grpc'}",
            PROTO,
        ],
        check=True,
        capture_output=True,
    )
    made = sorted((tmp_path / "ksb/api/queue/v1").iterdir())
    assert made, "protoc made nothing"
    for path in made:
        committed = ROOT / "shared/ksb/api/queue/v1" / path.name
        assert committed.read_bytes() == path.read_bytes(), f"{path.name}: run `make proto`"
