"""The `ksb` command line: `ksb.cli.app` (plumbing), `ksb.cli.catalog` (catalog and DDL),
`ksb.cli.views` (live state), `ksb.cli.security` (principals and ACLs), `ksb.cli.readers` (what
they read, shared with the demo)."""

try:
    from ksb.cli import catalog, security, views
    from ksb.cli.app import app, main
except ModuleNotFoundError as exc:  # `pip install ksb` installs the console script, not its needs
    raise SystemExit(
        f"the ksb command needs the cli extra: pip install 'ksb[cli]' ({exc})"
    ) from exc

__all__ = ["app", "catalog", "main", "security", "views"]
