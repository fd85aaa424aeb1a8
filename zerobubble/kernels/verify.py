"""Draft verification: exact-match counting and rejection sampling.

N-gram drafts have no draft distribution: the verifier samples the target's own token at every
position (keyed noise, see `zerobubble.worker_svc.sampler.sample`) and `count_accepted` keeps the drafts that
equal it. Draft-model proposals are verified the same way under ``--draft-acceptance keyed`` (the default,
see `zerobubble.worker_svc.proposers.draft`); under ``--draft-acceptance rejection`` they use `rejection_sample`:
accept draft ``j`` with probability ``min(1, p/q)``, resample the first rejected position from
``normalize(max(0, p - q))``, and draw a bonus token from ``p`` when every draft is accepted. All randomness is keyed by
(seed, absolute position) through `zerobubble.kernels.keyed_random`, so results do not depend on batching.

Token draws use the exponential race ``argmax_v w[v] / E[v]`` with ``E = -log(u)``, which samples
``v`` with probability ``w[v] / sum(w)`` and equals Gumbel-max on ``log w``: on the same keyed
noise (stream 0) the bonus token is the token `sample` would draw.
"""

from __future__ import annotations

import torch
from torch import Tensor

from zerobubble.kernels._triton import HAS_TRITON, KernelImpl, next_power_of_2, tl, triton, use_triton
from zerobubble.kernels.keyed_random import STREAM_ACCEPT, STREAM_RESIDUAL, STREAM_SAMPLE, keyed_uniform

if HAS_TRITON:
    from zerobubble.kernels.keyed_random import keyed_row_keys, keyed_unit


def _count_accepted_torch(target_tokens: Tensor, draft_tokens: Tensor, num_drafts: Tensor) -> Tensor:
    max_drafts = draft_tokens.shape[1]
    cols = torch.arange(max_drafts, device=draft_tokens.device)
    ok = draft_tokens.to(torch.int64) == target_tokens[:, :max_drafts].to(torch.int64)
    ok &= cols[None, :] < num_drafts.to(torch.int64)[:, None]
    return ok.to(torch.int32).cumprod(dim=1).sum(dim=1, dtype=torch.int32)


if HAS_TRITON:

    @triton.jit
    def _count_accepted_kernel(target_ptr, draft_ptr, num_drafts_ptr, out_ptr, max_drafts, BLOCK_K: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK_K)
        valid = cols < tl.minimum(tl.load(num_drafts_ptr + row), max_drafts)
        draft = tl.load(draft_ptr + row * max_drafts + cols, mask=valid, other=0)
        target = tl.load(target_ptr + row * (max_drafts + 1) + cols, mask=valid, other=0)
        # The first column that is not a valid match is the accepted count.
        stop = tl.where(valid & (draft == target), BLOCK_K, cols)
        tl.store(out_ptr + row, tl.min(stop, axis=0).to(tl.int32))


# A custom op (with a fake implementation): the step runs under FakeTensorMode and torch.compile.
@torch.library.custom_op("zerobubble::count_accepted", mutates_args=())
def _count_accepted_triton(target_tokens: Tensor, draft_tokens: Tensor, num_drafts: Tensor) -> Tensor:
    num_reqs, max_drafts = draft_tokens.shape
    out = torch.zeros(num_reqs, dtype=torch.int32, device=draft_tokens.device)
    if num_reqs == 0 or max_drafts == 0:
        return out
    _count_accepted_kernel[(num_reqs,)](
        target_tokens.contiguous(),
        draft_tokens.contiguous(),
        num_drafts.contiguous(),
        out,
        max_drafts,
        BLOCK_K=next_power_of_2(max_drafts),
    )
    return out


@_count_accepted_triton.register_fake
def _(target_tokens: Tensor, draft_tokens: Tensor, num_drafts: Tensor) -> Tensor:
    return draft_tokens.new_empty(draft_tokens.shape[0], dtype=torch.int32)


