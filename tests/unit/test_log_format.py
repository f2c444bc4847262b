"""KSB_LOG_FORMAT: one text line per record by default, one JSON object per record with json."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from devtools.runner import REPO_ROOT
from ksb.runtime.log_format import JsonFormatter, log_fields
from ksb.settings import DispatcherSettings, QueueServiceSettings, SettingsError


def _record(msg: str, *args: object, **extra: object) -> logging.LogRecord:
    record = logging.LogRecord("ksb.queue", logging.WARNING, __file__, 1, msg, args, None)
    record.__dict__.update(extra)
    return record


def test_a_json_line_has_the_process_the_record_and_the_call_s_fields() -> None:
    fmt = JsonFormatter({"service": "queue", "instance": "demo"})
    with log_fields(queue="Orders", conversation=None):
        line = json.loads(fmt.format(_record("dead-lettering %s", "h:1", conversation="h")))
    assert line["message"] == "dead-lettering h:1" and line["level"] == "WARNING"
    assert (line["service"], line["instance"], line["logger"]) == ("queue", "demo", "ksb.queue")
    assert (line["queue"], line["conversation"]) == ("Orders", "h")
    assert line["ts"].endswith("+00:00")
    # Outside the call its fields are gone; a record without extras has none.
    line = json.loads(fmt.format(_record("plain")))
    assert "queue" not in line and "conversation" not in line


def test_an_exception_stays_on_one_line() -> None:
    fmt = JsonFormatter({"service": "dispatcher"})
    try:
        raise ValueError("boom")
    except ValueError:
        record = _record("failed")
        record.exc_info = sys.exc_info()
    text = fmt.format(record)
    assert "\n" not in text and "ValueError: boom" in json.loads(text)["exception"]


def test_the_setting_takes_text_or_json_only() -> None:
    assert QueueServiceSettings.from_env({}).log_format == "text"
    assert DispatcherSettings.from_env({"KSB_LOG_FORMAT": "json"}).log_format == "json"
    with pytest.raises(SettingsError, match="KSB_LOG_FORMAT"):
        DispatcherSettings.from_env({"KSB_LOG_FORMAT": "xml"})


_SERVICE = """
import logging, threading
from ksb.runtime.service import Service, run_main
from ksb.settings import ServiceSettings

class Quiet(Service):
    name = "quiet"
    def open(self) -> None:
        logging.getLogger("ksb.quiet").info("shard taken", extra={{"shard": 3}})
        raise SystemExit(0)
    def step(self) -> None: ...
    def close(self) -> None: ...

run_main(lambda: Quiet(ServiceSettings.from_env()), "quiet")
"""


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_a_service_logs_as_its_setting_says(fmt: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _SERVICE.format()],
        cwd=REPO_ROOT,
        env={"PATH": "/usr/bin:/bin", "KSB_LOG_FORMAT": fmt, "KSB_INSTANCE": "demo"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = [line for line in done.stderr.splitlines() if "shard taken" in line]
    assert len(lines) == 1, done.stderr
    if fmt == "text":
        assert " quiet INFO shard taken" in lines[0]
        return
    line = json.loads(lines[0])
    assert (line["service"], line["instance"], line["shard"]) == ("quiet", "demo", 3)
