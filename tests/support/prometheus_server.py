"""A real Prometheus server for tests: started on loopback, scraping given targets, queried over
its HTTP API (https://prometheus.io/docs/prometheus/latest/querying/api/).

The server comes from the Debian/Ubuntu package ``prometheus`` (``tests.support.tools.require``). Each
server gets its own config, data directory and port, so runs never share state. Scrape targets
are file-based service discovery, so the server can start (which takes seconds) while the
services it will scrape are still loading, and learns their ports when they announce them.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.support.polling import wait_until
from zerobubble.tools.launch import free_port


class PrometheusError(Exception):
    """The server did not start, or the API answered with an error."""


@dataclass(slots=True)
class ScrapeJob:
    """One scrape job: its name (the ``job`` label), targets and labels added to every series."""

    name: str
    targets: list[str]
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class PrometheusServer:
    """A running ``prometheus`` process, its API address and its service-discovery files."""

    proc: subprocess.Popen
    url: str
    log_path: Path
    sd_dir: Path

    def set_targets(self, job: ScrapeJob) -> None:
        """Point scrape job ``job.name`` at ``job.targets`` (Prometheus rereads the file)."""
        path = self.sd_dir / f"{job.name}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps([{"targets": job.targets, "labels": job.labels}]))
        tmp.replace(path)  # atomic: Prometheus never reads half a file

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    # --- the HTTP API ---------------------------------------------------------------------------

    def api(self, path: str, **params: Any) -> Any:
        """GET ``/api/v1/<path>`` and return its ``data``; list values repeat the parameter."""
        query = urllib.parse.urlencode(
            [(k, v) for k, vs in params.items() for v in (vs if isinstance(vs, list) else [vs]) if v is not None]
        )
        url = f"{self.url}/api/v1/{path}" + (f"?{query}" if query else "")
        try:
            with urllib.request.urlopen(url, timeout=30) as reply:
                body = json.load(reply)
        except urllib.error.HTTPError as exc:
            body = json.loads(exc.read() or b"{}")
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> dict[str, Any]:
        """An instant query: ``{"resultType": ..., "result": [...]}``."""
        return self.api("query", query=expr, time=None if at is None else f"{at:.3f}")

    def vector(self, expr: str, at: float | None = None) -> list[tuple[dict[str, str], float]]:
        """An instant query that must return a vector: (labels, value) per sample."""
        data = self.query(expr, at)
        if data["resultType"] != "vector":
            raise PrometheusError(f"{expr!r} returned a {data['resultType']}, not a vector")
        return [(s["metric"], float(s["value"][1])) for s in data["result"]]

    def scalar_sum(self, expr: str, at: float | None = None) -> float | None:
        """The one value of an expression that yields at most one sample (None when empty)."""
        samples = self.vector(expr, at)
        if len(samples) > 1:
            raise PrometheusError(f"{expr!r} returned {len(samples)} samples, expected one")
        return samples[0][1] if samples else None

    def wait_until(self, predicate: Any, timeout: float, what: str, poll: float = 0.25) -> Any:
        """Poll ``predicate()`` until it returns something truthy; that value is returned."""
        return wait_until(predicate, timeout, f"Prometheus to show {what}", poll)

    def wait_targets_up(self, num_targets: int, timeout: float = 30.0) -> None:
        """Block until ``num_targets`` active targets have been scraped successfully."""

        def up() -> bool:
            active = self.api("targets", state="active")["activeTargets"]
            return sum(t["health"] == "up" for t in active) >= num_targets

        self.wait_until(up, timeout, f"{num_targets} targets up")


def start_prometheus(
    directory: Path, job_names: list[str], rule_files: list[Path], interval_s: float = 1.0, timeout: float = 60.0
) -> PrometheusServer:
    """Start ``prometheus`` with one scrape job per name (targets come later, from
    :meth:`PrometheusServer.set_targets`), evaluating ``rule_files`` every ``interval_s``."""
    sd_dir = directory / "targets"
    sd_dir.mkdir(parents=True, exist_ok=True)
    interval = f"{int(interval_s * 1000)}ms"
    config = {
        "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
        "rule_files": [str(p.resolve()) for p in rule_files],
        "scrape_configs": [
            {
                "job_name": name,
                "file_sd_configs": [{"files": [str(sd_dir / f"{name}.json")], "refresh_interval": interval}],
            }
            for name in job_names
        ],
    }
    config_path = directory / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    log_path = directory / "prometheus.log"
    for _ in range(3):  # a port taken between free_port() and the bind: try another
        port = free_port()
        with log_path.open("w") as log:
            proc = subprocess.Popen(
                [
                    "prometheus",
                    f"--config.file={config_path}",
                    f"--storage.tsdb.path={directory / 'data'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                    "--storage.tsdb.retention.time=1h",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        server = PrometheusServer(proc, f"http://127.0.0.1:{port}", log_path, sd_dir)
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{server.url}/-/ready", timeout=2) as reply:
                    if reply.status == 200:
                        return server
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        server.stop()
        if "address already in use" not in server.log():
            break
    raise PrometheusError(f"prometheus did not become ready:\n{server.log()}")
