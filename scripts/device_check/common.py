"""What every section shares: the report's records, the run's context, tensor comparisons."""

from __future__ import annotations

import json
import logging
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

PACKAGE_DIR = Path(__file__).resolve().parent  # run as `python scripts/device_check`
REPO_ROOT = PACKAGE_DIR.parents[1]

logger = logging.getLogger("device_check")

PASS, FAIL, SKIP = "pass", "fail", "skip"


class OutOfTime(BaseException):
    """SIGTERM (the wrapper's timeout) arrived: stop here and write what was found.

    A `BaseException`, so the sections' own ``except Exception`` do not swallow it.
    """


@dataclass(slots=True)
class Record:
    """One line of the report."""

    section: str
    name: str
    status: str
    detail: str = ""
    values: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


@dataclass(slots=True)
class Context:
    """What every section gets: the device, the shapes to use, where to write."""

    device: torch.device
    dry_run: bool
    out_dir: Path
    records: list[Record] = field(default_factory=list)
    deadline: float = float("inf")  # time.perf_counter() by which the sections must be done
    part_file: Path | None = None  # a section's own process: its records so far, after each

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def time_left(self) -> float:
        return self.deadline - time.perf_counter()

    def add(self, section: str, name: str, status: str, detail: str = "", **values: Any) -> None:
        self.records.append(Record(section, name, status, detail, values))
        logger.info("%-10s %-40s %s %s", section, name, status.upper(), detail)
        self._save_part()

    def finish_last(self, started: float) -> None:
        """Time the latest record from ``started`` (and save it again with its time)."""
        self.records[-1].seconds = time.perf_counter() - started
        self._save_part()

    def _save_part(self) -> None:
        if self.part_file is not None:  # the parent reads them even if this process is killed
            write_atomic(self.part_file, json.dumps([asdict(r) for r in self.records]))


# ----------------------------------------------------------------------------------- helpers


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def tensors_close(a: torch.Tensor, b: torch.Tensor, atol: float = 1e-4, rtol: float = 1e-4) -> tuple[bool, str]:
    if a.shape != b.shape:
        return False, f"shapes {tuple(a.shape)} vs {tuple(b.shape)}"
    if not a.is_floating_point():
        diff = int((a != b).sum())
        return diff == 0, f"{diff} of {a.numel()} differ"
    err = (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
    ok = bool(torch.allclose(a.float(), b.float(), atol=atol, rtol=rtol))
    return ok, f"max abs diff {err:.2e}"


Compare = Callable[[tuple, tuple], tuple[bool, str]]


def near_tie_draws(ref: tuple, out: tuple) -> tuple[bool, str]:
    """``rejection_sample``'s (tokens, accepted counts) of the torch twin and the kernel on CUDA.

    Triton's float32 log and division are approximate there; a draw is an exponential race
    whose winner has a tiny -log(u), so a near tie may go to the other token. The acceptance
    counts must agree; at most 1/32 of the tokens may differ.
    """
    (ref_tokens, ref_accepted), (tokens, num_accepted) = ref, out
    num_diff = int((tokens != ref_tokens).sum())
    same_counts = bool(torch.equal(num_accepted, ref_accepted))
    ok = same_counts and num_diff <= max(1, tokens.numel() // 32)
    return ok, f"accepted counts {'equal' if same_counts else 'DIFFER'}; {num_diff} of {tokens.numel()} tokens differ"


def stop_server(proc: subprocess.Popen) -> None:
    """Terminate a server (kill it if it does not end within 15 s)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
