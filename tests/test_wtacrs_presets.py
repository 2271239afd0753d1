"""Presets and the selective recomputation behind them: exact gradients, less kept for backward, one-line errors."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from wtacrs_common import tiny_batch, tiny_bert

from ds_bertopt.errors import ConfigError
from ds_bertopt.wtacrs import SampledLinear, apply_kit, saved_tensor_bytes
from ds_bertopt.wtacrs.config import PRESETS, KitConfig, WtaCrsConfig
from ds_bertopt.wtacrs.convert import prepare_model

ACTIVATION = 8 * 32 * 64 * 4  # one hidden-wide fp32 tensor of a batch of 8 × 32 at hidden 64


def _grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_preset_fills_only_what_was_not_given():
    cfg = WtaCrsConfig(preset="balanced")
    assert cfg.enabled and cfg.ratio == 0.3 and cfg.targets == ("all",)
    assert cfg.kit.recompute_qkv and cfg.kit.recompute_ffn and cfg.kit.checkpoint_every == 0
    given = WtaCrsConfig(preset="balanced", ratio=0.5, kit=KitConfig(recompute_qkv=False))
    assert given.ratio == 0.5 and not given.kit.recompute_qkv and given.kit.recompute_ffn
    assert WtaCrsConfig(preset="max_saving").kit.checkpoint_every == 1
    plain = WtaCrsConfig()
    assert not plain.enabled and plain.targets == ("auto",) and not plain.kit.any
    assert set(PRESETS) == {"exact", "balanced", "max_saving"}


@pytest.mark.parametrize(
    "build,message",
    [
        (lambda: WtaCrsConfig(preset="fastest"), "preset: 'fastest' is not one of exact, balanced, max_saving"),
        (lambda: KitConfig(recompute_ffn=True), "recompute_ffn: needs recompute_gelu"),
        (
            lambda: WtaCrsConfig(preset="exact", kit=KitConfig(recompute_gelu=False, recompute_ffn=True)),
            "recompute_ffn: needs recompute_gelu",
        ),
        (lambda: WtaCrsConfig(targets=("all", "qkv")), "'auto' and 'all' stand alone"),
        (lambda: KitConfig(checkpoint_every=-1), "checkpoint_every: must be >= 0"),
    ],
)
def test_bad_preset_settings_are_one_line_errors(build, message):
    with pytest.raises(ConfigError, match=message) as info:
        build()
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("checkpoint_every", [0, 1])
def test_exact_preset_reproduces_loss_and_gradients(attn, checkpoint_every):
    """Every exact part at once, q/k/v and FFN outputs rebuilt in backward (and with layer checkpointing on top)."""
    batch = tiny_batch(pad_from=11)
    reference = tiny_bert(hidden_dropout=0.0, attention_dropout=0.0, attn=attn).train()
    model = copy.deepcopy(reference)
    model, lines = prepare_model(
        model, WtaCrsConfig(preset="exact", kit=KitConfig(checkpoint_every=checkpoint_every), strict=True)
    )
    assert any("attention projections (q/k/v) rebuilt" in line for line in lines), lines
    assert any("FFN activation outputs rebuilt" in line for line in lines), lines
    ref_loss, ref_grads = _grads(reference, batch)
    for _ in range(2):  # a second step: nothing recorded in the first leaks into the next
        loss, grads = _grads(model, batch)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        assert grads.keys() == ref_grads.keys()
        for name in ref_grads:
            torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=2e-6, msg=name)


@pytest.mark.parametrize(
    "parts,category,at_least",
    [
        # q, k, v of both layers, kept by the attention kernel: rebuilt from the LayerNorm output kept anyway
        ({"sdpa_attention": True, "layernorm_saves_output": True, "recompute_qkv": True}, "total", 2 * 3 * ACTIVATION),
        # the 4h-wide FFN activation output the output projection keeps
        ({"recompute_gelu": True, "recompute_ffn": True}, "total", 2 * 4 * ACTIVATION),
    ],
)
def test_recomputation_keeps_less_for_backward(parts, category, at_least):
    batch = tiny_batch(batch=8, seq=32)
    reference = tiny_bert(hidden=64)
    without = copy.deepcopy(reference)
    apply_kit(
        without,
        KitConfig(**{k: v for k, v in parts.items() if not k.startswith("recompute_") or k == "recompute_gelu"}),
    )
    model = copy.deepcopy(reference)
    apply_kit(model, KitConfig(**parts))
    before, after = saved_tensor_bytes(without, batch), saved_tensor_bytes(model, batch)
    assert before[category] - after[category] >= at_least, (parts, before, after)


@pytest.mark.precision
@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_a_sampled_linear_keeping_its_input_gives_the_same_gradient(autocast):
    """``keep: input`` gathers in backward the rows forward would have copied: same weight gradient, bit for bit,
    in fp32 and under bf16 autocast (rows cast and scaled as forward would)."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(16, 8)
    x = torch.randn(4, 40, 16)
    grads = []
    for keep_input in (False, True):
        module = SampledLinear.from_linear(copy.deepcopy(linear), ratio=0.3, min_k=4, keep_input=keep_input)
        module.generator = torch.Generator().manual_seed(7)
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            out = module(x)
        out.float().pow(2).sum().backward()
        grads.append(module.weight.grad)
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)


def test_balanced_preset_samples_every_linear_by_reference():
    model = tiny_bert(hidden_dropout=0.0, attention_dropout=0.0)
    model, lines = prepare_model(model, WtaCrsConfig(preset="balanced"))
    sampled = [m for m in model.modules() if isinstance(m, SampledLinear)]
    # q, k, v and the attention output per layer (the FFN input projection is fused with its GELU by the kit)
    assert len(sampled) >= 2 * 4, lines
    assert all(m.keep_input for m in sampled), [m.extra_repr() for m in sampled]
    loss = model(**tiny_batch()).loss
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_fields_given_next_to_a_preset_are_named_in_the_log():
    """A config file that spells out ``targets`` keeps it under ``preset: balanced``: the log line says so."""
    model = tiny_bert(hidden_dropout=0.0, attention_dropout=0.0)
    cfg = WtaCrsConfig(preset="balanced", targets=("auto",), kit=KitConfig(recompute_qkv=False))
    _, lines = prepare_model(model, cfg)
    line = next(line for line in lines if line.startswith("wtacrs: preset balanced"))
    assert "targets ['auto'] (preset: ['all'])" in line and "kit.recompute_qkv False (preset: True)" in line, line
    _, plain = prepare_model(tiny_bert(), WtaCrsConfig(preset="balanced"))
    assert "wtacrs: preset balanced" in plain and not any("overridden" in line for line in plain)


@pytest.mark.precision
def test_exact_preset_under_bf16_autocast_tracks_the_plain_model():
    """The rebuilt q/k/v and FFN outputs replay the recorded autocast state: bf16 gradients track the plain model's."""
    batch = tiny_batch(pad_from=11)
    reference = tiny_bert(hidden_dropout=0.0, attention_dropout=0.0, attn="sdpa").train()
    model, _ = prepare_model(copy.deepcopy(reference), WtaCrsConfig(preset="exact"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss, ref_grads = _grads(reference, batch)
        loss, grads = _grads(model, batch)
    torch.testing.assert_close(loss, ref_loss, rtol=2e-2, atol=2e-2)
    for name in ref_grads:
        error = float((grads[name] - ref_grads[name]).norm() / ref_grads[name].norm().clamp_min(1e-12))
        assert error < 0.05, (name, error)
