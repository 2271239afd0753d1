"""apex's ``FusedLAMB`` step on the CPU: the reference a GPU run's LAMB is checked against (tests and bench only).

Read from NVIDIA/apex (commit 6424da3b): ``apex/optimizers/fused_lamb.py`` (``FusedLAMB``) and
``csrc/multi_tensor_lamb.cu`` (``multi_tensor_lamb_cuda``, ``LAMBStage1Functor``, ``LAMBStage2Functor``); the
comments below give the line each step comes from. The kernel computes in fp32 (``using MATH_T = float``).

* :func:`apex_lamb_step` — one group's kernel call, a pure function (new tensors; its inputs untouched);
* :class:`FusedLAMB` — ``apex.optimizers.FusedLAMB`` with its kernel replaced by :func:`apex_lamb_step`: the same
  constructor, defaults and ``step`` (the global gradient norm over every group, ``max_grad_norm`` read from
  ``defaults``, one step counter per group), so ``ds_bertopt.optim`` and DeepSpeed handle it as the real class.
"""

from __future__ import annotations

import contextlib
import math
from typing import Sequence

import torch

F32 = torch.float32


def _f32(x: float) -> float:
    """A Python number as the kernel's ``const float`` argument holds it."""
    return float(torch.tensor(x, dtype=F32))


def apex_lamb_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    step: int,
    bias_correction: bool,
    weight_decay: float,
    grad_averaging: bool = True,
    adam_w_mode: bool = True,
    global_grad_norm: torch.Tensor,
    max_grad_norm: float,
    use_nvlamb: bool = False,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """``multi_tensor_lamb_cuda(.., [grads, params, exp_avgs, exp_avg_sqs], lr, beta1, beta2, eps, step,
    bias_correction, weight_decay, grad_averaging, mode, global_grad_norm, max_grad_norm, use_nvlamb)`` on one
    group: returns the new ``(params, exp_avgs, exp_avg_sqs)``, all fp32."""
    beta1, beta2, eps, lr, decay = (_f32(x) for x in (beta1, beta2, eps, lr, weight_decay))
    # multi_tensor_lamb.cu 281-285: std::pow(beta, step) of the float betas, stored as float
    bc1 = _f32(1 - math.pow(beta1, step)) if bias_correction else 1.0
    bc2 = _f32(1 - math.pow(beta2, step)) if bias_correction else 1.0
    # 288-289: beta3 = 1 - beta1 with grad averaging, else 1
    beta3 = _f32(1 - beta1) if grad_averaging else 1.0
    norm = global_grad_norm.to(F32).reshape(())
    # LAMBStage1Functor 53-54: clipped_global_grad_norm = norm > max ? norm / max : 1 (max = 0: norm / 0 = inf)
    max_norm = torch.tensor(_f32(max_grad_norm) if math.isfinite(max_grad_norm) else math.inf, dtype=F32)
    clipped = torch.where(norm > max_norm, norm / max_norm, torch.ones((), dtype=F32))
    new_params, new_m, new_v = [], [], []
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        p32, g32, m32, v32 = (t.detach().to(F32) for t in (p, g, m, v))
        # 90-93 / 144-148: with decay == 0 the kernel does not read p (r_p = 0)
        r_p = p32 if decay != 0 else torch.zeros_like(p32)
        scaled_grad = g32 / clipped  # 101, 111, 161, 171
        if not adam_w_mode:  # MOMENT_MODE_0, 103: L2 on the scaled gradient
            scaled_grad = scaled_grad + decay * r_p
        m_next = m32 * beta1 + beta3 * scaled_grad  # 104 / 112
        v_next = v32 * beta2 + (1 - beta2) * scaled_grad * scaled_grad  # 105 / 113
        denom = torch.sqrt(v_next / bc2) + eps  # 106-108 / 114-116: next_m_unbiased / (sqrtf(next_v_unbiased) + eps)
        update = (m_next / bc1) / denom
        if adam_w_mode:  # MOMENT_MODE_1, 117: + decay * p (decoupled)
            update = update + decay * r_p
        # 295: per-tensor norm of the params before the update; 308: of the updates (multi_tensor_l2norm, fp32)
        param_norm, update_norm = torch.linalg.vector_norm(p32), torch.linalg.vector_norm(update)
        # LAMBStage2Functor 210-217: lr * (‖p‖ / ‖u‖) where use_nvlamb or decay != 0 and both norms nonzero, else lr
        ratio = torch.tensor(lr, dtype=F32)
        if use_nvlamb or decay != 0:
            ratio = torch.where((update_norm != 0) & (param_norm != 0), lr * (param_norm / update_norm), ratio)
        new_params.append(p32 - ratio * update)  # 237 / 255: p = p - ratio * update
        new_m.append(m_next)
        new_v.append(v_next)
    return new_params, new_m, new_v


