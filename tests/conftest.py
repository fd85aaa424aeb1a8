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

# Services the tests start read their flags' environment fallbacks: their greedy output is
# checked against Hugging Face's float32 model, so they compute in float32 whatever `--dtype
# auto` would pick on this CPU. Tests of other dtypes pass --dtype explicitly.
os.environ.setdefault("ZEROBUBBLE_DTYPE", "float32")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct, converted to a cached Hugging Face directory."""
    from zerobubble.worker_svc.model_loader import resolve_model

    return resolve_model("smollm2-135m")


@pytest.fixture(scope="session")
def grounded_rows() -> list[dict[str, Any]]:
    """Rows of the grounded workload: ``$ZEROBUBBLE_WORKLOAD``, else the shipped one (zerobubble/workloads/)."""
    path = Path(os.environ.get("ZEROBUBBLE_WORKLOAD", REPO_ROOT / "zerobubble" / "workloads" / "grounded.jsonl"))
    if not path.is_file():
        pytest.skip(f"workload file {path} not found")
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="session")
def cpu_kernels() -> None:
    """The compiled CPU kernels (zerobubble.kernels.cpu), built on first use: a failed build fails
    the tests that need them rather than skipping them."""
    from zerobubble.kernels import cpu

    assert cpu.load(), "the compiled CPU kernels did not build or load (the warning above says why)"


# --- the worker-runtime harness's runners (tests/support/runner_harness.py), shared by several modules


@pytest.fixture(scope="session")
def eagle_head_dir(smollm2_dir, grounded_rows, tmp_path_factory) -> Path:
    """An EAGLE head for SmolLM2 fitted to its forward over 16 grounded prompts
    (tests/support/drafting.py `fitted_head`): drafts that are right now and then, made in seconds."""
    from tests.support.drafting import fitted_head
    from tests.support.e2e import prompt_ids

    prompts = prompt_ids(smollm2_dir, grounded_rows[1::3])
    return fitted_head(smollm2_dir, prompts, tmp_path_factory.mktemp("eagle-head"))


def _runner(spec: str, draft_acceptance: str = "rejection", draft_model: str = ""):
    # Imported here: the light client's floor environment collects tests without torch.
    from tests.support.runner_harness import K
    from zerobubble.worker_svc.server import WorkerConfig, build_runner

    cfg = WorkerConfig(
        dtype="float32",
        spec_method=spec,
        num_spec_tokens=K,
        kv_cache_memory_gb=0.25,
        max_num_seqs=16,
        draft_model=draft_model,
        draft_acceptance=draft_acceptance,
    )
    runner, _ = build_runner(cfg)
    return runner


@pytest.fixture(scope="module")
def plain_runner(smollm2_dir):
    """SmolLM2 in float32 without a proposer."""
    from zerobubble.worker_svc.server import WorkerConfig, build_runner

    runner, _ = build_runner(
        WorkerConfig(dtype="float32", kv_cache_memory_gb=0.25, max_num_seqs=16, spec_method="none")
    )
    return runner


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    """The scheduler's tokenizer of SmolLM2 (its chat template included)."""
    from zerobubble.scheduler_svc.tokenizer import Tokenizer
    from zerobubble.worker_svc.server import tokenizer_fields

    fields = tokenizer_fields(smollm2_dir)
    return Tokenizer(fields["tokenizer_json"], fields["chat_template"], fields["bos_token"], fields["eos_token"])


@pytest.fixture(scope="module")
def ngram_runner(smollm2_dir):
    return _runner("ngram")


@pytest.fixture(scope="module")
def suffix_runner(smollm2_dir):
    return _runner("suffix")


@pytest.fixture(scope="module")
def draft_runner(smollm2_dir):
    # SmolLM2 drafting for itself, as in test_async_spec_e2e: greedy drafts are then always right,
    # so a rejected draft can only mean that the runner fed or verified the wrong thing.
    return _runner("draft", draft_model="smollm2-135m")


@pytest.fixture(scope="module")
def keyed_draft_runner(smollm2_dir):
    # Keyed acceptance (the worker's default): draft-model drafts verified like n-gram ones, so
    # seeded output is the unspeculated one. `draft_runner` keeps rejection sampling covered.
    return _runner("draft", draft_acceptance="keyed", draft_model="smollm2-135m")


@pytest.fixture(scope="module")
def eagle_runner(eagle_head_dir):
    # An EAGLE head fitted to SmolLM2 (eagle_head_dir), keyed acceptance.
    return _runner("eagle", draft_acceptance="keyed", draft_model=str(eagle_head_dir))


@pytest.fixture(params=["ngram", "draft", "eagle"])
def spec_runner(request):
    return request.getfixturevalue(f"{request.param}_runner")


@pytest.fixture(scope="module")
def grounded(smollm2_dir, grounded_rows) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, Hugging Face greedy outputs capped at 64 tokens) for every grounded row."""
    from tests.support.e2e import hf_reference, prompt_ids

    return prompt_ids(smollm2_dir, grounded_rows), hf_reference(smollm2_dir, grounded_rows)
