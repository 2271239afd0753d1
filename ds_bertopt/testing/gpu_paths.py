"""What a CUDA run executes, run on the CPU: DeepSpeed's own classes on the branches a GPU takes.

A CUDA run differs from our CPU runs mostly in the *optimizer class* we hand DeepSpeed, and DeepSpeed picks its
wrapper from that class (``DeepSpeedEngine._configure_fp16_optimizer``: ``isinstance(optimizer, FusedAdam)`` gives
the fused ``FP16_Optimizer``; anything else ``FP16_UnfusedOptimizer``). So:

* :func:`cpu_fused_adam` builds a real ``deepspeed.ops.adam.FusedAdam`` whose CUDA kernel is replaced by the same
  math in torch (:func:`multi_tensor_adam`, written from apex's ``multi_tensor_adam.cu`` that DeepSpeed ships):
  DeepSpeed's Python (``FusedAdam.step``, ``FP16_Optimizer``) runs unchanged, and training moves as on a GPU.
* :func:`cuda_optimizer_choice` makes ``ds_bertopt.optim`` choose as it does on a CUDA host (its two seams:
  ``_target_device_type`` and ``_deepspeed_fused_adam``), so our own selection code is what is tested.

Used by ``tests/test_gpu_conformance.py`` and ``bench/gpu_check.py``; never by the package.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Optional


def multi_tensor_adam(
    chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, eps, step, mode, bias_correction, weight_decay
):  # noqa: ARG001 - the kernel's signature (chunk_size, noop_flag are CUDA launch details)
    """``fused_adam_cuda.multi_tensor_adam`` in torch: per element, in fp32 (the kernel's ``MATH_T``),

    ``m = β1·m + (1-β1)·g``; ``v = β2·v + (1-β2)·g²``; ``u = (m/bc1) / (√(v/bc2) + ε)`` (+ ``λ·p`` in AdamW mode 1;
    mode 0 adds ``λ·p`` to ``g`` first); ``p -= lr·u``, with ``bc1 = 1-β1^t`` and ``bc2 = 1-β2^t`` (1 without
    bias correction)."""
    grads, params, exp_avgs, exp_avg_sqs = tensor_lists
    bc1 = 1.0 - beta1**step if bias_correction else 1.0
    bc2 = 1.0 - beta2**step if bias_correction else 1.0
    for g, p, m, v in zip(grads, params, exp_avgs, exp_avg_sqs):
        g32, p32, m32, v32 = g.float(), p.float(), m.float(), v.float()
        if mode == 0 and weight_decay:
            g32 = g32 + weight_decay * p32
        m32.mul_(beta1).add_(g32, alpha=1.0 - beta1)
        v32.mul_(beta2).addcmul_(g32, g32, value=1.0 - beta2)
        update = (m32 / bc1) / ((v32 / bc2).sqrt() + eps)
        if mode == 1 and weight_decay:
            update.add_(p32, alpha=weight_decay)
        p32.add_(update, alpha=-lr)
        for dst, src in ((p, p32), (m, m32), (v, v32)):
            if dst.data_ptr() != src.data_ptr():
                dst.copy_(src)


def cpu_fused_adam(params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                   weight_decay=0.0, set_grad_none=True):  # fmt: skip
    """A real ``deepspeed.ops.adam.FusedAdam`` (same class, same ``step``) that runs on the CPU.

    ``FusedAdam.__init__`` JIT-builds its CUDA op; everything else it sets is set here the same way."""
    from ds_bertopt.compat.deepspeed import fused_adam_with_kernel

    defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay)
    return fused_adam_with_kernel(params, defaults, multi_tensor_adam, adam_w_mode, set_grad_none)


@contextlib.contextmanager
def cuda_optimizer_choice(apex: bool = False):
    """Inside: ``ds_bertopt.optim`` builds the optimizers it builds on a CUDA host (DeepSpeed's FusedAdam for
    AdamW, via :func:`cpu_fused_adam`; with ``apex``, a host where apex is installed: LAMB is apex's ``FusedLAMB``
    where ``ds_bertopt.optim`` would take it, its kernel done on the CPU by :mod:`.apex_lamb`)."""
    from ds_bertopt import optim

    from .apex_lamb import FusedLAMB

    saved = optim._target_device_type, optim._deepspeed_fused_adam, optim.apex_fused_lamb

    def fused_adam(groups, cfg, lr):
        return cpu_fused_adam(groups, lr=lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)

    optim._target_device_type = lambda model: "cuda"
    optim._deepspeed_fused_adam = fused_adam
    optim.apex_fused_lamb = (lambda: FusedLAMB) if apex else (lambda: None)
    try:
        yield
    finally:
        optim._target_device_type, optim._deepspeed_fused_adam, optim.apex_fused_lamb = saved


# --- the conformance matrix ---------------------------------------------------------------------------------------

PRECISIONS = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("adamw", "lamb")
STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class Row:
    """One combination a CUDA run may be configured with."""

    precision: str
    optimizer: str
    stage: int
    offload: bool = False
    overlap: bool = False
    apex: bool = False
    """LAMB at ZeRO 0 on a host with apex installed: apex's ``FusedLAMB`` (on the CPU: :mod:`.apex_lamb`)."""

    @property
    def id(self) -> str:
        flags = (("offload", self.offload), ("overlap", self.overlap), ("apex", self.apex))
        extra = "".join(f"-{name}" for name, on in flags if on)
        return f"{self.precision}-{self.optimizer}-zero{self.stage}{extra}"

    def deepspeed_part(self) -> dict:
        """The ZeRO block of this row (``overlap_comm`` only where ZeRO reads it)."""
        zero = {"stage": self.stage}
        if self.stage > 0:
            zero["overlap_comm"] = self.overlap
        if self.offload:
            zero["offload_optimizer"] = {"device": "cpu"}
        return {"zero_optimization": zero}


def all_rows() -> list[Row]:
    """Every combination: precision × optimizer × ZeRO stage × offload_optimizer × overlap_comm (overlap only at
    stages 1-3, where DeepSpeed reads it)."""
    return [
        Row(precision, optimizer, stage, offload, overlap)
        for precision in PRECISIONS
        for optimizer in OPTIMIZERS
        for stage in STAGES
        for offload in (False, True)
        for overlap in ((False, True) if stage > 0 else (False,))
    ]


@dataclass(frozen=True)
class CudaChoice:
    """What a CUDA run gets for a row: read off ``ds_bertopt.optim`` and DeepSpeed 0.19.8's selection code."""

    refusal: Optional[str] = None
    """The pre-flight's one-line refusal (the rest is then empty)."""
    optimizer: str = ""
    """The optimizer ``ds_bertopt.optim.build`` hands DeepSpeed."""
    wrapper: str = ""
    """``type(engine.optimizer).__name__`` after ``deepspeed.initialize`` (the optimizer itself when unwrapped)."""
    cpu: str = ""
    """How the CPU suite covers it."""


def cuda_choice(row: Row) -> CudaChoice:
    """The optimizer and DeepSpeed wrapper a CUDA run gets for ``row``.

    * ours (``ds_bertopt.optim``): AdamW is DeepSpeed's ``FusedAdam`` on CUDA, torch's fused AdamW on the host with
      ZeRO-Offload; LAMB is ours, or apex ``FusedLAMB`` where apex is importable at ZeRO 0 without clamps; LAMB is
      refused at ZeRO 3 and with offload, offload is refused at ZeRO 0 (``engine.check_combinations``).
    * DeepSpeed (``DeepSpeedEngine._configure_optimizer`` → ``_do_optimizer_sanity_check``): with ZeRO,
      ``_configure_zero_optimizer`` (``DeepSpeedZeroOptimizer`` at 1/2, ``DeepSpeedZeroOptimizer_Stage3`` at 3;
      ``BF16_Optimizer`` only for bf16 with ``data_types.grad_accum_dtype`` fp32 at stage 1); without ZeRO, fp32
      keeps the optimizer itself, fp16 and bf16 go to ``_configure_fp16_optimizer``, whose test
      ``isinstance(optimizer, FusedAdam)`` picks the fused ``FP16_Optimizer``, else ``FP16_UnfusedOptimizer``.
    """
    if row.optimizer == "lamb" and row.stage >= 3:
        return CudaChoice(refusal='optimizer.type: "lamb" is not supported under ZeRO stage 3')
    if row.offload and row.stage == 0:
        return CudaChoice(refusal="zero_optimization.offload_optimizer: device 'cpu' needs ZeRO stage 1, 2 or 3")
    if row.offload and row.optimizer == "lamb":
        return CudaChoice(refusal='optimizer.type: "lamb" is not supported with zero_optimization.offload_optimizer')
    if row.optimizer == "adamw":
        optimizer = "AdamW (torch, fused, on the host)" if row.offload else "FusedAdam"
    else:
        optimizer = "FusedLAMB (apex, if importable) / Lamb" if row.stage == 0 else "Lamb"
    if row.stage == 3:
        wrapper = "DeepSpeedZeroOptimizer_Stage3"
    elif row.stage > 0:
        wrapper = "DeepSpeedZeroOptimizer"
    elif row.precision == "fp32":
        wrapper = "(none: " + optimizer.split(" ")[0] + ")"
    else:
        wrapper = "FP16_Optimizer" if row.optimizer == "adamw" else "FP16_UnfusedOptimizer"
    if row.precision == "fp16":
        cpu = "GPU only (DeepSpeed refuses fp16 on CPU); same wrapper class on CPU in the bf16 row; gpu_check"
    elif row.optimizer == "lamb" and row.stage == 0:
        cpu = "CPU test (Lamb, and apex's FusedLAMB with its kernel done on the CPU); the real apex: gpu_check"
    else:
        cpu = "CPU test"
    return CudaChoice(optimizer=optimizer, wrapper=wrapper, cpu=cpu)


def expected_classes(row: Row, apex: bool = False) -> tuple[str, str]:
    """(optimizer class, wrapper class) a conformance run must see: CUDA's (the CPU run has apex absent)."""
    choice = cuda_choice(row)
    optimizer = {"FusedAdam": "FusedAdam", "AdamW (torch, fused, on the host)": "AdamW"}.get(choice.optimizer, "Lamb")
    if optimizer == "Lamb" and row.stage == 0 and (apex or row.apex):
        optimizer = "FusedLAMB"
    wrapper = optimizer if choice.wrapper.startswith("(none") else choice.wrapper
    return optimizer, wrapper


def conformance_problems(row: Row, result: dict, apex: bool = False) -> list[str]:
    """What is wrong with one rank's figures of ``row`` (``tests/scripts/conformance_worker.py``); empty: conforms."""
    if "error" in result:
        return [f"raised {result['error']}"]
    problems = []
    if (result["optimizer"], result["wrapper"]) != expected_classes(row, apex):
        problems.append(f"classes {result['optimizer']}/{result['wrapper']}, CUDA's are {expected_classes(row, apex)}")
    if not (result["step1_applied"] and result["step2_applied"] and result["moved"] > 1e-4):
        problems.append(f"the steps did not train (applied {result['step1_applied']}/{result['step2_applied']})")
    elif not result["moved_by_gradients"] > 0.5:
        problems.append(
            f"the gradients did not move the weights: {1 - result['moved_by_gradients']:.1%} of the update lies "
            "along the weights themselves (weight decay on zero gradients?)"
        )
    coefficients = result.get("clip_coefficients")
    if row.stage < 3 and not (coefficients and len(coefficients) == 1 and 0.0 < coefficients[0] < 0.5):
        problems.append(f"the bucket clip did not clip its one bucket (coefficients {coefficients})")
    if row.optimizer == "lamb" and row.stage > 0 and result.get("lamb_layouts") != 2:
        problems.append("LAMB is not attached to the ZeRO shards (its trust ratio would be per shard)")
    if result["nan_applied"] or result["changed_by_nan_step"] != 0.0:
        problems.append("a step with NaN gradients changed the weights")
    if not (result["recovered_applied"] and result["recovered_finite"]):
        problems.append("training did not recover after the skipped step")
    if not (result["resumed_step"] == 1 and result["resumed_step2_applied"]) or result["resume_difference"] != 0.0:
        problems.append(f"resume is not exact (step 2 differs by {result['resume_difference']:.3e})")
    return problems


APEX_ROWS = (Row("fp32", "lamb", 0, apex=True), Row("bf16", "lamb", 0, apex=True))
"""LAMB at ZeRO 0 where apex is installed (the MLPerf recipe in NVIDIA's containers): apex's ``FusedLAMB``."""


def cpu_rows(rows: Optional[list[Row]] = None) -> list[Row]:
    """The rows the CPU can construct with DeepSpeed's classes (not refused, not fp16; by default every row of the
    matrix and the apex rows)."""
    rows = rows or [*all_rows(), *APEX_ROWS]
    return [r for r in rows if r.precision != "fp16" and cuda_choice(r).refusal is None]


def reference_row(row: Row) -> Optional[Row]:
    """The row whose step ``row`` must equal: ZeRO 0 with ours (with one clip bucket the clip is the same at stages
    0-2, and apex's FusedLAMB takes our LAMB's step); None for ZeRO 0 itself and for stage 3, which runs without the
    clip."""
    return Row(row.precision, row.optimizer, 0) if 0 < row.stage < 3 or row.apex else None


def gradient_part(before: dict, after: dict) -> float:
    """How much of the update ``after − before`` is not along the weights themselves, as a fraction of it:
    ``‖Δ − proj_w Δ‖ / ‖Δ‖`` over every tensor together (``proj_w Δ``: the multiple of ``w`` closest to ``Δ``, per
    tensor). Weight decay on zero gradients moves each tensor along itself (AdamW: by ``−lr·λ·w``; apex's LAMB with
    the 0.0 bound: by ``−lr·w``), so its part is ~0 (rounding: bf16 ~0.1); Adam's directions are nearly orthogonal to
    the weights: ~1. A tensor of zeros moves by gradients only."""
    residual = total = 0.0
    for name, w in before.items():
        delta = (after[name] - w).double().reshape(-1)
        w = w.double().reshape(-1)
        along = (delta @ w) / (w @ w) * w if bool((w != 0).any()) else w.new_zeros(w.shape)
        residual += float(((delta - along) ** 2).sum())
        total += float((delta**2).sum())
    return math.sqrt(residual / total) if total > 0 else 0.0


REPRESENTATIVE = (
    Row("bf16", "adamw", 0),  # bert.json on a GPU: the fused FP16_Optimizer
    Row("bf16", "lamb", 0),  # MLPerf's recipe: FP16_UnfusedOptimizer over LAMB
    Row("fp32", "adamw", 0),
    Row("fp32", "adamw", 1),
    Row("bf16", "adamw", 2, overlap=True),
    Row("fp32", "adamw", 2, offload=True, overlap=True),  # the bucket clip's ready_events path
    Row("bf16", "lamb", 1, overlap=True),
    Row("fp32", "lamb", 0),
    Row("bf16", "lamb", 0, apex=True),  # MLPerf's recipe where apex is installed: FP16_UnfusedOptimizer over FusedLAMB
    Row("fp32", "lamb", 2),
    Row("bf16", "adamw", 3, offload=True),
)
"""The rows ``make test`` runs; ``make test-matrix`` runs every CPU row."""


def markdown_table(rows: Optional[list[Row]] = None) -> str:
    """The matrix as the Markdown table in ``docs/gpu_matrix.md`` (a test keeps the two equal)."""
    short = {
        "AdamW (torch, fused, on the host)": "torch AdamW (host)",
        "FusedLAMB (apex, if importable) / Lamb": "FusedLAMB (apex) / Lamb",
    }
    lines = [
        "| precision | optimizer | ZeRO | offload | overlap | we build | DeepSpeed's wrapper | CPU coverage |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows or all_rows():
        c = cuda_choice(row)
        cells = [row.precision, row.optimizer, str(row.stage), "on" if row.offload else "off"]
        cells.append(("on" if row.overlap else "off") if row.stage > 0 else "n/a")
        if c.refusal:
            cells += ["refused", "", "pre-flight: " + REFUSAL_LABELS[c.refusal]]
        else:
            coverage = "make test" if row in REPRESENTATIVE else "make test-matrix"
            if row.precision == "fp16":
                coverage = "gpu_check (no fp16 on CPU; class as in bf16)"
            elif row.optimizer == "lamb" and row.stage == 0:
                coverage += " (Lamb, apex reference); apex: gpu_check"
            cells += [short.get(c.optimizer, c.optimizer), c.wrapper, coverage]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


REFUSAL_LABELS = {
    'optimizer.type: "lamb" is not supported under ZeRO stage 3': "LAMB at ZeRO 3",
    "zero_optimization.offload_optimizer: device 'cpu' needs ZeRO stage 1, 2 or 3": "offload at ZeRO 0",
    'optimizer.type: "lamb" is not supported with zero_optimization.offload_optimizer': "LAMB with offload",
}
"""Short names of the pre-flight's refusals, for the table."""
