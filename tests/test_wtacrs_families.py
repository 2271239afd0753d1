"""Every BERT-family architecture: the registry finds its parts, the kit + sampling at ratio 1 is exact,
kit + WTA@0.3 saves, and whatever cannot be converted is one warning line (``strict``: an error).

Models are tiny random-init configs of transformers' own config classes (no download)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from wtacrs_common import TINY_FAMILIES, tiny_batch, tiny_family  # noqa: E402

from ds_bertopt.configlib import load_section  # noqa: E402
from ds_bertopt.errors import ConfigError  # noqa: E402
from ds_bertopt.wtacrs import (
    GatedFfn,
    GatedLinear,
    GeluLinear,
    OutputSavingLayerNorm,
    SampledLinear,  # noqa: E402
    apply_kit,
    convert,
    detect,
    prepare_model,
    saved_tensor_bytes,
)
from ds_bertopt.wtacrs.config import KitConfig, WtaCrsConfig  # noqa: E402
from ds_bertopt.wtacrs.families import matches  # noqa: E402

EXACT_KIT = {
    "sdpa_attention": True,
    "dropout_mask": "regenerate",
    "layernorm_saves_output": True,
    "recompute_gelu": True,
}
NO_SDPA = {"mpnet", "deberta-v2"}  # transformers runs their attention eagerly only
FAMILY_OF = {
    "bert": "bert",
    "roberta": "bert",
    "xlm-roberta": "bert",
    "camembert": "bert",
    "electra": "bert",
    "distilbert": "distilbert",
    "albert": "albert",
    "mpnet": "mpnet",
    "deberta-v2": "deberta-v2",
    "modernbert": "modernbert",
}


def wtacrs_config(**raw) -> WtaCrsConfig:
    return load_section(WtaCrsConfig, raw, "wtacrs")


def family_batch(model_type: str, batch: int = 3, seq: int = 16, pad_from: int | None = 11):
    return tiny_batch(batch=batch, seq=seq, pad_from=pad_from)


def layers_of(model) -> int:
    config = model.config
    return getattr(config, "num_hidden_layers", None) or config.n_layers


def assert_same_gradients(model, reference, loss, ref_loss) -> None:
    """Backward both; every parameter's gradient matches (a parameter without one in the reference has none)."""
    ref_loss.backward()
    loss.backward()
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        if ref_params[name].grad is None:
            assert param.grad is None or not param.grad.any(), name
            continue
        torch.testing.assert_close(param.grad, ref_params[name].grad, rtol=1e-4, atol=3e-6, msg=name)


@pytest.mark.parametrize("model_type", sorted(TINY_FAMILIES))
def test_registry_finds_every_part(model_type):
    model = tiny_family(model_type)
    found = detect(model)
    assert found.known and found.family.name == FAMILY_OF[model_type]
    family = found.family
    names = [name for name, _ in model.named_modules()]
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    distinct = 1 if model_type == "albert" else layers_of(model)  # one AlbertLayer serves every depth

    def count(patterns, pool):
        return sum(any(matches(name, p) for p in patterns) for name in pool)

    assert count([family.attention.module], names) == distinct
    assert count([family.ffn.module], names) == distinct
    assert count(family.qkv, linears) == distinct * len(family.qkv)
    for group in ("attn_out", "ffn_in", "ffn_out"):
        assert count(family.targets(group), linears) == distinct, group


