"""``model.fused_dropout`` (ds_bertopt.model.fused): the packed-bits dropout's statistics (keep rate, scale, mean,
independence, uniform bits, determinism), the fused residual blocks equal to the stock modules in eval mode (fp32,
bf16), training-mode dropout replayed by activation checkpointing, and the config switch (every family's parity with
the stock padded model, fused: tests/test_families.py)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import transformers

from ds_bertopt.config import BertOptConfig, RunConfig, dead_keys
from ds_bertopt.model import fused
from ds_bertopt.model.config import ModelConfig
from ds_bertopt.model.families import family_of
from ds_bertopt.model.unpadded import UnpaddedMLM

N = 1 << 20


def z(observed: float, expected: float, count: int) -> float:
    """How many standard deviations a rate ``observed`` over ``count`` Bernoulli trials is from ``expected``."""
    return abs(observed - expected) / math.sqrt(expected * (1 - expected) / count)


# ---------------------------------------------------------------------------------------------- the random bits


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_is_the_rounded_keep_probability_and_the_scale_its_inverse(p):
    torch.manual_seed(0)
    keep = fused.keep_mask((N,), p)
    q = fused.keep_levels(p) / fused.KEEP_LEVELS
    assert abs(q - (1 - p)) <= 2**-17 and fused.keep_scale(p) * q == 1.0
    assert keep.dtype == torch.bool and keep.shape == (N,)
    assert z(keep.float().mean().item(), q, N) < 5


def test_edge_probabilities():
    assert fused.keep_levels(0.0) == fused.KEEP_LEVELS and fused.keep_levels(1 - 1e-9) == 1
    torch.manual_seed(0)
    assert fused.keep_mask((4096,), 0.0).all()  # p = 0: every 16-bit value is below the threshold
    x = torch.randn(64)
    assert fused.dropout(x, 0.0) is x and fused.dropout(x, 0.5, training=False) is x


def test_the_16_bit_values_are_uniform_in_every_lane_of_a_word():
    """Chi-square of the top and bottom 4 bits of each of a word's four 16-bit lanes (15 dof: 99.9 % at 37.7)."""
    torch.manual_seed(1)
    bits = fused.packed_bits(N).view(-1, 4).to(torch.int32) & 0xFFFF
    expected = bits.shape[0] / 16
    for lane in range(4):
        for nibble in (bits[:, lane] >> 12, bits[:, lane] & 0xF):
            counts = torch.bincount(nibble, minlength=16).double()
            assert ((counts - expected) ** 2 / expected).sum().item() < 37.7


@pytest.mark.parametrize("shift", [1, 2, 3, 4, 5])
def test_keep_decisions_are_independent_within_and_across_words(shift):
    """P(both kept) = q² for elements ``shift`` apart (lanes of one word and of neighbouring words)."""
    torch.manual_seed(2)
    keep = fused.keep_mask((N,), 0.5)
    both = (keep[:-shift] & keep[shift:]).float().mean().item()
    assert z(both, 0.25, N - shift) < 5


def test_dropout_keeps_the_mean_and_scales_kept_values_exactly():
    torch.manual_seed(3)
    x = torch.rand(N) + 0.5
    out = fused.dropout(x, 0.1)
    kept = out != 0
    torch.testing.assert_close(out[kept], x[kept] * fused.keep_scale(0.1), rtol=0, atol=0)
    assert abs(out.mean().item() / x.mean().item() - 1) < 5e-3  # sd of the ratio ~ 4e-4 at N = 2^20
    torch.manual_seed(3)
    reference = F.dropout(x, 0.1)  # torch's own dropout: the same keep rate
    assert z(kept.float().mean().item(), 0.9, N) < 5 and z((reference != 0).float().mean().item(), 0.9, N) < 5


def test_determinism_under_manual_seed_and_an_explicit_generator():
    torch.manual_seed(7)
    first = fused.keep_mask((1000,), 0.1)
    torch.manual_seed(7)
    again = fused.keep_mask((1000,), 0.1)
    torch.manual_seed(8)
    other = fused.keep_mask((1000,), 0.1)
    assert torch.equal(first, again) and not torch.equal(first, other)
    generator = torch.Generator().manual_seed(7)
    assert torch.equal(fused.keep_mask((1000,), 0.1, generator=generator), first)


BOTH_DTYPES = pytest.mark.parametrize(
    "dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.precision)], ids=["fp32", "bf16"]
)


@BOTH_DTYPES
def test_keep_factors_are_the_masks_decisions_in_the_activations_dtype(dtype):
    torch.manual_seed(5)
    keep = fused.keep_mask((4099,), 0.1)  # not a whole number of 64-bit words
    torch.manual_seed(5)
    factors = fused.keep_factors((4099,), 0.1, dtype)
    assert factors.dtype == dtype and torch.equal(factors, keep.to(dtype))
    assert torch.equal(fused.keep_factors((8,), 0.0, dtype), torch.ones(8, dtype=dtype))


