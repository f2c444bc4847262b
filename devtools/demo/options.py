"""The demo's command line: how many dialogs, which catalogs, where its state goes."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from devtools.demo.common import INSTANCE, INSTANCE_B

__all__ = ["DemoOptions", "parse_args"]

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_WORKDIR = REPO_ROOT / "var" / "demo"
DEFAULT_CATALOG = REPO_ROOT / "infra" / "demo" / "catalog.yaml"
DEFAULT_CATALOG_B = REPO_ROOT / "infra" / "demo" / "catalog-b.yaml"


@dataclass(frozen=True)
class DemoOptions:
    dialogs: int
    messages_per_dialog: int
    window: int
    keep_running: bool
    workdir: Path
    catalog: Path
    timeout_s: float
    spark: bool = True
    cross_dialogs: int = 10
    catalog_b: Path = DEFAULT_CATALOG_B
    dispatchers: int = 2
    """Dispatcher processes of the first instance, which gets as many shards: each owns one."""


def parse_args(argv: list[str] | None) -> DemoOptions:
    parser = argparse.ArgumentParser(
        prog="python -m devtools.demo", description="Run KSB end to end on a fresh local stack."
    )
    parser.add_argument("--dialogs", type=int, default=200, help="dialogs to open (default 200)")
    parser.add_argument(
        "--messages-per-dialog", type=int, default=5, help="requests per dialog (default 5)"
    )
    parser.add_argument(
        "--window", type=int, default=50, help="dialogs open at once at most (default 50)"
    )
    parser.add_argument(
        "--keep-running",
        action="store_true",
        help="keep the stack and services up after the demo, until Ctrl-C",
    )
    parser.add_argument(
        "--workdir", type=Path, default=DEFAULT_WORKDIR, help="state directory (wiped first)"
    )
    parser.add_argument("--catalog", type=Path, default=DEFAULT_CATALOG, help="catalog YAML")
    parser.add_argument(
        "--catalog-b",
        type=Path,
        default=DEFAULT_CATALOG_B,
        help=f"catalog YAML of the second instance, {INSTANCE_B}",
    )
    parser.add_argument(
        "--cross-dialogs",
        type=int,
        default=10,
        help=f"dialogs from {INSTANCE} to {INSTANCE_B} (default 10)",
    )
    parser.add_argument(
        "--dispatchers",
        type=int,
        default=2,
        help=f"dispatcher processes of {INSTANCE}, one shard each (default 2)",
    )
    parser.add_argument(
        "--timeout", type=float, default=180.0, help="seconds the dialogs may take (default 180)"
    )
    parser.add_argument(
        "--no-spark",
        dest="spark",
        action="store_false",
        help="do not run the Spark audit/SLA job (local mode) beside the services",
    )
    a = parser.parse_args(argv)
    for name in ("dialogs", "messages_per_dialog", "window", "cross_dialogs", "dispatchers"):
        if getattr(a, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return DemoOptions(
        dialogs=a.dialogs,
        messages_per_dialog=a.messages_per_dialog,
        window=a.window,
        keep_running=a.keep_running,
        workdir=a.workdir.resolve(),
        spark=a.spark,
        catalog=a.catalog.resolve(),
        timeout_s=a.timeout,
        cross_dialogs=a.cross_dialogs,
        catalog_b=a.catalog_b.resolve(),
        dispatchers=a.dispatchers,
    )
