"""The fine-tuning memory kit: exact (and one approximate) replacements that store less for backward.

Measured on MiniLM-L6 fine-tuning (64 × 128, fp32, eager attention), the inputs of the linears are
only a fifth of what a step saves for backward; attention operands, float dropout noise, the GELU
input and LayerNorm inputs are the rest. Each part below is a switch in
``"bertopt": {"wtacrs": {"kit": {...}}}`` and a module swap done before ``deepspeed.initialize``:

* ``sdpa_attention`` — scaled-dot-product attention with attention-probability dropout 0. On CPU
  (and GPU) the flash kernel then saves only q, k, v, the output and the log-sum-exp instead of the
  probabilities and matmul operands; with dropout > 0 SDPA takes the math path and saves everything,
  so the dropout is switched off (a modelling change: the only non-bit-exact switch besides
  ``bf16_gelu``).
* ``dropout_mask`` — :class:`CompactDropout` keeps a ``bool`` mask (1 byte/element), a bit-packed
  one (1 bit), or only a seed from which backward ``regenerate``\\ s the identical mask (0 bytes),
  instead of torch's fp32 noise tensor. Exact.
* ``layernorm_saves_output`` — :class:`OutputSavingLayerNorm` keeps its output ``y`` (which the
  next linears and the residual keep anyway) and ``1/σ`` instead of its input; backward recovers
  ``x̂ = (y − β)/γ``. Exact up to rounding; falls back to saving the input when some ``|γ_j|`` is
  below ``layernorm_min_abs_weight`` (backward divides by it).
* ``recompute_gelu`` — :class:`GeluLinear` fuses the FFN input projection with its GELU and keeps
  only the projection's input (which the LayerNorm before it keeps anyway); backward recomputes the
  4h-wide GELU input with one extra GEMM. Exact.
* ``bf16_gelu`` — :class:`Bf16InputGelu` keeps the GELU input in bf16 and computes the derivative
  in place in backward. An approximation (~1e-3 relative gradient error), off by default.

``apply_kit(model, kit)`` performs the swaps and returns one line per part for the log.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .linear import rebind_linear
from .zero import autocast_dtype, gathered, no_autocast

DROPOUT_MODES = ("float", "bool", "bits", "regenerate")
_BIT_VALUES = (1, 2, 4, 8, 16, 32, 64, 128)


# ---------------------------------------------------------------- module swapping (shared helper)
def swap_modules(model: nn.Module, choose: Callable[[str, nn.Module], Optional[nn.Module]]) -> list[str]:
    """Replace every submodule for which ``choose(name, module)`` returns a module; return their names."""
    swapped = []
    for name, module in list(model.named_modules()):
        if not name:
            continue
        replacement = choose(name, module)
        if replacement is None:
            continue
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, replacement)
        swapped.append(name)
    return swapped


# ---------------------------------------------------------------- dropout with a compact mask
def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Bool tensor → uint8 with 8 mask entries per byte (flattened, zero-padded to a multiple of 8)."""
    flat = mask.reshape(-1)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    bits = torch.tensor(_BIT_VALUES, dtype=torch.uint8, device=mask.device)
    return (flat.view(-1, 8).to(torch.uint8) * bits).sum(1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Inverse of :func:`pack_bits`."""
    bits = torch.tensor(_BIT_VALUES, dtype=torch.uint8, device=packed.device)
    flat = packed.unsqueeze(1).bitwise_and(bits).ne(0).reshape(-1)
    return flat[: math.prod(shape)].view(shape)


def keep_mask(shape, keep: float, device, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Bool mask, each entry true with probability ``keep`` (``rand < keep``: faster than bool bernoulli)."""
    return torch.rand(shape, device=device, generator=generator) < keep


def _seeded_mask(seed: int, shape, keep: float, device) -> torch.Tensor:
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return keep_mask(shape, keep, device, generator)


class _CompactDropoutFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, p, mode):
        keep = 1.0 - p
        ctx.keep, ctx.mode, ctx.shape = keep, mode, x.shape
        if mode == "regenerate":
            ctx.seed = int(torch.randint(0, 2**62, (1,)))  # from the global RNG: torch.manual_seed governs it
            mask = _seeded_mask(ctx.seed, x.shape, keep, x.device)
        else:
            mask = keep_mask(x.shape, keep, x.device)
            ctx.save_for_backward(pack_bits(mask) if mode == "bits" else mask)
        return torch.where(mask, x * (1.0 / keep), torch.zeros((), dtype=x.dtype, device=x.device))

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.mode == "regenerate":
            mask = _seeded_mask(ctx.seed, ctx.shape, ctx.keep, grad_out.device)
        else:
            (saved,) = ctx.saved_tensors
            mask = unpack_bits(saved, ctx.shape) if ctx.mode == "bits" else saved
        zero = torch.zeros((), dtype=grad_out.dtype, device=grad_out.device)
        return torch.where(mask, grad_out * (1.0 / ctx.keep), zero), None, None


