"""The pure math of bucket clipping and the bucketer (no processes, no DeepSpeed)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_bertopt.comm import (
    BucketClipConfig,
    assign_buckets,
    bucket_thresholds,
    clip_bucket_,
    clip_coefficient,
    clip_tensors_,
    reverse_registration_buckets,
)
from ds_bertopt.configlib import load_section
from ds_bertopt.errors import ConfigError


def reference_clip(values: torch.Tensor, threshold: float, eps: float) -> torch.Tensor:
    v = values.double()
    norm = float(v.norm())
    return v * min(1.0, threshold / (norm + eps))


@pytest.mark.parametrize("scale", [0.01, 1.0, 100.0])
def test_clip_bucket_matches_formula(scale):
    gen = torch.Generator().manual_seed(0)
    flat = torch.randn(1000, generator=gen) * scale
    want = reference_clip(flat, 0.5, 1e-6)
    coef = clip_bucket_(flat, 0.5, eps=1e-6)
    assert torch.allclose(flat.double(), want, rtol=1e-6, atol=0)
    assert coef.dim() == 0 and float(coef) <= 1.0
    # the result's norm is at most the threshold
    assert float(flat.double().norm()) <= 0.5 * (1 + 1e-6)


def test_below_threshold_is_bit_identical():
    flat = torch.full((100,), 1e-3)
    original = flat.clone()
    coef = clip_bucket_(flat, 1.0)
    assert float(coef) == 1.0 and torch.equal(flat, original)


def test_post_scale_is_folded_into_the_same_multiply():
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(500, generator=gen)
    b = a.clone()
    clip_bucket_(a, 0.1, post_scale=0.5)
    clip_bucket_(b, 0.1)
    assert torch.allclose(a, b * 0.5, rtol=1e-6)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_bucket_passes_through_unchanged(bad):
    flat = torch.randn(64, generator=torch.Generator().manual_seed(2)) * 100
    flat[5] = bad
    original = flat.clone()
    coef = clip_bucket_(flat, 0.01)
    assert float(coef) == 1.0
    assert torch.equal(flat, original) if not math.isnan(bad) else torch.equal(flat.nan_to_num(), original.nan_to_num())
    assert math.isnan(float(flat[5])) if math.isnan(bad) else float(flat[5]) == bad


def test_threshold_may_be_a_tensor_and_nothing_leaves_the_device():
    flat = torch.ones(64)  # norm 8
    coef = clip_bucket_(flat, torch.tensor(2.0) * 3.0)  # a loss scale held as a tensor
    assert isinstance(coef, torch.Tensor)
    assert torch.allclose(flat.norm(), torch.tensor(6.0), rtol=1e-5)


def test_clip_bucket_keeps_low_precision_dtype_and_uses_fp32_norm():
    flat = torch.full((4096,), 3.0, dtype=torch.bfloat16)  # fp32 norm 192; a bf16 sum of squares would round
    coef = clip_bucket_(flat, 1.0)
    assert flat.dtype == torch.bfloat16
    assert abs(float(coef) - 1.0 / 192.0) < 1e-6


def test_clip_tensors_equals_clip_of_the_concatenation():
    gen = torch.Generator().manual_seed(3)
    tensors = [torch.randn(3, 4, generator=gen), torch.randn(10, generator=gen), torch.randn(2, 2, 2, generator=gen)]
    flat = torch.cat([t.reshape(-1) for t in tensors])
    coef_list = clip_tensors_(tensors, 0.7, post_scale=0.25)
    coef_flat = clip_bucket_(flat, 0.7, post_scale=0.25)
    assert torch.allclose(coef_list, coef_flat)
    assert torch.allclose(torch.cat([t.reshape(-1) for t in tensors]), flat, rtol=1e-6)


def test_clip_coefficient_formula():
    norms = torch.tensor([0.0, 0.5, 2.0, float("inf"), float("nan")])
    coef = clip_coefficient(norms, 1.0, 1e-6)
    assert coef.tolist()[:3] == pytest.approx([1.0, 1.0, 1.0 / (2.0 + 1e-6)])
    assert coef.tolist()[3:] == [1.0, 1.0]


@pytest.mark.parametrize("mode", ["uniform", "proportional"])
def test_thresholds_bound_the_whole_local_gradient(mode):
    numels = [10, 1000, 37, 5]
    taus = bucket_thresholds(numels, 2.0, mode)
    assert sum(t * t for t in taus) == pytest.approx(4.0)
    if mode == "uniform":
        assert taus == [pytest.approx(1.0)] * 4
    else:
        assert taus[1] / taus[0] == pytest.approx(math.sqrt(100))
    # clipping every bucket of any gradient to its threshold gives a whole norm <= max_norm
    gen = torch.Generator().manual_seed(4)
    buckets = [torch.randn(n, generator=gen) * 10 for n in numels]
    for flat, tau in zip(buckets, taus):
        clip_bucket_(flat, tau, eps=0.0)
    assert float(torch.cat(buckets).double().norm()) <= 2.0 * (1 + 1e-6)


def test_one_bucket_is_local_clipping():
    assert bucket_thresholds([123], 1.5, "uniform") == [1.5]
    assert bucket_thresholds([123], 1.5, "proportional") == [1.5]


def test_bucketer_follows_deepspeeds_rule():
    # DeepSpeed closes a bucket when the next gradient would overflow it; a big one is alone
    assert assign_buckets([4, 4, 4, 20, 3, 3], 10) == [[0, 1], [2], [3], [4, 5]]
    assert assign_buckets([10, 1], 10) == [[0], [1]]
    assert assign_buckets([5, 5], 10) == [[0, 1]]


def test_bucketer_separates_dtypes():
    keys = ["f32", "bf16", "f32", "bf16", "f32"]
    buckets = assign_buckets([6, 6, 6, 6, 6], 12, keys)
    assert buckets == [[0, 2], [1, 3], [4]]


def test_reverse_registration_order():
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (8, 3, 3, 3)]
    # last registered first: params 3, 2 fill the first bucket of 6
    assert reverse_registration_buckets(params, 6) == [[3, 2], [1], [0]]


@settings(max_examples=200, deadline=None)
@given(
    numels=st.lists(st.integers(min_value=1, max_value=50), min_size=1, max_size=40),
    bucket_size=st.integers(min_value=1, max_value=120),
    keys=st.lists(st.sampled_from(["a", "b"]), min_size=40, max_size=40),
)
def test_bucketer_properties(numels, bucket_size, keys):
    keys = keys[: len(numels)]
    buckets = assign_buckets(numels, bucket_size, keys)
    assert buckets == assign_buckets(numels, bucket_size, keys), "deterministic"
    flat = sorted(i for bucket in buckets for i in bucket)
    assert flat == list(range(len(numels))), "every item exactly once"
    for bucket in buckets:
        assert bucket == sorted(bucket), "order kept inside a bucket"
        assert len({keys[i] for i in bucket}) == 1, "one dtype per bucket"
        assert len(bucket) == 1 or sum(numels[i] for i in bucket) <= bucket_size, "size respected"


def test_config_validation_names_the_key():
    with pytest.raises(ConfigError, match="bucket_clip.max_norm"):
        load_section(BucketClipConfig, {"max_norm": 0}, "bucket_clip")
    with pytest.raises(ConfigError, match="bucket_clip.threshold"):
        load_section(BucketClipConfig, {"threshold": "global"}, "bucket_clip")
    with pytest.raises(ConfigError, match="bucket_sise"):
        load_section(BucketClipConfig, {"bucket_sise": 10}, "bucket_clip")
    cfg = load_section(
        BucketClipConfig, {"enabled": True, "bucket_size": 100, "threshold": "proportional"}, "bucket_clip"
    )
    assert cfg.enabled and cfg.bucket_size == 100


def test_averaging_follows_deepspeeds_split():
    from ds_bertopt.comm.scaling import averaging_factors

    assert averaging_factors(8, average=True, postscale=True, predivide=1.0) == (1 / 8, 1.0)  # folded before
    assert averaging_factors(8, average=True, postscale=True, predivide=2.0) == (0.5, 0.25)  # 1/f, then f/world
    assert averaging_factors(8, average=True, postscale=False, predivide=2.0) == (1 / 8, 1.0)  # prescale
    assert averaging_factors(8, average=False, postscale=True, predivide=2.0) == (1.0, 1.0)  # a plain sum
    with pytest.raises(ConfigError, match="gradient_predivide_factor: must be positive"):
        averaging_factors(8, average=True, postscale=True, predivide=0.0)


def test_fp16_loss_scale_is_required_not_defaulted():
    from ds_bertopt.comm.scaling import loss_scale_reader

    class Scaled:
        loss_scale = 65536.0

    assert loss_scale_reader(Scaled(), fp16=True)() == 65536.0
    assert loss_scale_reader(object(), fp16=False)() == 1.0  # bf16 / fp32 wrappers: no scale
    with pytest.raises(ConfigError, match="fp16 is on, but DeepSpeed's optimizer object exposes no loss_scale"):
        loss_scale_reader(object(), fp16=True)
