"""`scripts/bench_peer.py` (ours vs llama-server) drives our real services over the OpenAI API.

llama-server itself is not built here (6-20 minutes of compiling); the harness around it, the
same for both systems, is what runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from zerobubble.kernels.cpu import cpu_model

ROOT = Path(__file__).resolve().parents[2]


def test_bench_peer_runs_our_server_and_counts_every_token(tmp_path: Path) -> None:
    out = tmp_path / "peer.json"
    cmd = [
        sys.executable, str(ROOT / "scripts" / "bench_peer.py"), "--llama-server", str(tmp_path / "unused"),
        "--systems", "ours --dtype float32", "--limit", "2", "--max-tokens-cap", "4",
        "--concurrency", "1", "--rounds", "1", "--json", str(out),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["cpu"].startswith(cpu_model()) and "cores" in report["cpu"]  # the machine it ran on
    assert f"CPU: {report['cpu']}" in proc.stdout
    measured = report["results"]["1"]["ours --dtype float32"]
    assert measured["tokens"] == 2 * 4  # ignore_eos: every row generates exactly its max_tokens
    assert measured["wall_s"] > 0
    assert "| ours --dtype float32 |" in proc.stdout
