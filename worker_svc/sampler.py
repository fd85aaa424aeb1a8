"""Keyed sampling: greedy, temperature, top-k, top-p, and log-probabilities.

Random rows use Gumbel-max with noise from `kernels.keyed_random.keyed_uniform`, keyed by
(seed, absolute position, token id): exact sampling from the filtered softmax, and the same token
for the same request position whatever the batch looks like. `sample` and `target_probs` share one
logits-processing function, so the distribution the verifier checks drafts against is exactly the
one the sampler draws from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.keyed_random import STREAM_SAMPLE, keyed_uniform
from worker_svc.staging import to_device

# Seeds are uint64 on the wire; the keyed-noise kernels take int64.
SEED_MASK = (1 << 63) - 1


@dataclass(slots=True)
class SamplingTensors:
    """Per-row sampling parameters on the logits' device (one row per sampled position)."""

    temperature: Tensor  # [N] float32; 0 = greedy
    top_k: Tensor  # [N] int32; 0 = off
    top_p: Tensor  # [N] float32; 1 = off
    seeds: Tensor  # [N] int64
    positions: Tensor  # [N] int64: absolute sequence position of the token being sampled
    # Host-side summaries so that sampling never syncs with the device to find out what to do
    # (the worker must stay ahead of the accelerator). The defaults are always correct, just slower.
    all_greedy: bool = False
    any_filter: bool = True

    @classmethod
    def from_params(
        cls,
        temperatures: Sequence[float],
        top_ks: Sequence[int],
        top_ps: Sequence[float],
        seeds: Sequence[int],
        positions: Sequence[int] | Tensor,
        device: torch.device | str = "cpu",
    ) -> SamplingTensors:
        """Build from per-row Python values (``positions`` may already be a device tensor)."""
        num_rows = len(temperatures)
        if not all(len(v) == num_rows for v in (top_ks, top_ps, seeds, positions)):
            raise ValueError("all per-row sampling sequences must have the same length")
        device = torch.device(device)
        if not isinstance(positions, Tensor):
            positions = to_device(positions, torch.int64, device)
        # Pinned staging and async copies: the host never waits for the device here.
        return cls(
            temperature=to_device(temperatures, torch.float32, device),
            top_k=to_device(top_ks, torch.int32, device),
            top_p=to_device(top_ps, torch.float32, device),
            seeds=to_device(seeds, torch.int64, device),
            positions=positions.to(torch.int64),
            all_greedy=all(temp <= 0 for temp in temperatures),
            any_filter=any(k > 0 for k in top_ks) or any(p < 1.0 for p in top_ps),
        )


def _processed_logits(logits: Tensor, t: SamplingTensors) -> Tensor:
    """Temperature-scaled, top-k/top-p filtered logits (masked entries are -inf), float32.

    Greedy rows become 0 at the raw argmax and -inf elsewhere, so one softmax / Gumbel-max over
    the result serves greedy and random rows alike.
    """
    logits = logits.float()
    greedy = t.temperature <= 0
    scaled = logits / torch.where(greedy, 1.0, t.temperature)[:, None]
    if t.any_filter:
        scaled = _top_k_top_p(scaled, t.top_k, t.top_p)
    greedy_logits = torch.full_like(scaled, float("-inf"))
    greedy_logits.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 0.0)
    return torch.where(greedy[:, None], greedy_logits, scaled)


def _top_k_top_p(scaled: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Mask all but the top-k tokens, then the smallest prefix holding top_p of what is left.

    Order and renormalisation follow Hugging Face's warpers: top-p sees the top-k-renormalised
    distribution. Ties at the boundary are broken by lower token id (stable sort), and the most
    likely token is always kept.
    """
    vocab_size = scaled.shape[-1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab_size, device=scaled.device)
    k = torch.where(top_k > 0, top_k.to(torch.int64), vocab_size)
    keep = rank[None, :] < k[:, None]
    sorted_logits = sorted_logits.masked_fill(~keep, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # top_p >= 1 must be a no-op even when rounding pushes the running sum to 1 early.
    keep &= (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0) | (rank[None, :] == 0)
    keep_by_token = torch.empty_like(keep).scatter_(-1, order, keep)
    return scaled.masked_fill(~keep_by_token, float("-inf"))


def sample(logits: Tensor, t: SamplingTensors) -> Tensor:
    """Sample one token per row of ``logits [N, V]``; returns ``[N]`` int64.

    Temperature-0 rows take the argmax of the raw logits (lowest id on ties, like
    ``torch.argmax`` and HF greedy). Other rows draw exactly from the filtered softmax by
    Gumbel-max with noise keyed by ``(seeds, positions)``.
    """
    if t.all_greedy:
        return logits.argmax(dim=-1)
    processed = _processed_logits(logits, t)
    u = keyed_uniform(t.seeds, t.positions, logits.shape[-1], STREAM_SAMPLE)
    gumbel = -torch.log(-torch.log(u))
    return (processed + gumbel).argmax(dim=-1)


def target_probs(logits: Tensor, t: SamplingTensors) -> Tensor:
    """The distribution `sample` draws from, as probabilities ``[N, V]`` float32.

    One-hot at the argmax for greedy rows. Used as the target of rejection sampling.
    """
    return _processed_logits(logits, t).softmax(dim=-1)


def token_logprobs(logits: Tensor, tokens: Tensor) -> Tensor:
    """``log_softmax`` of the raw logits at ``tokens [N]``; returns ``[N]`` float32."""
    logprobs = logits.float().log_softmax(dim=-1)
    return logprobs.gather(-1, tokens.to(torch.int64)[:, None]).squeeze(-1)
