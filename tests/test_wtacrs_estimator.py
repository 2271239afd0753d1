"""The WTA-CRS estimator as a pure function: unbiasedness in every path, variance, the winner rule.

Unbiasedness is checked statistically: over T independent estimates Ĝ_t of G = ∇W,
``E‖mean(Ĝ) − G‖²_F = tr Cov(Ĝ) / T`` exactly, so the ratio ``‖mean − G‖² / (Σ var̂ / T)`` is about 1
for an unbiased estimator and grows like T × bias² for a biased one. The bound 4 is far above what
the unbiased paths reach with these seeds (≤ ~2) and far below what a broken weighting gives (≫ 100),
which ``test_broken_weighting_is_caught`` demonstrates.
"""

from __future__ import annotations

import pytest
import torch

from ds_bertopt.wtacrs.estimator import (
    RowSelection,
    budget,
    row_probabilities,
    select_rows,
    weight_gradient,
    winner_count,
)

BIAS_BOUND = 4.0


def heavy_tailed_rows(n: int, d: int, seed: int, alpha: float = 1.2) -> torch.Tensor:
    """Rows with Pareto-distributed norms (a few tokens dominate, as in real activations)."""
    gen = torch.Generator().manual_seed(seed)
    directions = torch.randn(n, d, generator=gen, dtype=torch.float64)
    directions /= directions.norm(dim=1, keepdim=True)
    norms = (1.0 - torch.rand(n, generator=gen, dtype=torch.float64)) ** (-1.0 / alpha)
    return directions * norms.unsqueeze(1)


def bias_statistic(estimates: torch.Tensor, exact: torch.Tensor) -> float:
    """‖mean − exact‖² / (Σ elementwise variance / T); ≈ 1 when unbiased."""
    trials = estimates.shape[0]
    mean = estimates.mean(0)
    spread = estimates.var(0, unbiased=True).sum() / trials
    return float(((mean - exact) ** 2).sum() / spread)


def draw_estimates(x, grad_out, p, k, trials, seed, transform=None, use_winners=True):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(trials):
        selection = select_rows(p, k, generator=gen, use_winners=use_winners)
        if transform is not None:
            selection = transform(selection)
        out.append(weight_gradient(grad_out, x, selection))
    return torch.stack(out)


def test_budget_clamps():
    assert budget(100, 0.3, 8) == 30
    assert budget(10, 0.3, 8) == 8
    assert budget(5, 0.3, 8) == 5
    assert budget(0, 0.3, 8) == 0


def test_winner_rule_matches_brute_force():
    gen = torch.Generator().manual_seed(0)
    for trial in range(50):
        p = torch.rand(40, generator=gen, dtype=torch.float64) ** (8 * torch.rand(1, generator=gen).item() + 0.1)
        p /= p.sum()
        p_sorted = torch.sort(p, descending=True).values
        k = 5 + trial % 20
        objective = [(1.0 - float(p_sorted[:c].sum())) / (k - c) for c in range(k)]
        best = min(range(k), key=lambda c: (objective[c], c))
        assert winner_count(p_sorted, k) == best or abs(objective[winner_count(p_sorted, k)] - objective[best]) < 1e-15


def test_uniform_norms_need_no_winners_and_heavy_tails_do():
    flat = torch.full((64,), 1 / 64, dtype=torch.float64)
    assert int(select_rows(flat, 16, torch.Generator().manual_seed(0)).num_winners) == 0
    p = row_probabilities(heavy_tailed_rows(64, 8, seed=1))
    selection = select_rows(p, 16, torch.Generator().manual_seed(0))
    winners = int(selection.num_winners)
    assert 0 < winners < 16
    assert int(selection.num_draws) == 16 - winners
    assert selection.indices.shape == (16,) and selection.weights.shape == (16,)  # static: always k slots
    order = torch.argsort(p, descending=True, stable=True)
    assert torch.equal(selection.indices[:winners], order[:winners])  # winners first, in rank order, weight 1
    assert torch.equal(selection.weights[:winners], torch.ones(winners, dtype=torch.float64))
    assert not set(selection.indices[winners:].tolist()) & set(order[:winners].tolist())  # draws: non-winners


