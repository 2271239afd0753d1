"""The fine-tuning memory kit: exact (and one approximate) replacements that store less for backward.

Measured on MiniLM-L6 fine-tuning (64 × 128, fp32, eager attention), the inputs of the linears are
only a fifth of what a step saves for backward; attention operands, float dropout noise, the GELU
input and LayerNorm inputs are the rest. Each part below is a switch in
``"bertopt": {"wtacrs": {"kit": {...}}}`` and a module swap done before ``deepspeed.initialize``;
where each part applies in a model comes from its :mod:`~ds_bertopt.wtacrs.families` entry:

* ``sdpa_attention`` — scaled-dot-product attention with attention-probability dropout 0. On CPU
  (and GPU) the flash kernel then saves only q, k, v, the output and the log-sum-exp instead of the
  probabilities and matmul operands; with dropout > 0 SDPA takes the math path and saves everything,
  so the dropout is switched off (a modelling change: the only non-bit-exact switch besides
  ``bf16_gelu``). Families whose attention transformers runs eagerly only (MPNet, DeBERTa-v2) keep it.
* ``dropout_mask`` — :class:`CompactDropout` keeps a ``bool`` mask (1 byte/element), a bit-packed
  one (1 bit), or only the RNG state from which backward ``regenerate``\\ s the identical mask
  (0 bytes), instead of torch's mask. Exact. Eager attentions that *call* their probability dropout
  (MPNet, DeBERTa-v2) get it too.
* ``layernorm_saves_output`` — :class:`OutputSavingLayerNorm` keeps its output ``y`` (which the
  next linears and the residual keep anyway) and ``1/σ`` instead of its input; backward recovers
  ``x̂ = (y − β)/γ``. Exact up to rounding; falls back to saving the input when some ``|γ_j|`` is
  below ``layernorm_min_abs_weight`` (backward divides by it). That test reads γ on the host, so
  it is made once per optimizer step for all LayerNorms of a model together (:class:`GammaGuard`).
* ``recompute_gelu`` — :class:`GeluLinear` fuses the FFN input projection with its activation (GELU,
  or any parameter-free activation such as ALBERT's tanh GELU) and keeps only the projection's input
  (which the LayerNorm before it keeps anyway); backward recomputes the 4h-wide activation input with
  one extra GEMM. ModernBERT's GeGLU gets :class:`GatedLinear` (``act(input) · gate`` from ``Wi``) inside a
  :class:`GatedFfn`. Exact.
* ``bf16_gelu`` — :class:`Bf16InputGelu` keeps the GELU input in bf16 and computes the derivative
  in place in backward. An approximation (~1e-3 relative gradient error), off by default.

``apply_kit(model, kit)`` performs the swaps and returns one line per part for the log, plus one
``warning:`` line naming every module a part could not convert and why (``strict``: an error instead).
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..compat.deepspeed import zero3_status
from ..compat.transformers import attention_implementation
from ..errors import ConfigError
from .families import Detected, Family, detect, matches, pretrained_base, summarise
from .linear import rebind_linear
from .recompute import install_scope, record_outputs_of
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


_INT31 = 2**31  # ``random_()`` on int32 draws uniformly from [0, 2^31) on every device (``digits`` of int32)


def keep_threshold(keep: float) -> int:
    """The int32 threshold below which a uniform draw from [0, 2^31) keeps an entry: ``P = threshold / 2^31``,
    ``keep`` to within 2^-32 (finer than ``rand() < keep``'s 24-bit floats)."""
    return min(_INT31, max(0, round(keep * _INT31)))


def keep_mask(shape, keep: float, device, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Bool mask, each entry true with probability ``keep``: one int32 draw per entry against
    :func:`keep_threshold`. Measured on a 2-core AVX2 CPU (16 × 64 × 384): 1.7 ms against 3.1 ms for
    ``rand < keep`` and 3.9 ms for a bool ``bernoulli_`` — regenerating masks draws twice per dropout."""
    bits = torch.empty(shape, dtype=torch.int32, device=device).random_(generator=generator)
    return bits <= keep_threshold(keep) - 1  # not ``< threshold``: 2^31 itself does not fit an int32


def masked_scale(x: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """``x · mask · scale`` in one kernel where the device has one (``native_dropout_backward`` is exactly that:
    torch's own dropout backward, fused on CUDA; three ops as ``where(mask, x · scale, 0)``)."""
    return torch.ops.aten.native_dropout_backward(x, mask, scale)


def default_generator(device: torch.device) -> torch.Generator:
    """The default RNG of ``device`` (``torch.manual_seed`` seeds it): ``torch.default_generator`` on CPU,
    ``torch.<type>.default_generators[index]`` on an accelerator (``torch.cuda.default_generators``)."""
    if device.type == "cpu":
        return torch.default_generator
    module = getattr(torch, device.type)
    return module.default_generators[device.index if device.index is not None else module.current_device()]


class _CompactDropoutFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, p, mode):
        keep = 1.0 - p
        ctx.keep, ctx.mode, ctx.shape = keep, mode, x.shape
        if mode == "regenerate":
            # The state of the device's own RNG before the draw (host-side: CPU state, or the CUDA
            # seed/offset pair), not a seed read from a tensor: no host sync, and backward replays it.
            generator = default_generator(x.device)
            ctx.rng_state = generator.get_state()
            mask = keep_mask(x.shape, keep, x.device, generator)
        else:
            mask = keep_mask(x.shape, keep, x.device)
            ctx.save_for_backward(pack_bits(mask) if mode == "bits" else mask)
        return masked_scale(x, mask, 1.0 / keep)

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.mode == "regenerate":
            replay = torch.Generator(device=grad_out.device)
            replay.set_state(ctx.rng_state)
            mask = keep_mask(ctx.shape, ctx.keep, grad_out.device, replay)
        else:
            (saved,) = ctx.saved_tensors
            mask = unpack_bits(saved, ctx.shape) if ctx.mode == "bits" else saved
        return masked_scale(grad_out, mask, 1.0 / ctx.keep), None, None


class CompactDropout(nn.Dropout):
    """``nn.Dropout`` that keeps a bool / bit-packed mask, or the RNG state, for backward (``mode``)."""

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
def layernorm_backward(
    grad_out: torch.Tensor,
    y: torch.Tensor,
    rstd: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    reduce_dims: int,
):
    """Gradients of LayerNorm from its *output* ``y`` and ``rstd`` (pure; math in fp32 or wider).

    ``x̂ = (y − β)/γ``; ``∇x = rstd · (g − mean(g) − x̂ · mean(g · x̂))`` with ``g = ∇y · γ``.
    ``reduce_dims`` is the number of normalised (trailing) dimensions. That is torch's own LayerNorm backward
    (``native_layer_norm_backward``) applied to ``x̂`` as an input with mean 0 and ``rstd`` 1, times ``rstd``:
    one fused kernel instead of a dozen elementwise ops and reductions.
    """
    acc = torch.promote_types(grad_out.dtype, torch.float32)
    xhat = y.to(acc)
    if bias is not None:
        xhat = xhat - bias.to(acc)
    if weight is not None:  # in place only into a buffer of our own
        xhat = xhat.div_(weight.to(acc)) if bias is not None else xhat / weight.to(acc)
    stats_shape = rstd.shape
    grad_x, grad_w, grad_b = torch.ops.aten.native_layer_norm_backward(
        grad_out.to(acc),
        xhat,
        list(y.shape[-reduce_dims:]),
        torch.zeros(stats_shape, dtype=acc, device=y.device),
        torch.ones(stats_shape, dtype=acc, device=y.device),
        weight.to(acc) if weight is not None else None,
        bias.to(acc) if bias is not None else None,
        [True, weight is not None, bias is not None],
    )
    return grad_x.mul_(rstd.to(acc)), grad_w, grad_b


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


_optimizer_steps = [0]
_step_hook = []


def _count_optimizer_step(optimizer, args, kwargs) -> None:
    _optimizer_steps[0] += 1


def _watch_optimizer_steps() -> None:
    """Count every ``torch.optim.Optimizer.step`` of the process (once): DeepSpeed's ZeRO/bf16 wrappers
    step an inner torch optimizer and then write the module's parameters through ``.data``, which does
    not move their version counters; the step count does."""
    if not _step_hook:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _step_hook.append(register_optimizer_step_post_hook(_count_optimizer_step))


class GammaGuard:
    """Decides, for the :class:`OutputSavingLayerNorm`\\ s of one model together, which may save their
    output: those whose every ``|γ_j| ≥ min_abs_weight``.

    Reading that answer is a host sync, so it is re-decided only when some γ may have changed: its
    version counter moved (an in-place write, ``load_state_dict``) or any torch optimizer stepped
    since the last decision (:func:`_watch_optimizer_steps`). Then all LayerNorms whose γ is whole on
    this rank are checked in one reduction per device and one device-to-host copy — one host sync
    per optimizer step, in the first forward after it (under ZeRO-3 with LayerNorm weights below
    ``stage3_param_persistence_threshold``, the default, they are whole; a partitioned γ is checked in
    its own forward). ``host_checks`` counts these syncs. Writes through ``param.data`` outside an
    optimizer step are not seen; call :meth:`invalidate` after them.
    """

    def __init__(self) -> None:
        self.norms: list["OutputSavingLayerNorm"] = []  # strong refs: copy.deepcopy copies guard and norms together
        self.host_checks = 0
        _watch_optimizer_steps()

    def add(self, norm: "OutputSavingLayerNorm") -> None:
        self.norms.append(norm)

    def invalidate(self) -> None:
        for norm in self.norms:
            norm._gamma_stamp = None

    @staticmethod
    def _stamp(norm: "OutputSavingLayerNorm") -> tuple:
        return (norm.weight._version, _optimizer_steps[0])

    def output_is_safe(self, norm: "OutputSavingLayerNorm") -> bool:
        if norm._gamma_stamp == self._stamp(norm):
            return norm._gamma_safe
        self._check(norm)
        return norm._gamma_safe if norm._gamma_stamp is not None else False

    def _check(self, asking: "OutputSavingLayerNorm") -> None:
        """The documented host sync: one ``(|γ| < min).any()`` per stale LayerNorm, copied to the host at once."""
        stale = [
            n
            for n in self.norms
            if n.weight is not None and n.min_abs_weight > 0 and n._gamma_stamp != self._stamp(n) and _whole(n.weight)
        ]
        if asking not in stale:
            return  # its γ is partitioned right now: the caller saves the input (exact), nothing read
        by_device: dict[torch.device, dict[tuple, list]] = {}
        for norm in stale:  # same width and bound: one stacked comparison (a model's LayerNorms are all alike)
            key = (norm.weight.numel(), norm.weight.dtype, norm.min_abs_weight)
            by_device.setdefault(norm.weight.device, {}).setdefault(key, []).append(norm)
        for groups in by_device.values():
            with torch.no_grad():
                small = torch.cat(
                    [
                        torch.stack([n.weight.detach().reshape(-1) for n in norms]).abs_().lt_(bound).any(dim=1)
                        for (_, _, bound), norms in groups.items()
                    ]
                )
            flags = small.tolist()
            self.host_checks += 1
            for norm, has_small in zip((n for norms in groups.values() for n in norms), flags):
                norm._gamma_stamp, norm._gamma_safe = self._stamp(norm), not has_small


def _whole(param: torch.Tensor) -> bool:
    """Not a ZeRO-3 partition nor in flight: ``ds_status`` (deepspeed.runtime.zero.partition_parameters.
    ZeroParamStatus) absent or ``AVAILABLE``."""
    return zero3_status(param) in (None, "AVAILABLE") and param.numel() > 0


def _invalidate_after_load(module, incompatible_keys) -> None:
    module._gamma_stamp = None


class OutputSavingLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` that saves its output instead of its input; build with :meth:`from_layernorm`.

    The near-zero-γ fallback is decided by its :class:`GammaGuard` (shared by all LayerNorms that
    :func:`apply_kit` swaps in one model): at most one host sync per optimizer step, none otherwise.
    ``min_abs_weight = 0`` turns the check (and its sync) off.
    """

    min_abs_weight: float

    @classmethod
    def from_layernorm(
        cls, norm: nn.LayerNorm, min_abs_weight: float = 1e-3, guard: Optional[GammaGuard] = None
    ) -> "OutputSavingLayerNorm":
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.normalized_shape = tuple(norm.normalized_shape)
        module.eps = norm.eps
        module.elementwise_affine = norm.elementwise_affine
        module.weight, module.bias = norm.weight, norm.bias
        module.min_abs_weight = float(min_abs_weight)
        module._gamma_stamp, module._gamma_safe = None, False
        module.guard = guard if guard is not None else GammaGuard()
        module.guard.add(module)
        module.register_load_state_dict_post_hook(_invalidate_after_load)
        module.train(norm.training)
        return module

    def _output_is_safe(self) -> bool:
        if self.weight is None or self.min_abs_weight <= 0:
            return True
        return self.guard.output_is_safe(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        needs_grad = torch.is_grad_enabled() and (
            x.requires_grad or (self.weight is not None and self.weight.requires_grad)
        )
        # near-zero γ would blow up x̂ = (y − β)/γ: save the input then (plain LayerNorm), still exact
        if not needs_grad or not self._output_is_safe():
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        if x.is_floating_point() and torch.is_autocast_enabled(x.device.type):
            x = x.float()  # autocast runs layer_norm in fp32; so do we
        with no_autocast(x.device.type):
            return _OutputSavingLayerNormFn.apply(x, self.weight, self.bias, self.normalized_shape, self.eps)


# ---------------------------------------------------------------- GELU with a bf16 saved input
def gelu_grad_(pre_activation: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """``grad_out · (Φ(h) + h φ(h))`` for ``h = pre_activation``, written *into* ``pre_activation`` (overwritten;
    pure otherwise): torch's own fused ``gelu_backward`` kernel (the one autograd runs for ``F.gelu``, so the
    result is bit for bit full fine-tuning's) with its output aliased onto its input. No extra buffer; one pass
    instead of the eight elementwise ops of the formula (10.2 → 3.0 ms on 16 × 64 × 1536 fp32, 2-core AVX2)."""
    grad = grad_out if grad_out.dtype == pre_activation.dtype else grad_out.to(pre_activation.dtype)
    return torch.ops.aten.gelu_backward.grad_input(grad, pre_activation, grad_input=pre_activation)


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


# ---------------------------------------------------------------- FFN projection fused with its activation
def _activate(pre: torch.Tensor, activation: Optional[nn.Module], gated: bool) -> torch.Tensor:
    """``act(pre)``, or ``act(input) · gate`` for ``pre = [input, gate]`` (ModernBertMLP.forward's split)."""
    act = F.gelu if activation is None else activation
    if gated:
        value, gate = pre.chunk(2, dim=-1)
        return act(value) * gate
    return act(pre)


class PreActivationHandoff:
    """Hands the pre-activation that rebuilding the FFN activation output computed (``recompute_ffn``, see
    :mod:`ds_bertopt.wtacrs.recompute`) to the fused projection's backward, which then skips its own GEMM."""

    __slots__ = ("pre",)

    def __init__(self) -> None:
        self.pre: Optional[torch.Tensor] = None

    def take(self) -> Optional[torch.Tensor]:
        pre, self.pre = self.pre, None
        return pre


def _rebuild_activation(x, weight, bias, activation, gated, handoff: PreActivationHandoff, device_type: str):
    """The fused module's output again, from its (saved) input; the pre-activation goes to its backward."""
    with torch.no_grad(), no_autocast(device_type), gathered(weight, bias):
        pre = F.linear(x, weight, bias)
        out = _activate(pre, activation, gated)
    handoff.pre = pre
    return out


class _ActivationLinearFn(torch.autograd.Function):
    """``act(x Wᵀ + b)`` (or its gated form) keeping only ``x`` and the parameters; backward recomputes
    ``x Wᵀ + b`` (or takes it from ``handoff``). ``activation`` ``None`` is exact erf GELU with the in-place
    derivative; any other (parameter-free) activation is differentiated by autograd on the recomputed input."""

    @staticmethod
    def forward(ctx, x, weight, bias, activation, gated, handoff):
        ctx.save_for_backward(x, weight, bias)
        ctx.device_type, ctx.activation, ctx.gated, ctx.handoff = x.device.type, activation, gated, handoff
        return _activate(F.linear(x, weight, bias), activation, gated)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, bias = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        handed = ctx.handoff.take() if ctx.handoff is not None else None
        with no_autocast(ctx.device_type), gathered(weight, bias):
            # the recomputed activation input (a fresh buffer we may overwrite)
            pre = handed if handed is not None else F.linear(x, weight, bias)
            grad_pre = _activation_input_grad(pre, grad_out, ctx.activation, ctx.gated)
            rows = grad_pre.reshape(-1, grad_pre.shape[-1])
            if ctx.needs_input_grad[0]:
                grad_x = grad_pre.matmul(weight.to(grad_pre.dtype))
            if ctx.needs_input_grad[1]:
                grad_w = rows.t().matmul(x.reshape(-1, x.shape[-1]).to(rows.dtype)).to(weight.dtype)
            if bias is not None and ctx.needs_input_grad[2]:
                grad_b = rows.sum(0).to(bias.dtype)
        return grad_x, grad_w, grad_b, None, None, None


def _activation_input_grad(
    pre: torch.Tensor, grad_out: torch.Tensor, activation: Optional[nn.Module], gated: bool
) -> torch.Tensor:
    """∂loss/∂pre from the recomputed ``pre`` (pure; ``pre`` may be overwritten)."""
    if activation is not None:
        with torch.enable_grad():
            leaf = pre.detach().requires_grad_()
            (grad_pre,) = torch.autograd.grad(_activate(leaf, activation, gated), leaf, grad_out)
        return grad_pre
    if not gated:  # the kernel computes in fp32 for bf16/fp16 inputs, as autograd's GELU does
        return gelu_grad_(pre, grad_out).to(grad_out.dtype)
    value, gate = pre.chunk(2, dim=-1)
    grad_gate = (F.gelu(value) * grad_out).to(grad_out.dtype)
    grad_value = gelu_grad_(value.contiguous(), grad_out * gate).to(grad_out.dtype)
    return torch.cat([grad_value, grad_gate], dim=-1)


class GeluLinear(nn.Linear):
    """``nn.Linear`` followed by its activation (exact GELU unless ``activation`` is given), fused so that
    backward recomputes the activation input from the linear's input instead of keeping it (exact; one
    extra GEMM in backward). Same parameters and state-dict keys as the ``nn.Linear`` it replaces; the
    separate activation becomes Identity."""

    gated = False

    @classmethod
    def from_linear(cls, linear: nn.Linear, activation: Optional[nn.Module] = None) -> "GeluLinear":
        module = rebind_linear(cls, linear)
        object.__setattr__(module, "activation", activation)  # not a submodule: no state, no swaps inside
        return module

    def extra_repr(self) -> str:
        act = "gelu" if self.activation is None else type(self.activation).__name__
        return f"{super().extra_repr()}, activation={act}{', gated' if self.gated else ''}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() or not (x.requires_grad or self.weight.requires_grad):
            return _activate(F.linear(x, self.weight, self.bias), self.activation, self.gated)
        dtype = autocast_dtype(x.device.type) if x.is_floating_point() else None
        weight, bias = self.weight, self.bias
        if dtype is not None:  # as autocast would run the linear (and the activation then follows its dtype)
            x, weight = x.to(dtype), weight.to(dtype)
            bias = bias.to(dtype) if bias is not None else None
        scope = getattr(self, "_recompute_scope", None)
        handoff = PreActivationHandoff() if scope is not None and scope.innermost() else None
        with no_autocast(x.device.type):
            out = _ActivationLinearFn.apply(x, weight, bias, self.activation, self.gated, handoff)
        if handoff is not None:  # recompute_ffn: the output projection's saved input becomes a recipe
            rebuild = functools.partial(
                _rebuild_activation, x, weight, bias, self.activation, self.gated, handoff, x.device.type
            )
            scope.record(out, rebuild, (x, weight), "the FFN activation")
        return out


class GatedLinear(GeluLinear):
    """ModernBERT's ``Wi`` fused with its GeGLU: ``act(input) · gate`` for ``[input, gate] = x Wᵀ + b``,
    keeping only ``x``; backward recomputes the 2·I-wide projection. Output width is half of ``Wi``'s."""

    gated = True


class GatedFfn(nn.Module):
    """A gated FFN ``output(dropout(act(input) · gate))`` (ModernBertMLP.forward) whose first projection is a
    :class:`GatedLinear`. Keeps the original attribute names, so state-dict keys are unchanged."""

    def __init__(self, names: tuple[str, str, str], linear: GatedLinear, dropout: nn.Module, output: nn.Module):
        super().__init__()
        self._names = names
        for name, module in zip(names, (linear, dropout, output)):
            setattr(self, name, module)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        linear, dropout, output = (getattr(self, name) for name in self._names)
        return output(dropout(linear(hidden_states)))


def _is_exact_gelu(module: nn.Module) -> bool:
    if isinstance(module, nn.GELU):
        return module.approximate == "none"
    # transformers.activations.GELUActivation with the C implementation (``act`` is F.gelu)
    return type(module).__name__ == "GELUActivation" and getattr(module, "act", None) is F.gelu


def _parameter_free(module) -> bool:
    return isinstance(module, nn.Module) and next(module.parameters(), None) is None


def fuse_ffn_activations(model: nn.Module, family: Family, gaps: Optional[list] = None) -> list[str]:
    """Fuse each FFN input projection of ``family`` with its activation; return the fused modules' names."""
    spec = family.ffn
    gaps = gaps if gaps is not None else []
    fused, seen = [], 0
    for name, module in list(model.named_modules()):
        if not name or not matches(name, spec.module):
            continue
        linear, act = getattr(module, spec.linear, None), getattr(module, spec.activation, None)
        if linear is None or act is None:
            continue
        seen += 1
        what = f"{name}.{spec.linear}"
        if isinstance(linear, GeluLinear) or isinstance(module, GatedFfn):
            continue  # already fused
        if type(linear) is not nn.Linear:
            gaps.append((what, f"{type(linear).__name__}, not an nn.Linear"))
            continue
        if not _parameter_free(act):
            gaps.append((f"{name}.{spec.activation}", f"{type(act).__name__} has parameters"))
            continue
        activation = None if _is_exact_gelu(act) else act
        if spec.gated:
            dropout, output = getattr(module, spec.dropout), getattr(module, spec.output)
            swapped = GatedFfn(
                (spec.linear, spec.dropout, spec.output), GatedLinear.from_linear(linear, activation), dropout, output
            )
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, swapped)
        else:
            setattr(module, spec.linear, GeluLinear.from_linear(linear, activation))
            setattr(module, spec.activation, nn.Identity())
        fused.append(f"{type(act).__name__}{' (gated)' if spec.gated else ''}")
    if seen == 0:
        gaps.append((spec.module, f"no module with .{spec.linear} and .{spec.activation}"))
    return fused


def fuse_gelu_linears(model: nn.Module) -> int:
    """Fuse the FFN input projections with their activations (per the model's family); return the count."""
    return len(fuse_ffn_activations(model, detect(model).family))


# ---------------------------------------------------------------- applying the kit
def use_sdpa_without_attention_dropout(
    model: nn.Module, family: Optional[Family] = None, gaps: Optional[list] = None
) -> int:
    """Switch a transformers model to SDPA attention with attention dropout 0; return layers touched.

    Uses ``PreTrainedModel.set_attn_implementation("sdpa")`` and checks that the config took it (it
    warns and keeps eager for attentions that do not call ``ALL_ATTENTION_FUNCTIONS``).
    """
    base = pretrained_base(model)
    if base is None:
        raise ValueError("sdpa_attention needs a transformers PreTrainedModel (or a PEFT model around one)")
    family = family or detect(model).family
    spec = family.attention
    gaps = gaps if gaps is not None else []
    attention = [(name, module) for name, module in base.named_modules() if name and matches(name, spec.module)]
    label = f"{summarise(name for name, _ in attention) or spec.module}"
    if spec.sdpa_blocker is not None:
        kind = type(attention[0][1]).__name__ if attention else "attention"
        gaps.append((label, f"{kind}: {spec.sdpa_blocker}; kept with its dropout"))
        return 0
    base.set_attn_implementation("sdpa")
    implementation = attention_implementation(base.config)
    if implementation != "sdpa":
        gaps.append((label, f"transformers kept {implementation!r} attention (no SDPA path)"))
        return 0
    for key in spec.config_dropout:
        if hasattr(base.config, key):
            setattr(base.config, key, 0.0)
    touched = 0
    for name, module in attention:
        holder = getattr(module, spec.prob_dropout, None) if spec.prob_dropout else None
        if isinstance(holder, nn.Dropout):
            holder.p = 0.0
        elif isinstance(holder, (int, float)) and not isinstance(holder, bool):
            setattr(module, spec.prob_dropout, 0.0)
        elif spec.prob_dropout is not None:
            gaps.append((f"{name}.{spec.prob_dropout}", f"{type(holder).__name__}: unknown attention dropout"))
            continue
        touched += 1
    if not attention:
        gaps.append((spec.module, "no attention module of that name"))
    return touched


def _probability_dropouts(model: nn.Module, family: Family) -> tuple[set, set]:
    """Names of attention-probability dropout modules: (only ``p`` read, called on the probabilities)."""
    spec = family.attention
    read, called = set(), set()
    if spec.prob_dropout is None:
        return read, called
    for name, module in model.named_modules():
        if name and matches(name, spec.module) and isinstance(getattr(module, spec.prob_dropout, None), nn.Dropout):
            (called if spec.prob_dropout_called else read).add(f"{name}.{spec.prob_dropout}")
    return read, called


def _compact_dropouts(model: nn.Module, mode: str, family: Family, gaps: list) -> list[str]:
    read_only, _ = _probability_dropouts(model, family)
    for name, module in model.named_modules():
        if (
            (isinstance(module, nn.Dropout) or "Dropout" in type(module).__name__)
            and type(module) not in (nn.Dropout, CompactDropout)
            and getattr(module, "p", 0) > 0
        ):
            gaps.append((name, f"{type(module).__name__}, not an nn.Dropout"))
    return swap_modules(
        model,
        lambda name, m: (
            CompactDropout(m.p, mode) if type(m) is nn.Dropout and m.p > 0 and name not in read_only else None
        ),
    )


def _output_saving_layernorms(model: nn.Module, min_abs_weight: float, gaps: list) -> list[str]:
    guard = GammaGuard()
    for name, module in model.named_modules():
        kind = type(module).__name__
        if (
            (kind.endswith("LayerNorm") or kind.endswith("RMSNorm"))
            and type(module) is not nn.LayerNorm
            and not isinstance(module, OutputSavingLayerNorm)
        ):
            gaps.append((name, f"{kind}, not an nn.LayerNorm"))
    return swap_modules(
        model,
        lambda name, m: (
            OutputSavingLayerNorm.from_layernorm(m, min_abs_weight, guard) if type(m) is nn.LayerNorm else None
        ),
    )


def _bf16_gelus(model: nn.Module, family: Family, gaps: list) -> list[str]:
    spec = family.ffn
    for name, module in model.named_modules():
        act = getattr(module, spec.activation, None) if name and matches(name, spec.module) else None
        if isinstance(act, nn.Module) and not isinstance(act, (nn.Identity, Bf16InputGelu)) and not _is_exact_gelu(act):
            gaps.append((f"{name}.{spec.activation}", f"{type(act).__name__}: bf16_gelu covers exact erf GELU only"))
    return swap_modules(model, lambda name, m: Bf16InputGelu() if _is_exact_gelu(m) else None)


def kit_parts(model: nn.Module, kit, detected: Optional[Detected] = None) -> tuple[list[str], list[tuple[str, str]]]:
    """Apply ``kit``; return its log lines and the gaps ``(module, why)`` it could not convert."""
    detected = detected or detect(model)
    family = detected.family
    lines: list[str] = []
    gaps: list[tuple[str, str]] = []
    if kit.sdpa_attention:
        sdpa_gaps: list = []
        layers = use_sdpa_without_attention_dropout(model, family, sdpa_gaps)
        gaps += [(f"kit.sdpa_attention: {module}", why) for module, why in sdpa_gaps]
        lines.append(f"kit: SDPA attention, attention dropout 0 in {layers} layers")
    if kit.dropout_mask != "float":
        part: list = []
        names = _compact_dropouts(model, kit.dropout_mask, family, part)
        gaps += [(f"kit.dropout_mask: {module}", why) for module, why in part]
        lines.append(f"kit: {len(names)} dropouts keep a {kit.dropout_mask} mask")
    if kit.layernorm_saves_output:
        part = []
        names = _output_saving_layernorms(model, kit.layernorm_min_abs_weight, part)
        gaps += [(f"kit.layernorm_saves_output: {module}", why) for module, why in part]
        lines.append(f"kit: {len(names)} LayerNorms save their output")
    if kit.recompute_gelu:
        part = []
        fused = fuse_ffn_activations(model, family, part)
        gaps += [(f"kit.recompute_gelu: {module}", why) for module, why in part]
        kinds = ", ".join(sorted(set(fused)))
        lines.append(
            f"kit: {len(fused)} FFN activations recompute their input in backward" + (f" ({kinds})" if kinds else "")
        )
    if kit.bf16_gelu:
        part = []
        names = _bf16_gelus(model, family, part)
        gaps += [(f"kit.bf16_gelu: {module}", why) for module, why in part]
        lines.append(f"kit: {len(names)} GELUs save a bf16 input (approximate gradient)")
    if kit.checkpoint_every > 0:
        lines.append(_enable_checkpointing(model, kit.checkpoint_every))
    return lines, gaps


def _enable_checkpointing(model: nn.Module, every: int) -> str:
    """transformers' activation checkpointing of every ``every``-th layer (``PreTrainedModel.
    activation_checkpointing_enable(activation_checkpointing_kwargs, every_n_layers, offload)`` of transformers 5;
    it checkpoints with ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` by default)."""
    base = pretrained_base(model)
    enable = getattr(base, "activation_checkpointing_enable", None)
    if enable is None:
        raise ConfigError(
            f"kit.checkpoint_every: {type(base or model).__name__} has no "
            f"activation_checkpointing_enable (a transformers PreTrainedModel of transformers >= 5)"
        )
    if not getattr(base, "supports_gradient_checkpointing", False):
        raise ConfigError(f"kit.checkpoint_every: {type(base).__name__} does not support activation checkpointing")
    enable(every_n_layers=every)
    return f"kit: activation checkpointing of every {'' if every == 1 else f'{every}-th '}layer (transformers)"


def install_recompute(model: nn.Module, kit, detected: Optional[Detected] = None) -> tuple[list[str], list]:
    """``kit.recompute_qkv`` / ``kit.recompute_ffn`` (see :mod:`ds_bertopt.wtacrs.recompute`): after every other
    swap (the producers it hooks must be the final modules). Returns log lines and gaps."""

    lines: list[str] = []
    gaps: list[tuple[str, str]] = []
    if not (kit.recompute_qkv or kit.recompute_ffn):
        return lines, gaps
    family = (detected or detect(model)).family
    scope = install_scope(model)
    if kit.recompute_qkv:
        names = [name for name, _ in model.named_modules() if name and any(matches(name, p) for p in family.qkv)]
        recorded, skipped = record_outputs_of(model, scope, names)
        gaps += [(f"kit.recompute_qkv: {name}", "has an active dropout: not rebuilt") for name in skipped]
        if not names:
            gaps.append(("kit.recompute_qkv", f"no module named like {', '.join(family.qkv)}"))
        lines.append(f"kit: {len(recorded)} attention projections (q/k/v) rebuilt in backward")
    if kit.recompute_ffn:
        fused = [m for m in model.modules() if isinstance(m, GeluLinear)]
        for module in fused:
            object.__setattr__(module, "_recompute_scope", scope)  # not a submodule
        if not fused:
            gaps.append(("kit.recompute_ffn", "no fused FFN projection (recompute_gelu converted none)"))
        lines.append(f"kit: {len(fused)} FFN activation outputs rebuilt in backward")
    return lines, gaps


def coverage_line(gaps: list[tuple[str, str]], detected: Detected) -> Optional[str]:
    """The one line naming everything not converted (``None`` when all converted in a known family)."""
    if not gaps and detected.known:
        return None
    parts = [f"{module} ({why})" for module, why in dict.fromkeys(gaps)]
    what = "; ".join(parts) if parts else "nothing else"
    return f"not converted in {detected.describe()}: {what}"


def report_coverage(gaps: list[tuple[str, str]], detected: Detected, strict: bool) -> list[str]:
    """``[]``, or the one ``warning:`` line; with ``strict`` a :class:`ConfigError` instead."""
    line = coverage_line(gaps, detected)
    if line is None:
        return []
    if strict:
        raise ConfigError(f"wtacrs.strict: {line}")
    return [f"warning: wtacrs: {line} (wtacrs.strict: true makes this an error)"]


def apply_kit(model: nn.Module, kit, strict: bool = False) -> list[str]:
    """Apply the switches of ``kit`` (a :class:`~ds_bertopt.wtacrs.config.KitConfig`); return log lines,
    ending with one ``warning:`` line if some part could not convert some module (``strict``: raise)."""
    detected = detect(model)
    lines, gaps = kit_parts(model, kit, detected)
    more_lines, more_gaps = install_recompute(model, kit, detected)
    if not kit.any:
        return lines
    return lines + more_lines + report_coverage(gaps + more_gaps, detected, strict)
