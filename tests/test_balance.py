"""``ds-bertopt balance`` (the planner CLI) and the cost model it reports with."""

from __future__ import annotations

import re

import numpy as np
import pytest

from ds_bertopt.cli import main as cli_main
from ds_bertopt.data.peers import (
    PEERS,
    check_ds_token_packs,
    ds_batch_by_seqlens_plan,
    mlperf_phase2_lengths,
)
from ds_bertopt.data.config import STRATEGIES
from ds_bertopt.data.cost import CostModel, micro_batch_work, padding_fraction, plan_figures, rank_work, slot_lengths
from ds_bertopt.data.sampler import hf_batch_rebalance_plan

ROW = re.compile(
    r"^(\w+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)%\s+(\d+)\s+([\d.]+) / ([\d.]+)"
    r"\s+(\d+)(?:-(\d+))?\s+([\d.]+)/(\d+)\s+(\d+)\s+([\d.]+)$"
)


def table(out: str) -> dict[str, dict]:
    rows = {}
    for line in out.splitlines():
        m = ROW.match(line)
        if m and m.group(1) in (*STRATEGIES, *PEERS):
            rows[m.group(1)] = dict(
                imbalance=float(m.group(2)),
                p99=float(m.group(3)),
                padded=float(m.group(4)),
                padding=float(m.group(6)) / 100,
                tokens=int(m.group(7)),
                step_time=float(m.group(8)),
                padded_step_time=float(m.group(9)),
                samples_min=int(m.group(10)),
                samples_max=int(m.group(11) or m.group(10)),
                micro_mean=float(m.group(12)),
                micro_max=int(m.group(13)),
                dropped=int(m.group(14)),
                plan_seconds=float(m.group(15)),
            )
    return rows


def test_cost_model_by_hand():
    lengths = np.array([[[[10, 20]], [[30, 1]]]])  # 1 step, 2 ranks, 1 micro-batch of 2
    model = CostModel(linear=1.0, quadratic=0.5)
    np.testing.assert_allclose(rank_work(lengths, model), [[10 + 50 + 20 + 200, 30 + 450 + 1 + 0.5]])
    # padded: 2 × cost(24) and 2 × cost(32) (longest rounded up to a multiple of 8)
    np.testing.assert_allclose(
        rank_work(lengths, model, padded=True, pad_multiple=8), [[2 * (24 + 288), 2 * (32 + 512)]]
    )
    assert padding_fraction(lengths, 8) == pytest.approx(1 - 61 / (2 * 24 + 2 * 32))
    assert CostModel.for_hidden_size(1024) == CostModel()


def test_cost_model_on_a_ragged_plan():
    """Unused slots (-1 in the plan, length 0 here) cost nothing and are no samples: a micro-batch of n
    samples pays n × cost(padded longest) whatever the slot axis."""
    indices = np.array([[[[0, 1, -1]], [[2, -1, -1]]]])  # 1 step, 2 ranks, 1 micro-batch, 3 slots
    lengths = slot_lengths(indices, np.array([10, 20, 30]))
    np.testing.assert_array_equal(lengths, [[[[10, 20, 0]], [[30, 0, 0]]]])
    model = CostModel(linear=1.0, quadratic=0.5)
    np.testing.assert_allclose(rank_work(lengths, model), [[10 + 50 + 20 + 200, 30 + 450]])
    np.testing.assert_allclose(rank_work(lengths, model, padded=True, pad_multiple=8), [[2 * (24 + 288), 32 + 512]])
    np.testing.assert_allclose(micro_batch_work(lengths, model)[..., 0], rank_work(lengths, model))
    assert padding_fraction(lengths, 8) == pytest.approx(1 - 60 / (2 * 24 + 32))
    f = plan_figures(lengths, model, 8)
    assert (f.samples_per_step, f.micro_batch_samples_max, f.micro_batch_samples_mean) == (3, 2, 1.5)
    assert (f.micro_batch_tokens_max, f.micro_batch_padded_tokens_max) == (30, 48)
    assert f.mean_work == pytest.approx((280 + 480) / 2)


def test_padded_work_never_below_unpadded():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 513, size=(5, 8, 2, 4))
    f = plan_figures(lengths, CostModel(), 8)
    assert (rank_work(lengths, CostModel(), padded=True) >= rank_work(lengths, CostModel())).all()
    assert f.padded_step_time >= f.step_time and 0 < f.padding < 1