@pytest.mark.parametrize("host_bound", [False, True])
@pytest.mark.parametrize("n,k,positive", [(64, 16, 10), (64, 16, 16), (64, 16, 0), (5, 8, 5), (1, 1, 1)])
def test_all_positive_rows_fit_are_exact_with_spare_slots_at_weight_zero(n, k, positive, host_bound):
    p = torch.zeros(n, dtype=torch.float64)
    p[torch.randperm(n, generator=torch.Generator().manual_seed(1))[:positive]] = torch.rand(positive).double() + 0.1
    p = p / p.sum() if positive else p
    generator = torch.Generator().manual_seed(2)
    state = generator.get_state()
    selection = select_rows(p, k, generator, max_positive=positive if host_bound else None)
    if host_bound:  # the host knows every positive row fits: nothing drawn
        assert torch.equal(generator.get_state(), state)
    assert selection.indices.shape == (min(n, k),)
    assert int(selection.num_winners) == positive and int(selection.num_draws) == 0
    total = torch.zeros(n, dtype=torch.float64).index_add_(0, selection.indices, selection.weights)
    assert torch.equal(total, (p > 0).double())  # every contributing row exactly once, nothing else


def test_empty_budget_selects_nothing():
    selection = select_rows(torch.full((4,), 0.25, dtype=torch.float64), 0)
    assert selection.indices.numel() == 0 and int(selection.num_winners) == 0


def test_every_row_has_expected_weight_one():
    """The core identity: E[w_i] = 1 for each row (winner or not), checked per row."""
    p = row_probabilities(heavy_tailed_rows(48, 4, seed=2))
    gen = torch.Generator().manual_seed(3)
    trials = 6000
    totals = torch.zeros(48, dtype=torch.float64)
    squares = torch.zeros(48, dtype=torch.float64)
    for _ in range(trials):
        selection = select_rows(p, 12, gen)
        w = torch.zeros(48, dtype=torch.float64).index_add_(0, selection.indices, selection.weights)  # duplicates add
        totals += w
        squares += w * w
    mean = totals / trials
    std = ((squares / trials - mean**2).clamp_min(0) / trials).sqrt()
    deterministic = std == 0
    assert torch.allclose(mean[deterministic], torch.ones_like(mean[deterministic]))
    z = ((mean - 1).abs() / std)[~deterministic]
    assert float(z.max()) < 4.5, f"a row's mean weight is {float(z.max()):.1f} standard errors from 1"


@pytest.mark.parametrize("case", ["winners", "no_winners", "cache_scores", "padding", "all_fit"])
def test_weight_gradient_is_unbiased(case):
    n, d_in, d_out = 64, 6, 4
    x = heavy_tailed_rows(n, d_in, seed=10)
    gen = torch.Generator().manual_seed(11)
    grad_out = torch.randn(n, d_out, generator=gen, dtype=torch.float64)
    valid, scores, k = None, None, 16
    if case == "no_winners":
        x = x / x.norm(dim=1, keepdim=True)  # equal norms: plain CRS
    if case == "cache_scores":
        # stale, noisy gradient norms from a "previous visit": any positive scores stay unbiased
        scores = grad_out.norm(dim=1) * torch.exp(0.5 * torch.randn(n, generator=gen, dtype=torch.float64))
    if case == "padding":
        valid = torch.ones(n, dtype=torch.bool)
        valid[40:] = False  # padding outputs never reach the loss: their output gradient is zero
        grad_out[~valid] = 0
    if case == "all_fit":
        x[20:] = 0  # only 20 rows can contribute: with k = 24 all are kept exactly
        k = 24
    p = row_probabilities(x, valid, scores)
    exact = grad_out.t() @ x
    estimates = draw_estimates(x, grad_out, p, k, trials=3000, seed=12)
    if case == "all_fit":
        assert torch.allclose(estimates, exact.expand_as(estimates), atol=1e-10)
        return
    winners = int(select_rows(p, k, torch.Generator().manual_seed(0)).num_winners)
    assert winners == 0 if case == "no_winners" else winners > 0
    if case == "padding":
        for _ in range(50):
            selection = select_rows(p, k)
            used = selection.weights != 0
            assert bool(valid[selection.indices[used]].all()), "a padding row was selected"
    assert bias_statistic(estimates, exact) < BIAS_BOUND


