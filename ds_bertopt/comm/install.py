"""``install_bucket_clip(engine, cfg)``: pick the adapter for the engine's ZeRO stage and install it.

The adapters touch DeepSpeed internals (``zero0.py``: ``DeepSpeedEngine.allreduce_gradients``;
``zero12.py``: ``DeepSpeedZeroOptimizer.reduce_ipg_grads`` and its IPG buckets). They are checked
against DeepSpeed :data:`TESTED_DEEPSPEED` (pinned in setup.cfg); before installing, every
attribute they use is looked up and a missing one is an error naming it, never a silent fallback.
"""

from __future__ import annotations

from ..errors import ConfigError
from ..log import print0
from .config import BucketClipConfig, refuse_bucket_clip_under_zero3

TESTED_DEEPSPEED = "0.19.8"

# What each adapter reads or replaces; checked up front so a DeepSpeed upgrade fails at install.
ENGINE_API = (
    "allreduce_gradients",
    "is_gradient_accumulation_boundary",
    "inside_no_sync_ctxt",
    "enable_backward_allreduce",
    "communication_data_type",
    "gradient_average",
    "postscale_gradients",
    "gradient_predivide_factor",
    "fp16_enabled",
    "data_parallel_group",
    "zero_optimization_stage",
    "gradient_accumulation_steps",
    "gradient_clipping",
)
ZERO_OPTIMIZER_API = (
    "reduce_ipg_grads",
    "ipg_buckets",
    "reduce_bucket_size",
    "contiguous_gradients",
    "extra_large_param_to_reduce",
    "bit16_groups",
    "partition_gradients",
    "overlap_comm",
    "get_param_comm_dtype",
    "loss_scale",
    "gradient_average",
    "postscale_gradients",
    "gradient_predivide_factor",
    "_offload_gradient_safety_enabled",
    "dp_process_group",
)
IPG_BUCKET_API = ("buffer", "index", "elements", "grads", "params", "copy_streams", "ready_events")


def _require(obj, names, what: str) -> None:
    missing = [name for name in names if not hasattr(obj, name)]
    if missing:
        import deepspeed

        raise RuntimeError(
            f"bucket_clip: {what} of DeepSpeed {deepspeed.__version__} has no {', '.join(missing)}; "
            f"the adapter is written against DeepSpeed {TESTED_DEEPSPEED} (see ds_bertopt/comm)"
        )


def _refuse_unsupported(engine) -> None:
    stage = engine.zero_optimization_stage()
    refuse_bucket_clip_under_zero3(stage)
    if engine.gradient_clipping():
        raise ConfigError(
            f"bucket_clip: DeepSpeed gradient_clipping is {engine.gradient_clipping()}; set it to 0 "
            "(ds_bertopt.engine.initialize does) so gradients are not clipped twice"
        )
    for flag, why in (("pipeline_parallelism", "pipeline parallelism"), ("has_moe_layers", "MoE layers")):
        if getattr(engine, flag, False):
            raise ConfigError(f"bucket_clip: not supported with {why}")
    if getattr(engine, "sequence_parallel_size", 1) > 1:
        raise ConfigError("bucket_clip: not supported with sequence parallelism (sequence_parallel_size > 1)")
    if getattr(engine, "torch_autocast_z0_gradscaler", None) is not None:
        raise ConfigError(
            "bucket_clip: not supported with torch_autocast fp16 at ZeRO stage 0 "
            "(its GradScaler unscales after the allreduce); use DeepSpeed's fp16 or bf16"
        )
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    if isinstance(engine.optimizer, BF16_Optimizer):
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
    import deepspeed

    if getattr(engine, "bucket_clip", None) is not None:
        raise RuntimeError("bucket_clip: already installed on this engine")
    if deepspeed.__version__ != TESTED_DEEPSPEED:
        print0(f"bucket_clip: warning: tested with DeepSpeed {TESTED_DEEPSPEED}, running {deepspeed.__version__}")
    _require(engine, ENGINE_API, "DeepSpeedEngine")
    _refuse_unsupported(engine)
    stage = engine.zero_optimization_stage()
    if stage == 0:
        from .zero0 import ZeroStage0BucketClip

        adapter = ZeroStage0BucketClip(engine, cfg, engine.data_parallel_group)
        num_buckets = len(adapter.buckets)
    else:
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

        if not isinstance(engine.optimizer, DeepSpeedZeroOptimizer):
            raise ConfigError(
                f"bucket_clip: ZeRO stage {stage} is running {type(engine.optimizer).__name__}, "
                "not DeepSpeedZeroOptimizer; bucket_clip cannot hook it"
            )
        _require(engine.optimizer, ZERO_OPTIMIZER_API, "DeepSpeedZeroOptimizer")
        for bucket in engine.optimizer.ipg_buckets.values():
            _require(bucket, IPG_BUCKET_API, "DeepSpeedZeroOptimizer's IPG bucket")
        from .zero12 import ZeroStage12BucketClip

        adapter = ZeroStage12BucketClip(engine, cfg)
        num_buckets = adapter.num_buckets
    engine.bucket_clip = adapter
    print0(
        f"bucket_clip: ZeRO stage {stage}, {num_buckets} buckets of <= {cfg.bucket_size} elements, "
        f"{cfg.threshold} thresholds, each rank's local gradient clipped to norm {cfg.max_norm} before allreduce"
    )
    return adapter
