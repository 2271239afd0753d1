"""Skip optimizer steps whose gradients are not finite, for every precision and ZeRO stage.

DeepSpeed already skips on overflow with fp16 (loss scaler) and, from 0.17, bf16
(``bf16.check_grad_overflow``, default on). With fp32 it does not check at all, so:

* ZeRO 1/2/3: turn on the ZeRO optimizer's own ``check_grad_overflow`` (its ``step()`` then
  all-reduces an overflow flag and skips, ``DeepSpeedZeroOptimizer.step``); 0.16, which has no such switch, gets
  its ``check_overflow`` called before each step (hook ``zero.overflow_check`` in :mod:`ds_bertopt.compat.deepspeed`);
* ZeRO 0: guard the client optimizer's ``step`` — gradients are already averaged over ranks
  there, so every rank reaches the same verdict — and expose ``overflow``, which
  ``DeepSpeedEngine._take_model_step`` reads to skip the LR-scheduler step and count the skip.

The loop reads ``engine.was_step_applied()`` after each optimizer step.
"""

from __future__ import annotations

import torch

from .compat.deepspeed import enable_zero_overflow_check, set_step_overflow, wrapper_overflow_skip


def _all_finite(optimizer) -> bool:
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not grads:
        return True
    return bool(torch.stack(torch._foreach_norm(grads)).isfinite().all())


def guard_optimizer_step(optimizer) -> None:
    """Wrap ``optimizer.step`` so non-finite gradients skip the update and set ``optimizer.overflow``."""
    if getattr(optimizer, "_ds_bertopt_guarded", False):
        return
    original = optimizer.step

    def step(*args, **kwargs):
        overflow = not _all_finite(optimizer)
        set_step_overflow(optimizer, overflow)
        if overflow:
            return None
        return original(*args, **kwargs)

    set_step_overflow(optimizer, False)
    optimizer.step = step
    optimizer._ds_bertopt_guarded = True


def install_nonfinite_guard(engine) -> str:
    """Make ``engine.step()`` skip non-finite steps; returns a description for the log."""
    opt = engine.optimizer
    if engine.fp16_enabled():
        return "fp16: DeepSpeed's loss scaler skips overflowing steps"
    how = enable_zero_overflow_check(opt)
    if how:
        return f"{type(opt).__name__}: {how}"
    how = wrapper_overflow_skip(opt)  # DeepSpeed's fp16/bf16 wrapper at ZeRO 0 checks by itself
    if how:
        return f"{type(opt).__name__}: {how}"
    guard_optimizer_step(opt)
    return f"{type(opt).__name__}: ds_bertopt finite-gradient guard"