@pytest.mark.parametrize("model_type", sorted(TINY_FAMILIES))
def test_kit_and_sampling_at_ratio_one_are_exact(model_type):
    """fp32, dropout off: logits and every gradient match the unconverted model (sampling keeps every row)."""
    reference = tiny_family(model_type, attn="eager")
    model, lines = prepare_model(
        copy.deepcopy(reference),
        wtacrs_config(enabled=True, ratio=1.0, min_k=1, targets=["ffn_out", "qkv"], kit=EXACT_KIT),
    )
    sampled = [m for m in model.modules() if isinstance(m, SampledLinear)]
    distinct = 1 if model_type == "albert" else layers_of(reference)
    assert len(sampled) == distinct * (2 if model_type == "modernbert" else 4), lines
    assert any(isinstance(m, (GeluLinear, GatedLinear)) for m in model.modules())
    assert any(isinstance(m, OutputSavingLayerNorm) for m in model.modules())
    if model_type not in NO_SDPA:
        assert detect(model).family and model.config._attn_implementation == "sdpa"
    batch = family_batch(model_type)
    out_ref, out = reference(**batch), model(**batch)
    torch.testing.assert_close(out.logits, out_ref.logits, rtol=1e-5, atol=2e-6)
    assert_same_gradients(model, reference, out.loss, out_ref.loss)
    assert list(model.state_dict()) == list(reference.state_dict())


@pytest.mark.parametrize("model_type", sorted(TINY_FAMILIES))
def test_kit_and_wta_save_memory(model_type):
    """Dropout on: kit + WTA@0.3 keeps well under the saved-for-backward bytes of the plain model."""
    reference = tiny_family(model_type, dropout=0.1)
    model, lines = prepare_model(
        copy.deepcopy(reference), wtacrs_config(enabled=True, ratio=0.3, min_k=4, kit=EXACT_KIT)
    )
    assert any(isinstance(m, SampledLinear) for m in model.modules()), lines
    batch = family_batch(model_type, batch=4, seq=32, pad_from=None)
    before, after = saved_tensor_bytes(reference, batch), saved_tensor_bytes(model, batch)
    assert after["total"] < 0.8 * before["total"], (lines, before, after)
    assert after["dropout"] == 0 and after["activation"] < before["activation"]  # masks regenerated, FFN recomputed
    if model_type not in NO_SDPA:
        assert after["attention"] < 0.6 * before["attention"]


@pytest.mark.parametrize("model_type", sorted(NO_SDPA))
def test_an_attention_without_sdpa_is_one_warning_and_strict_makes_it_an_error(model_type):
    raw = dict(enabled=True, ratio=0.3, min_k=4, kit=EXACT_KIT)
    model, lines = prepare_model(tiny_family(model_type, dropout=0.1), wtacrs_config(**raw))
    warnings = [line for line in lines if line.startswith("warning:")]
    assert len(warnings) == 1, lines
    attention = detect(model).family.attention.module
    assert "kit.sdpa_attention" in warnings[0] and attention in warnings[0] and "eager only" in warnings[0]
    # its probability dropout is left on (no SDPA, no modelling change) but keeps no mask
    probability_dropouts = [
        m
        for name, m in model.named_modules()
        if matches(name, attention + "." + detect(model).family.attention.prob_dropout)
    ]
    assert probability_dropouts and all(m.p == 0.1 and m.mode == "regenerate" for m in probability_dropouts)
    with pytest.raises(ConfigError, match=rf"wtacrs.strict: .*{attention}.*eager only"):
        prepare_model(tiny_family(model_type, dropout=0.1), wtacrs_config(**raw, strict=True))


def test_fully_converted_family_has_no_warning_even_when_strict():
    model, lines = prepare_model(
        tiny_family("distilbert", dropout=0.1),
        wtacrs_config(enabled=True, ratio=0.3, min_k=4, kit=EXACT_KIT, strict=True),
    )
    assert not any(line.startswith("warning:") for line in lines), lines
    assert any("ffn.lin2" in line for line in lines), lines
    assert model.config._attn_implementation == "sdpa"
    assert all(m.p == 0 for name, m in model.named_modules() if name.endswith("attention.dropout"))


