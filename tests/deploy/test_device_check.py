"""The one-shot GPU check's dry run (`scripts/device_check.sh OUT --dry-run`) on the CPU.

The dry run executes every section at tiny shapes: Triton kernels under the interpreter against
their torch twins, the four model families against Hugging Face, the real service's greedy
output against `generate`, and the throughput driver. The parts that need CUDA (sync-debug
mode, CUDA graphs, busy fraction from events) must be reported as skipped, never silently
passed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_every_kernel_compiles_for_ampere_and_hopper(tmp_path: Path) -> None:
    """`scripts/compile_kernels.py`: every kernel of `kernels/`, launched as device_check's
    kernel section launches it at a real model's shapes, compiled to a cubin for sm_80 and
    sm_90 with the Triton wheel's own ptxas (no GPU, no driver)."""
    import pytest

    triton = pytest.importorskip("triton")
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this Triton wheel has no NVIDIA backend")
    out = tmp_path / "compile.json"
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "compile_kernels.py"), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["missing"] == []
    compiled = {(r["kernel"], r["target"]) for r in report["results"] if r["ok"]}
    kernels = {r["kernel"] for r in report["results"]}
    assert len(kernels) >= 9 and compiled == {(k, t) for k in kernels for t in ("sm_80", "sm_90")}
    # The attention kernel's 16-bit variants (what a GPU runs: --dtype auto) multiply on
    # tensor cores and keep everything in registers; float32 ones may not.
    attention = [r for r in report["results"] if r["kernel"] == "_paged_attention_kernel"]
    assert {r["constexprs"]["BLOCK_M"] for r in attention} == {16, 64}
    half = [r for r in attention if not r["constexprs"]["DOT_F32"]]
    assert half and all(r["mma"] for r in half)
    if all("stack_bytes" in r for r in half):  # cuobjdump ran
        assert [r["stack_bytes"] for r in half] == [0] * len(half), half


# Every section end to end on the CPU: about two minutes, in the slow suite (make test's time);
# the kernels' compile check below stays in the default run.
@pytest.mark.slow
def test_device_check_dry_run(tmp_path: Path) -> None:
    # No carried wheels: a checkout may hold the GPU machine's (another Python's) in .device-wheels.
    env = dict(os.environ, TRITON_INTERPRET="1", DEVICE_WHEELS=str(tmp_path / "no-wheels"))
    proc = subprocess.run(
        [str(REPO_ROOT / "scripts" / "device_check.sh"), str(tmp_path), "--dry-run"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "device_check.json").read_text())
    assert report["ok"] and report["dry_run"] and report["complete"]
    by_section: dict[str, list[dict]] = {}
    for record in report["records"]:
        by_section.setdefault(record["section"], []).append(record)
    assert set(by_section) == {
        "environment", "kernels", "families", "service", "sync_free", "roofline", "throughput", "served"
    }  # fmt: skip
    # Off a GPU the floor ratios are reported, never judged; every figure is there.
    for record in by_section["roofline"]:
        assert record["status"] == "skip", record
        assert record["values"]["ms"] > 0 and record["values"]["floor_ms"] > 0 and record["values"]["top_kernels"]
    kernels = {r["name"] for r in by_section["kernels"] if r["status"] == "pass"}
    assert {
        "slot_mapping",
        "assemble_inputs",
        "update_state",
        "ngram_propose",
        "keyed_uniform",
        "count_accepted",
        "rejection_sample",
        *(f"write_kv_cache + paged_attention {d}{b}" for d in ("float32", "bfloat16") for b in ("", " decodes")),
    } <= kernels
    environment = {r["name"]: r for r in by_section["environment"]}
    assert environment["versions"]["values"]["torch"] == torch_version()
    assert all(
        environment[f"import {m}"]["status"] == "pass" for m in ("zerobubble.worker_svc.runner", "zerobubble.rpc")
    )
    assert {r["name"] for r in by_section["families"] if r["status"] == "pass"} == {
        f"{family} {dtype}" for family in ("llama", "qwen2", "qwen3", "mistral") for dtype in ("float32", "bfloat16")
    }
    assert all(r["status"] == "pass" for r in by_section["service"])
    assert [r["status"] for r in by_section["sync_free"]] == ["skip"]
    throughput = {r["name"]: r for r in by_section["throughput"]}
    assert throughput["cuda_graphs=True"]["status"] == "skip"
    for n in (2, 8, 16):
        values = throughput[f"{n} prompts, cuda_graphs=False"]["values"]
        assert values["ngram_async_tok_s"] > 0 and values["none_sync_tok_s"] > 0
        assert values["none_async_gpu_busy"] is None  # no CUDA events on the CPU
    # The real worker and scheduler processes, sync and async in front of one worker.
    served = {r["name"]: r for r in by_section["served"]}
    assert served["spec=ngram graphs=False n=2"]["status"] == "pass"
    assert served["spec=ngram graphs=False n=2 via fronts"]["status"] == "pass"
    values = served["spec=ngram graphs=False n=2"]["values"]
    assert len(values["async_tok_s"]) == len(values["sync_tok_s"]) == len(values["async_over_sync"]) == 1
    assert values["async_over_sync"][0] == pytest.approx(values["async_tok_s"][0] / values["sync_tok_s"][0], rel=0.01)
    assert 0.0 <= values["async_worker_idle"][0] <= 1.0
    table = (tmp_path / "device_check.md").read_text()
    assert "| kernels | assemble_inputs | PASS |" in table and "dry run" in table


def torch_version() -> str:
    from importlib.metadata import version

    return version("torch")


def test_device_check_sigterm_still_writes_what_was_found(tmp_path: Path) -> None:
    """The wrapper's timeout sends SIGTERM: the section running in its own process is stopped,
    and the report holds the records it had written, marked incomplete."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO_ROOT))
    cmd = [sys.executable, str(REPO_ROOT / "scripts" / "device_check"), str(tmp_path), "--dry-run"]
    proc = subprocess.Popen(cmd + ["--only", "environment,kernels,families"], env=env, cwd=REPO_ROOT)
    try:
        deadline = time.monotonic() + 120
        # Wait until the kernels section has written a record of its own, then terminate.
        while not any(r.get("section") == "kernels" for r in _records(tmp_path / ".part-kernels.json")):
            assert proc.poll() is None and time.monotonic() < deadline, "kernels never started"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
    report = json.loads((tmp_path / "device_check.json").read_text())
    assert not report["ok"] and not report["complete"]
    sections = [r["section"] for r in report["records"]]
    assert "kernels" in sections and "families" not in sections and sections[-1] == "run"
    assert "incomplete" in (tmp_path / "device_check.md").read_text()


def _records(path: Path) -> list[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return []
