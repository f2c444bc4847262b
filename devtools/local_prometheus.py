"""A real Prometheus on loopback (Debian's binary, a temp dir, a free port, 1 s scrapes).

The dashboard test and the Spark audit benchmark both use it to read what the services export. It
loads KSB's alert rules (infra/prometheus/alerts.yml), as compose's Prometheus does, so the
dashboard test sees them evaluate against what the services export.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from devtools.localstack import free_port

__all__ = ["PROMETHEUS", "Prometheus"]

PROMETHEUS = "/usr/bin/prometheus"
ALERT_RULES = Path(__file__).resolve().parents[1] / "infra" / "prometheus" / "alerts.yml"


class Prometheus:
    """``prometheus`` scraping ``jobs`` (job name -> metrics port on 127.0.0.1) every second."""

    def __init__(self, workdir: Path, jobs: dict[str, int], scrape_s: float = 1.0) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        # JSON is YAML: no YAML writer needed for a config this small.
        config = {
            "global": {
                "scrape_interval": f"{scrape_s:g}s",
                "evaluation_interval": f"{scrape_s:g}s",
            },
            "rule_files": [str(ALERT_RULES)],
            "scrape_configs": [
                {"job_name": name, "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}
                for name, port in jobs.items()
            ],
        }
        (workdir / "prometheus.yml").write_text(json.dumps(config))
        self.jobs = jobs
        self.scrape_s = scrape_s
        self.port = free_port()
        self.log_path = workdir / "prometheus.log"
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [
                    PROMETHEUS,
                    f"--config.file={workdir / 'prometheus.yml'}",
                    f"--storage.tsdb.path={workdir / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def _failed(self) -> str:
        return f"prometheus exited:\n{self.log_path.read_text(errors='replace')[-3000:]}"

    def wait_ready(self, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(self._failed())
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2):
                    return
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.2)
        raise TimeoutError(f"prometheus not ready in {timeout_s}s")

    def answer(self, expr: str) -> dict[str, Any]:
        """The API's whole answer to an instant query, error answers included (400 for a query
        that does not parse), so a caller can report why a query failed."""
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode(
            {"query": expr}
        )
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                body: dict[str, Any] = json.load(resp)
        except urllib.error.HTTPError as exc:
            body = json.load(exc)
        return body

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result vector (raises on an error answer)."""
        body = self.answer(expr)
        if body.get("status") != "success":
            raise RuntimeError(f"prometheus query {expr!r}: {body.get('error')}")
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def rules(self) -> list[dict[str, Any]]:
        """Every rule Prometheus loaded, with its health and last evaluation (/api/v1/rules)."""
        url = f"http://127.0.0.1:{self.port}/api/v1/rules"
        with urllib.request.urlopen(url, timeout=10) as resp:
            body: dict[str, Any] = json.load(resp)
        return [rule for group in body["data"]["groups"] for rule in group["rules"]]

    def wait_targets_up(self, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        up: set[str] = set()
        while time.monotonic() < deadline:
            up = {r["metric"]["job"] for r in self.query("up == 1")}
            if up >= set(self.jobs):
                return
            time.sleep(0.2)
        raise TimeoutError(f"prometheus targets not up: {sorted(set(self.jobs) - up)}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
