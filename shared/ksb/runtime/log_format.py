"""How a service's log lines look: one line of text (the default), or one JSON object a line.

``KSB_LOG_FORMAT=json`` (`ServiceSettings.log_format`) is for log pipelines that index fields:
every line carries the time, level, logger and message, the service and its broker instance
(and the dispatcher's member), and, where the code that logged knows them, the shard, the
conversation, the group, the queue and the principal. Those come from the record's ``extra``
(``log.warning(..., extra={"conversation": handle})``) or from `log_fields`, which a call handler
sets once for every line logged while it runs (the queue service does, per gRPC call). An
exception is one field, its traceback in it, so a line stays a line.
"""

from __future__ import annotations

import contextvars
import json
import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any, Literal

__all__ = ["CONTEXT_FIELDS", "JsonFormatter", "LogFormat", "log_fields", "text_format"]

LogFormat = Literal["text", "json"]

CONTEXT_FIELDS = ("shard", "shards", "conversation", "group", "queue", "principal", "member")
"""The fields a line carries when its record or the running call knows them."""

_fields: contextvars.ContextVar[Mapping[str, Any]] = contextvars.ContextVar("ksb_log_fields")


@contextmanager
def log_fields(**fields: Any) -> Iterator[None]:
    """Every line logged in this context (thread or task) carries `fields` (None ones left out)."""
    current = _fields.get({})
    token = _fields.set({**current, **{k: v for k, v in fields.items() if v is not None}})
    try:
        yield
    finally:
        _fields.reset(token)


def text_format(name: str) -> str:
    """The text line: time, service, level, message (the format every service has always had)."""
    return f"%(asctime)s {name} %(levelname)s %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record, with the process's `static` fields (service, instance)."""

    def __init__(self, static: Mapping[str, Any]) -> None:
        super().__init__()
        self._static = dict(static)

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **self._static,
        }
        line.update(_fields.get({}))
        for key in CONTEXT_FIELDS:
            value = record.__dict__.get(key)
            if value is not None:
                line[key] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, default=str)