def global_grad_norm(grads_fp32: Sequence[torch.Tensor], grads_fp16: Sequence[torch.Tensor] = ()) -> torch.Tensor:
    """``FusedLAMB.step`` 139-159: the L2 norms of the fp32 and fp16 gradients (zeros when absent) blended by one more
    L2 norm."""
    norms = []
    for grads in (grads_fp32, grads_fp16):
        flat = [g.detach().to(F32).reshape(-1) for g in grads]
        norms.append(torch.linalg.vector_norm(torch.cat(flat)) if flat else torch.zeros((), dtype=F32))
    return torch.linalg.vector_norm(torch.stack(norms))


class FusedLAMB(torch.optim.Optimizer):
    """``apex.optimizers.FusedLAMB`` (``fused_lamb.py``) with its kernel done by :func:`apex_lamb_step` on the CPU."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01,
                 amsgrad=False, adam_w_mode=True, grad_averaging=True, set_grad_none=True, max_grad_norm=1.0,
                 use_nvlamb=False):  # fmt: skip  # noqa: ARG002 - amsgrad: refused by apex too (78-79)
        if amsgrad:
            raise RuntimeError("FusedLAMB does not support the AMSGrad variant.")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay,
                        grad_averaging=grad_averaging, max_grad_norm=max_grad_norm)  # fmt: skip
        super().__init__(params, defaults)
        # 95-97: apex's overflow buffer lives on the first parameter's device, and goes with every kernel call
        self._dummy_overflow_buf = torch.tensor([0], dtype=torch.int, device=self.param_groups[0]["params"][0].device)
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.set_grad_none = set_grad_none
        self.use_nvlamb = use_nvlamb

    def zero_grad(self, set_to_none: bool = True):  # noqa: ARG002 - apex's own signature has no argument
        for group in self.param_groups:
            for p in group["params"]:
                if self.set_grad_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        held = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        for p in held:  # multi_tensor_apply's check: every tensor on the noop flag's device
            if p.device != self._dummy_overflow_buf.device:
                raise RuntimeError(
                    f"FusedLAMB: a parameter on {p.device}, the overflow buffer on {self._dummy_overflow_buf.device} "
                    "(built before the model was placed)"
                )
        if any(p.dtype not in (torch.float32, torch.float16) for p in held):
            raise RuntimeError("FusedLAMB only support fp16 and fp32.")  # 136, 205
        norm = global_grad_norm(
            [p.grad for p in held if p.dtype == torch.float32], [p.grad for p in held if p.dtype == torch.float16]
        )
        max_grad_norm = self.defaults["max_grad_norm"]  # 160: the constructor's, never a group's
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1  # 169-172: one counter per group
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                state = self.state[p]
                if len(state) == 0:  # 188-192
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
            for dtype in (torch.float16, torch.float32):  # 207-242: one kernel call per dtype
                same = [p for p in params if p.dtype == dtype]
                if not same:
                    continue
                states = [self.state[p] for p in same]
                new_p, new_m, new_v = apex_lamb_step(
                    same,
                    [p.grad for p in same],
                    [s["exp_avg"] for s in states],
                    [s["exp_avg_sq"] for s in states],
                    lr=group["lr"],
                    beta1=group["betas"][0],
                    beta2=group["betas"][1],
                    eps=group["eps"],
                    step=group["step"],
                    bias_correction=group["bias_correction"],
                    weight_decay=group["weight_decay"],
                    grad_averaging=group["grad_averaging"],
                    adam_w_mode=bool(self.adam_w_mode),
                    global_grad_norm=norm,
                    max_grad_norm=max_grad_norm,
                    use_nvlamb=self.use_nvlamb,
                )
                for p, s, p_new, m_new, v_new in zip(same, states, new_p, new_m, new_v):
                    p.copy_(p_new)
                    s["exp_avg"].copy_(m_new)
                    s["exp_avg_sq"].copy_(v_new)
        return loss


# --- apex's step against ours (tests/test_apex_lamb.py on the CPU, bench/gpucheck on CUDA with the real apex) ------
def tiny_model() -> torch.nn.Module:
    """Decayed matrices and an embedding, biases and a LayerNorm without decay."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(50, 16), torch.nn.Linear(16, 24), torch.nn.LayerNorm(24), torch.nn.Linear(24, 8)
    )


