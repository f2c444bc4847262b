"""The CLI's tables show record text as written: a reason or name is never read as rich markup."""

from __future__ import annotations

from typing import Any

import pytest
from rich.console import Console
from typer.testing import CliRunner

from ksb.cli import app, views
from ksb.cli.catalog import table
from ksb.settings import CliSettings

# What `not_authorized` reasons look like, plus a tag rich would swallow into a style.
REASON = "GRANT SEND ON SERVICE::[//t/Initiator] TO x [bold]now[/bold] [/x]"


def test_ksb_errors_prints_a_reason_with_brackets_literally(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`ksb errors` (the table, not --json) failed with MarkupError on such a reason."""

    def records(_settings: CliSettings, _principal: str | None) -> list[dict[str, Any]]:
        return [{"offset": 7, "code": "not_authorized", "handle": "h1", "reason": REASON}]

    monkeypatch.setattr(views, "cli_settings", CliSettings)
    monkeypatch.setattr(views, "read_errors", records)
    result = CliRunner().invoke(app, ["errors"])
    assert result.exit_code == 0, f"exit {result.exit_code}: {result.output} {result.exception!r}"
    assert REASON in result.stdout


def test_table_title_header_and_cells_are_literal() -> None:
    t = table("Dead letters of [Q]", "[col]")
    t.add_row(REASON)
    console = Console(width=1_000)
    with console.capture() as captured:
        console.print(t)
    out = captured.get()
    assert "Dead letters of [Q]" in out
    assert "[col]" in out
    assert REASON in out
