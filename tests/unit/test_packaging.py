"""What `pip install ksb` brings, and what each extra adds (pyproject.toml).

The package without extras is a client: an application that imports the SDK must not need the
services' dependencies (Redis, Prometheus, the catalog's validators, the CLI's). Importing is where
that breaks, so the SDK's public modules are imported here in a fresh interpreter that refuses
every module an extra brings; tests/integration/test_wheel.py installs the built wheel into an empty
venv and runs a dialog with it.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
EXTRAS: dict[str, list[str]] = PROJECT["optional-dependencies"]

EXTRA_MODULES = (
    "redis",
    "hiredis",
    "prometheus_client",
    "yaml",
    "jsonschema",
    "lxml",
    "lmdb",
    "typer",
    "rich",
    "lark",
    "pyspark",
    "pandas",
    "plotly",
    "faust",
    "aiokafka",
)
"""The top-level modules the extras' packages install."""

CLIENT_MODULES = ("ksb.sdk", "ksb.catalog", "ksb.settings", "ksb.errors", "ksb.wire.protocol")
"""What an application imports (the README's SDK example: the client, END_DIALOG, settings)."""


def _name(requirement: str) -> str:
    match = re.match(r"[A-Za-z0-9_.-]+", requirement)
    assert match, requirement
    return match.group(0).lower().replace("_", "-")


def test_the_sdk_imports_nothing_an_extra_brings() -> None:
    blocker = (
        "import importlib.abc, sys\n"
        "class Refuse(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] in {EXTRA_MODULES!r}:\n"
        "            raise ImportError(f'{name} comes with an extra')\n"
        "sys.meta_path.insert(0, Refuse())\n"
        f"for m in {CLIENT_MODULES!r}:\n"
        "    __import__(m)\n"
        "from ksb.catalog import END_DIALOG\n"
        "from ksb.sdk import KsbClient\n"
    )
    run = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]


def test_the_refusal_above_can_fail() -> None:
    """The blocker does refuse: a service module needs Redis."""
    code = (
        "import importlib.abc, sys\n"
        "class Refuse(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'redis':\n"
        "            raise ImportError(name)\n"
        "sys.meta_path.insert(0, Refuse())\n"
        "import ksb.runtime.redis_client\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode != 0 and "ImportError" in run.stderr


def test_the_client_dependencies_are_only_what_a_client_needs() -> None:
    assert sorted(_name(r) for r in PROJECT["dependencies"]) == [
        "confluent-kafka",
        "grpcio",
        "msgspec",
        "protobuf",
        "pydantic",
    ]


def test_every_extra_lists_its_own_packages_and_dev_has_every_part() -> None:
    """No extra names ksb itself: the Dockerfile and the Python 3.13 image read these lists into
    `pip install -r`, where ``ksb[...]`` would be looked up on PyPI. `make setup` installs
    '.[dev,spark,faust]', so dev must bring every other part."""
    for extra, requirements in EXTRAS.items():
        assert all(_name(r) != "ksb" for r in requirements), extra
    dev = {_name(r) for r in EXTRAS["dev"]}
    for part in ("services", "cli", "xml", "ddl"):
        missing = {_name(r) for r in EXTRAS[part]} - dev
        assert not missing, f"dev lacks {part}'s {sorted(missing)}"


def test_the_image_installs_every_part_it_runs() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    for extra in ("services", "cli", "spark", "faust"):
        assert f"o['{extra}']" in dockerfile, extra
    # pyproject alone before the dependencies (their layer outlives a README edit); README and
    # LICENSE, which the metadata names, before the package is installed.
    assert re.findall(r"^COPY (.+) \./$", dockerfile, re.M) == [
        "pyproject.toml",
        "README.md LICENSE",
    ]
    assert dockerfile.index("COPY README.md LICENSE") < dockerfile.index("--no-deps -e .")
