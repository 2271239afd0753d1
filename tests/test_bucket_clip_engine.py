"""Bucket clipping through the real ``deepspeed.initialize`` on 2 gloo ranks (ZeRO 0, 1, 2).

Each rank computes its local gradients a second time on a plain copy of the model, the ranks
all-gather them, and the reference result is built from the formula in ``ds_bertopt.comm.clip``
(float64, per bucket of the layout the engine used, thresholds recomputed from scratch).
"""

from __future__ import annotations

import copy
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from bucket_clip_reference import (
    TinyLM,
    build_engine,
    ds_config,
    expected_reduced,  # noqa: E402
    layout_names,
    local_micro_grads,
    micro_batches,
    reduced_grads,
    reference_reduced,
    train_micro_batches,
)

from ds_bertopt.testing.distributed import spawn_ranks  # noqa: E402

WORLD = 2


def assert_layout_covers_each_parameter_once(engine, layout):
    flat = [n for bucket in layout for n in bucket]
    trainable = [n for n, p in engine.module.named_parameters() if p.requires_grad]
    assert sorted(flat) == sorted(trainable), (flat, trainable)
    views = [None] * WORLD
    dist.all_gather_object(views, layout)
    assert all(v == layout for v in views), "ranks disagree on the bucket layout"


def assert_close(got: dict, want: dict, rtol: float, atol: float, what: str):
    for n in want:
        assert torch.allclose(got[n], want[n], rtol=rtol, atol=atol), (
            f"{what}: {n} differs by {(got[n] - want[n]).abs().max().item():.3e}"
        )


# ---------------------------------------------------------------------------------------------
def check_matches_reference(stage, gas, mode, max_norm, *, bf16=False, loss_scale=None):
    rank = dist.get_rank()
    clip = {"max_norm": max_norm, "threshold": mode}
    engine, reference = build_engine(stage, gas, clip, bf16=bf16, unused=(stage == 0))
    adapter = engine.bucket_clip
    assert engine.gradient_clipping() == 0.0, "DeepSpeed's own clipping must be off under bucket_clip"
    if loss_scale is not None:
        engine.optimizer.loss_scale = loss_scale  # DeepSpeedZeroOptimizer's property: scales loss, unscales in step
    batches = micro_batches(rank, gas)
    train_micro_batches(engine, batches)
    got = reduced_grads(engine)
    if loss_scale is not None:  # gradients stay scaled until the optimizer step unscales them
        got = {n: g / loss_scale for n, g in got.items()}

    if stage > 0:
        # autograd may finish a layer's weight and bias in either order: compare bucket membership
        reduced = [sorted(b) for b in layout_names(engine, adapter.last_layout)]
        planned = [sorted(b) for b in layout_names(engine, adapter.layout())]
        assert reduced == planned, f"DeepSpeed reduced other buckets than the ones planned: {reduced} vs {planned}"
    dtype = torch.bfloat16 if bf16 else torch.float32
    want, names = expected_reduced(engine, reference, batches, stage=stage, max_norm=max_norm, mode=mode, dtype=dtype)
    assert len(names) >= 3, "the test needs several buckets"
    assert_layout_covers_each_parameter_once(engine, names)
    coefficients = torch.stack([c.double() for c in adapter.last_coefficients])
    assert (coefficients < 0.999).any(), "max_norm too large: nothing was clipped, the test would be vacuous"
    tol = dict(rtol=2e-2, atol=1e-4) if bf16 else dict(rtol=1e-5, atol=1e-8)
    assert_close(got, want, what=f"stage {stage} gas {gas} {mode} gradient", **tol)

    # the optimizer step after the hook equals AdamW applied to the reference gradient
    engine.step()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    for n, p in reference.named_parameters():
        p.grad = want[n].to(p.dtype)
    ref_opt.step()
    updated = {n: p.detach().double() for n, p in engine.module.named_parameters()}
    expected = {n: p.detach().to(dtype).double() for n, p in reference.named_parameters()}
    assert_close(
        updated,
        expected,
        what=f"stage {stage} gas {gas} {mode} step",
        **(dict(rtol=2e-2, atol=1e-2) if bf16 else dict(rtol=1e-5, atol=1e-6)),
    )


