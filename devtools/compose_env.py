"""`python3 -m devtools.compose_env`: generate docker-compose's secrets (git-ignored, 0600).

docker-compose.yml hands every password to the containers as files (compose ``secrets:``), never
as environment values: a value in a container's environment shows in ``docker inspect`` and is
inherited by every process the container starts (activated tasks, the external activator's
readers). This writes one file for each secret the compose file declares under
``${SECRETS_DIR}``, 256 random bits each, into a 0700 directory (``secrets/`` beside ``.env`` by
default): the passwords of ``broker``, of ``admin`` (one for Kafka, another for Redis), of every
role of the instance (each service logs in as its own principal) and of the order application;
the instance's lease key (the dispatchers' and the queue service's only); Grafana's admin
password. ``.env`` then says where they are (``SECRETS_DIR``), which compose reads to find them.
The variable carries no ``KSB_`` prefix on purpose: a shell that sources ``.env`` still starts KSB
processes, which refuse any ``KSB_*`` variable they do not read.

Standard library only, so that any ``python3`` (3.8 or later) runs it from the repository root
before anything is installed: deploying with compose needs neither the project's venv nor its
packages on the host.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import shutil
import sys
from pathlib import Path

__all__ = ["PASSWORD_BYTES", "SECRETS_VARIABLE", "main", "secret_names"]

REPO_ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
PASSWORD_BYTES = 32
"""256 random bits, as `ksb.runtime.credentials.generate_password` makes them (the lease key
needs at least 32 bytes: its text is 43)."""
SECRETS_VARIABLE = "SECRETS_DIR"


def secret_names(compose_text: str) -> list[str]:
    """Every file the compose file's secrets read from ``${SECRETS_DIR}``, in order of first use."""
    pattern = r"\$\{" + SECRETS_VARIABLE + r"(?::?[-?][^}]*)?\}/([A-Za-z0-9._-]+)"
    return list(dict.fromkeys(re.findall(pattern, compose_text)))


def _write_private(path: Path, text: str) -> None:
    """Readable by its owner only (0600) from the first byte."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _as_written(directory: Path, compose_file: Path) -> str:
    """The directory as ``.env`` names it: relative to the compose file's folder when inside it
    (compose resolves a secret's relative path from there), so the checkout can move."""
    try:
        return "./" + directory.resolve().relative_to(compose_file.resolve().parent).as_posix()
    except ValueError:
        return str(directory.resolve())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m devtools.compose_env", description=__doc__)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / ".env")
    parser.add_argument(
        "--secrets-dir", type=Path, default=None, help="default: secrets/ beside --out"
    )
    parser.add_argument("--compose-file", type=Path, default=COMPOSE_FILE)
    parser.add_argument("--force", action="store_true", help="replace existing secrets")
    args = parser.parse_args(argv)
    directory: Path = args.secrets_dir or args.out.parent / "secrets"
    if args.out.exists() or directory.exists():
        if not args.force:
            print(
                f"{args.out} or {directory} exists (its passwords are in use); --force replaces "
                "them (then remove the stack's volumes: Kafka and Redis keep the old ones)",
                file=sys.stderr,
            )
            return 1
        if args.out.exists():
            args.out.unlink()
        shutil.rmtree(directory, ignore_errors=True)
    names = secret_names(args.compose_file.read_text())
    directory.mkdir(mode=0o700, parents=True)
    directory.chmod(0o700)  # whatever the umask
    for name in names:
        # No newline: the file is the secret, byte for byte, for every reader (Grafana's too).
        _write_private(directory / name, secrets.token_urlsafe(PASSWORD_BYTES))
    _write_private(args.out, f"{SECRETS_VARIABLE}={_as_written(directory, args.compose_file)}\n")
    print(f"wrote {len(names)} secrets to {directory} (0600 each) and {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
