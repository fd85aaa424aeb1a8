"""`zerobubble bench plot`: reports in, one picture with throughput and TTFT / ITL CDFs out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from zerobubble.bench import BenchRow, summarize
from zerobubble.bench_plot import cdf, load_report
from zerobubble.client import Completion

pytest.importorskip("matplotlib")
ROOT = Path(__file__).resolve().parents[2]


def write_report(path: Path, scale: float) -> None:
    rows = [BenchRow(index=i, kind="", max_tokens=4, prompt="p") for i in range(5)]
    completions = [
        Completion(
            token_ids=[1, 2, 3],
            finish_reason="max_tokens",
            ttft_s=scale * (i + 1),
            itl=[scale / 10, scale / 5],
            e2e_s=scale * (i + 2),
        )
        for i in range(5)
    ]
    report = summarize(rows, completions, wall_s=2.0 * scale, concurrency=2)
    assert report["requests"][0]["itl_s"] == [scale / 10, scale / 5]
    path.write_text(json.dumps(report))


def test_cdf_is_sorted_and_ends_at_one() -> None:
    xs, ys = cdf([3.0, 1.0, 2.0])
    assert xs == [1.0, 2.0, 3.0] and ys == pytest.approx([1 / 3, 2 / 3, 1.0])


def test_plot_command_writes_a_png(tmp_path: Path) -> None:
    a, b, out = tmp_path / "grpc.json", tmp_path / "openai.json", tmp_path / "out.png"
    write_report(a, 0.1)
    write_report(b, 0.2)
    done = subprocess.run(
        [sys.executable, "-m", "zerobubble", "bench", "plot", str(a), str(b), "-o", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_plot_rejects_a_file_that_is_not_a_report(tmp_path: Path) -> None:
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="not a `zerobubble bench --json` report"):
        load_report(bad)
    done = subprocess.run(
        [sys.executable, "-m", "zerobubble", "bench", "plot", str(bad), "-o", str(tmp_path / "o.png")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "not a `zerobubble bench --json` report" in done.stderr
