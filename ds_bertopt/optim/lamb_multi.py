"""LAMB's moments and direction in one multi-tensor pass, on any device torch has a fused Adam kernel for: the step
LAMB takes on CUDA without apex (and on the CPU where the C kernel of :mod:`.lamb_kernel` does not apply).

torch's fused Adam kernel (``torch._fused_adam_``, behind ``torch.optim.Adam(fused=True)``; ``adam_math`` in
``aten/src/ATen/native/cuda/fused_adam_utils.cuh``, ``adam_fused_step_impl`` in ``native/cpu/FusedAdamKernel.cpp``)
advances m and v and, per element, computes ``param -= (lr / bc1) · m / (√v / √bc2 + ε)`` with ``bc = 1 − βᵗ`` from
per-tensor step tensors it reads on the device. Run on a buffer that holds ``λw``, with ``lr = −1`` and no weight
decay of its own, it leaves LAMB's direction there: ``u = λw + m̂/(√v̂ + ε)`` (the foreach path's
``λw + f·m/(√v + e)``, ``f = √bc2/bc1``, ``e = ε√bc2``: the same value, rounded in another order). The seven
elementwise passes of the foreach path (lerp, mul, addcmul, sqrt, add, mul, addcdiv) become two: ``λw`` and the
kernel. The clip factor ``c`` enters as the kernel's ``grad_scale = 1/c`` (a device tensor: nothing read on the
host); the kernel then writes the clipped gradients back into ``.grad``, as ``clip_grad_norm_`` would leave them.

Without bias correction the step tensors hold :data:`NO_CORRECTION_STEP`, where ``βᵗ`` is 0 in double for every
``β ≤ 1 − 1e-9``: the kernel's corrections are then exactly 1.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

Tensors = Sequence[torch.Tensor]

DEVICES = ("cuda", "cpu", "xpu", "mps", "hpu")
"""Device types with a ``torch._fused_adam_`` kernel (``torch.utils._foreach_utils``' fused-kernel devices)."""
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
"""What the kernel dispatches on (``AT_DISPATCH_FLOATING_TYPES_AND2(kHalf, kBFloat16, …)``)."""
NO_CORRECTION_STEP = 2.0**40
"""A step count whose ``βᵗ`` underflows to exactly 0 in double for ``β ≤ 1 − 1e-9`` (``(1 − 1e-9)^(2⁴⁰) ≈ e^-1100``),
exact in float32 (the CUDA kernel's step type) and in int64 (the CPU kernel's)."""
MAX_BETA_WITHOUT_CORRECTION = 1.0 - 1e-9


def unusable(tensors: tuple, betas: tuple[float, float], bias_correction: bool) -> Optional[str]:
    """Why the fused Adam kernel cannot take these ``(params, grads, exp_avgs, exp_avg_sqs)``; None when it can."""
    if not hasattr(torch, "_fused_adam_"):
        return f"torch {torch.__version__} has no fused Adam kernel"
    if not tensors[0]:
        return "no tensors"
    first = tensors[0][0]
    if first.device.type not in DEVICES or first.dtype not in DTYPES:
        return f"no fused Adam kernel for {first.dtype} on {first.device.type}"
    for group in tensors:
        for t in group:
            if t is None or t.device != first.device or t.dtype != first.dtype or not t.is_contiguous():
                return "it steps contiguous tensors of one device and dtype only"
    if not bias_correction and max(betas) > MAX_BETA_WITHOUT_CORRECTION:
        return f"without bias correction it needs betas <= 1 - 1e-9, got {list(betas)}"
    return None


def _step_tensors(steps: Sequence[int], bias_correction: bool, device: torch.device) -> list[torch.Tensor]:
    """One float32 step tensor per distinct step, filled on the device (``torch.full``: no copy from the host,
    which torch would wait for)."""
    made: dict = {}
    out = []
    for t in steps:
        value = float(t) if bias_correction else NO_CORRECTION_STEP
        if value not in made:
            made[value] = torch.full((), value, dtype=torch.float32, device=device)
        out.append(made[value])
    return out


def directions(
    params: Tensors,
    grads: Tensors,
    exp_avgs: Tensors,
    exp_avg_sqs: Tensors,
    steps: Sequence[int],
    *,
    grad_scale: Union[float, torch.Tensor] = 1.0,
    out: Optional[Tensors] = None,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    bias_correction: bool,
) -> list[torch.Tensor]:
    """Advance the moments in place with ``grad_scale × grad``; return ``u = m̂/(√v̂ + ε) + λw`` per tensor (two
    multi-tensor kernels; see the module docstring). ``out``: buffers shaped like ``params`` to hold ``u`` (on the
    CPU, where a fresh allocation page-faults every step; filled tensor by tensor there)."""
    device = params[0].device
    if out is None:
        updates = torch._foreach_mul(list(params), weight_decay)
    else:
        updates = list(out)
        for p, u in zip(params, updates):
            torch.mul(p, weight_decay, out=u)
    inverse = None
    if isinstance(grad_scale, torch.Tensor):
        inverse = torch.reciprocal(grad_scale.detach().to(device=device, dtype=torch.float32)).reshape(())
    elif grad_scale != 1.0:
        inverse = torch.full((), 1.0 / grad_scale, dtype=torch.float32, device=device)
    torch._fused_adam_(
        updates,
        list(grads),
        list(exp_avgs),
        list(exp_avg_sqs),
        [],
        _step_tensors(steps, bias_correction, device),
        lr=-1.0,
        beta1=beta1,
        beta2=beta2,
        weight_decay=0.0,
        eps=eps,
        amsgrad=False,
        maximize=False,
        grad_scale=inverse,
    )
    return updates
