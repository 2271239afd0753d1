"""Learning-rate schedules as a pure ``step → multiplier`` function, and batch-size LR scaling.

Step ``k`` (0-based) is the ``k``-th optimizer update; the LR it uses is
``peak_lr × lr_multiplier(k, cfg, max_steps)``. With ``W`` warmup steps and offset
``s₀ = start_warmup_step`` (≤ 0):

* warmup, while ``k − s₀ < W``: ``(k − s₀ + 1) / W`` — the first update already moves, the last
  warmup update is at the peak;
* then ``poly``: ``end + (1 − end)(1 − p)^power``, ``cosine``: ``end + (1 − end)(1 + cos πp)/2``,
  ``constant``: 1, with progress ``p = (k − k₀)/(N − k₀)`` clipped to [0, 1], ``N`` the decay
  steps and ``k₀`` the end of warmup (or 0 with ``decay_from: "step0"``, MLPerf's reference).

:class:`WarmupDecayLR` wraps the function as a torch ``LRScheduler`` for ``deepspeed.initialize``:
its checkpointed state is the step counter only; the shape comes from the config on resume.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import torch

from .config import ScheduleConfig


def warmup_length(cfg: ScheduleConfig, max_steps: int) -> int:
    """Warmup steps: ``warmup_steps`` when given, else ``warmup_fraction × max_steps``."""
    return cfg.warmup_steps if cfg.warmup_steps is not None else int(cfg.warmup_fraction * max_steps)


def lr_multiplier(step: int, cfg: ScheduleConfig, max_steps: int) -> float:
    """Pure ``step → multiplier of the peak LR`` (see the module docstring for the formula)."""
    warmup = warmup_length(cfg, max_steps)
    ramp = step - cfg.start_warmup_step
    if ramp < warmup:
        return (ramp + 1) / warmup
    if cfg.type == "constant":
        return 1.0
    decay_steps = cfg.decay_steps if cfg.decay_steps is not None else max_steps
    origin = max(0, warmup + cfg.start_warmup_step) if cfg.decay_from == "warmup_end" else 0
    progress = min(1.0, max(0.0, (step - origin) / max(1, decay_steps - origin)))
    end = cfg.end_lr_ratio
    if cfg.type == "cosine":
        return end + (1.0 - end) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return end + (1.0 - end) * (1.0 - progress) ** cfg.power


def scale_lr(lr: float, global_batch: int, cfg: ScheduleConfig) -> float:
    """``lr`` tuned at ``cfg.reference_batch``, scaled to ``global_batch`` by ``cfg.scaling``."""
    if cfg.scaling == "none":
        return lr
    factor = global_batch / cfg.reference_batch
    return lr * (factor if cfg.scaling == "linear" else math.sqrt(factor))


def describe_lr(lr: float, global_batch: int, cfg: ScheduleConfig) -> str:
    """One line naming the peak LR in use and how it was obtained."""
    scaled = scale_lr(lr, global_batch, cfg)
    if cfg.scaling == "none":
        return f"peak lr {scaled:.6g} at global batch {global_batch} (no batch scaling)"
    return (
        f"peak lr {scaled:.6g} at global batch {global_batch} = {lr:g} at reference batch "
        f"{cfg.reference_batch} scaled by the {cfg.scaling} rule"
    )


class WarmupDecayLR(torch.optim.lr_scheduler.LRScheduler):
    """``group["lr"] = initial_lr × multiplier(step)``; ``state_dict`` holds the counters only."""

    def __init__(self, optimizer: torch.optim.Optimizer, multiplier: Callable[[int], float], last_epoch: int = -1):
        self.multiplier = multiplier
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        factor = self.multiplier(self.last_epoch)
        return [base_lr * factor for base_lr in self.base_lrs]

    def state_dict(self) -> dict[str, Any]:
        # The function is rebuilt from the config; saving it would pickle code into checkpoints.
        return {k: v for k, v in super().state_dict().items() if k != "multiplier"}


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: ScheduleConfig, *, max_steps: int) -> WarmupDecayLR:
    return WarmupDecayLR(optimizer, functools.partial(lr_multiplier, cfg=cfg, max_steps=max_steps))