def gradients(model: torch.nn.Module, step: int, scale: float = 3.0) -> list[torch.Tensor]:
    """Step ``step``'s gradients (CPU, seeded): global norm well above 1, so that any clipping would show."""
    gen = torch.Generator().manual_seed(step)
    return [scale * torch.randn(p.shape, generator=gen) for p in model.parameters()]


def _train(model: torch.nn.Module, optimizer, steps: int) -> dict[str, torch.Tensor]:
    for step in range(steps):
        for p, g in zip(model.parameters(), gradients(model, step)):
            p.grad = g.to(p.device)
        optimizer.step()
    return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}


def lamb_runs(cfg, device: str, *, steps: int = 3) -> dict:
    """Weights after ``steps`` steps from the same model and gradients, by name: ``apex`` (apex's ``FusedLAMB`` as
    ``ds_bertopt.optim`` builds it for a run with bucket clipping on, on ``device``; on the CPU this module's
    :class:`FusedLAMB` stands in), ``ours`` (our ``Lamb`` on ``device``), ``reference`` (:class:`FusedLAMB` on the
    CPU with the bound ours gives apex), ``zero_bound`` (the same with the 0.0 bound), ``initial``; ``apex_device``:
    where apex's overflow buffer was put."""
    import dataclasses

    from ds_bertopt import optim

    from .gpu_paths import cuda_optimizer_choice

    def build(model, implementation: str):
        with cuda_optimizer_choice(apex=True) if device == "cpu" else contextlib.nullcontext():
            return optim.build_optimizer(
                model, dataclasses.replace(cfg, implementation=implementation), lr=cfg.lr, bucket_clip=True
            )

    out = {"initial": {n: p.detach().clone() for n, p in tiny_model().named_parameters()}}
    model = tiny_model()
    apex = build(model, "apex")  # placed on the training device by ds_bertopt.optim
    out["apex_device"] = str(apex._dummy_overflow_buf.device)
    out["apex"] = _train(model, apex, steps)
    model = tiny_model().to(device)
    out["ours"] = _train(model, build(model, "ours"), steps)
    for name, bound in (("reference", optim.apex_max_grad_norm(0.0)), ("zero_bound", 0.0)):
        model = tiny_model()
        groups = optim.param_groups(model, cfg.weight_decay)
        reference = FusedLAMB(groups, **optim.apex_lamb_arguments(cfg, lr=cfg.lr, bound=bound))
        out[name] = _train(model, reference, steps)
    return out


def max_relative_gap(a: dict, b: dict, initial: dict) -> float:
    """The largest difference between two runs' weights, relative to the largest update of ``b``."""
    gap = max(float((a[n] - b[n]).abs().max()) for n in b)
    update = max(float((b[n] - initial[n]).abs().max()) for n in b)
    return gap / update