def check_below_threshold_equals_plain_deepspeed(stage, gas, extra=None):
    """``extra``: DeepSpeed keys such as ``gradient_predivide_factor``, which both must honour alike."""
    rank = dist.get_rank()
    batches = micro_batches(rank, gas, step=1)
    results = []
    for clip in ({"max_norm": 1e6}, None):
        engine, _ = build_engine(stage, gas, clip, extra=extra)
        if clip is not None and "gradient_predivide_factor" in (extra or {}):  # DeepSpeed's split is kept
            adapter, f = engine.bucket_clip, extra["gradient_predivide_factor"]
            if stage == 0:
                assert (adapter.pre_scale, adapter.post_scale) == (1 / f, f / WORLD)
            else:
                assert not adapter.fold_average and adapter.post_scale == 1.0
        train_micro_batches(engine, batches)
        results.append(reduced_grads(engine))
        if clip is not None:
            assert all(float(c) == 1.0 for c in engine.bucket_clip.last_coefficients)
    ours, plain = results
    assert_close(ours, plain, rtol=0.0, atol=1e-7, what=f"stage {stage} gas {gas} below threshold vs DeepSpeed")


def check_inf_reaches_overflow_check(stage, bf16):
    """An inf in rank 1's gradient is neither clipped away nor turned into NaN; DeepSpeed skips the step."""
    rank = dist.get_rank()
    engine, _ = build_engine(stage, 1, {"max_norm": 0.05}, bf16=bf16)
    target = engine.module.layers[2].weight
    if rank == 1:

        def poison(grad):
            grad = grad.clone()
            grad[0, 0] = float("inf")
            return grad

        target.register_hook(poison)
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    train_micro_batches(engine, micro_batches(rank, 1))
    grads = reduced_grads(engine)
    poisoned = grads["layers.2.weight"]
    assert math.isinf(float(poisoned[0, 0])) and float(poisoned[0, 0]) > 0, float(poisoned[0, 0])
    assert torch.isfinite(poisoned.view(-1)[1:]).all(), "only the poisoned element may be non-finite"
    engine.step()
    assert engine.skipped_steps == 1, f"stage {stage}: the overflow did not reach DeepSpeed's check"
    for n, p in engine.module.named_parameters():
        assert torch.equal(p.detach(), before[n]), f"stage {stage}: {n} changed on an overflow step"


def check_zero3_refused():
    """Refused up front by ``ds_bertopt.engine.initialize``, and by the installer on a stage-3 engine."""
    import deepspeed

    from ds_bertopt.comm import BucketClipConfig, install_bucket_clip
    from ds_bertopt.errors import ConfigError

    with pytest.raises(ConfigError, match="ZeRO stage 3"):
        build_engine(3, 1, {"max_norm": 1.0})
    model = TinyLM()
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.AdamW(model.parameters()),
        config={k: v for k, v in ds_config(3, 1, clip=None).items() if k != "bertopt"},
    )
    with pytest.raises(ConfigError, match="ZeRO stage 3 is not supported"):
        install_bucket_clip(engine, BucketClipConfig(enabled=True))


def unless_refused(hook, check):
    """``check`` as it is, or, on a DeepSpeed that lacks ``hook`` (docs/compat.md), refused before deepspeed.initialize
    in one line naming the hook."""

    def run():
        from ds_bertopt.compat import deepspeed as ds_compat

        if ds_compat.available(hook):
            return check()
        with pytest.raises(ds_compat.DeepSpeedIncompatible, match=rf"hook {hook} .*known to work with"):
            check()

    return run


def bf16_at_zero0(check):
    """bf16 at ZeRO 0: refused before DeepSpeed 0.18 (0.16 runs BF16_Optimizer, 0.17 loss-scales bf16)."""
    return unless_refused("engine.bf16_zero0", check)


def accumulating_at_zero2(check):
    """ZeRO 2 with accumulation: refused on DeepSpeed 0.17, whose own accumulation there is wrong."""
    return unless_refused("zero.accumulation", check)


