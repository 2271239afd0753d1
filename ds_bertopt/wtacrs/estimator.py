"""WTA-CRS: the winner-take-all column-row sampling estimator of a linear layer's weight gradient.

For ``Y = X Wᵀ + b`` with ``X`` flattened to ``N`` token rows ``x_i`` (``N = B·L``), backward needs ``X``
only for the weight gradient ``∇W = ∇Yᵀ X = Σ_i ∇y_iᵀ x_i``, a sum of ``N`` rank-one terms. This module
estimates that sum from ``k ≤ N`` rows so that only ``k`` rows of ``X`` are kept for backward:

1. **Probabilities.** ``p_i ∝ ‖x_i‖ · s_i`` where ``s_i > 0`` estimates ``‖∇y_i‖`` (default ``s_i = 1``;
   optionally the norm cached from the previous visit of the same example, see
   :mod:`ds_bertopt.wtacrs.cache`). Padding rows get ``p_i = 0``: their outputs never reach the
   loss, so ``∇y_i = 0`` and they contribute nothing to ``∇W``. Rows with ``x_i = 0`` also get
   ``p_i = 0`` and contribute nothing either.
2. **Budget.** ``k = clamp(round(ratio · N'), min_k, N')`` with ``N'`` the non-padding rows.
3. **Winners.** Sort by ``p``; keep the top ``c`` rows exactly (weight 1), with ``c`` chosen by the
   paper's rule ``argmin_{0 ≤ c < k} (1 − P_C(c)) / (k − c)``, ``P_C(c)`` the mass of the top ``c``.
   ``c = 0`` is plain CRS. If at most ``k`` rows have ``p > 0`` all of them are kept exactly.
4. **Sampling.** Draw ``m = k − c`` rows with replacement from the residual distribution
   ``q_j = p_j / (1 − P_C)`` over the non-winners. A row drawn ``n_j`` times gets weight
   ``n_j / (m q_j)``; duplicates are stored once, so at most ``k`` rows are stored.

Then ``∇W ≈ Σ_{c∈C} ∇y_cᵀ x_c + (1/m) Σ_{draws j} ∇y_jᵀ x_j / q_j = Σ_{stored r} w_r ∇y_rᵀ x_r``.
Every row has ``E[w_i] = 1`` (winners deterministically, others because ``E[n_j] = m q_j``), so the
estimate is unbiased for any ``p`` with ``p_i > 0`` wherever ``∇y_iᵀ x_i ≠ 0``. Stored rows are
pre-scaled by ``w_r`` so backward is a single ``k``-row GEMM. ``∇X = ∇Y W`` and ``∇b = Σ ∇y_i`` stay
exact. Unlike the authors' reference code there is no path that leaves sampled rows unweighted.

Everything here is a pure function of tensors; the autograd glue is :mod:`ds_bertopt.wtacrs.linear`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class RowSelection:
    """The rows kept for the weight gradient and their weights."""

    indices: torch.Tensor
    """Row indices into the flattened input (int64, winners first, each at most once)."""
    weights: torch.Tensor
    """Weight of each kept row (float64); ``E[weight of row i] = 1`` for every row with ``p_i > 0``."""
    num_winners: int
    """Rows kept exactly (weight 1)."""
    num_draws: int
    """Draws ``m`` from the residual distribution (0 when every positive row is a winner)."""


def budget(num_rows: int, ratio: float, min_k: int) -> int:
    """``k = clamp(round(ratio · num_rows), min_k, num_rows)``."""
    return int(min(num_rows, max(min_k, round(ratio * num_rows))))


def row_probabilities(x: torch.Tensor, valid: Optional[torch.Tensor] = None,
                      scores: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``p_i ∝ ‖x_i‖ · s_i`` over the rows of 2-D ``x`` (float64, sums to 1, or all zero).

    ``valid`` (bool, one per row) zeroes padding rows; ``scores`` are the positive ``s_i``.
    """
    p = torch.linalg.vector_norm(x, dim=-1, dtype=torch.float64)
    if scores is not None:
        p = p * scores.to(torch.float64)
    if valid is not None:
        p = torch.where(valid, p, torch.zeros((), dtype=p.dtype, device=p.device))
    total = p.sum()
    return p / total if total > 0 else p


def winner_count(p_sorted: torch.Tensor, k: int) -> int:
    """The paper's rule: ``argmin_{0 ≤ c < k} (1 − P_C(c)) / (k − c)`` for ``p`` sorted descending.

    The residual mass is summed from the tail (not ``1 − cumsum``) so it never rounds to zero or below.
    """
    tail = torch.flip(torch.cumsum(torch.flip(p_sorted, [0]), 0), [0])  # tail[c] = mass of rows c..N-1
    residual = tail[:k]
    objective = residual / torch.arange(k, 0, -1, dtype=residual.dtype, device=residual.device)
    return int(torch.argmin(objective))  # first minimum: ties go to fewer winners


def select_rows(p: torch.Tensor, k: int, generator: Optional[torch.Generator] = None,
                use_winners: bool = True) -> RowSelection:
    """Pick the rows to keep for probabilities ``p`` (1-D, non-negative, sums to 1 or all zero).

    ``use_winners=False`` gives plain CRS (no deterministic winners), for comparisons.
    """
    device = p.device
    positive = int((p > 0).sum())
    if positive <= k:  # every row that can contribute fits: keep them all exactly
        indices = torch.nonzero(p > 0).flatten()
        return RowSelection(indices, torch.ones(indices.numel(), dtype=torch.float64, device=device),
                            num_winners=positive, num_draws=0)
    order = torch.argsort(p, descending=True, stable=True)
    p_sorted = p[order]
    winners = winner_count(p_sorted, k) if use_winners else 0
    draws = k - winners
    residual_rows = order[winners:]
    residual_p = p_sorted[winners:]
    residual_mass = residual_p.sum()
    picks = torch.multinomial(residual_p, draws, replacement=True, generator=generator)
    counts = torch.bincount(picks, minlength=residual_p.numel())
    drawn = torch.nonzero(counts).flatten()
    # weight n_j / (m q_j) with q_j = p_j / residual_mass
    drawn_weights = counts[drawn].to(torch.float64) * residual_mass / (draws * residual_p[drawn])
    indices = torch.cat([order[:winners], residual_rows[drawn]])
    weights = torch.cat([torch.ones(winners, dtype=torch.float64, device=device), drawn_weights])
    return RowSelection(indices, weights, num_winners=winners, num_draws=draws)


def weight_gradient(grad_out: torch.Tensor, x: torch.Tensor, selection: RowSelection) -> torch.Tensor:
    """``Σ_r w_r ∇y_rᵀ x_r`` over the selected rows of 2-D ``grad_out`` and ``x`` (reference path)."""
    rows = x[selection.indices] * selection.weights.to(x.dtype).unsqueeze(1)
    return grad_out[selection.indices].t() @ rows
