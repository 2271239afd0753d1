"""``install_bucket_clip(engine, cfg)``: pick the adapter for the engine's ZeRO stage and install it.

The adapters reach into DeepSpeed (``zero0.py``: ``DeepSpeedEngine.allreduce_gradients``; ``zero12.py``:
``DeepSpeedZeroOptimizer.reduce_ipg_grads`` and its IPG buckets) only through :mod:`ds_bertopt.compat.deepspeed`,
whose start-up check (:func:`~ds_bertopt.compat.deepspeed.check_release`) has refused a release where those
hooks are missing or changed before ``deepspeed.initialize`` ran.
"""

from __future__ import annotations

from ..compat import deepspeed as ds_compat
from ..errors import ConfigError
from ..log import print0
from .config import BucketClipConfig, refuse_bucket_clip_under_zero3


def _refuse_unsupported(engine) -> None:
    stage = engine.zero_optimization_stage()
    refuse_bucket_clip_under_zero3(stage)
    if engine.gradient_clipping():
        raise ConfigError(
            f"bucket_clip: DeepSpeed gradient_clipping is {engine.gradient_clipping()}; set it to 0 "
            "(ds_bertopt.engine.initialize does) so gradients are not clipped twice"
        )
    for why in ds_compat.unsupported_engine_features(engine):
        raise ConfigError(f"bucket_clip: not supported with {why}")
    if ds_compat.torch_autocast_gradscaler(engine) is not None:
        raise ConfigError(
            "bucket_clip: not supported with torch_autocast fp16 at ZeRO stage 0 "
            "(its GradScaler unscales after the allreduce); use DeepSpeed's fp16 or bf16"
        )
    if isinstance(engine.optimizer, ds_compat.bf16_optimizer_class()):
        raise ConfigError(
            "bucket_clip: bf16 with data_types.grad_accum_dtype fp32 at ZeRO stage "
            f"{stage} runs DeepSpeed's BF16_Optimizer, which bucket_clip does not hook; drop "
            "grad_accum_dtype or use ZeRO stage 2"
        )


def install_bucket_clip(engine, cfg: BucketClipConfig):
    """Install bucket-wise clipping into an initialised ``DeepSpeedEngine``; return the adapter.

    The adapter is also kept as ``engine.bucket_clip`` (its ``layout()``, ``thresholds`` /
    ``threshold()`` and ``last_coefficients`` are there for logging and tests).
    """
    if getattr(engine, "bucket_clip", None) is not None:
        raise RuntimeError("bucket_clip: already installed on this engine")
    _refuse_unsupported(engine)
    stage = engine.zero_optimization_stage()
    precision = "fp16" if engine.fp16_enabled() else "bf16" if engine.bfloat16_enabled() else "fp32"
    shape = dict(stage=stage, precision=precision, bucket_clip=True, lamb=False)
    ds_compat.check_release(ds_compat.needed_hooks(**shape, accumulation=engine.gradient_accumulation_steps()))
    if stage == 0:
        from .zero0 import ZeroStage0BucketClip

        adapter = ZeroStage0BucketClip(engine, cfg)
        num_buckets = len(adapter.buckets)
    else:
        if not isinstance(engine.optimizer, ds_compat.zero_optimizer_class()):
            raise ConfigError(
                f"bucket_clip: ZeRO stage {stage} is running {type(engine.optimizer).__name__}, "
                "not DeepSpeedZeroOptimizer; bucket_clip cannot hook it"
            )
        from .zero12 import ZeroStage12BucketClip

        adapter = ZeroStage12BucketClip(engine, cfg)
        num_buckets = adapter.num_buckets
    engine.bucket_clip = adapter
    print0(
        f"bucket_clip: ZeRO stage {stage}, {num_buckets} buckets of <= {cfg.bucket_size} elements, "
        f"{cfg.threshold} thresholds, each rank's local gradient clipped to norm {cfg.max_norm} before allreduce"
    )
    return adapter
