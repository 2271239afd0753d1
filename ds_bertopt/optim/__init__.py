"""Optimizers and LR schedules.

Foundation version: AdamW with the usual no-decay groups and warmup + polynomial decay.
The large-batch work (LAMB, ZeRO layer-wise trust ratio, LR scaling) extends this module.
"""
from __future__ import annotations

import math

import torch

from .config import OptimizerConfig, ScheduleConfig

NO_DECAY_SUFFIXES = ("bias", "LayerNorm.weight", "layernorm.weight", "layer_norm.weight", "norm.weight")


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: decayed weights, and biases + LayerNorm weights without decay."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim < 2 or name.endswith(NO_DECAY_SUFFIXES) else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(model: torch.nn.Module, cfg: OptimizerConfig, *, lr: float) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg.weight_decay)
    return torch.optim.AdamW(groups, lr=lr, betas=cfg.betas, eps=cfg.eps)


def lr_multiplier(step: int, cfg: ScheduleConfig, max_steps: int) -> float:
    """Pure ``step → multiplier of the peak LR``."""
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else int(cfg.warmup_fraction * max_steps)
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if cfg.type == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    end = cfg.end_lr_ratio
    if cfg.type == "cosine":
        return end + (1.0 - end) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return end + (1.0 - end) * (1.0 - progress) ** cfg.power


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: ScheduleConfig, *, max_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, cfg, max_steps))


def build(model: torch.nn.Module, bertopt, *, global_batch: int, zero_stage: int):
    """Optimizer and LR scheduler for ``model`` from the ``"bertopt"`` section.

    The single entry point the training loops call; returns ``(optimizer, lr_scheduler)`` to pass
    to ``ds_bertopt.initialize(optimizer=..., lr_scheduler=...)``.
    """
    del global_batch, zero_stage  # used by LR scaling and LAMB (large-batch work)
    optimizer = build_optimizer(model, bertopt.optimizer, lr=bertopt.optimizer.lr)
    scheduler = build_lr_scheduler(optimizer, bertopt.schedule, max_steps=bertopt.train.max_steps)
    return optimizer, scheduler
