"""The kcat example of docs/protocol.md, run as written against the real broker (BEGIN, SEND
and END as kcat; the RECEIVE that follows goes through the queue service, here the SDK's).

Running the documentation is what keeps it true: if a field is renamed or a rule changes, the
example a non-Python team copies stops working here first.

kcat logs in with SCRAM as the test's owner principal, from a 0600 config file (``-F``), with
the librdkafka of confluent-kafka's wheel: Debian's kcat links librdkafka 2.0.2, whose SCRAM
Kafka 4 refuses (librdkafka#4895; docs/protocol.md says how to work around it, as done here).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import confluent_kafka
import pytest

from devtools.deployment import Deployment
from ksb.catalog.model import END_DIALOG, Catalog
from ksb.names import Names
from ksb.runtime.credentials import kafka_login, write_private
from ksb.sdk.client import KsbClient
from ksb.wire.partitioning import target_handle
from tests.integration.conftest import ThreadDispatcher
from tests.integration.support import receive_all, wait_endpoint

pytestmark = pytest.mark.integration

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
HANDLE = "5d1c3a8e-0b7f-4c2a-9e61-3f2d8a4b7c10"


def kcat_example() -> str:
    """The first ```sh block under the '## kcat example' heading."""
    text = DOC.read_text()
    section = text.split("\n## kcat example", 1)[1]
    found = re.search(r"^```sh\n(.*?)^```", section, re.S | re.M)
    assert found is not None, "docs/protocol.md: no ```sh block under '## kcat example'"
    return found.group(1)


def kcat_library(folder: Path) -> Path:
    """A folder whose ``librdkafka.so.1`` is the wheel's (the workaround for Debian's kcat)."""
    libs = Path(confluent_kafka.__file__).resolve().parents[1] / "confluent_kafka.libs"
    [bundled] = sorted(libs.glob("librdkafka-*.so.1"))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "librdkafka.so.1").symlink_to(bundled)
    return folder


def kcat_config(settings: Deployment, path: Path) -> Path:
    """kcat's ``-F`` file: the principal's login, readable by its owner only."""
    login = kafka_login(settings)
    lines = [f"security.protocol={login.security_protocol}"]
    if login.sasl:
        lines += [
            f"sasl.mechanisms={login.mechanism}",
            f"sasl.username={login.username}",
            f"sasl.password={login.password}",
        ]
    if login.ssl_ca:
        lines.append(f"ssl.ca.location={login.ssl_ca}")
    write_private(path, "\n".join(lines) + "\n")
    return path


def run_script(script: str, env: dict[str, str], cwd: Path, timeout_s: float) -> str:
    """Run in its own process group so a hung kcat is killed with the shell."""
    proc = subprocess.Popen(
        ["bash", "-c", script],
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the kcat example hung\nstdout:\n{out}\nstderr:\n{err}")
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{out}\nstderr:\n{err}"
    return out


def test_doc_example_begins_sends_receives_and_ends(
    settings: Deployment,
    catalog: Catalog,
    dispatcher: ThreadDispatcher,
    client: KsbClient,
    tmp_path: Path,
) -> None:
    if shutil.which("kcat") is None:
        pytest.skip("kcat is not installed")
    env = {
        **os.environ,
        "BOOTSTRAP": settings.kafka_bootstrap,
        "INSTANCE": settings.instance,
        "PRINCIPAL": settings.acting_principal,
        "KCAT_CONFIG": str(kcat_config(settings, tmp_path / "kcat.conf")),
        "LD_LIBRARY_PATH": str(kcat_library(tmp_path / "kcat-lib")),
    }
    if not settings.secured:  # no principal: the requests topic of clients without one
        env["REQUESTS"] = Names(settings.instance).requests
    out = run_script(kcat_example(), env, tmp_path, timeout_s=90)

    # The END changed both endpoints in the same transaction as the EndDialog: the last line of
    # each handle is its state.
    target = target_handle(HANDLE)
    states = {
        key: json.loads(value)["state"]
        for key, value in (line.split("\t", 1) for line in out.splitlines() if "\t" in line)
    }
    assert states == {HANDLE: "DISCONNECTED_OUTBOUND", target: "DISCONNECTED_INBOUND"}

    # The target queue holds the request, once, with its Service Broker columns, then the
    # EndDialog; receiving that closes the initiator.
    request, end_dialog = receive_all(client, "TargetQueue", 2)
    assert request.conversation_id == HANDLE
    assert request.conversation_handle == target
    assert request.service_name == "//t/Target"
    assert request.message_type_name == "//t/Request"
    assert json.loads(request.message_body) == {"hello": "kafka"}
    assert end_dialog.message_type_name == END_DIALOG
    assert end_dialog.conversation_handle == target
    wait_endpoint(settings, HANDLE, "CLOSED")
