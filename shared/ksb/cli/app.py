"""The ``ksb`` command's plumbing: the typer apps, settings, output, and how errors are reported.

The commands live beside it (`ksb.cli.catalog`, `ksb.cli.views`) and read state with
`ksb.cli.readers`. Each command is a few lines that call small functions; every state it shows is read from Kafka
(catalog, endpoints, errors and queue topics), so the CLI needs no service to be running. Bad
input (a catalog field, a DDL token, an unknown queue) is a `KsbError`, printed as
``error: <reason>`` with exit code 2 and no traceback, because the reason already says what to fix.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import ParamSpec

import typer
from confluent_kafka import KafkaException
from rich.console import Console

from ksb.errors import KsbError
from ksb.settings import CliSettings

__all__ = [
    "app",
    "catalog_app",
    "cli_settings",
    "dlq_app",
    "echo_json",
    "main",
    "make_console",
    "queue_app",
    "reported",
]

_P = ParamSpec("_P")

app = typer.Typer(
    name="ksb",
    help="Service Broker conversations on Kafka: catalog, DDL and live state.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)
catalog_app = typer.Typer(help="The catalog: message types, contracts, queues, services.")
queue_app = typer.Typer(help="Look into a queue without receiving from it.")
app.add_typer(catalog_app, name="catalog")
app.add_typer(queue_app, name="queue")
dlq_app = typer.Typer(help="Dead letters: messages moved aside by a queue's dead-letter policy.")
app.add_typer(dlq_app, name="dlq")

_BAD_INPUT = 2
_UNAVAILABLE = 1


def reported(command: Callable[_P, None]) -> Callable[_P, None]:
    """Turn errors into one line on stderr: a user needs the reason, not our stack."""

    @functools.wraps(command)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> None:
        try:
            command(*args, **kwargs)
        except KsbError as exc:
            typer.echo(f"error: {exc.reason}", err=True)
            raise typer.Exit(_BAD_INPUT) from None
        except (KafkaException, TimeoutError) as exc:
            typer.echo(f"error: Kafka request failed: {exc}", err=True)
            raise typer.Exit(_UNAVAILABLE) from None

    return run


def cli_settings() -> CliSettings:
    return CliSettings.from_env()


_PIPE_WIDTH = 1_000


def make_console() -> Console:
    """Built per command so output follows the stdout of the moment (tests swap it).

    Piped output gets a width no table reaches, so handles are never folded across lines and
    `ksb endpoints | grep <handle>` finds them.
    """
    console = Console()
    return console if console.is_terminal else Console(width=_PIPE_WIDTH)


def echo_json(value: object) -> None:
    typer.echo(json.dumps(value, indent=2))


def main() -> None:
    """Entry point of the ``ksb`` script."""
    app()
