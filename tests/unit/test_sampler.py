"""Keyed sampler: greedy, temperature, top-k, top-p, log-probabilities, batch invariance."""

from __future__ import annotations

import os

# Triton decides interpreted vs compiled when a kernel is defined, i.e. at import time.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.support.stats import chi_square_pvalue  # noqa: E402
from zerobubble.worker_svc.sampler import SamplingTensors, sample, target_probs, token_logprobs  # noqa: E402

VOCAB = 6
LOGITS = torch.tensor([2.0, 1.5, 1.4, 0.3, -0.5, -1.0])


def expected_distribution(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Temperature, then top-k, then top-p on the renormalised rest, written one token at a time."""
    probs = (logits.double() / temperature).softmax(-1)
    order = sorted(range(len(probs)), key=lambda i: (-float(probs[i]), i))
    kept = order[:top_k] if top_k > 0 else order
    mass = sum(float(probs[i]) for i in kept)
    nucleus, running = [], 0.0
    for i in kept:
        if running >= top_p * mass and nucleus:
            break
        nucleus.append(i)
        running += float(probs[i])
    out = torch.zeros_like(probs)
    out[nucleus] = probs[nucleus]
    return out / out.sum()


def params(
    num_rows: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, first_seed: int = 0, position: int = 17
) -> SamplingTensors:
    return SamplingTensors.from_params(
        [temperature] * num_rows,
        [top_k] * num_rows,
        [top_p] * num_rows,
        list(range(first_seed, first_seed + num_rows)),
        [position] * num_rows,
    )


def test_greedy_is_argmax_with_lowest_id_on_ties() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(32, 50, generator=gen)
    logits[0, [3, 7]] = 10.0  # a tie: HF greedy (torch.argmax) takes the lower id
    t = params(32, temperature=0.0, top_k=5, top_p=0.5)
    assert sample(logits, t).tolist() == logits.argmax(-1).tolist()
    assert int(sample(logits, t)[0]) == 3
    # Greedy rows mixed with random rows still take the raw argmax.
    mixed = SamplingTensors.from_params([0.0, 1.0] * 16, [0] * 32, [1.0] * 32, list(range(32)), [5] * 32)
    assert sample(logits, mixed)[::2].tolist() == logits[::2].argmax(-1).tolist()
    probs = target_probs(logits, t)
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 50).float())


def test_same_seed_and_position_give_same_token_in_any_batch() -> None:
    gen = torch.Generator().manual_seed(1)
    num_rows = 24
    logits = torch.randn(num_rows, 40, generator=gen)
    temps = (torch.rand(num_rows, generator=gen) * 1.5 + 0.2).tolist()
    top_ks = torch.randint(0, 8, (num_rows,), generator=gen).tolist()
    top_ps = (torch.rand(num_rows, generator=gen) * 0.5 + 0.5).tolist()
    seeds = torch.randint(0, 2**62, (num_rows,), generator=gen).tolist()
    positions = torch.randint(0, 10_000, (num_rows,), generator=gen).tolist()
    alone = [
        int(
            sample(
                logits[i : i + 1],
                SamplingTensors.from_params(
                    temps[i : i + 1], top_ks[i : i + 1], top_ps[i : i + 1], seeds[i : i + 1], positions[i : i + 1]
                ),
            )
        )
        for i in range(num_rows)
    ]
    # Shuffled and surrounded by other requests (greedy rows too).
    perm = torch.randperm(num_rows, generator=gen).tolist()
    extra = 8
    batch = SamplingTensors.from_params(
        [temps[i] for i in perm] + [0.0] * 4 + [1.0] * 4,
        [top_ks[i] for i in perm] + [0] * extra,
        [top_ps[i] for i in perm] + [1.0] * extra,
        [seeds[i] for i in perm] + list(range(extra)),
        [positions[i] for i in perm] + [3] * extra,
    )
    batch_logits = torch.cat([logits[perm], torch.randn(extra, 40, generator=gen)])
    batched = sample(batch_logits, batch)[:num_rows].tolist()
    assert batched == [alone[i] for i in perm]
    # A different position (or seed) changes the draw for some rows.
    moved = SamplingTensors.from_params(temps, top_ks, top_ps, seeds, [p + 1 for p in positions])
    assert sample(logits, moved).tolist() != alone


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 0, 1.0), (0.6, 0, 1.0), (1.3, 3, 1.0), (1.0, 0, 0.7), (0.8, 4, 0.8), (2.0, 1, 1.0)],
)
def test_sampling_frequencies_match_filtered_softmax(temperature: float, top_k: int, top_p: float) -> None:
    num_samples = 30_000
    expected = expected_distribution(LOGITS, temperature, top_k, top_p)
    t = params(num_samples, temperature, top_k, top_p, first_seed=1_000_003)
    probs = target_probs(LOGITS.expand(num_samples, VOCAB), t)
    assert torch.allclose(probs[0].double(), expected, atol=1e-6)
    tokens = sample(LOGITS.expand(num_samples, VOCAB), t)
    counts = torch.bincount(tokens, minlength=VOCAB)
    # Masked tokens are never emitted (chi_square_pvalue asserts it), and the rest fit.
    assert chi_square_pvalue(counts, expected) > 1e-3


def test_filters_never_emit_masked_tokens_on_a_large_vocab() -> None:
    gen = torch.Generator().manual_seed(2)
    num_rows, vocab = 400, 300
    logits = torch.randn(num_rows, vocab, generator=gen) * 3
    top_ks = torch.randint(1, 20, (num_rows,), generator=gen)
    top_ps = torch.rand(num_rows, generator=gen) * 0.9 + 0.05
    t = SamplingTensors.from_params(
        [1.0] * num_rows, top_ks.tolist(), top_ps.tolist(), list(range(num_rows)), [0] * num_rows
    )
    tokens = sample(logits, t)
    probs = target_probs(logits, t)
    assert bool((probs.gather(-1, tokens[:, None]) > 0).all())
    allowed = (probs > 0).sum(-1)
    assert bool((allowed <= top_ks).all()) and bool((allowed >= 1).all())
    rank = (logits > logits.gather(-1, tokens[:, None])).sum(-1)
    assert bool((rank < top_ks).all())


def test_token_logprobs_are_raw_log_softmax() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 30, generator=gen)
    tokens = torch.tensor([0, 29, 4, 4, 17])
    expected = torch.log_softmax(logits.double(), -1)[torch.arange(5), tokens].float()
    out = token_logprobs(logits, tokens)
    assert out.dtype == torch.float32 and torch.allclose(out, expected, atol=1e-6)


def test_from_params_summaries() -> None:
    assert params(3).all_greedy and not params(3).any_filter
    assert not params(3, temperature=0.5).all_greedy
    assert params(3, top_k=2).any_filter and params(3, top_p=0.9).any_filter
    positions = torch.tensor([9], dtype=torch.int32)  # the runner passes device positions
    from_tensor = SamplingTensors.from_params([1.0], [0], [1.0], [5], positions)
    assert from_tensor.positions.dtype == torch.int64 and from_tensor.positions.tolist() == [9]
    with pytest.raises(ValueError):
        SamplingTensors.from_params([1.0], [0, 0], [1.0], [1], [1])


def test_peak_bytes_per_logit_covers_a_full_sampling_step() -> None:
    """The KV budget on CUDA leaves PEAK_BYTES_PER_LOGIT per logit for a step's sampling: what
    drawing with every filter on, the rejection target's probabilities and the log-probabilities
    hold at their peak beside the float32 logits, measured as the growth of a fresh process's
    peak resident memory, its high-water mark reset first (large enough that the allocator's
    own slack is small beside it)."""
    import json
    import subprocess
    import sys

    code = """
import gc, json, torch
from zerobubble.worker_svc.sampler import SamplingTensors, sample, target_probs, token_logprobs, top_logprobs
def peak_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
G, V = 128, 131072
logits = torch.randn(G, V)
def every_filter(n):
    return SamplingTensors.from_params(
        [0.8] * n, [50] * n, [0.9] * n, list(range(n)), list(range(n)), min_ps=[0.05] * n, typical_ps=[0.9] * n
    )
t, warm = every_filter(G), every_filter(2)
sample(logits[:2], warm), target_probs(logits[:2], warm)  # one-time allocations (thread pools) first
gc.collect()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak so far (imports) is forgotten: from here it is the current size
base = peak_kib()
for fn in (sample, target_probs):
    fn(logits, t)
token_logprobs(logits, torch.zeros(G, dtype=torch.long))
top_logprobs(logits, 5)
print(json.dumps((peak_kib() - base) * 1024 / (G * V)))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    bytes_per_logit = json.loads(out.stdout.strip().splitlines()[-1])
    from zerobubble.worker_svc.sampler import PEAK_BYTES_PER_LOGIT

    # Beside the logits themselves (4 bytes each, float32), which the reserve also covers.
    assert 8 < bytes_per_logit + 4 <= PEAK_BYTES_PER_LOGIT, bytes_per_logit


@pytest.mark.parametrize(("temperature", "typical_p"), [(1.0, 0.5), (0.7, 0.9), (1.5, 0.3)])
def test_typical_p_frequencies_match_hf_typical_warper(temperature: float, typical_p: float) -> None:
    from transformers.generation.logits_process import TypicalLogitsWarper

    num_samples = 30_000
    expected = TypicalLogitsWarper(typical_p)(None, LOGITS[None] / temperature).double().softmax(-1)[0]
    t = SamplingTensors.from_params(
        [temperature] * num_samples,
        [0] * num_samples,
        [1.0] * num_samples,
        list(range(2_000_003, 2_000_003 + num_samples)),
        [17] * num_samples,
        typical_ps=[typical_p] * num_samples,
    )
    assert torch.allclose(target_probs(LOGITS.expand(num_samples, VOCAB), t)[0].double(), expected, atol=1e-6)
    counts = torch.bincount(sample(LOGITS.expand(num_samples, VOCAB), t), minlength=VOCAB)
    assert chi_square_pvalue(counts, expected) > 1e-3
