"""`pip install ksb` is a client: the built wheel, in an empty venv, runs a dialog on a real stack.

The wheel is built from this checkout (no build isolation: the venv's setuptools), installed into
a fresh venv with its dependencies from PyPI (pip's cache makes that quick), and must not bring
any extra's package. A script run by that venv's Python, from a directory outside the checkout,
then begins a dialog, sends, RECEIVEs through the queue service, replies and ends, as the README's
SDK example does, against this test's instance (its dispatcher and queue service).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from devtools.deployment import Deployment
from devtools.runner import REPO_ROOT
from ksb.catalog import END_DIALOG
from ksb.settings import ClientSettings, settings_env
from tests.integration.conftest import ThreadDispatcher
from tests.unit.test_packaging import EXTRA_MODULES

CLIENT = """
import json, sys
import ksb
from ksb.catalog import END_DIALOG
from ksb.sdk import KsbClient
from ksb.settings import ClientSettings

I, T, C = "//t/Initiator", "//t/Target", "//t/Contract"
with KsbClient(ClientSettings.from_env()) as client:
    handle = client.begin_dialog(I, T, C)
    client.send(handle, "//t/Request", json.dumps({"n": 1}))
    client.flush()
    got = []
    while not got:
        with client.transaction() as tx:
            for m in tx.receive("TargetQueue", waitfor_ms=5000):
                got.append(m.message_body.decode())
                tx.send(m.conversation_handle, "//t/Reply", "ok")
                tx.end_conversation(m.conversation_handle)
    replies = []
    while END_DIALOG not in [t for t, _ in replies]:
        with client.transaction() as tx:
            for m in tx.receive("InitiatorQueue", waitfor_ms=5000):
                replies.append((m.message_type_name, m.message_body.decode()))
                if m.message_type_name == END_DIALOG:
                    tx.end_conversation(m.conversation_handle)
print(json.dumps({"ksb": ksb.__file__, "received": got, "replies": replies}))
"""


PACKAGED = ("pyproject.toml", "README.md", "LICENSE", "shared", "services", "apps")
"""What pyproject's package list and metadata read."""


def _run(args: list[str], cwd: Path, timeout_s: float) -> tuple[str, float]:
    started = time.monotonic()
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, f"{args}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done.stdout, time.monotonic() - started


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_the_wheel_alone_runs_a_dialog(
    settings: Deployment, dispatcher: ThreadDispatcher, tmp_path: Path
) -> None:
    # Built from a copy of what the wheel is made of: setuptools leaves build/ where it builds,
    # and a module since deleted would linger there and in every later wheel.
    source = tmp_path / "source"
    source.mkdir()
    for part in PACKAGED:
        if (REPO_ROOT / part).is_dir():
            skip = shutil.ignore_patterns("__pycache__", "*.egg-info")
            shutil.copytree(REPO_ROOT / part, source / part, ignore=skip)
        else:
            shutil.copy2(REPO_ROOT / part, source / part)
    dist = tmp_path / "dist"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    _, built_s = _run(
        [*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist), str(source)],
        tmp_path,
        120,
    )
    (wheel,) = dist.glob("ksb-*.whl")
    venv = tmp_path / "venv"
    _, venv_s = _run([sys.executable, "-m", "venv", str(venv)], tmp_path, 60)
    python = str(venv / "bin" / "python")
    _, install_s = _run(
        [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", str(wheel)],
        tmp_path,
        180,
    )
    freeze, _ = _run([python, "-m", "pip", "list", "--format=json"], tmp_path, 60)
    installed = {p["name"].lower().replace("_", "-") for p in json.loads(freeze)}
    extras = {"redis", "hiredis", "prometheus-client", "pyyaml", "jsonschema", "lxml", "lmdb"}
    extras |= {"typer", "rich", "lark", "pyspark", "pandas", "plotly", "faust-streaming"}
    assert not installed & extras, f"the wheel brought {sorted(installed & extras)}"
    assert {"confluent-kafka", "grpcio", "protobuf", "msgspec", "pydantic"} <= installed
    present = [m for m in EXTRA_MODULES if any(venv.glob(f"lib/python3*/site-packages/{m}"))]
    assert not present, f"modules of extras installed: {present}"

    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    env = settings_env(settings.narrow(ClientSettings))
    env.pop("PYTHONPATH", None)
    started = time.monotonic()
    done = subprocess.run(
        [python, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["ksb"].startswith(str(venv)), result["ksb"]  # not the checkout's
    assert result["received"] == ['{"n": 1}']
    assert [t for t, _ in result["replies"]] == ["//t/Reply", END_DIALOG]
    size_kb = wheel.stat().st_size / 1024
    print(
        f"\nwheel {wheel.name}: {size_kb:.0f} KiB, built in {built_s:.1f} s; venv {venv_s:.1f} s,"
        f" installed in {install_s:.1f} s ({len(installed)} packages); dialog in"
        f" {time.monotonic() - started:.1f} s"
    )