@pytest.mark.parametrize("broken", ["unweighted_samples", "missing_1_over_m"])
def test_broken_weighting_is_caught(broken):
    """The same test statistic flags the authors' unweighted-sample path and a dropped 1/m."""
    n = 64
    x = heavy_tailed_rows(n, 6, seed=10)
    grad_out = torch.randn(n, 4, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    p = row_probabilities(x)

    def corrupt(selection: RowSelection) -> RowSelection:
        weights = selection.weights.clone()
        drawn = slice(int(selection.num_winners), None)
        if broken == "unweighted_samples":
            weights[drawn] = 1.0
        else:
            weights[drawn] = weights[drawn] * int(selection.num_draws)
        return RowSelection(selection.indices, weights, selection.num_winners, selection.num_draws)

    estimates = draw_estimates(x, grad_out, p, 16, trials=3000, seed=12, transform=corrupt)
    assert bias_statistic(estimates, grad_out.t() @ x) > 25 * BIAS_BOUND


def test_variance_wta_below_crs_below_uniform():
    n, k, trials = 128, 24, 2000
    x = heavy_tailed_rows(n, 8, seed=20)
    grad_out = torch.randn(n, 5, generator=torch.Generator().manual_seed(21), dtype=torch.float64)
    exact = grad_out.t() @ x
    p = row_probabilities(x)
    uniform = torch.full((n,), 1.0 / n, dtype=torch.float64)

    def mse(estimates):
        return float(((estimates - exact) ** 2).sum(dim=(1, 2)).mean())

    wta = mse(draw_estimates(x, grad_out, p, k, trials, seed=22))
    crs = mse(draw_estimates(x, grad_out, p, k, trials, seed=22, use_winners=False))
    uni = mse(draw_estimates(x, grad_out, uniform, k, trials, seed=22, use_winners=False))
    assert wta < 0.8 * crs, (wta, crs)
    assert crs < 0.8 * uni, (crs, uni)


def test_zero_input_selects_nothing():
    p = row_probabilities(torch.zeros(10, 3))
    assert torch.equal(p, torch.zeros(10, dtype=torch.float64))
    selection = select_rows(p, 4)
    assert selection.indices.shape == (4,) and torch.equal(selection.weights, torch.zeros(4, dtype=torch.float64))
    assert weight_gradient(torch.randn(10, 2), torch.zeros(10, 3), selection).abs().sum() == 0


def _previous_select_rows(p, k, generator):
    """The multinomial + merged-duplicates selection this package used before the static-shape one."""
    positive = int((p > 0).sum())
    if positive <= k:
        indices = torch.nonzero(p > 0).flatten()
        return RowSelection(indices, torch.ones(indices.numel(), dtype=torch.float64), positive, 0)
    order = torch.argsort(p, descending=True, stable=True)
    p_sorted = p[order]
    winners = int(winner_count(p_sorted, k))
    draws = k - winners
    residual_p = p_sorted[winners:]
    picks = torch.multinomial(residual_p, draws, replacement=True, generator=generator)
    counts = torch.bincount(picks, minlength=residual_p.numel())
    drawn = torch.nonzero(counts).flatten()
    drawn_weights = counts[drawn].to(torch.float64) * residual_p.sum() / (draws * residual_p[drawn])
    return RowSelection(
        torch.cat([order[:winners], order[winners:][drawn]]),
        torch.cat([torch.ones(winners, dtype=torch.float64), drawn_weights]),
        winners,
        draws,
    )


@pytest.mark.parametrize("scores", [False, True])
def test_variance_no_worse_than_the_previous_selection(scores):
    """Same estimator distribution as the multinomial version (its MSE within sampling noise), at most k rows."""
    n, k, trials = 128, 24, 3000
    x = heavy_tailed_rows(n, 8, seed=30)
    gen = torch.Generator().manual_seed(31)
    grad_out = torch.randn(n, 5, generator=gen, dtype=torch.float64)
    s = grad_out.norm(dim=1) * torch.exp(0.5 * torch.randn(n, generator=gen, dtype=torch.float64)) if scores else None
    p = row_probabilities(x, scores=s)
    exact = grad_out.t() @ x
    ours, previous = [], []
    gen_ours, gen_prev = torch.Generator().manual_seed(32), torch.Generator().manual_seed(33)
    for _ in range(trials):
        selection = select_rows(p, k, gen_ours)
        assert selection.indices.numel() == k
        ours.append(weight_gradient(grad_out, x, selection))
        old = _previous_select_rows(p, k, gen_prev)
        assert old.indices.numel() <= k
        previous.append(weight_gradient(grad_out, x, old))
    mse = lambda e: float(((torch.stack(e) - exact) ** 2).sum(dim=(1, 2)).mean())  # noqa: E731
    assert mse(ours) <= 1.08 * mse(previous), (mse(ours), mse(previous))
    assert bias_statistic(torch.stack(ours), exact) < BIAS_BOUND