def count_accepted(target_tokens: Tensor, draft_tokens: Tensor, num_drafts: Tensor, impl: KernelImpl = None) -> Tensor:
    """Accepted drafts per row ``[R]`` int32: the length of the leading run of columns
    ``j < num_drafts[r]`` with ``draft_tokens[r, j] == target_tokens[r, j]``.

    ``target_tokens [R, K+1]``, ``draft_tokens [R, K]``, ``num_drafts [R]``. Drafts past
    ``num_drafts`` are never compared (they may hold -1 or stale ids).
    """
    if use_triton(draft_tokens, impl, _count_accepted_kernel if HAS_TRITON else None):
        return _count_accepted_triton(target_tokens, draft_tokens, num_drafts)
    return _count_accepted_torch(target_tokens, draft_tokens, num_drafts)


def _race(weights: Tensor, u: Tensor) -> Tensor:
    """Index of ``max weights / -log(u)`` per row: a draw proportional to ``weights``."""
    return (weights / -torch.log(u)).argmax(dim=-1)


def _rejection_torch(
    target_probs: Tensor,
    draft_probs: Tensor,
    draft_tokens: Tensor,
    num_drafts: Tensor,
    seeds: Tensor,
    positions: Tensor,
) -> tuple[Tensor, Tensor]:
    num_reqs, max_drafts = draft_tokens.shape
    vocab_size = target_probs.shape[-1]
    device = target_probs.device
    rows = torch.arange(num_reqs, device=device)
    cols = torch.arange(max_drafts, device=device)
    seeds = seeds.to(torch.int64)
    positions = positions.to(torch.int64)
    num_valid = num_drafts.to(torch.int64).clamp(max=max_drafts)

    valid = cols[None, :] < num_valid[:, None]
    tokens = torch.where(valid, draft_tokens.to(torch.int64), 0)
    p = target_probs[:, :max_drafts].gather(-1, tokens[..., None]).squeeze(-1)
    q = draft_probs.gather(-1, tokens[..., None]).squeeze(-1)
    # One acceptance uniform per draft position: a vocabulary of one (token id 0).
    u_accept = keyed_uniform(
        seeds.repeat_interleave(max_drafts),
        (positions[:, None] + cols[None, :]).reshape(-1),
        1,
        STREAM_ACCEPT,
    ).view(num_reqs, max_drafts)
    # u < p / q without dividing (q can be 0 for garbage inputs).
    accept = valid & (u_accept * q < p)
    num_accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)

    # The emitted token at column a: bonus from p if everything was accepted, otherwise a
    # draw from the residual max(0, p - q) (from p if rounding left no residual mass).
    all_accepted = num_accepted == num_valid
    p_next = target_probs[rows, num_accepted]
    if max_drafts > 0:
        q_next = draft_probs[rows, num_accepted.clamp(max=max_drafts - 1)]
        residual = (p_next - q_next).clamp(min=0.0)
    else:
        residual = p_next
    use_residual = ~all_accepted & (residual.sum(dim=-1) > 0)
    weights = torch.where(use_residual[:, None], residual, p_next)
    pos_next = positions + num_accepted
    u_sample = keyed_uniform(seeds, pos_next, vocab_size, STREAM_SAMPLE)
    u_residual = keyed_uniform(seeds, pos_next, vocab_size, STREAM_RESIDUAL)
    u_next = torch.where(all_accepted[:, None], u_sample, u_residual)
    next_token = _race(weights, u_next)

    out = torch.full((num_reqs, max_drafts + 1), -1, dtype=torch.int64, device=device)
    out[:, :max_drafts] = torch.where(cols[None, :] < num_accepted[:, None], draft_tokens.to(torch.int64), -1)
    out.scatter_(1, num_accepted[:, None], next_token[:, None])
    return out, num_accepted.to(torch.int32)