SCENARIOS = {
    0: [
        lambda: check_matches_reference(0, 1, "uniform", 0.05),
        lambda: check_matches_reference(0, 2, "proportional", 0.05),
        bf16_at_zero0(lambda: check_matches_reference(0, 1, "uniform", 0.05, bf16=True)),
        lambda: check_below_threshold_equals_plain_deepspeed(0, 2),
        lambda: check_below_threshold_equals_plain_deepspeed(0, 1, {"gradient_predivide_factor": 4.0}),
        lambda: check_below_threshold_equals_plain_deepspeed(0, 1, {"prescale_gradients": True}),
        bf16_at_zero0(lambda: check_inf_reaches_overflow_check(0, bf16=True)),
    ],
    1: [
        lambda: check_matches_reference(1, 1, "uniform", 0.05, loss_scale=8.0),
        lambda: check_matches_reference(1, 2, "proportional", 0.05),
        lambda: check_below_threshold_equals_plain_deepspeed(1, 2),
        lambda: check_below_threshold_equals_plain_deepspeed(
            1, 1, {"gradient_predivide_factor": 4.0, "zero_optimization": {"reduce_scatter": False}}
        ),
        lambda: check_inf_reaches_overflow_check(1, bf16=False),
    ],
    2: [
        lambda: check_matches_reference(2, 1, "proportional", 0.05),
        accumulating_at_zero2(lambda: check_matches_reference(2, 2, "uniform", 0.05)),
        accumulating_at_zero2(lambda: check_below_threshold_equals_plain_deepspeed(2, 2)),
        lambda: check_inf_reaches_overflow_check(2, bf16=False),
        check_zero3_refused,
    ],
}


def _run_scenarios(rank: int, world_size: int, stage: int) -> None:
    for scenario in SCENARIOS[stage]:
        scenario()


@pytest.mark.timeout(300)
@pytest.mark.precision
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_bucket_clip_through_deepspeed(stage):
    """Clipped+reduced gradients and the following step match the reference, with and without
    accumulation; below threshold equals plain DeepSpeed; an inf reaches the overflow check.
    Stage 1 also runs with loss scale 8 (threshold scaled with it); stage 2 also checks ZeRO 3 is refused."""
    spawn_ranks(_run_scenarios, WORLD, stage, timeout=280)


# --- the same clip as a torch DDP comm hook ---------------------------------------------------
def ddp_bucket_layout(ddp) -> list[list[torch.nn.Parameter]]:
    """DDP's current buckets (``Reducer._get_zeros_like_grad_buckets`` -> ``GradBucket.parameters``)."""
    return [bucket.parameters() for bucket in ddp.reducer._get_zeros_like_grad_buckets()]


def _ddp_worker(rank: int, world_size: int) -> None:
    from ds_bertopt.comm import BucketClipConfig, register_ddp_bucket_clip

    torch.manual_seed(0)
    model = TinyLM()
    reference = copy.deepcopy(model)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=4096 / 2**20)
    cfg = BucketClipConfig(enabled=True, max_norm=0.05, threshold="proportional")
    register_ddp_bucket_clip(ddp, cfg)
    # DDP's first iteration uses one 1 MiB bucket and then rebuilds them with bucket_cap_mb:
    # check the second iteration, which has several buckets
    ddp(micro_batches(rank, 1, step=0)[0]).backward()
    model.zero_grad(set_to_none=True)
    batch = micro_batches(rank, 1, step=1)[0]
    ddp(batch).backward()
    got = {n: p.grad.double() for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    layout = [[names[id(p)] for p in bucket] for bucket in ddp_bucket_layout(ddp)]
    assert len(layout) >= 3, layout
    params = dict(model.named_parameters())
    total = sum(p.numel() for p in model.parameters())
    thresholds = [0.05 * math.sqrt(sum(params[n].numel() for n in b) / total) for b in layout]
    micro = local_micro_grads(reference, [batch], torch.float32)
    want = reference_reduced(micro, layout, thresholds, cfg.eps, per_micro=False)
    assert_close(got, want, rtol=1e-5, atol=1e-8, what="DDP comm hook")
    unclipped = reference_reduced(micro, layout, [1e9] * len(layout), cfg.eps, per_micro=False)
    assert any(not torch.allclose(got[n], unclipped[n]) for n in got), "nothing was clipped"


@pytest.mark.timeout(120)
def test_ddp_comm_hook_matches_reference():
    spawn_ranks(_ddp_worker, WORLD, timeout=110)