@BOTH_DTYPES
def test_dropout_add_is_residual_plus_dropout_and_its_gradient_is_the_mask(dtype):
    """The forward to its dtype's rounding of the exact sum; the gradient exactly the kept values times the exact
    scale (autograd's own addcmul backward would round the scale to bf16 first)."""
    x = torch.randn(512, 16).to(dtype).requires_grad_(True)
    residual = torch.randn(512, 16).to(dtype).requires_grad_(True)
    torch.manual_seed(4)
    out = fused.dropout_add(x, residual, 0.2)
    torch.manual_seed(4)
    keep = fused.keep_mask(x.shape, 0.2)
    scale = fused.keep_scale(0.2)
    exact = residual.double() + torch.where(keep, x.double(), 0) * scale
    torch.testing.assert_close(out, exact.to(dtype))
    grad = torch.randn_like(out)
    out.backward(grad)
    assert torch.equal(x.grad, torch.where(keep, grad, 0) * scale) and x.grad.dtype == dtype
    assert torch.equal(residual.grad, grad)


# ----------------------------------------------------------------------------------------------- the fused model


def tiny_bert(dropout: float = 0.1, seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.BertConfig(
        vocab_size=90, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
        max_position_embeddings=64, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
    )  # fmt: skip
    return transformers.BertForMaskedLM(config)


@pytest.mark.parametrize(
    "dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.precision)], ids=["fp32", "bf16"]
)
def test_fused_blocks_equal_the_stock_modules_in_eval_mode(dtype):
    stock = tiny_bert().to(dtype).eval()
    ours = tiny_bert().to(dtype).eval()
    what = fused.fuse_encoder(ours, family_of(ours))
    assert what == ["dropout x7", "dropout + residual add x4"]  # embeddings + 3 per layer; 2 blocks per layer
    assert ours.state_dict().keys() == stock.state_dict().keys()
    torch.manual_seed(0)
    for block in ("attention.output", "output"):
        ref, mine = (m.bert.encoder.layer[0].get_submodule(block) for m in (stock, ours))
        width = ref.dense.in_features
        hidden, residual = torch.randn(37, width, dtype=dtype), torch.randn(37, 32, dtype=dtype)
        assert torch.equal(mine(hidden, residual), ref(hidden, residual))
    ids = torch.randint(0, 90, (2, 11))
    assert torch.equal(ours(input_ids=ids).logits, stock(input_ids=ids).logits)


def test_training_mode_drops_with_the_packed_bits_and_checkpointing_replays_them():
    """Fused dropout is on in training (the loss moves with the seed, repeats under it), and a checkpointed
    layer recomputes the same masks: the same gradients as without checkpointing."""
    from ds_bertopt.data.collate import pack_sequences

    samples = [
        {"input_ids": [5 + (i * 7 + n) % 80 for i in range(n)], "token_type_ids": [0] * n,
         "labels": [(i * 3) % 90 if i % 4 == 1 else -100 for i in range(n)]}
        for n in (9, 17, 5)
    ]  # fmt: skip
    packed = pack_sequences(samples)
    model = tiny_bert()
    wrapper = UnpaddedMLM(model, fused_dropout=True).train()
    assert isinstance(model.bert.encoder.layer[0].output.dropout, fused.PackedBitsDropout)
    losses = []
    for seed in (3, 4, 3):
        torch.manual_seed(seed)
        losses.append(wrapper(**packed).loss)
    assert not torch.equal(losses[0], losses[1]) and torch.equal(losses[0], losses[2])
    torch.manual_seed(3)
    wrapper(**packed).loss.backward()
    plain = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model.activation_checkpointing_enable({"use_reentrant": False})
    calls = []
    model.bert.encoder.layer[1].intermediate.register_forward_hook(lambda *args: calls.append(1))
    torch.manual_seed(3)
    wrapper(**packed).loss.backward()
    assert len(calls) == 2  # the layer ran again in the backward: it was checkpointed
    for key, grad in plain.items():
        torch.testing.assert_close(dict(model.named_parameters())[key].grad, grad, atol=1e-6, rtol=1e-5)


# --------------------------------------------------------------------------------------------------- the config


def test_the_switch_is_validated_and_dead_unless_unpadded():
    assert "fused_dropout" in ModelConfig(unpadded=False).dead_fields()
    assert "fused_dropout" not in ModelConfig(unpadded=True, fused_dropout=True).dead_fields()
    run = RunConfig(path="", deepspeed={}, bertopt=BertOptConfig(model=ModelConfig(unpadded=False)))
    assert "model.fused_dropout" in dead_keys(run)
    with pytest.raises(Exception, match="fused_dropout"):
        ModelConfig(fused_dropout="yes")
