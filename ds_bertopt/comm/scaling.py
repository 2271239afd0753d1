"""What surrounds the clip: the loss scale the gradients carry, and how the average over ranks is split.

* Under fp16 the gradients in a bucket are multiplied by DeepSpeed's (dynamic) loss scale until the
  optimizer step unscales them, so the clip threshold must be multiplied by the same scale. Every
  DeepSpeed wrapper that scales (``FP16_Optimizer``, ``FP16_UnfusedOptimizer``,
  ``DeepSpeedZeroOptimizer``) exposes it as ``loss_scale``; under fp16 a wrapper without it is refused
  instead of clipping ~65,536× too hard. bf16/fp32 wrappers may have none, or say ``None``: the scale is then 1.
* DeepSpeed averages over ``world`` ranks as ``allreduce_bucket`` (engine, ZeRO 0) and
  ``gradient_reduction_w_predivide`` (ZeRO 1/2) do: with ``postscale_gradients`` and a
  ``gradient_predivide_factor`` f it multiplies by ``1/f`` before the allreduce and by ``f/world``
  after; without ``postscale_gradients`` by ``1/world`` before. :func:`averaging_factors` returns
  that split. With the default f = 1 the whole ``1/world`` goes before (folded into the clip's
  multiply, so the bucket is written once): the same average, and fp16 sums stay in range.
"""

from __future__ import annotations

from typing import Callable

from ..compat.deepspeed import LOSS_SCALE_ABSENT, loss_scale
from ..errors import ConfigError


def loss_scale_reader(optimizer, fp16: bool) -> Callable[[], float]:
    """A function returning the current loss scale of DeepSpeed's optimizer wrapper (no host sync).

    Outside fp16 nothing scales the gradients, whatever the wrapper says: the fused ``FP16_Optimizer`` that a
    CUDA run gets for DeepSpeed's ``FusedAdam`` answers ``None`` under bf16 (``fused_optimizer.py``,
    ``_get_loss_scale``: no grad scaling, no scale), which means 1."""
    if loss_scale(optimizer) is LOSS_SCALE_ABSENT:
        if fp16:
            raise ConfigError(
                f"bucket_clip: fp16 is on, but DeepSpeed's optimizer {type(optimizer).__name__} exposes no "
                "loss_scale, so the clip threshold cannot follow the loss scale; use bf16, or set "
                "bucket_clip.enabled false"
            )
        return lambda: 1.0
    if fp16:
        return lambda: loss_scale(optimizer)

    def read() -> float:
        scale = loss_scale(optimizer)
        return 1.0 if scale is None else scale

    return read


def averaging_factors(world: int, *, average: bool, postscale: bool, predivide: float) -> tuple[float, float]:
    """``(before, after)``: the factors applied to a bucket around its allreduce to average it over ``world``."""
    if predivide <= 0:
        raise ConfigError(f"gradient_predivide_factor: must be positive, got {predivide}")
    if not average:
        return 1.0, 1.0
    if not postscale or predivide == 1.0:
        return 1.0 / world, 1.0
    return 1.0 / predivide, predivide / world
