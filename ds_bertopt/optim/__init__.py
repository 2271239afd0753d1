"""Large-batch optimizers and LR schedules: LAMB (layer-wise, also under ZeRO 1/2) and AdamW.

The entry point the training loops call is :func:`build`; it returns ``(optimizer, lr_scheduler)``
for ``ds_bertopt.engine.initialize(optimizer=..., lr_scheduler=...)``, which attaches LAMB to the
engine so ZeRO 1/2 keep its trust ratio per layer (:mod:`ds_bertopt.optim.zero`).

* :mod:`.lamb` — the LAMB math (pure functions) and the ``Lamb`` optimizer;
* :mod:`.schedule` — ``lr_multiplier(step, cfg, max_steps)``, LR scaling, the torch scheduler;
* :mod:`.zero` — DeepSpeed glue: fragment layouts from ``_hp_mapping``.
"""

from __future__ import annotations

import math
import os
from typing import Optional

import torch

from ..errors import ConfigError
from ..log import print0
from .config import OptimizerConfig, ScheduleConfig
from .lamb import Lamb, describe_lamb
from .schedule import WarmupDecayLR, build_lr_scheduler, describe_lr, lr_multiplier, scale_lr, warmup_length
from .zero import refuse_lamb_under_zero3

__all__ = [
    "build",
    "build_optimizer",
    "build_lr_scheduler",
    "param_groups",
    "lr_multiplier",
    "scale_lr",
    "warmup_length",
    "Lamb",
    "WarmupDecayLR",
    "OptimizerConfig",
    "ScheduleConfig",
    "refuse_lamb_under_zero3",
]

NO_DECAY_SUFFIXES = ("bias", "LayerNorm.weight", "layernorm.weight", "layer_norm.weight", "norm.weight")


def is_no_decay(name: str, param: torch.Tensor) -> bool:
    """Biases, LayerNorm weights and every other 1-D parameter take no weight decay."""
    return param.ndim < 2 or name.endswith(NO_DECAY_SUFFIXES)


def param_groups(
    model: torch.nn.Module,
    weight_decay: float,
    *,
    decay_extra: Optional[dict] = None,
    no_decay_extra: Optional[dict] = None,
) -> list[dict]:
    """Decayed weights, then biases + LayerNorm weights without decay; empty groups are left out
    (DeepSpeed drops them, which would desynchronise a scheduler built on the groups)."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if is_no_decay(name, param) else decay).append(param)
    groups = []
    if decay:
        groups.append({"params": decay, "weight_decay": weight_decay, **(decay_extra or {})})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0, **(no_decay_extra or {})})
    if not groups:
        raise ConfigError("optimizer: the model has no trainable parameters")
    return groups


def apex_fused_lamb():
    """``apex.optimizers.FusedLAMB`` when apex is importable and a GPU is present, else None."""
    if not torch.cuda.is_available():
        return None
    try:
        from apex.optimizers import FusedLAMB
    except Exception:  # noqa: BLE001 - apex missing or built without its CUDA extensions
        return None
    return FusedLAMB


APEX_NO_CLIP = math.inf
"""The ``max_grad_norm`` that makes apex ``FusedLAMB`` clip nothing. Its kernel (NVIDIA/apex
``csrc/multi_tensor_lamb.cu``, ``LAMBStage1Functor``) divides every gradient by
``norm > max_grad_norm ? norm / max_grad_norm : 1``, with ``norm`` the global gradient norm ``FusedLAMB.step``
computes over all groups, and ``max_grad_norm`` read from ``defaults`` only. With 0 (our "off") any nonzero norm
gives ``norm / 0 = inf`` and every gradient becomes 0: the moments stay 0 and weight decay alone moves the weights.
With +inf the comparison is false for every norm, finite, inf or NaN: the factor is exactly 1."""


def apex_max_grad_norm(max_grad_norm: float) -> float:
    """apex ``FusedLAMB``'s bound for our ``max_grad_norm`` (0 means no clipping: :data:`APEX_NO_CLIP`)."""
    return max_grad_norm if max_grad_norm > 0 else APEX_NO_CLIP


def _apex_problem(cfg: OptimizerConfig, zero_stage: int) -> Optional[str]:
    """Why apex ``FusedLAMB`` cannot take ours' steps here (None: it can)."""
    if zero_stage > 0:
        return f"apex FusedLAMB sees ZeRO {zero_stage} shards, not layers; it runs at ZeRO 0 only"
    if cfg.min_trust_ratio is not None or cfg.max_trust_ratio is not None:
        return "apex FusedLAMB has no trust-ratio clamps"
    if cfg.weight_decay == 0 and not cfg.adapt_no_decay:
        # LAMBStage2Functor: the trust ratio only where `use_nvlamb || decay != 0`; ours takes it on every decay group
        return "apex FusedLAMB takes no trust ratio in a group without weight decay (weight_decay is 0)"
    return None


