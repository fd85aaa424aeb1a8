"""``zerobubble bench plot A.json B.json … -o OUT.png``: several bench reports side by side.

Three panels: output throughput per run (bars), and the empirical CDFs of time to first token
and of inter-token latency over all requests of each run. matplotlib comes with the ``plot``
extra (``pip install 'zerobubble[plot]'``); it is imported only here.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def load_report(path: str | Path) -> dict[str, Any]:
    """A ``bench --json`` report.

    Raises:
        ValueError: the file is not a bench report (the message names it).
    """
    try:
        report = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: {exc}") from exc
    if not isinstance(report, dict) or "requests" not in report or "output_tokens_per_s" not in report:
        raise ValueError(f"{path}: not a `zerobubble bench --json` report")
    return report


def label_of(path: str | Path, report: dict[str, Any]) -> str:
    """The file name, which is what the user chose to call the run."""
    return Path(path).stem


def cdf(values: Sequence[float]) -> tuple[list[float], list[float]]:
    """(sorted values, cumulative fraction) of an empirical CDF."""
    ordered = sorted(values)
    n = len(ordered)
    return ordered, [(i + 1) / n for i in range(n)]


def plot_reports(paths: Sequence[str | Path], out: str | Path, title: str = "") -> None:
    """Draw the reports at ``paths`` into the image ``out`` (format from its suffix)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    reports = [(label_of(p, r), r) for p, r in ((p, load_report(p)) for p in paths)]
    fig, (ax_tp, ax_ttft, ax_itl) = plt.subplots(1, 3, figsize=(15, 4.2))
    labels = [label for label, _ in reports]
    throughput = [r["output_tokens_per_s"] for _, r in reports]
    colors = [f"C{i}" for i in range(len(reports))]
    bars = ax_tp.bar(range(len(reports)), throughput, color=colors)
    ax_tp.bar_label(bars, fmt="%.1f")
    ax_tp.set_xticks(range(len(reports)), labels, rotation=15, ha="right")
    ax_tp.set_ylabel("output tokens / s")
    ax_tp.set_title("throughput")
    for ax, key, name in ((ax_ttft, "ttft_s", "time to first token"), (ax_itl, "itl_s", "inter-token latency")):
        for (label, report), color in zip(reports, colors):
            ok = [r for r in report["requests"] if r.get("finish_reason") != "error"]
            if key == "itl_s":
                values = [gap for r in ok for gap in r.get("itl_s") or ()]
            else:
                values = [r["ttft_s"] for r in ok if r.get("ttft_s") is not None]
            if values:
                xs, ys = cdf([v * 1000 for v in values])
                ax.step(xs, ys, where="post", color=color, label=label)
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of " + ("requests" if key == "ttft_s" else "gaps"))
        ax.set_title(name + " (CDF)")
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # minor labels collide on a short log axis
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small", loc="lower right")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def run_plot(args: argparse.Namespace) -> int:
    """Entry point of ``zerobubble bench plot``; returns the exit status."""
    try:
        plot_reports(args.reports, args.output, args.title)
    except ImportError:
        print("error: bench plot needs matplotlib: pip install 'zerobubble[plot]'", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}")
    return 0
