"""The benchmark workloads ship inside the wheel, so `zerobubble bench --dataset grounded` works
from an install, not only from a clone."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_carries_every_shipped_workload(tmp_path: Path) -> None:
    pytest.importorskip("setuptools")
    # A copy without the clone's build leftovers: an editable install's egg-info lists every
    # file it saw, which would put the workloads in the wheel whatever pyproject.toml says.
    source = tmp_path / "src"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", ".venv*", "build", "*.egg-info", "__pycache__"))
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run(
        [*pip_wheel, "-w", str(tmp_path), str(source)],
        check=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("zerobubble-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = sorted(p.name for p in (ROOT / "zerobubble" / "workloads").glob("*.jsonl"))
    assert shipped, "no workloads in zerobubble/workloads/"
    assert [n for n in shipped if f"zerobubble/workloads/{n}" not in names] == []