def _training_device(model: torch.nn.Module) -> torch.device:
    """Where ``deepspeed.initialize`` will put the model: ``get_accelerator().device_name(local_rank)``
    (``DeepSpeedEngine._set_distributed_vars``, then ``_configure_distributed_model``'s ``module.to``), the local
    rank being the launcher's ``LOCAL_RANK``."""
    try:
        from deepspeed.accelerator import get_accelerator
    except ImportError:  # outside DeepSpeed the model stays where it is
        return next(model.parameters()).device
    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu":
        return torch.device("cpu")
    return torch.device(accelerator.device_name(int(os.environ.get("LOCAL_RANK", "0") or 0)))


def _build_apex_lamb(fused, model: torch.nn.Module, cfg: OptimizerConfig, *, lr: float, max_grad_norm: float):
    """apex ``FusedLAMB`` over ``model``, built where the model trains. ``FusedLAMB.__init__`` puts its overflow
    buffer on the device of the first parameter (``_dummy_overflow_buf``), which every ``multi_tensor_applier`` call
    of its step passes with the tensors: built before ``deepspeed.initialize`` moves the model, it stayed on the
    CPU. So the model is placed first, on the device the engine would place it (the engine's own move is then a
    no-op and keeps the same ``Parameter`` objects, ``nn.Module._apply``)."""
    model.to(_training_device(model))
    groups = param_groups(model, cfg.weight_decay)
    bound = apex_max_grad_norm(max_grad_norm)
    print0(
        f'LAMB: apex FusedLAMB (found on this GPU machine; set optimizer.implementation "ours" to force ours), '
        f"{f'global-norm clip {bound:g}' if math.isfinite(bound) else 'no clipping (max_grad_norm inf)'}"
    )
    return fused(groups, **apex_lamb_arguments(cfg, lr=lr, bound=bound))


def apex_lamb_arguments(cfg: OptimizerConfig, *, lr: float, bound: float) -> dict:
    """``FusedLAMB``'s keyword arguments for ``cfg`` at ``lr`` with clipping ``bound`` (see :func:`apex_max_grad_norm`);
    its defaults otherwise (decoupled decay ``adam_w_mode``, ``grad_averaging``: our LAMB's)."""
    return dict(
        lr=lr,
        bias_correction=cfg.bias_correction,
        betas=cfg.betas,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        max_grad_norm=bound,
        use_nvlamb=cfg.adapt_no_decay,
    )


def _build_lamb(
    model: torch.nn.Module, cfg: OptimizerConfig, *, lr: float, zero_stage: int, bucket_clip: bool
) -> torch.optim.Optimizer:
    refuse_lamb_under_zero3(zero_stage)
    max_grad_norm = cfg.max_grad_norm
    if bucket_clip and max_grad_norm > 0:
        print0(f"bucket_clip is on: LAMB's own global-norm clipping (max_grad_norm {max_grad_norm:g}) is off")
        max_grad_norm = 0.0
    fused = apex_fused_lamb() if cfg.implementation in ("auto", "apex") else None
    problem = _apex_problem(cfg, zero_stage)
    if cfg.implementation == "apex" and (fused is None or problem):
        why = "apex.optimizers.FusedLAMB is not importable on a GPU here" if fused is None else problem
        raise ConfigError(f'optimizer.implementation: "apex" requested but {why}; use "auto" or "ours"')
    if fused is not None and problem is None:
        return _build_apex_lamb(fused, model, cfg, lr=lr, max_grad_norm=max_grad_norm)
    if fused is not None:
        print0(f"LAMB: apex FusedLAMB found but not used ({problem}); using ours")
    groups = param_groups(
        model, cfg.weight_decay, decay_extra={"adapt": True}, no_decay_extra={"adapt": cfg.adapt_no_decay}
    )
    optimizer = Lamb(
        groups,
        lr=lr,
        betas=cfg.betas,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        bias_correction=cfg.bias_correction,
        min_trust_ratio=cfg.min_trust_ratio,
        max_trust_ratio=cfg.max_trust_ratio,
        max_grad_norm=max_grad_norm,
    )
    print0(describe_lamb(optimizer))
    return optimizer


def _target_device_type(model: torch.nn.Module) -> str:
    """Where the model will train: the optimizer is built before ``deepspeed.initialize`` moves the model to
    the accelerator, so the parameters' current device says nothing (:func:`_training_device` does)."""
    return _training_device(model).type


def _deepspeed_fused_adam(groups: list[dict], cfg: OptimizerConfig, lr: float):
    from deepspeed.ops.adam import FusedAdam

    return FusedAdam(groups, lr=lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, adam_w_mode=True)


def _deepspeed_cpu_adam(groups: list[dict], cfg: OptimizerConfig, lr: float):
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam(groups, lr=lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, adamw_mode=True)