def test_mlperf_mix_has_the_phase2_bin_ratio():
    lengths = mlperf_phase2_lengths(200_000, np.random.default_rng(0))
    shares = np.bincount((lengths - 1) // 128) / len(lengths)
    np.testing.assert_allclose(shares, np.array([6, 3, 2, 5]) / 16, atol=0.01)
    assert np.mean(lengths == 512) == pytest.approx(0.8 * 5 / 16, abs=0.01)


def test_cli_on_1024_ranks_prints_every_strategy_and_a_png(tmp_path, capsys):
    png = tmp_path / "balance.png"
    code = cli_main(
        [
            "balance",
            "--mlperf-mix",
            "--world-size",
            "1024",
            "--ranks-per-node",
            "8",
            "--micro-batch",
            "16",
            "--steps",
            "10",
            "--plot",
            str(png),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    rows = table(out)
    assert set(rows) == set(STRATEGIES), out
    assert rows["random"]["padded_step_time"] == 1.0  # step times are relative to random on padded kernels
    assert rows["random"]["imbalance"] > 1.4
    assert rows["stratified_node_balance"]["imbalance"] <= 1.02 < rows["stratified_node_sort"]["imbalance"]
    assert (
        rows["stratified_node_balance"]["step_time"]
        < rows["stratified_node_sort"]["step_time"]
        < rows["random"]["step_time"]
        < 1.0
    )
    assert rows["sorted_megabatch"]["padding"] < 0.05 < rows["random"]["padding"]
    # the packed strategies: a global batch of 16,384 every step, micro-batches of varying size
    assert rows["packed_node_balance"]["step_time"] <= 0.55 and rows["packed_node_balance"]["imbalance"] <= 1.02
    assert rows["padded_node_balance"]["padded_step_time"] < 0.7 < rows["stratified_node_balance"]["padded_step_time"]
    assert rows["padded_node_balance"]["micro_max"] > 16 and rows["padded_node_balance"]["micro_mean"] == 16.0
    assert all(r["samples_min"] == r["samples_max"] == 16384 for r in rows.values())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_cli_on_a_corpus_and_a_lengths_file(tmp_path, capsys, small_corpus, cache_dir):
    code = cli_main(
        [
            "balance",
            "--corpus",
            str(small_corpus),
            "--cache-dir",
            str(cache_dir),
            "--max-seq-len",
            "128",
            "--world-size",
            "4",
            "--ranks-per-node",
            "2",
            "--micro-batch",
            "4",
            "--grad-accum",
            "2",
            "--strategies",
            "random",
            "stratified_node_balance",
            "--padded",
            "--hidden-size",
            "128",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "balances the padded cost" in out and "b = 0.001302" in out
    assert set(table(out)) == {"random", "stratified_node_balance"}
    lengths_file = tmp_path / "lengths.txt"
    lengths_file.write_text("\n".join(str(x) for x in np.random.default_rng(0).integers(1, 129, size=500)))
    code = cli_main(
        [
            "balance",
            "--lengths",
            str(lengths_file),
            "--world-size",
            "2",
            "--ranks-per-node",
            "2",
            "--micro-batch",
            "8",
            "--bins",
            "32,64,128",
            "--bin-counts",
            "2,2,4",
            "--strategies",
            "stratified",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and "bins of stratified (per rank): [32, 64, 128]" in out


def test_cli_errors_are_one_line(tmp_path, capsys):
    missing = tmp_path / "nope.npy"
    assert (
        cli_main(
            ["balance", "--lengths", str(missing), "--world-size", "2", "--ranks-per-node", "2", "--micro-batch", "2"]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert err == f"ds-bertopt balance: error: lengths file {missing} does not exist"
    assert (
        cli_main(["balance", "--mlperf-mix", "--world-size", "6", "--ranks-per-node", "4", "--micro-batch", "2"]) == 2
    )
    assert "--world-size 6 is not a multiple of --ranks-per-node 4" in capsys.readouterr().err
    bad = tmp_path / "bad.txt"
    bad.write_text("12 0 5")
    assert (
        cli_main(["balance", "--lengths", str(bad), "--world-size", "2", "--ranks-per-node", "2", "--micro-batch", "2"])
        == 2
    )
    assert "needs positive integer lengths" in capsys.readouterr().err


def test_transformers_batch_rebalance_driven_per_rank_or_once_per_step_is_the_same_plan():
    lengths = np.random.default_rng(1).integers(1, 513, size=600)
    kw = dict(world_size=4, micro_batch=4, grad_accum=2, seed=3)
    per_rank, _, how = hf_batch_rebalance_plan(lengths, per_rank=True, **kw)
    once, _, other = hf_batch_rebalance_plan(lengths, per_rank=False, **kw)
    assert how == "per-rank iterators" and other.startswith("_assign once per step")
    np.testing.assert_array_equal(per_rank.indices, once.indices)
    used = per_rank.indices[per_rank.indices >= 0]
    assert len(np.unique(used)) == used.size == per_rank.steps * 32 and per_rank.dropped == 600 - used.size
    assert (per_rank.micro_batch_sizes >= 1).all()


@pytest.mark.parametrize("seed, max_tokens, effective", [(0, 600, 4), (1, 1100, 3), (5, 513, 1)])
def test_our_copy_of_deepspeeds_batch_by_seqlens_packs_as_it_does(seed, max_tokens, effective):
    lengths = np.random.default_rng(seed).integers(1, 513, size=250)
    assert check_ds_token_packs(lengths, max_tokens, effective, seed)


def test_deepspeed_dynamic_batching_plan_is_dealt_as_its_loader_deals():
    lengths = np.random.default_rng(2).integers(1, 513, size=2000)
    plan, _, note = ds_batch_by_seqlens_plan(lengths, world_size=4, micro_batch=4, grad_accum=2, seed=0)
    assert "max_tokens" in note
    used = plan.indices[plan.indices >= 0]
    assert len(np.unique(used)) == used.size and plan.dropped == 2000 - used.size
    assert (plan.micro_batch_sizes >= 1).all()
    max_tokens = int(note.split()[1].rstrip(","))
    assert slot_lengths(plan.indices, lengths).sum(axis=3).max() <= max_tokens
    # a step holds about a global batch of samples on average (max_tokens is calibrated for it)
    assert abs(plan.micro_batch_sizes.sum(axis=(1, 2)).mean() / 32 - 1) < 0.15


def test_cli_prints_the_peers_next_to_ours(capsys):
    code = cli_main(
        [
            "balance",
            "--mlperf-mix",
            "--world-size",
            "4",
            "--ranks-per-node",
            "2",
            "--micro-batch",
            "4",
            "--grad-accum",
            "2",
            "--steps",
            "20",
            "--peers",
            "--strategies",
            "random",
            "packed_node_balance",
            "padded_node_balance",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    rows = table(out)
    assert set(rows) == {"random", "packed_node_balance", "padded_node_balance", *PEERS}, out
    assert "hf_batch_rebalance: global, a peer's algorithm (every rank plans every rank's steps): per-rank" in out
    assert rows["packed_node_balance"]["step_time"] < rows["hf_batch_rebalance"]["padded_step_time"]


def test_cli_at_scale_plans_one_rank_in_windows_identical_to_the_global_plan(capsys):
    """``--sequences``: each strategy's training sampler in a fresh process (first step, windows, waits, peak RSS)
    next to the global plan in another; the rows must be bit-identical, every target printed met or NOT met."""
    strategies = ["stratified_node_sort", "padded_node_balance"]
    code = cli_main(
        [
            "balance",
            "--sequences",
            "12k",
            "--world-size",
            "16",
            "--ranks-per-node",
            "4",
            "--micro-batch",
            "4",
            "--grad-accum",
            "2",
            "--rank",
            "6",
            "--strategies",
            *strategies,
            "--windows",
            "2",
            "--step-time",
            "0",
            "--global-plan",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "12000 synthetic MLPerf-like lengths" in out
    for strategy in strategies:
        line = next(x for x in out.splitlines() if f"rank 6: {strategy}: first step" in x)
        assert re.search(r"a window of 32 steps [\d.]+ s mean", line) and "bit-identical: yes" in line, line
        assert re.search(r"peak RSS \d+ MiB", line), line
    for target in ("≤ 1 GiB peak RSS", "≤ 10 s before the first step", "no step waits for planning"):
        assert re.search(f"target {target}[^:]*: (met|NOT met): ", out), target
    assert "target bit-identical to the global plan where both run: met: 2 of 2 strategies" in out
