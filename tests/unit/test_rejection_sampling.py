"""Rejection sampling preserves the target distribution, and reduces to exact matching for
greedy (one-hot) targets."""

from __future__ import annotations

import os

# Triton decides interpreted vs compiled when a kernel is defined, i.e. at import time.
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from tests.support.stats import chi_square_pvalue  # noqa: E402
from zerobubble.kernels.verify import count_accepted, rejection_sample  # noqa: E402

VOCAB = 8
NUM_DRAFTS = 2
NUM_TRIALS = 40_000
STRICT = 1e-3  # the test is deterministic (keyed noise, fixed generator): no flakiness margin


def fixed_distributions() -> tuple[torch.Tensor, torch.Tensor]:
    """Target p [K+1, V] and draft q [K, V], deliberately different (some q-heavy tokens)."""
    gen = torch.Generator().manual_seed(1234)
    p = (torch.randn(NUM_DRAFTS + 1, VOCAB, generator=gen) * 1.2).softmax(-1)
    q = (torch.randn(NUM_DRAFTS, VOCAB, generator=gen) * 1.2).softmax(-1)
    return p, q


def run_trials(num_drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One vectorized call: every row is an independent trial (distinct seed), drafts ~ q."""
    p, q = fixed_distributions()
    num_rows = num_drafts.shape[0]
    gen = torch.Generator().manual_seed(99)
    drafts = torch.stack(
        [torch.multinomial(q[j], num_rows, replacement=True, generator=gen) for j in range(NUM_DRAFTS)], dim=1
    )
    seeds = torch.arange(num_rows, dtype=torch.int64) * 7919 + 11
    positions = torch.full((num_rows,), 321, dtype=torch.int64)
    out, accepted = rejection_sample(
        p.expand(num_rows, -1, -1), q.expand(num_rows, -1, -1), drafts, num_drafts, seeds, positions
    )
    return out, accepted, drafts


def test_emitted_tokens_follow_the_target_distribution() -> None:
    p, q = fixed_distributions()
    out, accepted, drafts = run_trials(torch.full((NUM_TRIALS,), NUM_DRAFTS, dtype=torch.int32))
    assert out.shape == (NUM_TRIALS, NUM_DRAFTS + 1) and out.dtype == torch.int64
    assert accepted.dtype == torch.int32
    # Emitted prefix: accepted drafts, then one more token; -1 after.
    cols = torch.arange(NUM_DRAFTS + 1)
    acc = accepted.long()[:, None]
    assert torch.equal(out[:, :NUM_DRAFTS][cols[:NUM_DRAFTS] < acc], drafts[cols[:NUM_DRAFTS] < acc])
    assert bool((out[cols > acc] == -1).all()) and bool((out[cols <= acc] >= 0).all())

    # First emitted token ~ p[0].
    first = torch.bincount(out[:, 0], minlength=VOCAB)
    assert chi_square_pvalue(first, p[0]) > STRICT
    # Acceptance rate of the first draft = sum_v min(p, q) (binomial, 5 sigma).
    rate = float(torch.minimum(p[0], q[0]).sum())
    observed = float((accepted >= 1).float().mean())
    assert abs(observed - rate) < 5 * (rate * (1 - rate) / NUM_TRIALS) ** 0.5

    # Given the first draft was accepted, (token 0, token 1) ~ min(p0, q0) (x) p1: the second
    # emitted token follows p[1] whatever the first was.
    kept = accepted >= 1
    pairs = torch.bincount(out[kept, 0] * VOCAB + out[kept, 1], minlength=VOCAB * VOCAB)
    joint = torch.minimum(p[0], q[0])[:, None] * p[1][None, :]
    assert chi_square_pvalue(pairs, joint) > STRICT
    # Bonus tokens (both drafts accepted) ~ p[2].
    bonus = torch.bincount(out[accepted == NUM_DRAFTS, 2], minlength=VOCAB)
    assert chi_square_pvalue(bonus, p[2]) > STRICT


def test_fewer_real_drafts_than_slots() -> None:
    """Rows with num_drafts < K: drafts past it are never judged, and the token after the last
    real draft comes from the target at that position."""
    p, _ = fixed_distributions()
    num_drafts = torch.tensor([0, 1] * (NUM_TRIALS // 4), dtype=torch.int32)
    out, accepted, _ = run_trials(num_drafts)
    assert bool((accepted <= num_drafts).all())
    none = num_drafts == 0
    assert chi_square_pvalue(torch.bincount(out[none, 0], minlength=VOCAB), p[0]) > STRICT
    one = num_drafts == 1
    assert chi_square_pvalue(torch.bincount(out[one, 0], minlength=VOCAB), p[0]) > STRICT
    tail = one & (accepted == 1)
    assert chi_square_pvalue(torch.bincount(out[tail, 1], minlength=VOCAB), p[1]) > STRICT
    assert bool((out[:, 2] == -1).all())


def test_greedy_targets_reduce_to_count_accepted() -> None:
    gen = torch.Generator().manual_seed(5)
    num_rows, vocab = 300, 6
    targets = torch.randint(0, vocab, (num_rows, NUM_DRAFTS + 1), generator=gen)
    one_hot = torch.nn.functional.one_hot(targets, vocab).float()
    q = torch.randn(num_rows, NUM_DRAFTS, vocab, generator=gen).softmax(-1)
    # Drafts agree with the target half of the time, otherwise anything (even -1 past num).
    agree = torch.rand(num_rows, NUM_DRAFTS, generator=gen) < 0.5
    drafts = torch.where(agree, targets[:, :NUM_DRAFTS], torch.randint(0, vocab, (num_rows, NUM_DRAFTS), generator=gen))
    num_drafts = torch.randint(0, NUM_DRAFTS + 1, (num_rows,), generator=gen).int()
    drafts[torch.arange(NUM_DRAFTS)[None, :] >= num_drafts[:, None]] = -1
    seeds = torch.arange(num_rows, dtype=torch.int64)
    out, accepted = rejection_sample(one_hot, q, drafts, num_drafts, seeds, torch.zeros(num_rows, dtype=torch.int64))
    assert torch.equal(accepted, count_accepted(targets, drafts, num_drafts))
    emitted = torch.arange(NUM_DRAFTS + 1)[None, :] <= accepted.long()[:, None]
    assert torch.equal(out[emitted], targets[emitted])


def test_keyed_by_seed_and_position_not_by_row() -> None:
    p, q = fixed_distributions()
    num_rows = 64
    gen = torch.Generator().manual_seed(3)
    drafts = torch.randint(0, VOCAB, (num_rows, NUM_DRAFTS), generator=gen)
    num_drafts = torch.full((num_rows,), NUM_DRAFTS, dtype=torch.int32)
    seeds = torch.randint(0, 2**62, (num_rows,), generator=gen)
    positions = torch.randint(0, 1000, (num_rows,), generator=gen)
    target, draft = p.expand(num_rows, -1, -1), q.expand(num_rows, -1, -1)
    out, accepted = rejection_sample(target, draft, drafts, num_drafts, seeds, positions)
    perm = torch.randperm(num_rows, generator=gen)
    out_p, accepted_p = rejection_sample(target, draft, drafts[perm], num_drafts, seeds[perm], positions[perm])
    assert torch.equal(out_p, out[perm]) and torch.equal(accepted_p, accepted[perm])
