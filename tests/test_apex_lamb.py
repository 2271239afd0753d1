"""apex's FusedLAMB as ds_bertopt builds it: the bound that clips nothing, built where the model trains, and its step
equal to our LAMB's (docs/gpu.md). apex is not installable here: ``ds_bertopt.testing.apex_lamb`` is its step on the
CPU, read line by line from ``csrc/multi_tensor_lamb.cu`` and ``fused_lamb.py``; ``bench/gpu_check.sh`` compares the
real kernel with ours on CUDA."""

from __future__ import annotations

import copy
import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from ds_bertopt import optim
from ds_bertopt.errors import ConfigError
from ds_bertopt.optim import APEX_NO_CLIP, OptimizerConfig, apex_max_grad_norm, build_optimizer
from ds_bertopt.optim.lamb import Lamb
from ds_bertopt.testing.apex_lamb import (
    FusedLAMB,
    apex_lamb_step,
    global_grad_norm,
    lamb_runs,
    max_relative_gap,
    tiny_model,
)
from ds_bertopt.testing.gpu_paths import cuda_optimizer_choice, gradient_part

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # bench.gpucheck

DEFAULT = OptimizerConfig(type="lamb", lr=0.02, weight_decay=0.01)
MLPERF = OptimizerConfig(  # ds_configs/mlperf_bert_large.json's LAMB (no bias correction, as the TF reference)
    type="lamb", lr=2.88293e-3, betas=(0.88, 0.88), eps=1e-6, weight_decay=0.0166629, bias_correction=False
)


def build(model, cfg: OptimizerConfig, *, apex: bool, bucket_clip: bool = True):
    with cuda_optimizer_choice(apex=apex):
        return build_optimizer(model, cfg, lr=cfg.lr, zero_stage=0, bucket_clip=bucket_clip)


@pytest.mark.parametrize("cfg", [DEFAULT, MLPERF, dataclasses.replace(DEFAULT, adapt_no_decay=True)], ids=str)
def test_apex_as_we_build_it_takes_our_lamb_step_with_bucket_clip_on(cfg):
    """mlperf_bert_large.json (ZeRO 0, LAMB, bucket clip) in a container with apex: LAMB's own clipping is off, and
    apex must then take our steps, not steps on gradients divided by norm / 0. ``lamb_runs`` is what gpu_check runs
    on CUDA with the real apex."""
    runs = lamb_runs(cfg, "cpu")
    for name in runs["ours"]:  # fp32 either way; the norms are summed in another order (float64 partials in ours)
        torch.testing.assert_close(runs["apex"][name], runs["ours"][name], rtol=2e-6, atol=2e-7, msg=name)
        torch.testing.assert_close(runs["reference"][name], runs["ours"][name], rtol=2e-6, atol=2e-7, msg=name)
    with cuda_optimizer_choice(apex=True):
        apex = build_optimizer(tiny_model(), cfg, lr=cfg.lr, zero_stage=0, bucket_clip=True)
    assert isinstance(apex, FusedLAMB) and apex.defaults["max_grad_norm"] == APEX_NO_CLIP


def test_apex_with_the_zero_bound_trains_on_weight_decay_alone():
    """The 0.0 bound main passed: every gradient divided by norm / 0 = inf. The reference shows it (the control that
    makes the test above meaningful): the weights move along themselves only, far from our step."""
    runs = lamb_runs(DEFAULT, "cpu")
    assert gradient_part(runs["initial"], runs["zero_bound"]) < 1e-3  # decay only: each update a multiple of w
    assert gradient_part(runs["initial"], runs["ours"]) > 0.5
    assert max_relative_gap(runs["zero_bound"], runs["ours"], runs["initial"]) > 0.5


def test_the_reference_follows_the_kernel_on_hand_computed_numbers():
    """One tensor, one step, numbers worked by hand from LAMBStage1Functor / LAMBStage2Functor (mode 1, bias
    correction, grad averaging): m = 0.1 g, v = 0.001 g², u = g/|g| / (1 + eps) + λp elementwise, ratio ‖p‖/‖u‖."""
    p, g = torch.tensor([3.0, -4.0]), torch.tensor([0.5, 0.25])
    zeros = torch.zeros(2)
    (new_p,), (m,), (v,) = apex_lamb_step(
        [p], [g], [zeros], [zeros], lr=0.1, beta1=0.9, beta2=0.999, eps=0.0, step=1, bias_correction=True,
        weight_decay=0.5, global_grad_norm=global_grad_norm([g]), max_grad_norm=APEX_NO_CLIP,
    )  # fmt: skip
    torch.testing.assert_close(m, 0.1 * g)
    torch.testing.assert_close(v, 0.001 * g * g)
    u = torch.tensor([1.0, 1.0]) + 0.5 * p  # m̂/√v̂ = sign(g) at step 1
    torch.testing.assert_close(new_p, p - 0.1 * (p.norm() / u.norm()) * u)
    clipped = apex_lamb_step(
        [p], [g], [zeros], [zeros], lr=0.1, beta1=0.9, beta2=0.999, eps=0.0, step=1, bias_correction=True,
        weight_decay=0.5, global_grad_norm=global_grad_norm([g]), max_grad_norm=0.0,
    )  # fmt: skip
    torch.testing.assert_close(clipped[1][0], zeros)  # norm / 0: no gradient reaches the moments
    assert apex_max_grad_norm(0.0) == APEX_NO_CLIP and apex_max_grad_norm(1.5) == 1.5


def test_apex_is_built_on_the_device_the_model_trains_on(monkeypatch):
    """FusedLAMB puts its overflow buffer on the first parameter's device when built; built before
    deepspeed.initialize moved the model, that was the CPU. The training device here is a stand-in (meta)."""
    monkeypatch.setattr(optim, "_training_device", lambda model: torch.device("meta"))
    model = tiny_model()
    apex = build(model, DEFAULT, apex=True)
    assert apex._dummy_overflow_buf.device.type == "meta"
    assert all(p.device.type == "meta" for p in model.parameters())


def test_apex_is_not_taken_where_it_would_not_take_our_step():
    """apex's kernel takes the trust ratio only in groups with weight decay (or all with use_nvlamb): with weight
    decay 0 its steps would be Adam's, ours LAMB's."""
    no_decay = dataclasses.replace(DEFAULT, weight_decay=0.0)
    assert isinstance(build(tiny_model(), no_decay, apex=True), Lamb)
    assert isinstance(build(tiny_model(), dataclasses.replace(no_decay, adapt_no_decay=True), apex=True), FusedLAMB)
    with pytest.raises(ConfigError, match="no trust ratio in a group without weight decay"):
        build(tiny_model(), dataclasses.replace(no_decay, implementation="apex"), apex=True)
    model = tiny_model()
    reference = copy.deepcopy(model)
    build(model, no_decay, apex=True)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


def test_gpu_checks_apex_comparison_runs_here(tmp_path):
    """``bench/gpu_check.sh``'s ``lamb_equal`` compares the real apex with ours on CUDA; its logic runs on the CPU with
    the reference standing in (the dry run), every check holding."""
    import time

    from bench.gpucheck.apex_lamb import apex_checks
    from bench.gpucheck.runner import Ctx

    ctx = Ctx(device="cpu", tiny=True, gpus=1, workdir=tmp_path, deadline=time.monotonic() + 300, jobs=1)
    ctx.section = "lamb_equal"
    checks = apex_checks(ctx)
    assert len(checks) == 8 and all(ok for _, ok, _ in checks), [c for c in checks if not c[1]]
