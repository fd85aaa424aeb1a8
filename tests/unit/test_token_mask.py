"""The grammar-mask kernel: Triton (CPU interpreter) vs its torch twin, the twin vs the bits
themselves, and the CPU step's host unpacking vs the twin."""

from __future__ import annotations

import os

# Triton decides interpreted vs compiled when a kernel is defined, i.e. at import time.
os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from zerobubble.kernels._triton import HAS_TRITON  # noqa: E402
from zerobubble.kernels.token_mask import apply_token_bitmask, unpack_bitmask  # noqa: E402

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


def _case(
    num_logit_rows: int, vocab: int, rows: list[int], seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(seed)
    words = -(-vocab // 32)
    bitmask = torch.from_numpy(rng.integers(-(2**31), 2**31, size=(len(rows), words), dtype=np.int64).astype(np.int32))
    logits = torch.from_numpy(rng.standard_normal((num_logit_rows, vocab)).astype(np.float32))
    return logits, torch.tensor(rows, dtype=torch.long), bitmask


def test_the_twin_forbids_exactly_the_clear_bits():
    logits, rows, bitmask = _case(5, 100, [3, 0], seed=1)
    out = logits.clone()
    apply_token_bitmask(out, rows, bitmask, impl="torch")
    for i, row in enumerate(rows.tolist()):
        for t in range(100):
            allowed = (int(bitmask[i, t // 32]) >> (t % 32)) & 1
            assert out[row, t] == (logits[row, t] if allowed else float("-inf"))
    untouched = [r for r in range(5) if r not in rows.tolist()]
    assert torch.equal(out[untouched], logits[untouched])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("vocab", "rows"), [(100, [3, 0]), (2085, [1, 4, 2]), (1024, [0])])
def test_the_kernel_equals_its_twin(dtype: torch.dtype, vocab: int, rows: list[int]):
    logits, index, bitmask = _case(6, vocab, rows, seed=vocab)
    logits = logits.to(dtype)
    twin, kernel = logits.clone(), logits.clone()
    apply_token_bitmask(twin, index, bitmask, impl="torch")
    apply_token_bitmask(kernel, index, bitmask, impl="triton")
    assert torch.equal(kernel, twin)


def test_the_cpu_steps_host_unpacking_equals_the_twin():
    from zerobubble.worker_svc.grammar import host_mask_bias

    logits, rows, bitmask = _case(4, 77, [2, 1, 3], seed=7)
    twin = logits.clone()
    apply_token_bitmask(twin, rows, bitmask, impl="torch")
    host = logits.clone().index_add_(0, rows, host_mask_bias(bitmask.numpy(), 77))
    assert torch.equal(host, twin)
    assert unpack_bitmask(bitmask, 77).tolist() == (host[rows] != float("-inf")).tolist()
