"""Config of the optimizers and LR schedules (``"bertopt": {"optimizer": ..., "schedule": ...}``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from ..errors import check


@dataclass(frozen=True)
class OptimizerConfig:
    type: Literal["adamw", "lamb"] = "adamw"
    """``adamw`` (torch's, fused/foreach) or ``lamb`` (layer-wise trust ratio, ZeRO 0/1/2)."""
    lr: float = 1e-3
    """Peak learning rate at ``schedule.reference_batch`` (scaled to the actual batch if set)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam moment decay rates."""
    eps: float = 1e-6
    """Adam epsilon."""
    weight_decay: float = 0.01
    """Decoupled weight decay; biases and LayerNorm weights are excluded."""

    def validate(self) -> None:
        check(self.lr > 0, f"lr: must be positive, got {self.lr}")
        check(all(0.0 <= b < 1.0 for b in self.betas), f"betas: must be in [0, 1), got {list(self.betas)}")
        check(self.eps > 0, f"eps: must be positive, got {self.eps}")
        check(self.weight_decay >= 0, f"weight_decay: must be >= 0, got {self.weight_decay}")


@dataclass(frozen=True)
class ScheduleConfig:
    type: Literal["poly", "cosine", "constant"] = "poly"
    """``poly``: linear warmup then polynomial decay; ``cosine``: linear warmup then cosine."""
    warmup_fraction: float = 0.1
    """Warmup length as a fraction of ``train.max_steps`` (ignored when ``warmup_steps`` is set)."""
    warmup_steps: Optional[int] = None
    """Warmup length in steps."""
    power: float = 1.0
    """Exponent of the polynomial decay (1.0 = linear)."""
    end_lr_ratio: float = 0.0
    """Final LR as a fraction of the peak LR."""

    def validate(self) -> None:
        check(0.0 <= self.warmup_fraction < 1.0, f"warmup_fraction: must be in [0, 1), got {self.warmup_fraction}")
        check(self.warmup_steps is None or self.warmup_steps >= 0,
              f"warmup_steps: must be >= 0, got {self.warmup_steps}")
        check(self.power > 0, f"power: must be positive, got {self.power}")
        check(0.0 <= self.end_lr_ratio <= 1.0, f"end_lr_ratio: must be in [0, 1], got {self.end_lr_ratio}")
