"""The memory kit: each part exact (or within its stated error) and each saving less on its own."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from wtacrs_common import tiny_batch, tiny_bert  # noqa: E402

from ds_bertopt.wtacrs import (
    Bf16InputGelu,
    CompactDropout,
    GeluLinear,
    OutputSavingLayerNorm,  # noqa: E402
    apply_kit,
    saved_tensor_bytes,
)
from ds_bertopt.wtacrs.config import KitConfig  # noqa: E402
from ds_bertopt.wtacrs.kit import gelu_grad_, pack_bits, unpack_bits  # noqa: E402


def saved_storage_bytes(fn) -> int:
    """Distinct storage bytes saved for backward while running ``fn()`` (parameters included)."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


@pytest.mark.parametrize("shape", [(3,), (8,), (5, 7, 3), (2, 16, 9)])
def test_bit_packing_round_trips(shape):
    mask = torch.rand(shape, generator=torch.Generator().manual_seed(0)) < 0.7
    packed = pack_bits(mask)
    assert packed.dtype == torch.uint8 and packed.numel() == -(-mask.numel() // 8)
    assert torch.equal(unpack_bits(packed, mask.shape), mask)


@pytest.mark.parametrize("mode", ["bool", "bits", "regenerate"])
def test_compact_dropout_is_exact_and_keeps_its_rate(mode):
    torch.manual_seed(0)
    drop = CompactDropout(0.1, mode)
    x = (torch.rand(64, 40, 40) + 0.5).requires_grad_()  # no zeros: y == 0 exactly where dropped
    y = drop(x)
    kept = y != 0
    assert abs(float(kept.float().mean()) - 0.9) < 0.005
    torch.testing.assert_close(y[kept], x[kept] * (1 / 0.9), rtol=0, atol=0)  # scale as torch does
    grad = torch.randn_like(x)
    y.backward(grad)
    expected = torch.where(kept, grad * (1 / 0.9), torch.zeros(()))
    torch.testing.assert_close(x.grad, expected, rtol=0, atol=0)
    assert not torch.equal(kept, drop(x) != 0)  # a fresh mask each call


@pytest.mark.parametrize("mode,expected_bytes", [("bool", 64 * 40), ("bits", 64 * 40 // 8), ("regenerate", 0)])
def test_compact_dropout_saves_only_its_mask(mode, expected_bytes):
    x = torch.rand(64, 40, requires_grad=True)
    nbytes, _ = saved_storage_bytes(lambda: CompactDropout(0.1, mode)(x))
    assert nbytes == expected_bytes
    float_bytes, _ = saved_storage_bytes(lambda: nn.Dropout(0.1)(x))
    assert float_bytes >= 64 * 40  # torch keeps at least a byte per element


def test_regenerated_mask_follows_the_global_seed():
    x = torch.ones(1000)
    torch.manual_seed(7)
    first = CompactDropout(0.5, "regenerate")(x.requires_grad_())
    torch.manual_seed(7)
    second = CompactDropout(0.5, "regenerate")(x)
    assert torch.equal(first, second)


def _layernorm_pair(dtype, weight_zero=False):
    torch.manual_seed(0)
    reference = nn.LayerNorm(32).to(dtype)
    with torch.no_grad():
        reference.weight.uniform_(0.5, 1.5)
        reference.bias.uniform_(-0.5, 0.5)
        if weight_zero:
            reference.weight[3] = 0.0
    return reference, OutputSavingLayerNorm.from_layernorm(copy.deepcopy(reference))


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
@pytest.mark.parametrize("weight_zero", [False, True])
def test_output_saving_layernorm_matches_layernorm(dtype, tol, weight_zero):
    reference, ours = _layernorm_pair(dtype, weight_zero)
    x1 = (torch.randn(4, 16, 32, dtype=dtype) * 3 + 1).requires_grad_()
    x2 = x1.detach().clone().requires_grad_()
    y1 = reference(x1)
    nbytes, y2 = saved_storage_bytes(lambda: ours(x2))
    torch.testing.assert_close(y2, y1, rtol=tol, atol=tol)
    grad = torch.randn_like(y1)
    y1.backward(grad)
    y2.backward(grad)
    for a, b in ((x2.grad, x1.grad), (ours.weight.grad, reference.weight.grad), (ours.bias.grad, reference.bias.grad)):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    activation = x1.numel() * x1.element_size()
    param_bytes = 2 * 32 * x1.element_size()
    stats = 4 * 16 * x1.element_size()
    if weight_zero:  # guarded: it fell back to saving the input (plus mean and rstd)
        assert nbytes >= activation + param_bytes
    else:  # the output (shared with whoever reads it next), rstd and the parameters
        assert nbytes <= activation + param_bytes + stats


def test_layernorm_output_is_shared_with_the_next_linear():
    torch.manual_seed(0)
    norm, linear = nn.LayerNorm(32), nn.Linear(32, 32)
    x = torch.randn(8, 16, 32, requires_grad=True)
    plain, _ = saved_storage_bytes(lambda: linear(norm(x)))
    ours_norm = OutputSavingLayerNorm.from_layernorm(norm)
    shared, _ = saved_storage_bytes(lambda: linear(ours_norm(x)))
    assert plain - shared >= x.numel() * 4 - 8 * 16 * 4  # one activation fewer (its mean went too)


def test_gelu_grad_in_place_is_the_exact_derivative():
    h = torch.linspace(-6, 6, 1001, dtype=torch.float64, requires_grad=True)
    grad = torch.randn_like(h)
    F.gelu(h).backward(grad)
    torch.testing.assert_close(gelu_grad_(h.detach().clone(), grad), h.grad, rtol=1e-12, atol=1e-12)


def test_gelu_linear_is_exact_and_keeps_only_its_input():
    torch.manual_seed(0)
    linear = nn.Linear(16, 64).double()
    fused = GeluLinear.from_linear(copy.deepcopy(linear))
    x1 = torch.randn(4, 8, 16, dtype=torch.float64, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_()
    y1 = F.gelu(linear(x1))
    nbytes, y2 = saved_storage_bytes(lambda: fused(x2))
    torch.testing.assert_close(y2, y1, rtol=0, atol=0)
    grad = torch.randn_like(y1)
    y1.backward(grad)
    y2.backward(grad)
    for a, b in ((x2.grad, x1.grad), (fused.weight.grad, linear.weight.grad), (fused.bias.grad, linear.bias.grad)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    params = sum(p.numel() for p in linear.parameters()) * 8
    assert nbytes == x1.numel() * 8 + params  # no 4h-wide pre-activation kept


def test_bf16_gelu_error_is_small_and_storage_halves():
    x1 = (torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * 2).requires_grad_()
    x2 = x1.detach().clone().requires_grad_()
    grad = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    y1 = F.gelu(x1)
    nbytes, y2 = saved_storage_bytes(lambda: Bf16InputGelu()(x2))
    assert torch.equal(y1, y2)  # forward is exact
    assert nbytes == x1.numel() * 2
    y1.backward(grad)
    y2.backward(grad)
    relative = float((x2.grad - x1.grad).norm() / x1.grad.norm())
    assert 0 < relative < 5e-3


def test_exact_kit_on_bert_reproduces_loss_and_grads():
    """SDPA (dropout 0 in both), LayerNorm-saves-output, recomputed GELU: same loss and gradients."""
    batch = tiny_batch(pad_from=11)
    reference = tiny_bert(hidden_dropout=0.0, attention_dropout=0.0, attn="eager")
    model = copy.deepcopy(reference)
    lines = apply_kit(
        model,
        KitConfig(sdpa_attention=True, layernorm_saves_output=True, recompute_gelu=True, dropout_mask="regenerate"),
    )
    assert len(lines) == 4
    assert sum(isinstance(m, OutputSavingLayerNorm) for m in model.modules()) == 5
    assert sum(isinstance(m, GeluLinear) for m in model.modules()) == 2
    ref_loss, loss = reference(**batch).loss, model(**batch).loss
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    ref_loss.backward()
    loss.backward()
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, ref_params[name].grad, rtol=1e-4, atol=2e-6, msg=name)
    assert list(model.state_dict()) == list(reference.state_dict())


ACTIVATION = 8 * 32 * 64 * 4  # one hidden-wide fp32 tensor of the batch below


@pytest.mark.parametrize(
    "part,category,at_least",
    [
        ({"sdpa_attention": True}, "attention", 2 * 3 * ACTIVATION),  # probabilities and their dropout gone
        ({"dropout_mask": "bits"}, "dropout", 5 * ACTIVATION * 3 // 4),  # 5 hidden dropouts: 4 → ≤ 1 byte
        ({"layernorm_saves_output": True}, "total", 4 * ACTIVATION),  # the 4 in-layer LayerNorm inputs
        ({"recompute_gelu": True}, "activation", 2 * 4 * ACTIVATION),  # the 4h-wide GELU inputs
        ({"bf16_gelu": True}, "activation", 2 * 2 * ACTIVATION),  # half of them
    ],
)
def test_each_kit_part_saves_on_its_own(part, category, at_least):
    batch = tiny_batch(batch=8, seq=32)
    reference = tiny_bert(hidden=64)
    model = copy.deepcopy(reference)
    apply_kit(model, KitConfig(**part))
    before = saved_tensor_bytes(reference, batch)
    after = saved_tensor_bytes(model, batch)
    assert before[category] - after[category] >= at_least, (part, before, after)
    assert before["total"] - after["total"] >= at_least
