"""The state-creating first step changes no weight, whatever the optimizer and DeepSpeed wrapper (docs/gpu.md).

DeepSpeed's fp16/bf16 wrappers at ZeRO 0 create the optimizer state by stepping once on zero gradients. With
decoupled weight decay that step moved the fp32 master weights: AdamW shrank them by ``1 − lr·λ``, apex's LAMB by
``1 − lr`` (the trust ratio makes the decay term a full-size step); the first real step then carried the shrink into
the model. Every combination runs in ``tests/scripts/first_step_worker.py`` on one gloo rank.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import first_step_worker  # noqa: E402

from ds_bertopt.testing.distributed import spawn_ranks  # noqa: E402

WRAPPER_CLASSES = {
    "none": None,  # the optimizer itself
    "fp16 wrapper": ("FP16_Optimizer", "FP16_UnfusedOptimizer"),
    "BF16_Optimizer": ("BF16_Optimizer",),
    "ZeRO 1": ("DeepSpeedZeroOptimizer",),
    "ZeRO 2": ("DeepSpeedZeroOptimizer",),
}


@pytest.fixture(scope="module")
def results():
    return spawn_ranks(first_step_worker.run, 1, timeout=420)[0]


@pytest.mark.precision
@pytest.mark.parametrize("combination", first_step_worker.combinations(), ids=lambda c: f"{c[0]}-{c[1]}")
def test_the_state_creating_step_changes_no_weight(results, combination):
    opt, wrapper = combination
    found = results[f"{opt} / {wrapper}"]
    assert found["optimizer"] == opt
    expected = WRAPPER_CLASSES[wrapper] or (opt,)
    if wrapper == "fp16 wrapper":  # DeepSpeedEngine._configure_fp16_optimizer: isinstance(optimizer, FusedAdam)
        expected = ("FP16_Optimizer",) if opt == "FusedAdam" else ("FP16_UnfusedOptimizer",)
    assert found["wrapper"] in expected, found
    assert found["steps_counted"] == [0] * len(found["steps_counted"]), "the state-creating step was counted"
    assert found["applied"] and found["moved"] == 0.0, f"{opt} under {found['wrapper']}: moved {found['moved']:.3g}"
