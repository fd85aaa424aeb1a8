"""Keyed sampling: greedy, temperature, top-k, top-p, min-p, typical-p, penalties, logit bias, logprobs.

The logits of a row go through, in order (vLLM's order for the raw-logit stage, Hugging Face's
for the warpers): logit_bias (added); repetition penalty (HF/CTRL: over every token of prompt +
output, positive logits divided, negative multiplied); frequency and presence penalties (OpenAI:
minus ``frequency * count + presence * [count > 0]`` over output tokens only); then temperature,
top-k, top-p, min-p and typical-p. Greedy rows take the argmax after the raw-logit stage. Log-probabilities
(and top-N) are always of the raw model distribution, as vLLM and OpenAI report them.

Random rows use Gumbel-max with noise from `zerobubble.kernels.keyed_random.keyed_uniform`, keyed by
(seed, absolute position, token id): exact sampling from the filtered softmax, and the same token
for the same request position whatever the batch looks like. `sample` and `target_probs` share one
logits-processing function, so the distribution the verifier checks drafts against is exactly the
one the sampler draws from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from zerobubble.kernels.keyed_random import STREAM_SAMPLE, keyed_uniform
from zerobubble.request_options import SamplingOptions, has_penalty
from zerobubble.worker_svc.staging import to_device

# Seeds are uint64 on the wire; the keyed-noise kernels take int64.
SEED_MASK = (1 << 63) - 1

PEAK_BYTES_PER_LOGIT = 48
"""Peak bytes a step's logits and sampling hold per logit (sampled row x vocabulary entry).

