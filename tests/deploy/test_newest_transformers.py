"""Our worker beside the newest transformers and Hugging Face's `kernels` distribution.

`make test-newest` runs this module in an environment with both at their newest releases (the
main environment runs it too). Our kernels install as `zerobubble.kernels`, so `import kernels`
finds Hugging Face's even with the repository root first on the path, where a `kernels/` folder
sits; and the worker, loaded beside transformers, generates what transformers generates.
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.support.drive import run_job
from tests.support.hf_oracle import hf_greedy
from zerobubble.worker_svc.server import WorkerConfig, build_runner

MAX_TOKENS = 16
MESSAGES = [
    [{"role": "user", "content": "Name three primary colours."}],
    [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
]


def test_import_kernels_finds_hugging_faces_distribution() -> None:
    import transformers  # noqa: F401  (5.25 and later import `kernels` while loading)

    spec = importlib.util.find_spec("kernels")
    if spec is None or spec.origin is None:
        # Nothing, or only our folder as a namespace portion: the distribution is not installed.
        pytest.skip("Hugging Face's `kernels` is not installed here (`make test-newest` installs it)")
    # By name: the layering test refuses a bare `import kernels` in our code.
    hf_kernels = importlib.import_module("kernels")
    assert "site-packages" in str(hf_kernels.__file__), hf_kernels.__file__
    assert callable(hf_kernels.get_kernel)


def test_a_worker_generates_what_transformers_generates(smollm2_dir) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = [
        list(tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=False))
        for m in MESSAGES
    ]
    # float32: the precision Hugging Face's greedy reference is computed in (auto may pick bfloat16).
    runner, _ = build_runner(WorkerConfig(dtype="float32", kv_cache_memory_gb=0.25, max_num_seqs=4, spec_method="none"))
    outputs = run_job(runner, [(str(i), p, dict(max_tokens=MAX_TOKENS)) for i, p in enumerate(prompts)])
    assert [outputs[str(i)] for i in range(len(prompts))] == hf_greedy(smollm2_dir, prompts, MAX_TOKENS)
