"""Config of the bucket-wise gradient clipping hook (``"bertopt": {"bucket_clip": {...}}``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..errors import ConfigError, check


@dataclass(frozen=True)
class BucketClipConfig:
    enabled: bool = False
    """Clip each gradient bucket on each rank before its allreduce (replaces DeepSpeed's
    ``gradient_clipping``, which is then set to 0). ZeRO stages 0, 1 and 2."""
    max_norm: float = 1.0
    """Bound on the norm of each rank's whole local gradient (the per-bucket thresholds' squares
    sum to ``max_norm**2``)."""
    bucket_size: int = 5_000_000
    """Elements per bucket. Stage 0: our buckets, filled in reverse parameter registration order.
    Stages 1/2: DeepSpeed's IPG buckets; ``zero_optimization.reduce_bucket_size`` is set to this."""
    threshold: Literal["uniform", "proportional"] = "uniform"
    """Per-bucket threshold: ``uniform`` τ_b = max_norm/√B (B buckets); ``proportional``
    τ_b = max_norm·√(n_b/n) (n_b elements in the bucket, n in all)."""
    eps: float = 1e-6
    """Added to the bucket norm before dividing."""

    def dead_fields(self) -> dict[str, str]:
        """Every setting of the hook is dead while it is off."""
        if self.enabled:
            return {}
        return {name: "bucket_clip.enabled is false" for name in ("max_norm", "bucket_size", "threshold", "eps")}

    def __post_init__(self) -> None:
        check(self.max_norm > 0, f"max_norm: must be positive, got {self.max_norm}")
        check(self.bucket_size > 0, f"bucket_size: must be positive, got {self.bucket_size}")
        check(self.eps >= 0, f"eps: must be >= 0, got {self.eps}")


def refuse_bucket_clip_under_zero3(stage: int) -> None:
    """The one place bucket clipping's ZeRO-3 refusal is decided (pre-flight, the HF integration, the install)."""
    if stage >= 3:
        raise ConfigError(
            f"bucket_clip: ZeRO stage {stage} is not supported (parameters are partitioned and "
            "reduced by DeepSpeed's stage-3 hooks); use zero_optimization.stage 0, 1 or 2, or set "
            "bucket_clip.enabled false"
        )