Measured on CPU (`tests/unit/test_sampler.py`): drawing with top-k, top-p and min-p, the rejection
target's probabilities and the log-probabilities hold about 33 bytes per logit beyond the
float32 logits (the sort's values and order, masks, softmaxes, the Gumbel noise), 37 with them;
typical-p on every row adds about 5 (its own sort, after the others' buffers are freed).
Set above that for CUDA, whose sort keeps double buffers. The worker's KV budget leaves this
much for a full step (`zerobubble.worker_svc.server.step_reserve_bytes`)."""


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
    min_p: Tensor | None = None  # [N] float32; None = off for every row
    typical_p: Tensor | None = None  # [N] float32; 1 = off, None = off for every row
    penalties: Penalties | None = None
    logit_bias: LogitBias | None = None
    # [S] int64: the rows that draw at random, when some rows are greedy and some not (None when
    # every row draws). Greedy rows then take one argmax and pay for no noise and no sort.
    random_rows: Tensor | None = None

    @classmethod
    def from_params(
        cls,
        temperatures: Sequence[float],
        top_ks: Sequence[int],
        top_ps: Sequence[float],
        seeds: Sequence[int],
        positions: Sequence[int] | Tensor,
        device: torch.device | str = "cpu",
        min_ps: Sequence[float] | None = None,
        penalties: Penalties | None = None,
        logit_bias: LogitBias | None = None,
        typical_ps: Sequence[float] | None = None,
    ) -> SamplingTensors:
        """Build from per-row Python values (``positions`` may already be a device tensor)."""
        num_rows = len(temperatures)
        if not all(len(v) == num_rows for v in (top_ks, top_ps, seeds, positions)):
            raise ValueError("all per-row sampling sequences must have the same length")
        device = torch.device(device)
        if not isinstance(positions, Tensor):
            positions = to_device(positions, torch.int64, device)
        # The summaries are taken over host arrays (a step's rows come as numpy gathers).
        temps, ks, ps = np.asarray(temperatures), np.asarray(top_ks), np.asarray(top_ps)
        use_min_p = min_ps is not None and bool((np.asarray(min_ps) > 0).any())
        use_typical = typical_ps is not None and bool((np.asarray(typical_ps) < 1).any())
        random = np.flatnonzero(temps > 0)
        mixed = 0 < len(random) < num_rows
        # Pinned staging and async copies: the host never waits for the device here.
        return cls(
            temperature=to_device(temperatures, torch.float32, device),
            top_k=to_device(top_ks, torch.int32, device),
            top_p=to_device(top_ps, torch.float32, device),
            seeds=to_device(seeds, torch.int64, device),
            positions=positions.to(torch.int64),
            all_greedy=bool((temps <= 0).all()),
            any_filter=bool((ks > 0).any() or (ps < 1.0).any()),
            min_p=to_device(min_ps, torch.float32, device) if use_min_p and min_ps is not None else None,
            typical_p=to_device(typical_ps, torch.float32, device) if use_typical and typical_ps is not None else None,
            penalties=penalties,
            logit_bias=logit_bias,
            random_rows=to_device(random, torch.int64, device) if mixed else None,
        )

    @property
    def is_raw_argmax(self) -> bool:
        """Whether `sample` is the plain argmax of the logits: every row greedy and no stage
        before it (`_raw_logit_stage`) changes them."""
        return self.all_greedy and self.logit_bias is None and self.penalties is None

    def rows(self, index: Tensor) -> SamplingTensors:
        """The per-row parameters of rows ``index`` (penalties and bias are not carried: they
        belong to the raw-logit stage, which runs over the whole batch first)."""
        return SamplingTensors(
            temperature=self.temperature.index_select(0, index),
            top_k=self.top_k.index_select(0, index),
            top_p=self.top_p.index_select(0, index),
            seeds=self.seeds.index_select(0, index),
            positions=self.positions.index_select(0, index),
            any_filter=self.any_filter,
            min_p=None if self.min_p is None else self.min_p.index_select(0, index),
            typical_p=None if self.typical_p is None else self.typical_p.index_select(0, index),
        )


class SlotSampling:
    """Every state slot's sampling parameters as host arrays, written once on admission.

    A step gathers its rows' values with one index per field instead of rebuilding Python lists
    from each request's protobuf (the persistent input batch of vLLM). Penalties and logit bias
    need per-row work (context counts, sparse ids); ``special`` marks the slots that use them.
    """

    def __init__(self, num_slots: int) -> None:
        self.temperature = np.zeros(num_slots, np.float32)
        self.top_k = np.zeros(num_slots, np.int32)
        self.top_p = np.ones(num_slots, np.float32)
        self.min_p = np.zeros(num_slots, np.float32)
        self.typical_p = np.ones(num_slots, np.float32)
        self.seed = np.zeros(num_slots, np.int64)
        self.top_logprobs = np.zeros(num_slots, np.int64)  # top-N log-probabilities wanted
        self.special = np.zeros(num_slots, np.bool_)

    def set(self, slot: int, p: SamplingOptions) -> None:
        """Record the parameters of the request admitted to ``slot``."""
        self.temperature[slot] = p.temperature
        self.top_k[slot] = p.top_k
        self.top_p[slot] = p.top_p if p.top_p > 0 else 1.0
        self.min_p[slot] = p.min_p
        self.typical_p[slot] = p.typical_p
        self.seed[slot] = (p.seed or 0) & SEED_MASK
        self.top_logprobs[slot] = p.top_logprobs
        self.special[slot] = has_penalty(p) or bool(p.logit_bias)

    def tensors(
        self,
        rows: np.ndarray,
        positions: Tensor,
        device: torch.device | str,
        penalties: Penalties | None = None,
        logit_bias: LogitBias | None = None,
    ) -> SamplingTensors:
        """The sampling tensors of logits rows drawn for slots ``rows`` (one entry per row)."""
        return SamplingTensors.from_params(
            temperatures=self.temperature[rows],
            top_ks=self.top_k[rows],
            top_ps=self.top_p[rows],
            seeds=self.seed[rows],
            positions=positions,
            device=device,
            min_ps=self.min_p[rows],
            penalties=penalties,
            logit_bias=logit_bias,
            typical_ps=self.typical_p[rows],
        )


@dataclass(slots=True)
class Penalties:
    """Repetition / frequency / presence penalties of some logits rows (the others have none).

    ``output_counts[i, v]`` is how often token ``v`` occurs among the output tokens of the context
    of logits row ``rows[i]``; ``seen[i, v]`` whether it occurs anywhere in prompt + output.
    Either may be None when no row needs it. Build the counts with `context_token_counts`.
    """

    rows: Tensor  # [P] int64: logits rows these apply to
    repetition: Tensor  # [P] float32; 1 = off
    frequency: Tensor  # [P] float32; 0 = off
    presence: Tensor  # [P] float32; 0 = off
    output_counts: Tensor | None  # [P, V] int32
    seen: Tensor | None  # [P, V] bool


@dataclass(slots=True)
class LogitBias:
    """Sparse additive biases: ``logits[rows[i], token_ids[i]] += values[i]``."""

    rows: Tensor  # [B] int64
    token_ids: Tensor  # [B] int64
    values: Tensor  # [B] float32


def context_token_counts(
    history: Tensor,
    block_tables: Tensor,
    context_len: Tensor,
    num_prompt_tokens: Tensor,
    vocab_size: int,
    need_counts: bool = True,
    need_seen: bool = True,
) -> tuple[Tensor | None, Tensor | None]:
    """Token counts over each row's context, read from the paged token history.

    ``history [num_blocks, block_size]`` holds the token of every written KV slot;
    ``block_tables [P, nb]`` the rows' blocks (entries past the context are never counted);
    ``context_len [P]`` how many leading positions are the context (on the device: the worker's
    own count, so drafts 0..j-1 of a verification row are in the context of draft j and rejected
    tokens of earlier steps never are). Returns ``(output_counts [P, V] int32, seen [P, V] bool)``:
    counts over positions ``num_prompt_tokens <= p < context_len``, and presence over
    ``p < context_len``.
    """
    num_rows = block_tables.shape[0]
    tokens = history[block_tables.long()].reshape(num_rows, -1).long().clamp_(0, vocab_size - 1)
    pos = torch.arange(tokens.shape[1], device=tokens.device)
    in_context = pos[None, :] < context_len.long()[:, None]
    counts = seen = None
    if need_counts:
        is_output = in_context & (pos[None, :] >= num_prompt_tokens.long()[:, None])
        counts = torch.zeros(num_rows, vocab_size, dtype=torch.int32, device=tokens.device)
        counts.scatter_add_(1, tokens, is_output.to(torch.int32))
    if need_seen:
        seen = torch.zeros(num_rows, vocab_size, dtype=torch.int32, device=tokens.device)
        seen.scatter_add_(1, tokens, in_context.to(torch.int32))
        seen = seen > 0
    return counts, seen


def _raw_logit_stage(logits: Tensor, t: SamplingTensors) -> Tensor:
    """float32 logits with logit_bias and penalties applied (a copy when anything applies)."""
    logits = logits.float()
    if t.logit_bias is None and t.penalties is None:
        return logits
    logits = logits.clone()
    if t.logit_bias is not None:
        b = t.logit_bias
        logits.index_put_((b.rows, b.token_ids), b.values, accumulate=True)
    if t.penalties is not None:
        p = t.penalties
        rows = logits[p.rows]
        if p.seen is not None:
            rep = p.repetition[:, None]
            penalized = torch.where(rows < 0, rows * rep, rows / rep)
            rows = torch.where(p.seen, penalized, rows)
        if p.output_counts is not None:
            counts = p.output_counts.to(torch.float32)
            rows = rows - p.frequency[:, None] * counts
            rows = rows - p.presence[:, None] * (counts > 0).to(torch.float32)
        logits[p.rows] = rows
    return logits


def _min_p(scaled: Tensor, min_p: Tensor) -> Tensor:
    """Mask tokens whose probability is below ``min_p`` times the row's most likely one."""
    probs = scaled.softmax(dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
    return scaled.masked_fill(probs < threshold, float("-inf"))


def _typical(scaled: Tensor, mass: Tensor) -> Tensor:
    """Mask all but the tokens whose surprisal is closest to the row's entropy, the fewest that
    hold ``mass`` of the probability (Hugging Face's TypicalLogitsWarper); rows at 1 are kept."""
    logp = scaled.log_softmax(dim=-1)
    entropy = -(logp * logp.exp()).nansum(dim=-1, keepdim=True)  # masked tokens give 0 * -inf
    # In place, and the distances dropped once sorted: this stage must fit PEAK_BYTES_PER_LOGIT.
    sorted_distance, order = logp.neg_().sub_(entropy).abs_().sort(dim=-1, stable=True)
    del logp
    mass_through = scaled.gather(-1, order).softmax(dim=-1).cumsum_(dim=-1)
    last = (mass_through < mass[:, None]).sum(dim=-1, keepdim=True).clamp_(max=scaled.shape[-1] - 1)
    drop = sorted_distance > sorted_distance.gather(-1, last)
    drop[:, 0] = False  # the most typical token is always kept
    drop &= (mass < 1.0)[:, None]
    return scaled.masked_fill(torch.empty_like(drop).scatter_(-1, order, drop), float("-inf"))


def _processed_logits(logits: Tensor, t: SamplingTensors) -> Tensor:
    """Biased, penalized, temperature-scaled, top-k/top-p/min-p filtered logits (masked entries
    are -inf), float32.

    Greedy rows become 0 at the argmax of the biased and penalized logits and -inf elsewhere,
    so one softmax / Gumbel-max over the result serves greedy and random rows alike.
    """
    logits = _raw_logit_stage(logits, t)
    greedy = t.temperature <= 0
    scaled = _filtered(logits / torch.where(greedy, 1.0, t.temperature).unsqueeze(1), t)
    greedy_logits = torch.full_like(scaled, float("-inf"))
    greedy_logits.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 0.0)
    return torch.where(greedy[:, None], greedy_logits, scaled)


def _filtered(scaled: Tensor, t: SamplingTensors) -> Tensor:
    """Temperature-scaled logits with each row's top-k, top-p, min-p and typical-p filters applied."""
    if t.any_filter:
        scaled = _top_k_top_p(scaled, t.top_k, t.top_p)
    if t.min_p is not None:
        scaled = _min_p(scaled, t.min_p)
    if t.typical_p is not None:
        scaled = _typical(scaled, t.typical_p)
    return scaled


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

    Temperature-0 rows take the argmax of the biased and penalized logits (lowest id on ties,
    like ``torch.argmax`` and HF greedy). Other rows draw exactly from the filtered softmax by
    Gumbel-max with noise keyed by ``(seeds, positions)``.
    """
    raw = _raw_logit_stage(logits, t)
    if t.all_greedy:
        return raw.argmax(dim=-1)
    if t.random_rows is None:
        return _draw(raw, t)
    tokens = raw.argmax(dim=-1)
    return tokens.index_copy_(0, t.random_rows, _draw(raw.index_select(0, t.random_rows), t.rows(t.random_rows)))


def _draw(raw: Tensor, t: SamplingTensors) -> Tensor:
    """Gumbel-max over the filtered, temperature-scaled ``raw`` logits of rows that all draw."""
    scaled = _filtered(raw / t.temperature.unsqueeze(1), t)
    u = keyed_uniform(t.seeds, t.positions, raw.shape[-1], STREAM_SAMPLE)
    return (scaled - torch.log(-torch.log(u))).argmax(dim=-1)


def target_probs(logits: Tensor, t: SamplingTensors) -> Tensor:
    """The distribution `sample` draws from, as probabilities ``[N, V]`` float32.

    One-hot at the argmax for greedy rows. Used as the target of rejection sampling.
    """
    return _processed_logits(logits, t).softmax(dim=-1)


def token_logprobs(logits: Tensor, tokens: Tensor) -> Tensor:
    """``log_softmax`` of the raw logits at ``tokens [N]``; returns ``[N]`` float32."""
    logprobs = logits.float().log_softmax(dim=-1)
    return logprobs.gather(-1, tokens.to(torch.int64)[:, None]).squeeze(-1)


def top_logprobs(logits: Tensor, num: int) -> tuple[Tensor, Tensor]:
    """The ``num`` most likely tokens of the raw ``log_softmax`` per row, most likely first;
    returns ``(token_ids [N, num] int64, logprobs [N, num] float32)``.
    """
    values, ids = logits.float().log_softmax(dim=-1).topk(num, dim=-1, sorted=True)
    return ids, values
