"""LAMB inside real DeepSpeed engines on 2 gloo ranks: ZeRO-1/2 take ZeRO-0's steps; resume is exact.

The work runs in ``tests/scripts/optim_zero_check.py`` (spawned here, and under the real
``deepspeed`` launcher in the slow test); these tests judge the tensors it saves.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ds_bertopt.compat import deepspeed as ds_compat
from ds_bertopt.optim import lamb_kernel
from ds_bertopt.testing.distributed import free_port, start_processes
import pytest
from _launch import deepspeed_cmd
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "optim_zero_check.py"
sys.path.insert(0, str(SCRIPT.parent))
import optim_zero_check  # noqa: E402

STEPS = 4


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("optim_zero")
    start_processes(
        optim_zero_check.spawn_worker, (2, free_port(), str(out), optim_zero_check.ALL_CHECKS, STEPS), nprocs=2
    )
    return torch.load(out / "optim_zero_check.pt", weights_only=False)


def _initial_params() -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in optim_zero_check.tiny_bert().parameters()])


@pytest.mark.precision
@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_lamb_takes_the_zero0_steps(results, stage):
    zero0, zero_n = results["stage0"], results[f"stage{stage}"]
    moved = float((zero0["params"] - _initial_params()).abs().max())
    assert moved > 1e-2, "training barely moved the weights; the comparison would be vacuous"
    # Same per-layer ratio on every stage: equal up to the summation order of the layer norms.
    torch.testing.assert_close(zero_n["params"], zero0["params"], rtol=1e-5, atol=1e-6)
    # LAMB's own clipping was active, and DeepSpeed's global norm fed it the same factor as ZeRO-0's.
    assert all(s < 1.0 for s in zero0["grad_scales"])
    assert zero_n["grad_scales"] == pytest.approx(zero0["grad_scales"], rel=1e-5)
    assert zero_n["lr"] == pytest.approx(zero0["lr"])
    assert zero_n["attached"] and zero0["attached"] == []  # layouts only where DeepSpeed flattened


@pytest.mark.precision
@pytest.mark.timeout(240)
@pytest.mark.parametrize("run", ["stage0", "stage1", "stage2", "stage2_foreach"])
def test_fused_kernel_takes_the_foreach_steps(results, run):
    """The fused CPU kernel (auto on these fp32 CPU ranks) at ZeRO 0/1/2, and the foreach path under ZeRO 2, take
    the steps of the foreach path at ZeRO 0 (the step as it was before the kernel): fp32, equal up to rounding
    order (1-ulp differences per step in u and in the fp32 vs float64 norm sums; observed max 1e-7)."""
    reference, other = results["stage0_foreach"], results[run]
    assert reference["fused_steps"] == 0 and results["stage2_foreach"]["fused_steps"] == 0
    if not run.endswith("_foreach"):
        if lamb_kernel.library() is None:
            pytest.skip(f"no fused CPU kernel here: {lamb_kernel.unavailable_reason()}")
        assert other["fused_steps"] > 0, "the fused kernel was not used: the comparison would be vacuous"
    torch.testing.assert_close(other["params"], reference["params"], rtol=1e-5, atol=1e-6)
    assert other["grad_scales"] == pytest.approx(reference["grad_scales"], rel=1e-5)


@pytest.mark.precision
@pytest.mark.timeout(240)
def test_per_shard_trust_ratio_would_differ(results):
    """The control: ZeRO-1 with one trust ratio per flat shard (what a plain client LAMB gets)."""
    gap = float((results["per_shard"]["params"] - results["stage0"]["params"]).abs().max())
    assert gap > 1e-3


@pytest.mark.precision
@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage", [0, 2])
def test_checkpoint_resume_is_bit_exact(results, stage):
    straight, resumed = results[f"resume{stage}"]["straight"], results[f"resume{stage}"]["resumed"]
    assert torch.equal(straight["params"], resumed["params"])
    assert len(straight["state"]) == len(resumed["state"]) == 2
    for a, b in zip(straight["state"], resumed["state"]):
        assert torch.equal(a, b)
    assert straight["lr"] == resumed["lr"] and straight["sched"] == resumed["sched"] == STEPS


@pytest.mark.timeout(240)
@pytest.mark.precision
@pytest.mark.parametrize("stage", [1, 2])
def test_bf16_lamb_at_zero0_takes_the_zero12_steps(results, stage):
    """bf16 (pinned): ZeRO 0 runs DeepSpeed's FP16_UnfusedOptimizer (fp32 copies, whole layers), ZeRO 1/2 the
    partitioned optimizer; all take the same layer-wise steps on their fp32 masters."""
    zero0, zero_n = results["bf16_stage0"], results[f"bf16_stage{stage}"]
    if not ds_compat.available("engine.bf16_zero0"):  # DeepSpeed < 0.18: bf16 at ZeRO 0 is refused in one line
        assert "hook engine.bf16_zero0 " in zero0["refused"] and "\n" not in zero0["refused"], zero0
        assert zero_n["wrapper"] == "DeepSpeedZeroOptimizer" and zero_n["fragments"] > 0
        return
    assert zero0["wrapper"] == "FP16_UnfusedOptimizer" and zero0["fragments"] == 0
    assert zero_n["wrapper"] == "DeepSpeedZeroOptimizer" and zero_n["fragments"] > 0
    # DeepSpeed's zero-gradient state-initialisation step did not count as a step
    assert zero0["steps"] == zero_n["steps"] == [STEPS]
    moved = float((zero0["masters"] - _initial_params()).abs().max())
    assert moved > 1e-2
    gap = float((zero_n["masters"] - zero0["masters"]).abs().max())
    control = float((results["bf16_per_shard"]["masters"] - zero0["masters"]).abs().max())
    assert gap < 1e-4 < control, (gap, control)
    assert zero_n["grad_scales"] == pytest.approx(zero0["grad_scales"], rel=1e-3)
    assert torch.equal(zero0["params"], zero0["masters"].to(torch.bfloat16).float())  # params are the rounded masters


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_deepspeed_launcher_zero_stages(tmp_path):
    launcher = deepspeed_cmd()[0]  # next to sys.executable: CI does not activate the venv
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [
            launcher,
            "--num_gpus",
            "2",
            "--master_port",
            str(free_port()),
            str(SCRIPT),
            "--out",
            str(tmp_path),
            "--checks",
            "stages",
            "per_shard",
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "layer-wise trust ratio over DeepSpeedZeroOptimizer (ZeRO 2)" in proc.stdout
    res = torch.load(tmp_path / "optim_zero_check.pt", weights_only=False)
    for stage in (1, 2):
        torch.testing.assert_close(res[f"stage{stage}"]["params"], res["stage0"]["params"], rtol=1e-5, atol=1e-6)
    assert float((res["per_shard"]["params"] - res["stage0"]["params"]).abs().max()) > 1e-3