def _unknown(model_type: str):
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.for_model(
        model_type,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        vocab_size=200,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return AutoModelForSequenceClassification.from_config(config)


def test_unknown_bert_like_family_uses_the_generic_patterns_and_says_so():
    model, lines = prepare_model(_unknown("ernie"), wtacrs_config(enabled=True, ratio=0.3, min_k=4, kit=EXACT_KIT))
    assert not detect(model).known
    assert sum(isinstance(m, SampledLinear) for m in model.modules()) == 2
    assert sum(isinstance(m, GeluLinear) for m in model.modules()) == 2
    warnings = [line for line in lines if line.startswith("warning:")]
    assert len(warnings) == 1 and "'ernie', not in the family registry" in warnings[0], lines
    with pytest.raises(ConfigError, match="not in the family registry"):
        prepare_model(_unknown("ernie"), wtacrs_config(enabled=True, kit=EXACT_KIT, strict=True))


def test_unknown_family_names_what_did_not_convert():
    # Nyströmformer: BERT module names, but its attention has no SDPA path
    model, lines = prepare_model(
        _unknown("nystromformer"), wtacrs_config(enabled=True, ratio=0.3, min_k=4, kit=EXACT_KIT)
    )
    warnings = [line for line in lines if line.startswith("warning:")]
    assert len(warnings) == 1 and "kit.sdpa_attention" in warnings[0] and "'eager'" in warnings[0], lines
    assert sum(isinstance(m, SampledLinear) for m in model.modules()) == 2  # the generic ffn_out pattern matched


def test_targets_that_match_nothing_are_an_error_listing_the_linears():
    model = tiny_family("bert")
    with pytest.raises(
        ConfigError,
        match=r"wtacrs.targets: 'nonexistent' matched no trainable nn.Linear .*"
        r"bert.encoder.layer.\*.attention.self.query",
    ):
        prepare_model(model, wtacrs_config(enabled=True, targets=["nonexistent"]))
    with pytest.raises(ConfigError, match="'layer.*.ffn.lin2'"):  # a DistilBERT pattern on a BERT model
        convert(tiny_family("bert"), targets=["ffn_out", "layer.*.ffn.lin2"])


def test_a_target_the_kit_fused_is_a_warning_not_silence():
    model, lines = prepare_model(
        tiny_family("bert"), wtacrs_config(enabled=True, targets=["ffn_out", "ffn_in"], kit={"recompute_gelu": True})
    )
    warnings = [line for line in lines if line.startswith("warning:")]
    assert len(warnings) == 1 and "ffn_in" in warnings[0] and "GeluLinear" in warnings[0], lines


def test_lora_auto_targets_follow_the_family():
    for model_type, expected in (("modernbert", "Wqkv"), ("deberta-v2", "query_proj"), ("distilbert", "q_lin")):
        model, lines = prepare_model(
            tiny_family(model_type), wtacrs_config(lora={"enabled": True, "targets": ["auto"]})
        )
        assert any(name.endswith(f"{expected}.lora_A.default") for name, _ in model.named_modules()), lines


def test_gated_ffn_is_exact_and_keeps_only_its_input():
    """ModernBERT's GeGLU MLP vs GatedFfn (fp64): same output and gradients; only Wi's input saved in it."""
    model = tiny_family("modernbert").double()
    mlp = model.model.layers[1].mlp
    fused_model = copy.deepcopy(model)
    lines = apply_kit(fused_model, KitConfig(recompute_gelu=True))
    fused = fused_model.model.layers[1].mlp
    assert isinstance(fused, GatedFfn) and isinstance(fused.Wi, GatedLinear), lines
    h1 = torch.randn(2, 8, 32, dtype=torch.float64, requires_grad=True)
    h2 = h1.detach().clone().requires_grad_()
    y1 = mlp(h1)
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y2 = fused.Wi(h2)
    torch.testing.assert_close(fused.Wo(fused.drop(y2)), y1, rtol=0, atol=0)
    grad = torch.randn_like(y1)
    y1.backward(grad)
    fused.Wo(fused.drop(y2)).backward(grad)
    for a, b in ((h2.grad, h1.grad), (fused.Wi.weight.grad, mlp.Wi.weight.grad)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    params = {p.untyped_storage().data_ptr() for p in fused.parameters()}
    activations = [t for ptr, t in saved.items() if ptr not in params]
    assert len(activations) == 1 and activations[0].shape == h2.shape  # no 2·I-wide projection kept


def test_generic_activation_recompute_matches_albert_gelu_new():
    """ALBERT's tanh GELU (not erf): recomputed through autograd of the module itself, exact."""
    reference = tiny_family("albert").double()
    layer = reference.albert.encoder.albert_layer_groups[0].albert_layers[0]
    fused_model = copy.deepcopy(reference)
    apply_kit(fused_model, KitConfig(recompute_gelu=True))
    fused_layer = fused_model.albert.encoder.albert_layer_groups[0].albert_layers[0]
    assert isinstance(fused_layer.ffn, GeluLinear) and type(fused_layer.ffn.activation).__name__ == "NewGELUActivation"
    x1 = torch.randn(2, 8, 32, dtype=torch.float64, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_()
    y1, y2 = layer.ff_chunk(x1), fused_layer.ff_chunk(x2)
    torch.testing.assert_close(y2, y1, rtol=0, atol=0)
    grad = torch.randn_like(y1)
    y1.backward(grad)
    y2.backward(grad)
    torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fused_layer.ffn.weight.grad, layer.ffn.weight.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("model_type", ["bert", "modernbert", "deberta-v2"])
def test_bf16_autocast_kit_and_sampling_track_the_plain_model(model_type):
    """bf16 autocast (emulated on this CPU: tiny model): kit + WTA@1.0 follows the plain model in bf16."""
    reference = tiny_family(model_type, attn="eager")
    model, lines = prepare_model(
        copy.deepcopy(reference),
        wtacrs_config(enabled=True, ratio=1.0, min_k=1, targets=["ffn_out", "qkv"], kit=EXACT_KIT),
    )
    batch = family_batch(model_type, batch=2, seq=8, pad_from=6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_ref, out = reference(**batch), model(**batch)
    assert out.logits.dtype == out_ref.logits.dtype
    torch.testing.assert_close(out.logits.float(), out_ref.logits.float(), rtol=0.05, atol=0.03)
    out_ref.loss.backward()
    out.loss.backward()
    ref_params = dict(reference.named_parameters())
    worst = 0.0
    for name, param in model.named_parameters():
        if ref_params[name].grad is None:
            continue
        assert param.grad.dtype == torch.float32 and torch.isfinite(param.grad).all(), name
        scale = ref_params[name].grad.norm() + 1e-6
        worst = max(worst, float((param.grad - ref_params[name].grad).norm() / scale))
    assert worst < 0.05, worst  # bf16 rounding of a tiny model (measured ≤ 0.012), not a wrong gradient (~1)


def test_bf16_gelu_warns_where_the_activation_is_not_erf_gelu():
    _, lines = prepare_model(tiny_family("albert"), wtacrs_config(kit={"bf16_gelu": True}))
    warnings = [line for line in lines if line.startswith("warning:")]
    assert len(warnings) == 1 and "NewGELUActivation" in warnings[0] and "kit.bf16_gelu" in warnings[0], lines


def test_family_attention_is_counted_as_attention():
    model = tiny_family("distilbert")
    batch = family_batch("distilbert", pad_from=None)
    assert saved_tensor_bytes(model, batch)["attention"] > 0


@pytest.mark.parametrize("model_type", sorted(TINY_FAMILIES))
def test_exact_preset_is_exact_and_keeps_less_in_every_family(model_type):
    """``wtacrs.preset: exact`` (q/k/v and FFN outputs rebuilt in backward on top of the kit): logits and every
    gradient match the unconverted model, and it keeps less than the kit without the recomputation."""
    reference = tiny_family(model_type, attn="eager")
    model, lines = prepare_model(copy.deepcopy(reference), wtacrs_config(preset="exact"))
    batch = family_batch(model_type)
    out_ref, out = reference(**batch), model(**batch)
    torch.testing.assert_close(out.logits, out_ref.logits, rtol=1e-5, atol=2e-6)
    assert_same_gradients(model, reference, out.loss, out_ref.loss)
    kit_only, _ = prepare_model(copy.deepcopy(reference), wtacrs_config(kit=EXACT_KIT))
    big = family_batch(model_type, batch=4, seq=32, pad_from=None)
    assert saved_tensor_bytes(model, big)["total"] < saved_tensor_bytes(kit_only, big)["total"], lines