class CompactDropout(nn.Dropout):
    """``nn.Dropout`` that keeps a bool / bit-packed mask, or a seed, for backward (``mode``)."""

    def __init__(self, p: float = 0.5, mode: str = "bits"):
        super().__init__(p)
        if mode not in DROPOUT_MODES[1:]:
            raise ValueError(f"dropout mode must be one of {DROPOUT_MODES[1:]}, got {mode!r}")
        self.mode = mode

    def extra_repr(self) -> str:
        return f"p={self.p}, mode={self.mode}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if not torch.is_grad_enabled() or not x.requires_grad:
            return F.dropout(x, self.p, True)
        return _CompactDropoutFn.apply(x, self.p, self.mode)


# ---------------------------------------------------------------- LayerNorm that saves its output
def layernorm_backward(grad_out: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor,
                       weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], reduce_dims: int):
    """Gradients of LayerNorm from its *output* ``y`` and ``rstd`` (pure; math in fp32 or wider).

    ``x̂ = (y − β)/γ``; ``∇x = rstd · (g − mean(g) − x̂ · mean(g · x̂))`` with ``g = ∇y · γ``.
    ``reduce_dims`` is the number of normalised (trailing) dimensions.
    """
    dims = tuple(range(-reduce_dims, 0))
    acc = torch.promote_types(grad_out.dtype, torch.float32)
    gy = grad_out.to(acc)
    xhat = y.to(acc)
    if bias is not None:
        xhat = xhat - bias.to(acc)
    if weight is not None:
        xhat = xhat / weight.to(acc)
        g = gy * weight.to(acc)
    else:
        g = gy
    grad_x = g - g.mean(dims, keepdim=True) - xhat * (g * xhat).mean(dims, keepdim=True)
    grad_x = grad_x.mul_(rstd.to(acc))
    batch_dims = tuple(range(gy.dim() - reduce_dims))
    grad_w = (gy * xhat).sum(batch_dims) if weight is not None else None
    grad_b = gy.sum(batch_dims) if bias is not None else None
    return grad_x, grad_w, grad_b


class _OutputSavingLayerNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, normalized_shape, eps):
        y, _, rstd = torch.native_layer_norm(x, normalized_shape, weight, bias, eps)
        ctx.save_for_backward(y, rstd, weight, bias)
        ctx.reduce_dims = len(normalized_shape)
        ctx.device_type = x.device.type
        return y

    @staticmethod
    def backward(ctx, grad_out):
        y, rstd, weight, bias = ctx.saved_tensors
        with no_autocast(ctx.device_type), gathered(weight, bias):
            grad_x, grad_w, grad_b = layernorm_backward(grad_out, y, rstd, weight, bias, ctx.reduce_dims)
            grad_w = grad_w.to(weight.dtype) if grad_w is not None and ctx.needs_input_grad[1] else None
            grad_b = grad_b.to(bias.dtype) if grad_b is not None and ctx.needs_input_grad[2] else None
        return grad_x.to(grad_out.dtype), grad_w, grad_b, None, None


class OutputSavingLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` that saves its output instead of its input; build with :meth:`from_layernorm`."""

    min_abs_weight: float

    @classmethod
    def from_layernorm(cls, norm: nn.LayerNorm, min_abs_weight: float = 1e-3) -> "OutputSavingLayerNorm":
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.normalized_shape = tuple(norm.normalized_shape)
        module.eps = norm.eps
        module.elementwise_affine = norm.elementwise_affine
        module.weight, module.bias = norm.weight, norm.bias
        module.min_abs_weight = float(min_abs_weight)
        module.train(norm.training)
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        needs_grad = torch.is_grad_enabled() and (x.requires_grad or (
            self.weight is not None and self.weight.requires_grad))
        # near-zero γ would blow up x̂ = (y − β)/γ: save the input then (plain LayerNorm), still exact
        if not needs_grad or (self.weight is not None and
                              bool((self.weight.detach().abs() < self.min_abs_weight).any())):
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        if x.is_floating_point() and torch.is_autocast_enabled(x.device.type):
            x = x.float()  # autocast runs layer_norm in fp32; so do we
        with no_autocast(x.device.type):
            return _OutputSavingLayerNormFn.apply(x, self.weight, self.bias, self.normalized_shape, self.eps)


# ---------------------------------------------------------------- GELU with a bf16 saved input
_INV_SQRT2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def gelu_grad_(pre_activation: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """``grad_out · (Φ(h) + h φ(h))``, computed *into* ``pre_activation`` (fp32 or fp64, overwritten;
    pure otherwise). One extra fp32 buffer; a non-in-place version ate most of the memory it saved."""
    h = pre_activation
    h_pdf = h.square().mul_(-0.5).exp_().mul_(h).mul_(_INV_SQRT_2PI)  # h φ(h)
    grad = h.mul_(_INV_SQRT2).erf_().add_(1.0).mul_(0.5).add_(h_pdf)  # Φ(h) + h φ(h)
    del h_pdf
    return grad.mul_(grad_out)


class _Bf16GeluFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x.to(torch.bfloat16))
        return F.gelu(x)

    @staticmethod
    def backward(ctx, grad_out):
        (saved,) = ctx.saved_tensors
        return gelu_grad_(saved.to(torch.float32, copy=True), grad_out).to(grad_out.dtype)


class Bf16InputGelu(nn.Module):
    """Exact erf-GELU forward; backward from a bf16 copy of the input (approximate gradient)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (torch.is_grad_enabled() and x.requires_grad):
            return F.gelu(x)
        return _Bf16GeluFn.apply(x)


class _GeluLinearFn(torch.autograd.Function):
    """``gelu(x Wᵀ + b)`` keeping only ``x`` (and the parameters); backward recomputes ``x Wᵀ + b``."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight, bias)
        ctx.device_type = x.device.type
        return F.gelu(F.linear(x, weight, bias))

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, bias = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        with no_autocast(ctx.device_type), gathered(weight, bias):
            pre = F.linear(x, weight, bias)  # the recomputed GELU input (a fresh buffer we may overwrite)
            pre = pre.to(torch.promote_types(pre.dtype, torch.float32))
            grad_pre = gelu_grad_(pre, grad_out).to(grad_out.dtype)
            rows = grad_pre.reshape(-1, grad_pre.shape[-1])
            if ctx.needs_input_grad[0]:
                grad_x = grad_pre.matmul(weight.to(grad_pre.dtype))
            if ctx.needs_input_grad[1]:
                grad_w = rows.t().matmul(x.reshape(-1, x.shape[-1]).to(rows.dtype)).to(weight.dtype)
            if bias is not None and ctx.needs_input_grad[2]:
                grad_b = rows.sum(0).to(bias.dtype)
        return grad_x, grad_w, grad_b


class GeluLinear(nn.Linear):
    """``nn.Linear`` followed by exact GELU, fused so that backward recomputes the GELU input from
    the linear's input instead of keeping it (exact; one extra GEMM in backward). Same parameters
    and state-dict keys as the ``nn.Linear`` it replaces; the separate activation becomes Identity."""

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "GeluLinear":
        return rebind_linear(cls, linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() or not (x.requires_grad or self.weight.requires_grad):
            return F.gelu(F.linear(x, self.weight, self.bias))
        dtype = autocast_dtype(x.device.type) if x.is_floating_point() else None
        weight, bias = self.weight, self.bias
        if dtype is not None:  # as autocast would run the linear (and GELU then follows its input dtype)
            x, weight = x.to(dtype), weight.to(dtype)
            bias = bias.to(dtype) if bias is not None else None
        with no_autocast(x.device.type):
            return _GeluLinearFn.apply(x, weight, bias)


def fuse_gelu_linears(model: nn.Module) -> int:
    """Fuse ``dense`` + exact-GELU ``intermediate_act_fn`` pairs (BERT-family FFN input); return count."""
    fused = 0
    for module in model.modules():
        dense, act = getattr(module, "dense", None), getattr(module, "intermediate_act_fn", None)
        if type(dense) is nn.Linear and isinstance(act, nn.Module) and _is_exact_gelu(act):
            module.dense = GeluLinear.from_linear(dense)
            module.intermediate_act_fn = nn.Identity()
            fused += 1
    return fused


def _is_exact_gelu(module: nn.Module) -> bool:
    if isinstance(module, nn.GELU):
        return module.approximate == "none"
    # transformers.activations.GELUActivation with the C implementation (``act`` is F.gelu)
    return type(module).__name__ == "GELUActivation" and getattr(module, "act", None) is F.gelu


# ---------------------------------------------------------------- applying the kit
def _pretrained_base(model: nn.Module):
    """The transformers ``PreTrainedModel`` inside ``model`` (PEFT wraps it), or ``None``."""
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else model
    return base if hasattr(base, "set_attn_implementation") else None


def use_sdpa_without_attention_dropout(model: nn.Module) -> int:
    """Switch a transformers model to SDPA attention with attention dropout 0; return layers touched."""
    base = _pretrained_base(model)
    if base is None:
        raise ValueError("sdpa_attention needs a transformers PreTrainedModel (or a PEFT model around one)")
    base.set_attn_implementation("sdpa")
    if hasattr(base.config, "attention_probs_dropout_prob"):
        base.config.attention_probs_dropout_prob = 0.0
    touched = 0
    for name, module in base.named_modules():
        # BERT-family self-attention passes ``self.dropout.p`` to the attention kernel
        if name.endswith("attention.self") and isinstance(getattr(module, "dropout", None), nn.Dropout):
            module.dropout.p = 0.0
            touched += 1
    return touched


def apply_kit(model: nn.Module, kit) -> list[str]:
    """Apply the switches of ``kit`` (a :class:`~ds_bertopt.wtacrs.config.KitConfig`); return log lines."""
    lines = []
    if kit.sdpa_attention:
        layers = use_sdpa_without_attention_dropout(model)
        lines.append(f"kit: SDPA attention, attention dropout 0 in {layers} layers")
    if kit.dropout_mask != "float":
        names = swap_modules(model, lambda name, m: CompactDropout(m.p, kit.dropout_mask)
                             if type(m) is nn.Dropout and m.p > 0 and not name.endswith("attention.self.dropout")
                             else None)
        lines.append(f"kit: {len(names)} dropouts keep a {kit.dropout_mask} mask")
    if kit.layernorm_saves_output:
        names = swap_modules(model, lambda name, m: OutputSavingLayerNorm.from_layernorm(m, kit.layernorm_min_abs_weight)
                             if type(m) is nn.LayerNorm else None)
        lines.append(f"kit: {len(names)} LayerNorms save their output")
    if kit.recompute_gelu:
        lines.append(f"kit: {fuse_gelu_linears(model)} FFN GELUs recompute their input in backward")
    if kit.bf16_gelu:
        names = swap_modules(model, lambda name, m: Bf16InputGelu() if _is_exact_gelu(m) else None)
        lines.append(f"kit: {len(names)} GELUs save a bf16 input (approximate gradient)")
    return lines
