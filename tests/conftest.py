"""Shared pytest fixtures: the embedded model directory and the grounded workload rows."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

try:
    import torch
except ImportError:  # the light client install (`make test-floor`) has no torch
    torch = None

# Triton picks compiled vs interpreted when a kernel is defined (at import), so on machines
# without CUDA the interpreter must be on before any test module imports `kernels`.
if torch is not None and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct, converted to a cached Hugging Face directory."""
    from worker_svc.model_loader import resolve_model

    return resolve_model("smollm2-135m")


@pytest.fixture(scope="session")
def grounded_rows() -> list[dict[str, Any]]:
    """Rows of the grounded workload (``$ZEROBUBBLE_WORKLOAD`` or ``../shared/workloads/grounded.jsonl``)."""
    path = Path(os.environ.get("ZEROBUBBLE_WORKLOAD", REPO_ROOT.parent / "shared" / "workloads" / "grounded.jsonl"))
    if not path.is_file():
        pytest.skip(f"workload file {path} not found")
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]
