"""The `ksb` command line: `ksb.cli.app` (plumbing), `ksb.cli.catalog` (catalog and DDL),
`ksb.cli.views` (live state), `ksb.cli.security` (principals and ACLs), `ksb.cli.readers` (what
they read, shared with the demo)."""

from ksb.cli import catalog, security, views
from ksb.cli.app import app, main

__all__ = ["app", "catalog", "main", "security", "views"]