if HAS_TRITON:

    @triton.jit
    def _rejection_kernel(
        target_ptr,
        draft_probs_ptr,
        draft_tokens_ptr,
        num_drafts_ptr,
        seeds_ptr,
        positions_ptr,
        out_ptr,
        num_accepted_ptr,
        max_drafts,
        vocab_size,
        BLOCK_V: tl.constexpr,
        SAMPLE: tl.constexpr,
        ACCEPT: tl.constexpr,
        RESIDUAL: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        num_valid = tl.minimum(tl.load(num_drafts_ptr + row), max_drafts)
        seed = tl.load(seeds_ptr + row).to(tl.int64)
        pos0 = tl.load(positions_ptr + row).to(tl.int64)
        target_row = target_ptr + row * (max_drafts + 1) * vocab_size
        draft_row = draft_probs_ptr + row * max_drafts * vocab_size

        num_accepted = tl.zeros((), tl.int64)
        alive = tl.full((), 1, tl.int1)
        for j in range(0, num_valid):
            token = tl.load(draft_tokens_ptr + row * max_drafts + j).to(tl.int64)
            p = tl.load(target_row + j * vocab_size + token)
            q = tl.load(draft_row + j * vocab_size + token)
            # One acceptance uniform per draft position (token id 0), as in the torch path.
            key_a, key_b = keyed_row_keys(seed, pos0 + j, ACCEPT)
            u = keyed_unit(key_a, key_b, tl.zeros((), tl.int32))
            alive = alive & (u * q < p)
            num_accepted += alive.to(tl.int64)
            tl.store(out_ptr + row * (max_drafts + 1) + j, token, mask=alive)

        all_accepted = num_accepted == num_valid
        pos_next = pos0 + num_accepted
        a_sample, b_sample = keyed_row_keys(seed, pos_next, SAMPLE)
        a_residual, b_residual = keyed_row_keys(seed, pos_next, RESIDUAL)
        key_a = tl.where(all_accepted, a_sample, a_residual)
        key_b = tl.where(all_accepted, b_sample, b_residual)
        # Two races in one pass: over the residual (or p for the bonus) and over p, the
        # fallback when rounding left no residual mass.
        best_w = tl.full((), -1.0, tl.float32)
        best_w_idx = tl.zeros((), tl.int64)
        best_p = tl.full((), -1.0, tl.float32)
        best_p_idx = tl.zeros((), tl.int64)
        residual_mass = tl.zeros((), tl.float32)
        p_next = target_row + num_accepted * vocab_size
        q_next = draft_row + num_accepted * vocab_size
        # No residual when everything was accepted (and the q row may not exist then).
        q_end = tl.where(all_accepted, 0, vocab_size)
        for chunk in range(0, vocab_size, BLOCK_V):
            cols = chunk + tl.arange(0, BLOCK_V)
            in_vocab = cols < vocab_size
            p = tl.load(p_next + cols, mask=in_vocab, other=0.0)
            q = tl.load(q_next + cols, mask=cols < q_end, other=0.0)
            residual = tl.maximum(p - q, 0.0)
            residual_mass += tl.sum(tl.where(in_vocab, residual, 0.0), axis=0)
            w = tl.where(all_accepted, p, residual)
            exp_noise = -tl.log(keyed_unit(key_a, key_b, cols))
            score_w = tl.where(in_vocab, w / exp_noise, -1.0)
            score_p = tl.where(in_vocab, p / exp_noise, -1.0)
            chunk_w = tl.max(score_w, axis=0)
            chunk_p = tl.max(score_p, axis=0)
            # Strict > keeps the earliest chunk on ties, like torch.argmax.
            best_w_idx = tl.where(chunk_w > best_w, chunk + tl.argmax(score_w, axis=0), best_w_idx)
            best_w = tl.maximum(best_w, chunk_w)
            best_p_idx = tl.where(chunk_p > best_p, chunk + tl.argmax(score_p, axis=0), best_p_idx)
            best_p = tl.maximum(best_p, chunk_p)
        use_w = all_accepted | (residual_mass > 0)
        next_token = tl.where(use_w, best_w_idx, best_p_idx)
        out_row = out_ptr + row * (max_drafts + 1)
        tl.store(out_row + num_accepted, next_token)
        for j in range(num_accepted + 1, max_drafts + 1):
            tl.store(out_row + j, tl.full((), -1, tl.int64))
        tl.store(num_accepted_ptr + row, num_accepted.to(tl.int32))


# A custom op (with a fake implementation): the step runs under FakeTensorMode and torch.compile.
@torch.library.custom_op("zerobubble::rejection_sample", mutates_args=())
def _rejection_triton(
    target_probs: Tensor,
    draft_probs: Tensor,
    draft_tokens: Tensor,
    num_drafts: Tensor,
    seeds: Tensor,
    positions: Tensor,
) -> tuple[Tensor, Tensor]:
    num_reqs, max_drafts = draft_tokens.shape
    vocab_size = target_probs.shape[-1]
    device = target_probs.device
    out = torch.empty((num_reqs, max_drafts + 1), dtype=torch.int64, device=device)
    num_accepted = torch.empty(num_reqs, dtype=torch.int32, device=device)
    if num_reqs == 0:
        return out, num_accepted
    _rejection_kernel[(num_reqs,)](
        target_probs.contiguous(),
        draft_probs.contiguous(),
        draft_tokens.contiguous(),
        num_drafts.contiguous(),
        # The kernel reads element `row` of each: a strided view (the runner passes one
        # column of a [R, K+1] spread) would hand row r another row's key.
        seeds.to(torch.int64).contiguous(),
        positions.to(torch.int64).contiguous(),
        out,
        num_accepted,
        max_drafts,
        vocab_size,
        BLOCK_V=min(1024, next_power_of_2(vocab_size)),
        SAMPLE=STREAM_SAMPLE,
        ACCEPT=STREAM_ACCEPT,
        RESIDUAL=STREAM_RESIDUAL,
    )
    return out, num_accepted


@_rejection_triton.register_fake
def _(
    target_probs: Tensor,
    draft_probs: Tensor,
    draft_tokens: Tensor,
    num_drafts: Tensor,
    seeds: Tensor,
    positions: Tensor,
) -> tuple[Tensor, Tensor]:
    num_reqs, max_drafts = draft_tokens.shape
    out = draft_tokens.new_empty((num_reqs, max_drafts + 1), dtype=torch.int64)
    return out, draft_tokens.new_empty(num_reqs, dtype=torch.int32)


def rejection_sample(
    target_probs: Tensor,
    draft_probs: Tensor,
    draft_tokens: Tensor,
    num_drafts: Tensor,
    seeds: Tensor,
    positions: Tensor,
    impl: KernelImpl = None,
) -> tuple[Tensor, Tensor]:
    """Speculative sampling for draft-model proposals; returns
    ``(out_tokens [R, K+1] int64, num_accepted [R] int32)``.

    ``target_probs [R, K+1, V]`` and ``draft_probs [R, K, V]`` are float32 distributions,
    ``draft_tokens [R, K]`` were drawn from ``draft_probs``, only the first ``num_drafts [R]`` are
    real, and ``positions [R]`` is the absolute position of each row's first draft token. Draft
    ``j`` is accepted with probability ``min(1, p/q)`` (keyed uniform, stream 1, position
    ``positions + j``); the first rejected position is resampled from
    ``normalize(max(0, p - q))`` (stream 2); if all ``num_drafts`` are accepted a bonus token is
    drawn from ``target_probs[r, num_drafts]`` (stream 0). ``out_tokens[r, :a+1]`` are the emitted
    tokens (``a = num_accepted[r]``); later columns are -1.
    """
    if use_triton(target_probs, impl, _rejection_kernel if HAS_TRITON else None):
        return _rejection_triton(target_probs, draft_probs, draft_tokens, num_drafts, seeds, positions)
    return _rejection_torch(target_probs, draft_probs, draft_tokens, num_drafts, seeds, positions)
