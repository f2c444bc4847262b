"""`python -m devtools.compose_env`: generate docker-compose's secrets into ``.env`` (git-ignored).

One password per principal of the compose deployment (``broker`` and ``admin``, and every role of
the instance: each service logs in as its own), 256 random bits each. Compose reads ``.env`` to fill
in ``${PASSWORD_...}`` in docker-compose.yml; each container receives only its own. The names carry
no ``KSB_`` prefix on purpose: a shell that sources the file still starts KSB processes, which
refuse any ``KSB_*`` variable they do not read.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from devtools.processes import REPO_ROOT
from ksb.runtime.credentials import generate_password, write_private
from ksb.security.principals import ADMIN, BROKER, Role

__all__ = ["env_name", "main"]


def env_name(principal_or_role: str) -> str:
    """``PASSWORD_<ROLE>``: the variable docker-compose.yml interpolates for a principal."""
    return "PASSWORD_" + principal_or_role.upper().replace("-", "_")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.compose_env", description=__doc__)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / ".env")
    parser.add_argument("--force", action="store_true", help="replace an existing file")
    args = parser.parse_args(argv)
    if args.out.exists() and not args.force:
        print(f"{args.out} exists (its passwords are in use); --force replaces it", file=sys.stderr)
        return 1
    names = [BROKER, ADMIN, *(r.value for r in Role)]
    lines = [f"{env_name(n)}={generate_password()}" for n in names]
    write_private(args.out, "\n".join(lines) + "\n")
    print(f"wrote {len(lines)} passwords to {args.out} (mode 0600)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
