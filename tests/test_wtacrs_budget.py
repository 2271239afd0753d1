"""Sizing to a memory budget (ds_bertopt.wtacrs.sizing): the batch search, the choice, ``preset: "auto"`` as a
config and at start-up, and the faster kernels that removed the kit's fixed per-step costs (each still exact)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from wtacrs_common import tiny_bert  # noqa: E402
import memory_children  # noqa: E402

from ds_bertopt.configlib import load_section  # noqa: E402
from ds_bertopt.errors import ConfigError  # noqa: E402
from ds_bertopt.wtacrs import sizing  # noqa: E402
from ds_bertopt.wtacrs.sizing import (  # noqa: E402
    GiB,
    Measured,
    candidate_config,
    choose,
    estimated_rate,
    fit_largest_batch,
    fitted_batch,
    largest_fitting_batch,
    probe_batches,
    rate_bound,
    resolve_auto,
)
from ds_bertopt.wtacrs.config import KitConfig, LoraConfig, WtaCrsConfig  # noqa: E402
from ds_bertopt.wtacrs.convert import prepare_model  # noqa: E402
from ds_bertopt.wtacrs.kit import keep_mask, keep_threshold, layernorm_backward  # noqa: E402


# ---------------------------------------------------------------- the batch search and the choice (pure)
def test_largest_batch_fit():
    # peaks 100 + 10·b: a budget of 355 fits b = 25, not 26; a flat or falling fit fits nothing
    assert fit_largest_batch({8: 180, 16: 260}, 355.0)[:2] == (25, 10.0)
    assert fit_largest_batch({8: 180, 16: 180}, 355.0)[0] == 0


CURVES = {
    "convex": lambda b: 100 + 10 * b + b * b // 20,
    "linear": lambda b: 100 + 10 * b,
    "proportional": lambda b: 50 * b,
    # flat at small batches (the weights and AdamW state dominate; RSS noise can even make it fall): the line
    # through the two probes does not rise, and the search must still go up (it used to stop at the probe)
    "flat, then rising": lambda b: max(400, 10 * b) - (b == 16),
}


@pytest.mark.parametrize("curve", list(CURVES))
@pytest.mark.parametrize("budget_bytes,max_batch", [(1000, 256), (1000, 20), (60, 256), (40, 256)])
def test_the_search_returns_a_measured_batch_that_fits(curve, budget_bytes, max_batch):
    """Whatever the (convex) peak curve: the answer was measured and fits, is at most max_batch, and is within a
    few percent of the true largest (never more than a handful of measurements)."""
    curve = CURVES[curve]
    calls = []

    def peak_at(b):
        calls.append(b)
        return curve(b)

    found, peaks = largest_fitting_batch(peak_at, budget_bytes, probe=16, max_batch=max_batch)
    truth = max((b for b in range(1, max_batch + 1) if curve(b) <= budget_bytes), default=0)
    assert len(calls) == len(set(calls)) <= 7, calls
    if truth == 0:
        assert found == 0
        return
    assert found in peaks and peaks[found] <= budget_bytes and found <= max_batch
    assert found >= 0.9 * truth, (found, truth, peaks)


# ---------------------------------------------------------------- the fast search: probes, line, bound (pure)
def test_two_small_probes_then_the_batch_their_line_puts_under_the_budget():
    assert probe_batches(64, 256) == (16, 32) and probe_batches(8, 8) == (1, 2) and probe_batches(4, 1024) == (4, 8)
    # peaks 100 + 10·b: 355 fits b = 25 (peak 350 on the line); clamped to max_batch; a probe over: below it
    assert fitted_batch({8: 180, 16: 260}, 355.0, 256) == (25, 350.0)
    assert fitted_batch({8: 180, 16: 260}, 355.0, 20) == (20, 300.0)
    assert fitted_batch({8: 180, 16: 400}, 355.0, 256) == (14, 345.0)
    assert fitted_batch({8: 400, 16: 500}, 355.0, 256) == (0, 400)
    # a line that does not rise (RSS noise): max_batch, where the verified peak decides; no line through a step that
    # ran out of memory: the probe that fits
    assert fitted_batch({8: 300, 16: 299}, 355.0, 256) == (256, 300)
    assert fitted_batch({8: 300, 16: math.inf}, 355.0, 256) == (8, 300)


def test_the_rate_estimate_and_its_bound():
    # t(b) = 0.5 + 0.1·b through the probes: at 64, 64 / 6.9 sequences/s
    assert estimated_rate({8: 1.3, 16: 2.1}, 64) == pytest.approx(64 / 6.9)
    # noise never makes the estimate pessimistic: a larger probe that ran faster counts as a fixed step time, a line
    # below the origin as time proportional to the batch
    assert estimated_rate({8: 2.2, 16: 2.1}, 64) == pytest.approx(64 / 2.1)
    assert estimated_rate({8: 0.2, 16: 2.0}, 64) == pytest.approx(8.0)
    assert rate_bound(10.0, []) == math.inf  # nothing timed yet: everything can win
    # the most generous measured/estimated ratio (1.2), then the margin
    assert rate_bound(15.0, [(10.0, 12.0), (20.0, 18.0)], margin=0.25) == pytest.approx(15 * 1.2 * 1.25)
    # a setup the probes overestimated (5x) never lowers another's bound below its own estimate × (1 + margin)
    assert rate_bound(15.0, [(100.0, 20.0)], margin=0.25) == pytest.approx(15 * 1.25)


WORLDS = {
    # setup: (peak at rest, peak per sequence, step fixed s, step s per sequence), the budget 2000
    "the cheapest step wins at the same batch": {
        "full": (500, 9, 0.2, 0.010),
        "checkpointing": (500, 3, 0.2, 0.016),
        "exact": (500, 4, 0.2, 0.012),
        "lora": (300, 4, 0.2, 0.008),
    },
    "a larger batch wins": {"full": (500, 30, 1.0, 0.010), "lean": (500, 5, 1.0, 0.011), "ckpt": (500, 2, 1, 0.02)},
    "nothing but one fits": {"huge": (2500, 9, 0.1, 0.01), "small": (100, 50, 0.1, 0.05)},
    # its probes see only fixed overhead (a flat 0.05 s): extrapolated, it looks 10x the fastest and is timed
    # first; measuring it must not shrink the real winner's bound
    "an overhead-bound setup the probes overestimate": {
        "full": (500, 9, 0.02, 0.002),
        "overhead": (500, 3, 0.3, 0.004, 0.05),
    },
}


@pytest.mark.parametrize("margin", [0.0, sizing.TIE_MARGIN])
@pytest.mark.parametrize("world", list(WORLDS))
def test_the_fast_search_chooses_what_measuring_everything_does(monkeypatch, world, margin):
    """``size_fast`` against the truth of a world of linear peaks and step times: the same setup at the same batch
    as the exhaustive search, with and without a tie margin; every setup it did not time could not have changed the
    choice at its true rate, and no more timed. The probes' step times run 1.3× slow (their malloc setting), which
    the calibration undoes, unless a world says otherwise."""
    from ds_bertopt.wtacrs import memory

    setups, budget, timed = WORLDS[world], 2000.0, []

    def peak(spec, b):
        rest, per, *_ = setups[spec["wtacrs"]]
        return rest + per * b

    def step_s(spec, b):
        _, _, fixed, per, *_ = setups[spec["wtacrs"]]
        return fixed + per * b

    def probe_s(spec, b):
        _, _, _, _, *flat = setups[spec["wtacrs"]]
        return flat[0] if flat else 1.3 * step_s(spec, b)

    def probe_setups_in_child(specs, batches, on_setup):
        for index, spec in enumerate(specs):
            peaks, times = {b: peak(spec, b) for b in batches}, {b: probe_s(spec, b) for b in batches}
            on_setup(index, {"peaks": peaks, "step_s": times})

    def probe_in_child(spec, batches, budget=None):  # one child: the peak verified, the steps timed if it fits
        ((b,),) = (batches,)
        fits = budget is None or peak(spec, b) <= budget
        timed.extend([spec["wtacrs"]] if fits else [])
        return {"peaks": {b: peak(spec, b)}, "step_s": {b: step_s(spec, b) if fits else math.inf}}

    monkeypatch.setattr(memory, "probe_setups_in_child", probe_setups_in_child)
    monkeypatch.setattr(memory, "measure_step_in_child", lambda spec: {"step_peak": peak(spec, spec["batch"])})
    monkeypatch.setattr(memory, "probe_in_child", probe_in_child)
    specs = {name: {"wtacrs": name} for name in setups}
    fast = sizing.size_fast(specs, budget, probe=64, max_batch=256, say=lambda line: None, tie_margin=margin)
    fast_timed, timed[:] = list(timed), []
    full = [sizing.measure(spec, name, budget, probe=64, max_batch=256) for name, spec in specs.items()]
    chosen, truth = choose(fast, budget, margin), choose(full, budget, margin)
    assert (chosen.setup, chosen.batch) == (truth.setup, truth.batch), (fast, full)
    timed_fast = [m for m in fast if m.rate > 0]
    for pruned, true in zip(fast, full):
        if pruned.bound:  # at its true rate it would not have changed the answer either
            assert true.rate <= pruned.bound and not sizing.could_change(timed_fast, true, list(specs), budget, margin)
    assert len(fast_timed) <= len(timed), (fast_timed, timed)
    if world == "the cheapest step wins at the same batch":
        # full, the simplest, first: the reference; lora's bound could beat it, the others' could not
        assert fast_timed == ["full", "lora"] and len(timed) == 4
        # lora is 1.28x full's rate: inside the tie margin full stays, without one lora wins
        assert chosen.setup == ("full" if margin else "lora")


def test_choose_takes_the_fastest_that_fits_and_says_why_nothing_does():
    runs = [
        Measured("full", 8, 5 * GiB, 1.0),  # over
        Measured("preset exact", 32, 2 * GiB, 2.0),  # 16 /s
        Measured("preset balanced", 32, 2 * GiB, 1.6),  # 20 /s: fastest that fits
        Measured("checkpointing", 64, 3 * GiB, 5.0),  # 12.8 /s
    ]
    assert choose(runs, 4 * GiB, margin=0).setup == "preset balanced"
    assert choose(runs, 6 * GiB, margin=0).setup == "preset balanced"  # full fits now but runs 8 /s
    line = sizing.recommendation(choose(runs, 4 * GiB, margin=0), runs, 4 * GiB, margin=0)
    assert "preset balanced" in line and "the fastest that fits 4.00 GiB; next: preset exact" in line, line
    with pytest.raises(ConfigError, match=r"no setup fits; the smallest peak is preset exact's 2\.00 GiB") as info:
        choose(runs, 1 * GiB)
    assert "\n" not in str(info.value)
    assert Measured("x", 0, GiB, math.inf).rate == 0.0


def _rated(setup: str, rate: float, batch: int = 256) -> Measured:
    return Measured(setup, batch, GiB, batch / rate)


def test_choose_prefers_the_simplest_setup_within_the_tie_margin():
    """Issue 40: rates that differ by less than the run-to-run spread do not decide; the list is simplest first."""
    full, exact, balanced = _rated("full", 27.0, 117), _rated("preset exact", 27.9), _rated("preset balanced", 28.1)
    lora = _rated("LoRA + preset balanced", 31.3)
    assert sizing.TIE_MARGIN == pytest.approx(0.30)
    assert choose([full, exact, balanced, lora], 2 * GiB).setup == "full"  # 31.3 / 27.0 = 1.16x: a tie
    assert choose([full, exact, balanced, lora], 2 * GiB, margin=0.15).setup == "preset exact"  # 1.12x: a tie
    assert choose([full, exact, balanced, lora], 2 * GiB, margin=0).setup == "LoRA + preset balanced"
    faster = _rated("LoRA + preset balanced", 36.0)  # 1.33x full's: beyond the margin; exact is within 1.29x of it
    assert choose([full, exact, balanced, faster], 2 * GiB).setup == "preset exact"
    over = Measured("full", 117, 3 * GiB, 117 / 40.0)  # the fastest, but over the budget: not the reference
    assert choose([over, exact, lora], 2 * GiB).setup == "preset exact"
    line = sizing.recommendation(full, [full, exact, balanced, lora], 2 * GiB)
    assert line.startswith("full (batch 117, peak 1.00 GiB, 27.0 sequences/s): fits 2.00 GiB and is simpler"), line
    assert "the fastest, LoRA + preset balanced at 31.3 (1.16x), within the 30% tie margin" in line, line
    # an untimed setup is timed only if, at its bound, it could change the answer (either way round)
    order = ["full", "preset exact", "preset balanced", "LoRA + preset balanced"]
    assert not sizing.could_change([full], _rated("preset balanced", 35.0), order, 2 * GiB)  # 1.30x: inside
    assert sizing.could_change([full], _rated("preset balanced", 35.2), order, 2 * GiB)
    slow_full = _rated("full", 20.0, 117)  # LoRA wins by 1.57x; exact, simpler than LoRA, could take it back
    assert sizing.could_change([slow_full, lora], _rated("preset exact", 24.5), order, 2 * GiB)
    assert not sizing.could_change([slow_full, lora], _rated("preset exact", 24.0), order, 2 * GiB)


# ---------------------------------------------------------------- preset "auto" as a config
def test_auto_candidates_keep_what_was_given_and_take_their_preset():
    cfg = WtaCrsConfig(
        preset="auto", memory_budget=2.0, ratio=0.2, kit=KitConfig(recompute_qkv=False), lora=LoraConfig(enabled=True)
    )
    assert not cfg.enabled and not cfg.kit.any  # nothing chosen yet
    built = {name: load_section(WtaCrsConfig, candidate_config(cfg, name), "wtacrs") for name in cfg.auto_candidates}
    assert built["none"].preset is None and not built["none"].kit.any and built["none"].lora.enabled
    assert built["checkpointing"].kit.checkpoint_every == 1 and built["checkpointing"].preset is None
    balanced = built["balanced"]
    assert balanced.preset == "balanced" and balanced.enabled and balanced.targets == ("all",)
    assert balanced.ratio == 0.2 and not balanced.kit.recompute_qkv and balanced.kit.recompute_ffn  # given wins
    assert built["max_saving"].kit.checkpoint_every == 1 and all(b.memory_budget is None for b in built.values())
    with pytest.raises(ConfigError, match='"auto" must be resolved'):
        prepare_model(tiny_bert(), cfg)


@pytest.mark.parametrize(
    "raw,message",
    [
        ({"preset": "auto"}, 'preset: "auto" needs memory_budget'),
        ({"memory_budget": 4}, 'memory_budget: only used with preset "auto"'),
        ({"preset": "auto", "memory_budget": 0}, "memory_budget: must be a positive number of GiB"),
        ({"preset": "auto", "memory_budget": 4, "auto_candidates": ["fast"]}, "auto_candidates: 'fast' is not one"),
        ({"preset": "auto", "memory_budget": 4, "budget_seq_length": 0}, "budget_seq_length: must be at least 1"),
    ],
)
def test_bad_budget_settings_are_one_line(raw, message):
    with pytest.raises(ConfigError, match=message) as info:
        load_section(WtaCrsConfig, raw, "wtacrs")
    assert "\n" not in str(info.value)


def _fake_measure(table):
    """``budget.measure`` answering from ``{setup label: (peak GiB, step s)}``; records what it was asked."""
    asked = []

    def measure(spec, setup, budget_bytes, batch=None, probe=16, max_batch=256, steps=2):
        asked.append((setup, spec["wtacrs"].get("preset"), batch, max_batch))
        peak, step = table[setup]
        return Measured(setup, batch or max_batch, int(peak * GiB), step)

    return measure, asked


def test_resolve_auto_picks_the_fastest_that_fits_and_logs_why(monkeypatch):
    table = {
        "no preset": (6.0, 1.0),
        "checkpointing": (3.0, 1.4),
        "preset exact": (2.5, 1.05),
        "preset balanced": (2.4, 1.02),
        "preset max_saving": (1.5, 1.3),
    }
    measure, asked = _fake_measure(table)
    monkeypatch.setattr(sizing, "measure", measure)
    cfg = WtaCrsConfig(preset="auto", memory_budget=4.0)
    chosen, batch, lines = resolve_auto(cfg, model_dir="unused", batch=16, seq=64)
    # balanced is the fastest by 3 %, inside the tie margin: exact, simpler (exact gradients), is chosen
    assert chosen.preset == "exact" and not chosen.enabled and batch == 16
    assert [a[0] for a in asked] == list(table) and all(a[2] == 16 for a in asked)
    assert "preset auto chose preset exact (batch 16" in lines[-1], lines
    assert "simpler than the fastest, preset balanced at 15.7 (1.03x)" in lines[-1], lines
    # the candidates are measured simplest first whatever order they were given in
    asked.clear()
    shuffled = WtaCrsConfig(preset="auto", memory_budget=4.0, auto_candidates=("balanced", "none", "exact"))
    assert resolve_auto(shuffled, model_dir="unused", batch=16, seq=64)[0].preset == "exact"
    assert [a[0] for a in asked] == ["no preset", "preset exact", "preset balanced"]
    assert sum("over 4.00" in line for line in lines) == 1  # "no preset" (full fine-tuning) is over the budget
    exact_only = WtaCrsConfig(preset="auto", memory_budget=4.0, auto_candidates=("none", "checkpointing", "exact"))
    assert resolve_auto(exact_only, model_dir="unused", batch=16, seq=64)[0].preset == "exact"
    with pytest.raises(ConfigError, match="no setup fits") as info:
        resolve_auto(WtaCrsConfig(preset="auto", memory_budget=1.0), model_dir="unused", batch=16, seq=64)
    assert "\n" not in str(info.value)
    plain = WtaCrsConfig(preset="exact")
    assert resolve_auto(plain, model_dir="unused", batch=16, seq=64) == (plain, 16, [])


def test_a_budget_on_a_device_we_cannot_measure_is_one_line():
    with pytest.raises(ConfigError, match="cannot measure peak memory on mps: no peak-memory counter") as info:
        resolve_auto(WtaCrsConfig(preset="auto", memory_budget=4.0), model_dir="x", batch=4, seq=8, device="mps")
    assert "\n" not in str(info.value)


@pytest.mark.timeout(300)
def test_resolve_auto_measures_for_real(tmp_path):
    """The one real measurement (two fresh children on a tiny saved model: the peak, then the timed steps): the
    candidate's config is built, stepped and timed at the run's batch, and comes back resolved."""
    model_dir = tmp_path / "model"
    tiny_bert(hidden=64, layers=2, vocab=1000).save_pretrained(str(model_dir))
    cfg = WtaCrsConfig(preset="auto", memory_budget=64.0, auto_candidates=("exact",))
    chosen, batch, lines = resolve_auto(cfg, model_dir=str(model_dir), batch=8, seq=32)
    assert chosen.preset == "exact" and chosen.kit.recompute_qkv and not chosen.enabled and batch == 8
    (measured,) = [line for line in lines if "preset exact: batch 8, peak" in line]
    assert "(fits 64.00)" in measured and " s/step, " in measured, lines  # timed, not "not timed"
    assert "preset auto chose preset exact" in lines[-1], lines
    assert memory_children.fork_servers() == []  # the training run that follows keeps no server of children


# ---------------------------------------------------------------- the fixed per-step costs, removed exactly
def test_dropout_mask_threshold_is_the_keep_rate():
    assert keep_threshold(0.9) == round(0.9 * 2**31) and keep_threshold(1.0) == 2**31 and keep_threshold(0.0) == 0
    gen = torch.Generator().manual_seed(0)
    mask = keep_mask((200_000,), 0.9, "cpu", gen)
    assert mask.dtype == torch.bool and abs(float(mask.float().mean()) - 0.9) < 0.003
    again = keep_mask((200_000,), 0.9, "cpu", torch.Generator().manual_seed(0))
    assert torch.equal(mask, again)  # what backward regenerates from the same state
    # the edges: keep 1 (and a keep that rounds to it) keeps everything, keep 0 nothing (2^31 overflows int32)
    assert keep_mask((1000,), 1.0, "cpu").all() and keep_mask((1000,), 1 - 1e-12, "cpu").all()
    assert not keep_mask((1000,), 0.0, "cpu").any()


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("affine", ["both", "weight", "none"])
def test_layernorm_backward_from_the_output_matches_autograd(dtype, tol, affine):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, 16, generator=gen, dtype=dtype) * 2 + 1).requires_grad_()
    weight = (torch.rand(16, generator=gen, dtype=dtype) + 0.5).requires_grad_() if affine != "none" else None
    bias = torch.randn(16, generator=gen, dtype=dtype).requires_grad_() if affine == "both" else None
    y = F.layer_norm(x, (16,), weight, bias, 1e-5)
    grad = torch.randn(y.shape, generator=gen, dtype=dtype)
    expected = torch.autograd.grad(y, [t for t in (x, weight, bias) if t is not None], grad)
    _, _, rstd = torch.native_layer_norm(x.detach(), (16,), weight, bias, 1e-5)
    ours = layernorm_backward(grad, y.detach(), rstd, weight, bias, 1)
    for got, want in zip([g for g in ours if g is not None], expected):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
