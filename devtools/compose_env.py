"""`python3 -m devtools.compose_env`: generate docker-compose's secrets into ``.env`` (git-ignored).

One password for every ``${PASSWORD_...}`` docker-compose.yml asks for (``broker`` and ``admin``,
every role of the instance, since each service logs in as its own principal, and the order
application's), 256 random bits each. Compose reads ``.env`` to fill them in; each container
receives only its own. The names carry no ``KSB_`` prefix on purpose: a shell that sources the
file still starts KSB processes, which refuse any ``KSB_*`` variable they do not read.

Standard library only, so that any ``python3`` (3.8 or later) runs it from the repository root
before anything is installed: deploying with compose needs neither the project's venv nor its
packages on the host.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import sys
from pathlib import Path

__all__ = ["PASSWORD_BYTES", "env_name", "main", "password_variables"]

REPO_ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
PASSWORD_BYTES = 32
"""256 random bits, as `ksb.runtime.credentials.generate_password` makes them."""


def env_name(principal_or_role: str) -> str:
    """``PASSWORD_<ROLE>``: the variable docker-compose.yml interpolates for a principal."""
    return "PASSWORD_" + principal_or_role.upper().replace("-", "_")


def password_variables(compose_text: str) -> list[str]:
    """Every ``PASSWORD_*`` variable the compose file interpolates, in order of first use."""
    return list(dict.fromkeys(re.findall(r"\$\{(PASSWORD_\w+?)(?::?[-?][^}]*)?\}", compose_text)))


def _write_private(path: Path, text: str) -> None:
    """Readable by its owner only (0600) from the first byte."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m devtools.compose_env", description=__doc__)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / ".env")
    parser.add_argument("--compose-file", type=Path, default=COMPOSE_FILE)
    parser.add_argument("--force", action="store_true", help="replace an existing file")
    args = parser.parse_args(argv)
    if args.out.exists():
        if not args.force:
            print(
                f"{args.out} exists (its passwords are in use); --force replaces it",
                file=sys.stderr,
            )
            return 1
        args.out.unlink()
    names = password_variables(args.compose_file.read_text())
    lines = [f"{name}={secrets.token_urlsafe(PASSWORD_BYTES)}" for name in names]
    _write_private(args.out, "\n".join(lines) + "\n")
    print(f"wrote {len(lines)} passwords to {args.out} (mode 0600)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
