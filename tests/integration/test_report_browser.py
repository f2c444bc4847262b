"""`make report`'s page opened in a real headless browser (Debian's chromium, from `make setup`).

The page must draw every chart with no network: Chromium runs with background networking off, on
a fresh profile, and the DOM it dumps after the scripts ran must hold Plotly's SVG for each chart
with a trace drawn in it. The screenshot must show coloured data (Plotly's trace colours, which
nothing else on the page uses) in a band for every chart down the page.

Needs no Kafka: it runs `python -m ksb.spark.report` on Parquet files written here.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("plotly")
pytest.importorskip("pyarrow")
Image = pytest.importorskip("PIL.Image")

from devtools.runner import REPO_ROOT  # noqa: E402
from ksb.spark.report import CHARTS  # noqa: E402
from tests.unit.test_report import write_outputs  # noqa: E402

WIDTH, HEIGHT = 1400, 3000


def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.fail("chromium is not installed: run `make setup` (it installs Debian's chromium)")
    return path


def _browse(page: Path, profile: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [
            _chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            f"--user-data-dir={profile}",
            f"--window-size={WIDTH},{HEIGHT}",
            "--virtual-time-budget=10000",  # let the page's scripts run to the end
            *args,
            page.as_uri(),
        ],
        capture_output=True,
        timeout=120,
        check=True,
    )


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("report")
    write_outputs(tmp / "spark")
    target = tmp / "index.html"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "ksb.spark.report",
            "--input",
            str(tmp / "spark"),
            "--output",
            str(target),
        ],
        cwd=REPO_ROOT,
        check=True,
        timeout=120,
    )
    return target


def test_every_chart_is_drawn_as_svg_after_render(report: Path, tmp_path: Path) -> None:
    dom = _browse(report, tmp_path / "profile", "--dump-dom").stdout.decode()
    sections = re.split(r"<section class=\"chart\"", dom)[1:]
    drawn: dict[str, str] = {}
    for section in sections:
        found = re.search(r'data-chart="([a-z_]+)"', section)
        assert found is not None
        drawn[found.group(1)] = section
    assert tuple(drawn) == CHARTS
    for key, section in drawn.items():
        assert 'class="main-svg"' in section, f"{key}: no SVG drawn"
        # A line or a bar of data, not just the axes: Plotly puts each trace in a "trace" group.
        assert re.search(r'class="[^"]*\btrace\b', section), f"{key}: no trace drawn"


def test_the_screenshot_shows_data_in_every_chart(report: Path, tmp_path: Path) -> None:
    shot = tmp_path / "report.png"
    _browse(report, tmp_path / "profile", f"--screenshot={shot}")
    image = Image.open(shot).convert("RGB")
    assert image.size == (WIDTH, HEIGHT)
    pixels = image.load()
    assert pixels is not None

    def coloured(y: int) -> bool:
        # Trace colours are saturated; text, grid lines and the table are greys and dark blue.
        for x in range(0, WIDTH, 2):
            r, g, b = pixels[x, y]
            if max(r, g, b) - min(r, g, b) > 80:
                return True
        return False

    rows = [y for y in range(0, HEIGHT, 2) if coloured(y)]
    bands: list[list[int]] = []
    for y in rows:
        if bands and y - bands[-1][1] <= 60:
            bands[-1][1] = y
        else:
            bands.append([y, y])
    # One band of data per chart at least (a chart's legend may make a second).
    assert len(bands) >= len(CHARTS), bands
    assert bands[-1][1] - bands[0][0] > HEIGHT // 2
