"""`scripts/grpc_fanout.py`, the transport's floor under `bench_sim.py host`: real gRPC servers
stream every message of every call, and the window counts what the clients received in it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_fanout_streams_every_message_and_reports_per_message_cost(tmp_path: Path) -> None:
    out = tmp_path / "fanout.json"
    cmd = [
        sys.executable,
        str(ROOT / "scripts" / "grpc_fanout.py"),
        *("--requests", "3", "8", "--servers", "1", "2", "--connections", "4", "--max-tokens", "300"),
        *("--repeats", "1", "--json", str(out)),
    ]
    # The script raises if a stream ended short of its replies, or before every stream settled.
    subprocess.run(cmd, check=True, cwd=ROOT, timeout=120, capture_output=True, text=True)
    runs = json.loads(out.read_text())
    assert sorted((r["requests"], r["mode"], r["servers"]) for r in runs) == [
        (n, mode, s) for n in (3, 8) for mode in ("free", "steps") for s in (1, 2)
    ]
    for run in runs:
        # The window opens at 10 % of each stream's messages and closes at the first end.
        assert 0 < run["replies_per_stream"] < 300
        assert run["ms_per_step"] > 0
        # Both ends spend CPU on every message; /proc ticks are 10 ms, so only > 0 is certain.
        assert run["server_us_per_reply"] >= 0 and run["client_us_per_reply"] > 0
