"""The preset fallback (ds_bertopt.wtacrs.fallback): where activations are too small a share of the step peak to pay
for recomputation, presets exact, balanced and auto run full fine-tuning and say so in one line; the rule on the
estimator's figures, the line, the config it resolves to, auto measuring full first, and the Trainer path."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from wtacrs_common import tiny_bert  # noqa: E402

from ds_bertopt.errors import ConfigError  # noqa: E402
from ds_bertopt.wtacrs import sizing  # noqa: E402
from ds_bertopt.wtacrs.config import FALLBACK_MIN_SAVING, KitConfig, WtaCrsConfig  # noqa: E402
from ds_bertopt.wtacrs.fallback import (  # noqa: E402
    GiB,
    ModelShape,
    PeakEstimate,
    decide,
    decision_line,
    estimate,
    preset_decision,
)

# the figures of the two encoders users fine-tune most (transformers' own parameter counts, encoder only)
MINILM = ModelShape(hidden=384, layers=6, intermediate=1536, heads=12, params=22_713_216, trainable=22_713_216,
                    largest=11_720_448)  # fmt: skip
BERT_BASE = ModelShape(hidden=768, layers=12, intermediate=3072, heads=12, params=109_482_240,
                       trainable=109_482_240, largest=23_440_896)  # fmt: skip


def _estimate(activations: int, setup_activations: int, states: int = 100, optimizer_phase: int = 50) -> PeakEstimate:
    return PeakEstimate("exact", states, activations, setup_activations, optimizer_phase)


def test_the_rule_keeps_the_preset_only_where_its_saving_reaches_the_threshold():
    small = _estimate(activations=40, setup_activations=10)  # below the optimizer phase: nothing to save
    assert small.peak == 150 and small.saving == 0 and not decide(small, 0.15)
    large = _estimate(activations=900, setup_activations=100)
    assert large.share == pytest.approx(0.9) and large.saving == 800 and decide(large, 0.15)
    boundary = _estimate(activations=200, setup_activations=155)  # peak 300, saving 45 = 15 % exactly
    assert boundary.saving == 45 and decide(boundary, 0.15) and not decide(boundary, 0.151)
    assert decide(small, 0.0)  # 0: never fall back


@pytest.mark.parametrize("shape", [MINILM, BERT_BASE], ids=["MiniLM-L6", "BERT-base"])
@pytest.mark.parametrize("preset", ["exact", "balanced"])
def test_small_batches_fall_back_and_the_users_batches_keep_the_preset(shape, preset):
    """bf16 16 × 64 (measured: 0.99x of full's peak for 1.37-1.44x its step time) falls back; 64 × 128 (3.1x lower
    peak at 0.75x) keeps the preset, in both precisions."""
    assert not decide(estimate(shape, 16, 64, "bf16", preset), FALLBACK_MIN_SAVING)
    for precision in ("bf16", "fp32"):
        kept = estimate(shape, 64, 128, precision, preset)
        assert decide(kept, FALLBACK_MIN_SAVING) and kept.peak / kept.setup_peak > 2.0, (precision, kept)
    assert estimate(shape, 16, 64, "fp32", preset, zero_stage=3, world=64).share > 0.9  # ZeRO-3 leaves activations


def test_the_line_gives_the_share_the_peak_and_the_saving():
    estimated = estimate(MINILM, 16, 64, "bf16", "balanced")
    line = decision_line("balanced", estimated, False, 0.15)
    assert "\n" not in line and line.startswith("wtacrs: preset balanced: activations are "), line
    share, peak, saving = re.search(r"are (\d+)% of the estimated peak \(([\d.]+) GiB\).*~([\d.]+) GiB", line).groups()
    assert int(share) == round(100 * estimated.share) and float(peak) == round(estimated.peak / GiB, 2)
    assert float(saving) == round(estimated.saving / GiB, 2) and line.endswith("so running full")
    assert decision_line("auto", estimated, False, 0.15).endswith("so running full if it fits the budget")
    assert decision_line("exact", estimated, True, 0.15).endswith("so keeping it")


def test_which_configs_fall_back_and_what_full_keeps():
    assert preset_decision(WtaCrsConfig(), MINILM, 16, 64, "bf16") is None  # the kit fields as given: never
    assert preset_decision(WtaCrsConfig(preset="max_saving"), MINILM, 16, 64, "bf16") is None
    assert preset_decision(WtaCrsConfig(preset="exact", fallback_min_saving=0), MINILM, 16, 64, "bf16") is None
    with pytest.raises(ConfigError, match=r"fallback_min_saving: must be in \[0, 1\), got 1.0"):
        WtaCrsConfig(preset="exact", fallback_min_saving=1.0)
    dead = WtaCrsConfig(preset="max_saving").dead_fields()
    assert "fallback_min_saving" in dead and "budget_seq_length" in dead
    assert "fallback_min_saving" not in WtaCrsConfig(preset="exact").dead_fields()
    # the fields given next to the preset stay; what the preset set goes
    given = WtaCrsConfig(preset="balanced", min_k=8, kit=KitConfig(dropout_mask="bool"))
    model = tiny_bert()
    full, batch, lines = sizing.resolve_preset(given, model, batch=1, seq=4)
    assert full.preset is None and not full.enabled and full.min_k == 8 and batch == 1
    assert full.kit.dropout_mask == "bool" and not (full.kit.recompute_gelu or full.kit.sdpa_attention)
    assert len(lines) == 1 and lines[0].endswith("so running full"), lines
    kept, _, lines = sizing.resolve_preset(given, model, batch=64, seq=128)
    assert kept == given and lines[0].endswith("so keeping it")


def test_auto_measures_full_first_and_alone_where_recomputation_does_not_pay(monkeypatch):
    asked = []

    def measure(spec, setup, budget, batch=None, probe=16, max_batch=256, steps=2):  # noqa: ARG001
        asked.append(setup)
        return sizing.Measured(setup, batch, int(peaks[setup] * GiB), 0.5 if setup == "preset exact" else 1.0)

    monkeypatch.setattr(sizing, "measure", measure)
    peaks = dict.fromkeys(("no preset", "checkpointing", "preset exact", "preset balanced", "preset max_saving"), 1.0)
    cfg = WtaCrsConfig(preset="auto", memory_budget=2.0)
    chosen, _, lines = sizing.resolve_preset(cfg, tiny_bert(), batch=1, seq=4, model_dir="unused")
    assert asked == ["no preset"] and chosen.preset is None and not chosen.kit.any
    assert lines[0].endswith("so running full if it fits the budget") and "not measured" in lines[-2], lines
    asked.clear()
    peaks["no preset"] = 3.0  # full does not fit: the others are measured as before
    chosen, _, _ = sizing.resolve_preset(cfg, tiny_bert(), batch=1, seq=4, model_dir="unused")
    assert asked == list(peaks) and chosen.preset == "exact"


def test_the_trainer_runs_full_and_says_why(tmp_path, capsys):
    """The real BertOptTrainer path (fp32): preset exact at a micro-batch of 2 × 8 tokens falls back to full
    fine-tuning, logged in one line; the model keeps its stock modules."""
    from transformers import TrainingArguments, default_data_collator

    from ds_bertopt.integrations import hf
    from ds_bertopt.wtacrs.kit import GeluLinear, OutputSavingLayerNorm

    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, use_cpu=True, report_to="none", max_steps=1
    )
    rows = [{"input_ids": [5 + i] * 8, "attention_mask": [1] * 8, "labels": i % 2} for i in range(4)]
    trainer = hf.BertOptTrainer(
        model=tiny_bert(),
        args=args,
        train_dataset=rows,
        data_collator=default_data_collator,
        bertopt={"wtacrs": {"preset": "exact", "budget_seq_length": 8}},
    )
    out = capsys.readouterr().out
    assert re.search(r"wtacrs: preset exact: activations are \d+% of the estimated peak .* so running full$", out, re.M)
    assert trainer._bertopt.bertopt.wtacrs.preset is None
    assert not any(isinstance(m, (GeluLinear, OutputSavingLayerNorm)) for m in trainer.model.modules())
    assert trainer.train().global_step == 1