def _build_offloaded_adamw(groups: list[dict], cfg: OptimizerConfig, *, lr: float) -> torch.optim.Optimizer:
    """ZeRO-Offload steps the fp32 partitions on the host: a GPU kernel (FusedAdam) cannot run there, and DeepSpeed
    refuses any client optimizer but its ``DeepSpeedCPUAdam`` unless told otherwise
    (``DeepSpeedEngine._configure_optimizer``: ``zero_force_ds_cpu_optimizer``, which ``engine.initialize`` turns
    off for torch's). ``auto``/``torch``: torch's fused CPU AdamW (no JIT build on the nodes); ``deepspeed``:
    ``DeepSpeedCPUAdam`` (JIT-built once per node)."""
    if cfg.implementation == "deepspeed":
        try:
            optimizer = _deepspeed_cpu_adam(groups, cfg, lr)
        except Exception as exc:  # noqa: BLE001 - the op is JIT-built; any build failure lands here
            raise ConfigError(
                f"optimizer.implementation: DeepSpeedCPUAdam (for ZeRO-Offload) could not be built: "
                f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            ) from None
        print0("AdamW: DeepSpeedCPUAdam on the host (ZeRO-Offload)")
        return optimizer
    print0("AdamW: torch fused, on the host (ZeRO-Offload steps the fp32 partitions there)")
    return torch.optim.AdamW(groups, lr=lr, betas=cfg.betas, eps=cfg.eps, fused=True)


def _build_adamw(model: torch.nn.Module, cfg: OptimizerConfig, *, lr: float, offload: bool) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg.weight_decay)
    if offload:
        return _build_offloaded_adamw(groups, cfg, lr=lr)
    device_type = _target_device_type(model)
    want_deepspeed = cfg.implementation == "deepspeed" or (cfg.implementation == "auto" and device_type == "cuda")
    if want_deepspeed:
        try:
            optimizer = _deepspeed_fused_adam(groups, cfg, lr)
            print0("AdamW: DeepSpeed FusedAdam")
            return optimizer
        except Exception as exc:  # noqa: BLE001 - the op is JIT-built; any build failure lands here
            if cfg.implementation == "deepspeed":
                raise ConfigError(
                    f"optimizer.implementation: DeepSpeed FusedAdam could not be built: "
                    f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                ) from None
            print0(f"AdamW: DeepSpeed FusedAdam did not build ({type(exc).__name__}); using torch's")
    # torch's fused kernel exists for CPU and CUDA since 2.4; foreach elsewhere.
    fused = device_type in ("cpu", "cuda")
    optimizer = torch.optim.AdamW(
        groups, lr=lr, betas=cfg.betas, eps=cfg.eps, fused=fused or None, foreach=None if fused else True
    )
    print0(f"AdamW: torch ({'fused' if fused else 'foreach'})")
    return optimizer


def build_optimizer(
    model: torch.nn.Module,
    cfg: OptimizerConfig,
    *,
    lr: float,
    zero_stage: int = 0,
    bucket_clip: bool = False,
    offload: bool = False,
) -> torch.optim.Optimizer:
    """The optimizer ``cfg`` asks for over ``model``'s decay / no-decay groups, at peak ``lr``; ``offload``:
    ZeRO-Offload steps it on the host."""
    if cfg.type == "lamb":
        if offload:  # also refused by the pre-flight (engine.check_combinations), for callers that skip it
            raise ConfigError(LAMB_OFFLOAD_REFUSAL)
        return _build_lamb(model, cfg, lr=lr, zero_stage=zero_stage, bucket_clip=bucket_clip)
    return _build_adamw(model, cfg, lr=lr, offload=offload)


LAMB_OFFLOAD_REFUSAL = (
    'optimizer.type: "lamb" is not supported with zero_optimization.offload_optimizer (its per-layer norms are '
    'all-reduced from host memory, which NCCL cannot do); drop offload_optimizer, or use type "adamw"'
)


def build(model: torch.nn.Module, bertopt, *, global_batch: int, zero_stage: int, offload: bool = False):
    """Optimizer and LR scheduler for ``model`` from the ``"bertopt"`` section.

    The single entry point the training loops call; returns ``(optimizer, lr_scheduler)`` to pass
    to ``ds_bertopt.engine.initialize(optimizer=..., lr_scheduler=...)``. ``global_batch`` is the
    number of sequences per optimizer step (DeepSpeed's ``train_batch_size``); ``offload``: DeepSpeed's part has
    ZeRO-Offload of the optimizer (``ds_bertopt.dsconfig.optimizer_offload``).
    """
    if global_batch <= 0:
        raise ConfigError(f"train_batch_size: must be positive, got {global_batch}")
    ocfg, scfg = bertopt.optimizer, bertopt.schedule
    lr = scale_lr(ocfg.lr, global_batch, scfg)
    print0(f"optimizer {ocfg.type}: {describe_lr(ocfg.lr, global_batch, scfg)}")
    optimizer = build_optimizer(
        model, ocfg, lr=lr, zero_stage=zero_stage, bucket_clip=bertopt.bucket_clip.enabled, offload=offload
    )
    if bertopt.train.max_steps is None:
        raise ConfigError(
            "train.max_steps: the learning-rate schedule needs the run's length in steps (the training "
            "loop resolves it from train.epochs; set it when building the optimizer yourself)"
        )
    scheduler = build_lr_scheduler(optimizer, scfg, max_steps=bertopt.train.max_steps)
    return optimizer, scheduler
