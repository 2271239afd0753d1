"""WTA-CRS: the winner-take-all column-row sampling estimator of a linear layer's weight gradient.

For ``Y = X Wᵀ + b`` with ``X`` flattened to ``N`` token rows ``x_i`` (``N = B·L``), backward needs ``X``
only for the weight gradient ``∇W = ∇Yᵀ X = Σ_i ∇y_iᵀ x_i``, a sum of ``N`` rank-one terms. This module
estimates that sum from ``k ≤ N`` rows so that only ``k`` rows of ``X`` are kept for backward:

1. **Probabilities.** ``p_i ∝ ‖x_i‖ · s_i`` where ``s_i > 0`` estimates ``‖∇y_i‖`` (default ``s_i = 1``;
   optionally the norm cached from the previous visit of the same example, see
   :mod:`ds_bertopt.wtacrs.cache`). Padding rows get ``p_i = 0``: their outputs never reach the
   loss, so ``∇y_i = 0`` and they contribute nothing to ``∇W``. Rows with ``x_i = 0`` also get
   ``p_i = 0`` and contribute nothing either.
2. **Budget.** ``k = clamp(round(ratio · N'), min_k, N')``, a host integer: ``N'`` is a row count the
   host knows without reading the device (the tensor's row count, or the number of non-padding rows
   that the training loop counted before it moved the batch; see :mod:`ds_bertopt.wtacrs.linear`).
3. **Winners.** Sort by ``p``; keep the top ``c`` rows exactly (weight 1), with ``c`` chosen by the
   paper's rule ``argmin_{0 ≤ c < k} (1 − P_C(c)) / (k − c)``, ``P_C(c)`` the mass of the top ``c``.
   ``c = 0`` is plain CRS. If at most ``k`` rows have ``p > 0`` all of them are kept exactly.
4. **Sampling.** Draw ``m = k − c`` rows with replacement from the residual distribution
   ``q_j = p_j / (1 − P_C)`` over the non-winners (inverse CDF of ``m`` uniforms). Each draw gets
   weight ``1 / (m q_j)``; a row drawn ``n_j`` times thus carries ``n_j / (m q_j)`` in total.

Then ``∇W ≈ Σ_{c∈C} ∇y_cᵀ x_c + (1/m) Σ_{draws j} ∇y_jᵀ x_j / q_j = Σ_{slots r} w_r ∇y_rᵀ x_r``.
Every row has ``E[total weight of row i] = 1`` (winners deterministically, others because
``E[n_j] = m q_j``), so the estimate is unbiased for any ``p`` with ``p_i > 0`` wherever ``∇y_iᵀ x_i ≠ 0``.
``∇X = ∇Y W`` and ``∇b = Σ ∇y_i`` stay exact. Unlike the authors' reference code there is no path
that leaves sampled rows unweighted.

**Static shapes, no host sync.** :func:`select_rows` always returns exactly ``k`` slots: slot
``r < c`` holds winner ``r``, the other slots hold draws (a row drawn twice fills two slots, each
with its own weight; the sum is the same as storing it once with weight ``n_j / (m q_j)``). Where
every positive row is a winner (``c`` = number of positive rows ``< k``) the spare slots get weight 0.
``c`` and ``m`` are 0-d device tensors; no ``.item()``, ``nonzero`` or data-dependent shape is used, so
a CUDA step never waits for the device here. At most ``k`` rows are stored, as before. When the host
knows that every positive row fits (``k ≥ N'``, e.g. ratio 1) nothing is drawn, so the RNG stream —
and with it every dropout mask — is the same as without sampling.

Everything here is a pure function of tensors; the autograd glue is :mod:`ds_bertopt.wtacrs.linear`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class RowSelection:
    """The ``k`` slots kept for the weight gradient and their weights."""

    indices: torch.Tensor
    """Row index into the flattened input per slot (int64, ``k`` of them): winners first, in rank
    order, then draws (a row may fill several draw slots)."""
    weights: torch.Tensor
    """Weight per slot (float64); 0 for spare slots. Summed over its slots, ``E[weight of row i] = 1``
    for every row with ``p_i > 0``."""
    num_winners: torch.Tensor
    """Rows kept exactly, weight 1 (0-d int64 tensor on the device of ``p``)."""
    num_draws: torch.Tensor
    """Draws ``m`` from the residual distribution (0-d int64; 0 when every positive row is a winner)."""


def budget(num_rows: int, ratio: float, min_k: int) -> int:
    """``k = clamp(round(ratio · num_rows), min_k, num_rows)`` (host integers only)."""
    return int(min(num_rows, max(min_k, round(ratio * num_rows))))


def row_probabilities(
    x: torch.Tensor, valid: Optional[torch.Tensor] = None, scores: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """``p_i ∝ ‖x_i‖ · s_i`` over the rows of 2-D ``x`` (float64, sums to 1, or all zero).

    ``valid`` (bool, one per row) zeroes padding rows; ``scores`` are the positive ``s_i``. The row norms are
    accumulated in fp32 (float64 inputs: float64) and only the ``N`` norms are widened: a float64 reduction over
    the whole input cost 4× as much (1.1 vs 0.27 ms at 1024 × 1536), and ``p`` needs no more than fp32's
    relative precision per row; its sum and the CDFs of :func:`select_rows` stay float64.
    """
    norm_dtype = torch.promote_types(x.dtype, torch.float32) if x.is_floating_point() else torch.float32
    p = torch.linalg.vector_norm(x, dim=-1, dtype=norm_dtype).to(torch.float64)
    if scores is not None:
        p = p * scores.to(torch.float64)
    if valid is not None:
        p = torch.where(valid, p, torch.zeros((), dtype=p.dtype, device=p.device))
    total = p.sum()
    return p / torch.where(total > 0, total, torch.ones_like(total))  # all-zero p stays zero, on the device


def winner_count(p_sorted: torch.Tensor, k: int) -> torch.Tensor:
    """The paper's rule: ``argmin_{0 ≤ c < k} (1 − P_C(c)) / (k − c)`` for ``p`` sorted descending.

    Returns a 0-d int64 tensor. The residual mass is summed from the tail (not ``1 − cumsum``) so it
    never rounds to zero or below.
    """
    tail = torch.flip(torch.cumsum(torch.flip(p_sorted, [0]), 0), [0])  # tail[c] = mass of rows c..N-1
    residual = tail[:k]
    objective = residual / torch.arange(k, 0, -1, dtype=residual.dtype, device=residual.device)
    return torch.argmin(objective)  # first minimum: ties go to fewer winners


def select_rows(
    p: torch.Tensor,
    k: int,
    generator: Optional[torch.Generator] = None,
    use_winners: bool = True,
    max_positive: Optional[int] = None,
) -> RowSelection:
    """Pick ``k`` slots for probabilities ``p`` (1-D, non-negative, sums to 1 or all zero).

    ``k`` is a host integer (clamped to ``p.numel()``). ``max_positive`` is a host upper bound on the
    rows with ``p > 0`` (default ``p.numel()``; the non-padding row count): when it is ``≤ k`` every such
    row is kept exactly without drawing anything (no RNG use, as at ratio 1). ``use_winners=False``
    gives plain CRS (no deterministic winners except when every positive row fits), for comparisons.
    """
    device, n = p.device, p.numel()
    k = min(int(k), n)
    long = dict(dtype=torch.int64, device=device)
    if k == 0:
        return RowSelection(
            torch.zeros(0, **long),
            torch.zeros(0, dtype=torch.float64, device=device),
            torch.zeros((), **long),
            torch.zeros((), **long),
        )
    # ~35 small ops per selection, each a kernel launch on a GPU and a dispatch on a CPU: they are the sampled
    # linear's fixed cost at small batches, so every value is computed once (one sort for order and values, one
    # slot range, scalar fills instead of materialised zeros)
    p_sorted, order = torch.sort(p, descending=True, stable=True)
    positive = (p_sorted > 0).sum()
    slot = torch.arange(k, **long)
    if (n if max_positive is None else min(int(max_positive), n)) <= k:  # known on the host: all fit, no draws
        return RowSelection(order[:k], (slot < positive).to(torch.float64), positive, torch.zeros((), **long))
    all_fit = positive <= k  # every row that can contribute fits: keep them all exactly
    rule = winner_count(p_sorted, k) if use_winners else torch.zeros((), **long)
    winners = torch.where(all_fit, positive, rule)
    draws = (k - winners).masked_fill_(all_fit, 0)

    residual = p_sorted.masked_fill(torch.arange(n, **long) < winners, 0.0)
    cdf = torch.cumsum(residual, 0)
    mass = cdf[-1]  # the residual mass, summed exactly as the CDF that is sampled
    uniform = torch.rand(k, generator=generator, dtype=p.dtype, device=device)
    picked = torch.searchsorted(cdf, uniform.mul_(mass), right=True)  # first rank whose CDF exceeds u·mass
    # u·mass can round up to mass: clamp onto the last positive row (sorted descending: rank positive − 1)
    picked = torch.minimum(picked, (positive - 1).clamp_min_(0))

    is_winner = slot < winners
    picked_p = p_sorted[picked]
    usable = (picked_p > 0).logical_and_(draws > 0)
    # weight 1 / (m q_j) with q_j = p_j / mass; unusable slots (spare, or p = 0) get 0, winners 1
    draw_weights = (mass / (draws.clamp_min(1) * picked_p)).masked_fill_(~usable, 0.0)
    weights = draw_weights.masked_fill_(is_winner, 1.0)
    return RowSelection(order[torch.where(is_winner, slot, picked)], weights.to(torch.float64), winners, draws)


def weight_gradient(grad_out: torch.Tensor, x: torch.Tensor, selection: RowSelection) -> torch.Tensor:
    """``Σ_r w_r ∇y_rᵀ x_r`` over the selected slots of 2-D ``grad_out`` and ``x`` (reference path)."""
    rows = x[selection.indices] * selection.weights.to(x.dtype).unsqueeze(1)
    return grad_out[selection.indices].t() @ rows
