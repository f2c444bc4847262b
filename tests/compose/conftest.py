"""The compose run the checks in this folder share: docker-compose.yml up once, down at the end.

Only `make compose-test` runs them (it builds the images first and sets ``COMPOSE_TEST=1``);
elsewhere every test here is skipped with that reason. The run's files (its .env of fresh
passwords) are under var/compose-test/.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from devtools.containers.compose import ComposeRun
from devtools.processes import REPO_ROOT

NETWORK = "ksb-compose-test"


_config: pytest.Config | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _config
    _config = config


def say(message: str) -> None:
    """A line on the terminal, past pytest's capture: what each step and check saw."""
    line = f"[compose-test] {message}"
    if _config is None:
        print(line, file=sys.stderr)
        return
    capture: Any = _config.pluginmanager.getplugin("capturemanager")
    reporter: Any = _config.pluginmanager.getplugin("terminalreporter")
    with capture.global_and_fixture_disabled():
        reporter.write_line(line)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if os.environ.get("COMPOSE_TEST") == "1":
        return
    skip = pytest.mark.skip(reason="needs podman and the images: `make compose-test` runs it")
    for item in items:
        if "tests/compose/" in str(item.path).replace(os.sep, "/"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def stack() -> Iterator[ComposeRun]:
    """docker-compose.yml (with infra/compose/test-override.yml) up and every service healthy;
    removed afterwards whatever happened (a check may already have taken it down)."""
    run = ComposeRun(REPO_ROOT / "var" / "compose-test", network=NETWORK, say=say)
    started = time.monotonic()
    try:
        run.prepare()
        run.up()
        say(f"up: every service healthy in {time.monotonic() - started:.0f} s")
        yield run
    finally:
        left = run.down()
        if left:
            say(f"teardown removed what `down -v` left: {', '.join(left)}")
