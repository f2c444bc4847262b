"""`python -m devtools.containers.py313` (`make test-py313`): the unit suite on Python 3.13.

The project's venv runs Debian 12's Python 3.11; Debian 13's is 3.13, so the suite runs there in
a container (`images.build_py313`: a trixie debootstrap and the project's dependencies from PyPI).
The checkout is mounted read-only and copied inside (without .venv, .cache, var or .git), installed
editable without touching the network, and `pytest tests/unit` runs with no network at all:
the unit suite needs none. Exits with pytest's status.
"""

from __future__ import annotations

import subprocess
import sys
import time

from devtools.containers.images import PY313_IMAGE, build_py313
from devtools.containers.podman import PodmanError, podman_env
from devtools.processes import REPO_ROOT

__all__ = ["main"]

SUITE_TIMEOUT_S = 900.0
INSIDE = (
    "set -e; mkdir /tmp/ksb; "
    "tar -C /src --exclude=./.venv --exclude=./.cache --exclude=./var --exclude=./.git -cf - . "
    "| tar -C /tmp/ksb -xf -; cd /tmp/ksb; "
    "pip install -q --no-deps --no-build-isolation --no-index -e . ; "
    "python --version; exec python -m pytest tests/unit -p no:cacheprovider -q {args}"
)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        build_py313()
    except PodmanError as exc:
        print(f"[py313] {exc}", file=sys.stderr)
        return 1
    started = time.monotonic()
    cmd = [
        "podman", "run", "--rm", "--network", "none",
        "--volume", f"{REPO_ROOT}:/src:ro", PY313_IMAGE,
        "sh", "-c", INSIDE.format(args=" ".join(args)),
    ]  # fmt: skip
    try:
        done = subprocess.run(
            cmd, env=podman_env(), stdin=subprocess.DEVNULL, timeout=SUITE_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        print(f"[py313] the unit suite did not end in {SUITE_TIMEOUT_S:.0f} s", file=sys.stderr)
        return 1
    print(
        f"[py313] unit suite on Python 3.13: exit {done.returncode} in {time.monotonic() - started:.0f} s"
    )
    return done.returncode


if __name__ == "__main__":
    raise SystemExit(main())
