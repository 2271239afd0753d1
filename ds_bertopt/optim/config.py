"""Config of the optimizers and LR schedules (``"bertopt": {"optimizer": ..., "schedule": ...}``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from ..errors import check

LAMB_IMPLEMENTATIONS = ("auto", "ours", "apex")
ADAM_IMPLEMENTATIONS = ("auto", "torch", "deepspeed")


@dataclass(frozen=True)
class OptimizerConfig:
    type: Literal["adamw", "lamb"] = "adamw"
    """``adamw`` (torch's fused/foreach, or DeepSpeed's ``FusedAdam``) or ``lamb`` (layer-wise trust
    ratio, also under ZeRO 1/2)."""
    lr: float = 1e-3
    """Peak learning rate; tuned at ``schedule.reference_batch`` when ``schedule.scaling`` is set
    (then scaled to the actual global batch)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam moment decay rates."""
    eps: float = 1e-6
    """Adam epsilon (added to √v̂)."""
    weight_decay: float = 0.01
    """Decoupled weight decay; biases and LayerNorm weights are excluded."""
    bias_correction: bool = True
    """LAMB only: divide the moments by 1 − βᵗ (MLPerf's TF reference LAMB does not; apex does)."""
    max_grad_norm: float = 1.0
    """LAMB only: clip the global gradient norm to this before the moments (0 turns it off). Turned
    off when ``bucket_clip.enabled`` (the hook bounds the norm) or when DeepSpeed's
    ``gradient_clipping`` is set (DeepSpeed then clips)."""
    min_trust_ratio: Optional[float] = None
    """LAMB only: lower clamp of the trust ratio ‖w‖/‖update‖ (none by default)."""
    max_trust_ratio: Optional[float] = None
    """LAMB only: upper clamp of the trust ratio (none by default; some recipes use 10)."""
    adapt_no_decay: bool = False
    """LAMB only: also apply the trust ratio to biases and LayerNorm weights (NVLAMB, apex's
    ``use_nvlamb``). Off: they take plain Adam steps, as in MLPerf's reference and apex's default."""
    implementation: Literal["auto", "ours", "apex", "torch", "deepspeed"] = "auto"
    """LAMB: ``auto`` uses apex ``FusedLAMB`` when importable on a GPU at ZeRO 0 (logged), else
    ours; ``ours`` forces ours; ``apex`` requires apex. AdamW: ``auto`` uses DeepSpeed's
    ``FusedAdam`` on GPU when it builds, torch's fused AdamW otherwise; ``torch`` / ``deepspeed``
    force one."""

    def dead_fields(self) -> dict[str, str]:
        """The LAMB-only fields under AdamW (``ds_bertopt.optim.build``)."""
        if self.type == "lamb":
            return {}
        lamb_only = ("bias_correction", "max_grad_norm", "min_trust_ratio", "max_trust_ratio", "adapt_no_decay")
        return {name: 'LAMB only, and type is "adamw"' for name in lamb_only}

    def __post_init__(self) -> None:
        check(self.lr > 0, f"lr: must be positive, got {self.lr}")
        check(all(0.0 <= b < 1.0 for b in self.betas), f"betas: must be in [0, 1), got {list(self.betas)}")
        check(self.eps > 0, f"eps: must be positive, got {self.eps}")
        check(self.weight_decay >= 0, f"weight_decay: must be >= 0, got {self.weight_decay}")
        check(self.max_grad_norm >= 0, f"max_grad_norm: must be >= 0, got {self.max_grad_norm}")
        for name in ("min_trust_ratio", "max_trust_ratio"):
            value = getattr(self, name)
            check(value is None or value > 0, f"{name}: must be positive, got {value}")
        check(
            self.min_trust_ratio is None
            or self.max_trust_ratio is None
            or self.min_trust_ratio <= self.max_trust_ratio,
            f"min_trust_ratio: {self.min_trust_ratio} exceeds max_trust_ratio {self.max_trust_ratio}",
        )
        allowed = LAMB_IMPLEMENTATIONS if self.type == "lamb" else ADAM_IMPLEMENTATIONS
        check(
            self.implementation in allowed,
            f"implementation: {self.implementation!r} is not one for type {self.type!r}; "
            f"use one of {', '.join(allowed)}",
        )
        if self.type == "adamw":
            check(self.bias_correction, 'bias_correction: false is only supported with type "lamb"')
            for name in ("min_trust_ratio", "max_trust_ratio"):
                check(getattr(self, name) is None, f'{name}: only applies to type "lamb"')
            check(not self.adapt_no_decay, 'adapt_no_decay: only applies to type "lamb"')


@dataclass(frozen=True)
class ScheduleConfig:
    type: Literal["poly", "cosine", "constant"] = "poly"
    """``poly``: linear warmup then polynomial decay; ``cosine``: linear warmup then cosine decay;
    ``constant``: linear warmup then the peak LR."""
    warmup_fraction: float = 0.1
    """Warmup length as a fraction of ``train.max_steps`` (ignored when ``warmup_steps`` is set)."""
    warmup_steps: Optional[int] = None
    """Warmup length in optimizer steps."""
    start_warmup_step: int = 0
    """MLPerf's offset: the warmup ramp is read at ``step − start_warmup_step``, so a negative value
    starts part-way up the ramp (NVIDIA's MLPerf BERT configs use e.g. −25 with 100 warmup steps)."""
    power: float = 1.0
    """Exponent of the polynomial decay (1.0 = linear; MLPerf BERT logs it as
    ``opt_lamb_learning_rate_decay_poly_power``)."""
    end_lr_ratio: float = 0.0
    """LR at the end of the decay, as a fraction of the peak LR."""
    decay_steps: Optional[int] = None
    """Step at which the decay reaches ``end_lr_ratio`` (default ``train.max_steps``; MLPerf's
    ``opt_learning_rate_training_steps``)."""
    decay_from: Literal["warmup_end", "step0"] = "warmup_end"
    """Where the decay's progress is measured from: the end of warmup, or step 0 as in MLPerf's
    reference (``polynomial_decay(global_step)``, the warmup overriding it while it lasts)."""
    scaling: Literal["none", "linear", "sqrt"] = "none"
    """Scale ``optimizer.lr`` from ``reference_batch`` to the actual global batch: ``linear``
    (lr × B/B_ref, Goyal et al.) or ``sqrt`` (lr × √(B/B_ref), the LAMB paper's rule)."""
    reference_batch: Optional[int] = None
    """Global batch (sequences per optimizer step) at which ``optimizer.lr`` was tuned."""

    def dead_fields(self) -> dict[str, str]:
        """Fields the schedule (``ds_bertopt.optim.schedule.lr_factor``) does not read under the rest of it."""
        dead = {}
        if self.warmup_steps is not None:
            dead["warmup_fraction"] = "warmup_steps is given"
        if self.type == "constant":
            for name in ("power", "end_lr_ratio", "decay_steps", "decay_from"):
                dead[name] = 'type "constant" does not decay'
        elif self.type == "cosine":
            dead["power"] = 'only type "poly" has a power'
        return dead

    def __post_init__(self) -> None:
        check(0.0 <= self.warmup_fraction < 1.0, f"warmup_fraction: must be in [0, 1), got {self.warmup_fraction}")
        check(
            self.warmup_steps is None or self.warmup_steps >= 0, f"warmup_steps: must be >= 0, got {self.warmup_steps}"
        )
        check(
            self.start_warmup_step <= 0,
            f"start_warmup_step: must be <= 0 (a negative offset starts part-way up the ramp), "
            f"got {self.start_warmup_step}",
        )
        check(self.power > 0, f"power: must be positive, got {self.power}")
        check(0.0 <= self.end_lr_ratio <= 1.0, f"end_lr_ratio: must be in [0, 1], got {self.end_lr_ratio}")
        check(
            self.decay_steps is None or self.decay_steps > 0, f"decay_steps: must be positive, got {self.decay_steps}"
        )
        check(
            self.reference_batch is None or self.reference_batch > 0,
            f"reference_batch: must be positive, got {self.reference_batch}",
        )
        check(
            (self.scaling == "none") == (self.reference_batch is None),
            f'reference_batch: set it exactly when scaling is not "none" (scaling is {self.scaling!r}, '
            f"reference_batch is {self.reference_batch})",
        )
