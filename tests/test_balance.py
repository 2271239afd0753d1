"""``ds-bertopt balance`` (the planner CLI) and the cost model it reports with."""
from __future__ import annotations

import re

import numpy as np
import pytest

from ds_bertopt.cli import main as cli_main
from ds_bertopt.data.balance_cli import mlperf_phase2_lengths
from ds_bertopt.data.config import STRATEGIES
from ds_bertopt.data.cost import CostModel, padding_fraction, plan_figures, rank_work

ROW = re.compile(r"^(\w+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)%\s+(\d+)\s+([\d.]+) / ([\d.]+)\s+(\d+)")


def table(out: str) -> dict[str, dict]:
    rows = {}
    for line in out.splitlines():
        m = ROW.match(line)
        if m and m.group(1) in STRATEGIES:
            rows[m.group(1)] = dict(imbalance=float(m.group(2)), p99=float(m.group(3)), padded=float(m.group(4)),
                                    padding=float(m.group(6)) / 100, tokens=int(m.group(7)),
                                    step_time=float(m.group(8)), padded_step_time=float(m.group(9)),
                                    dropped=int(m.group(10)))
    return rows


def test_cost_model_by_hand():
    lengths = np.array([[[[10, 20]], [[30, 1]]]])  # 1 step, 2 ranks, 1 micro-batch of 2
    model = CostModel(linear=1.0, quadratic=0.5)
    np.testing.assert_allclose(rank_work(lengths, model), [[10 + 50 + 20 + 200, 30 + 450 + 1 + 0.5]])
    # padded: 2 × cost(24) and 2 × cost(32) (longest rounded up to a multiple of 8)
    np.testing.assert_allclose(rank_work(lengths, model, padded=True, pad_multiple=8),
                               [[2 * (24 + 288), 2 * (32 + 512)]])
    assert padding_fraction(lengths, 8) == pytest.approx(1 - 61 / (2 * 24 + 2 * 32))
    assert CostModel.for_hidden_size(1024) == CostModel()


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
    code = cli_main(["balance", "--mlperf-mix", "--world-size", "1024", "--ranks-per-node", "8", "--micro-batch", "16",
                     "--steps", "10", "--plot", str(png)])
    out = capsys.readouterr().out
    assert code == 0, out
    rows = table(out)
    assert set(rows) == set(STRATEGIES), out
    assert rows["random"]["step_time"] == 1.0
    assert rows["random"]["imbalance"] > 1.4
    assert rows["stratified_node_balance"]["imbalance"] <= 1.02 < rows["stratified_node_sort"]["imbalance"]
    assert rows["stratified_node_balance"]["step_time"] < rows["stratified_node_sort"]["step_time"] < 1.0
    assert rows["sorted_megabatch"]["padding"] < 0.05 < rows["random"]["padding"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_cli_on_a_corpus_and_a_lengths_file(tmp_path, capsys, small_corpus, cache_dir):
    code = cli_main(["balance", "--corpus", str(small_corpus), "--cache-dir", str(cache_dir), "--max-seq-len", "128",
                     "--world-size", "4", "--ranks-per-node", "2", "--micro-batch", "4", "--grad-accum", "2",
                     "--strategies", "random", "stratified_node_balance", "--padded", "--hidden-size", "128"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "balances the padded cost" in out and "b = 0.001302" in out
    assert set(table(out)) == {"random", "stratified_node_balance"}
    lengths_file = tmp_path / "lengths.txt"
    lengths_file.write_text("\n".join(str(x) for x in np.random.default_rng(0).integers(1, 129, size=500)))
    code = cli_main(["balance", "--lengths", str(lengths_file), "--world-size", "2", "--ranks-per-node", "2",
                     "--micro-batch", "8", "--bins", "32,64,128", "--bin-counts", "2,2,4",
                     "--strategies", "stratified"])
    out = capsys.readouterr().out
    assert code == 0 and "bins of stratified (per rank): [32, 64, 128]" in out


def test_cli_errors_are_one_line(tmp_path, capsys):
    missing = tmp_path / "nope.npy"
    assert cli_main(["balance", "--lengths", str(missing), "--world-size", "2", "--ranks-per-node", "2",
                     "--micro-batch", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"ds-bertopt balance: error: lengths file {missing} does not exist"
    assert cli_main(["balance", "--mlperf-mix", "--world-size", "6", "--ranks-per-node", "4",
                     "--micro-batch", "2"]) == 2
    assert "--world-size 6 is not a multiple of --ranks-per-node 4" in capsys.readouterr().err
    bad = tmp_path / "bad.txt"
    bad.write_text("12 0 5")
    assert cli_main(["balance", "--lengths", str(bad), "--world-size", "2", "--ranks-per-node", "2",
                     "--micro-batch", "2"]) == 2
    assert "needs positive integer lengths" in capsys.readouterr().err
