"""Statistics for sampling tests: goodness of fit of observed token counts."""

from __future__ import annotations

import torch


def chi_square_pvalue(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson chi-square p-value of ``counts`` against ``expected_probs`` (cells with zero
    expected probability must have zero counts; they are left out)."""
    counts = counts.double().flatten()
    probs = expected_probs.double().flatten()
    assert float(counts[probs == 0].sum()) == 0, "a cell with probability 0 was observed"
    counts, probs = counts[probs > 0], probs[probs > 0]
    expected = probs / probs.sum() * counts.sum()
    statistic = float(((counts - expected) ** 2 / expected).sum())
    dof = counts.numel() - 1
    if dof == 0:
        return 1.0
    # Survival function of chi-square(dof) = regularized upper incomplete gamma.
    return float(
        torch.special.gammaincc(
            torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(statistic / 2, dtype=torch.float64)
        )
    )
