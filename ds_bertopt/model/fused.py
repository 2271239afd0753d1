"""The unpadded encoder's dropout made cheap (``model.fused_dropout``): packed random bits, and the dropout of
BERT's ``dense → dropout → LayerNorm(· + input)`` blocks fused with the residual add.

What a BERT step spends outside its GEMMs on CPU (``bench/mfu.py``'s split on main): dropout's ``bernoulli_`` (a
float draw per element, then a division and a multiply, the float mask kept for backward) is its largest elementwise
item, then LayerNorm, GELU, adds and copies.

* :func:`keep_mask` — dropout's random numbers as one draw of packed bits: ``random_`` fills ``⌈n/4⌉`` 64-bit words
  (one generator call per word), each word gives four 16-bit uniforms, and an element is kept when its uniform is
  below ``k = round((1 - p)·2¹⁶)``. The keep probability is ``k/2¹⁶`` (within 2⁻¹⁷ of ``1 - p``) and kept values are
  scaled by ``2¹⁶/k``, its exact inverse, so the output's expectation is the input. Elements are independent
  (disjoint bits of torch's uniform 64-bit stream). The stream is torch's generator (the default one unless given):
  deterministic under ``manual_seed``, restored by the checkpoint's RNG state, and replayed by activation
  checkpointing (``torch.utils.checkpoint`` restores the CPU/device RNG state before recomputing).
* :func:`keep_factors` — the same decisions as 1/0 in the activations' dtype, compared straight into it: what the
  eager dropout multiplies by and keeps for backward (as stock CPU dropout keeps its noise). A bool mask costs 1 byte
  where this costs 2 (bf16) or 4, but ``where`` and a multiply by a bool are slow on the CPU: on [1567, 768]
  (2 threads, torch 2.13) ``where`` took 0.66 ms, a multiply by a bool 0.28 (fp32), and one by the factors 0.08.
* :func:`dropout_add` — ``residual + dropout(x)`` as one ``addcmul`` (the dropout scale its ``value``), and a
  backward of one multiply and one scale: on [1567, 768] bf16 0.1 ms forward where ``where`` + ``add`` took 0.8.
* :func:`fuse_encoder` — every ``nn.Dropout`` of the model becomes :class:`PackedBitsDropout`, and the family's
  residual blocks (``MlmFamily.residual_norm_blocks``: ``BertSelfOutput``, ``BertOutput`` and their copies) run
  ``LayerNorm(dropout_add(dense(h), input))``. The blocks still call their ``dense`` and ``LayerNorm`` modules, so
  parameters, state dict, ZeRO-3's per-module gathering and any replaced linear (LoRA) work as before.
  In eval mode (or ``p = 0``) a fused block computes exactly what the stock one does.

Under ``model.compile`` the mask is one custom op (:func:`packed_keep_mask_op`, the same draws as eager) and Inductor
fuses the mask's cast, the multiply-add and LayerNorm around it. Attention dropout on the CPU draws these bits too,
inside :mod:`.cpu_attention` (one draw for every score of a micro-batch); on CUDA it stays inside the attention
kernels.
Bias + GELU stay in ``addmm`` + GELU unless compiled.
"""

from __future__ import annotations

import math
import types
from typing import Optional

import torch
from torch import nn

KEEP_LEVELS = 1 << 16
"""Resolution of a keep decision: 16 bits of the generator's output per element."""


def keep_levels(p: float) -> int:
    """``k``: an element is kept with probability ``k / 2¹⁶`` (``round((1 - p)·2¹⁶)``, at least 1); ``2¹⁶`` means
    nothing is dropped (``p`` below 2⁻¹⁷)."""
    return min(KEEP_LEVELS, max(1, round((1.0 - p) * KEEP_LEVELS)))


def keep_scale(p: float) -> float:
    """What kept elements are multiplied by: the inverse of the actual keep probability (an unbiased dropout)."""
    return KEEP_LEVELS / keep_levels(p)


def packed_bits(count: int, device=None, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """``count`` uniform 16-bit integers (``int16``, ``[-2¹⁵, 2¹⁵)``) from ``⌈count/4⌉`` draws of 64 random bits."""
    words = torch.empty((count + 3) // 4, dtype=torch.int64, device=device)
    words.random_(-(1 << 63), None, generator=generator)  # from int64 min, no bound: all 64 bits random
    return words.view(torch.int16)[:count]


def keep_mask(shape, p: float, device=None, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Bool ``shape`` tensor, True where an element is kept, each independently with probability ``k/2¹⁶``
    (:func:`keep_levels`)."""
    levels = keep_levels(p)
    if levels == KEEP_LEVELS:  # the threshold 2¹⁵ would wrap to -2¹⁵ as an int16 scalar: nothing is dropped
        return torch.ones(shape, dtype=torch.bool, device=device)
    if torch.compiler.is_compiling():  # model.compile: in-place random_ breaks the graph; one opaque op instead
        return packed_keep_mask_op(torch.empty(shape, dtype=torch.bool, device=device), p)
    return packed_bits(math.prod(shape), device, generator).view(shape) < _threshold(levels)


def _threshold(levels: int) -> int:
    """The int16 values below it are ``levels`` of the 2¹⁶."""
    return levels - KEEP_LEVELS // 2


def keep_factors(shape, p: float, dtype: torch.dtype, device=None) -> torch.Tensor:
    """:func:`keep_mask`'s decisions (the same draws from the default generator) as 1/0 in ``dtype``."""
    levels = keep_levels(p)
    if levels == KEEP_LEVELS or torch.compiler.is_compiling():  # compiled: Inductor fuses the cast into its kernel
        return keep_mask(shape, p, device).to(dtype)
    bits = packed_bits(math.prod(shape), device)
    return torch.lt(bits, _threshold(levels), out=bits.new_empty(bits.shape, dtype=dtype)).view(shape)


@torch.library.custom_op("ds_bertopt::packed_keep_mask_v1", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def packed_keep_mask_op(like: torch.Tensor, p: float) -> torch.Tensor:
    """:func:`keep_mask` for ``like``'s shape and device as one graph node (``model.compile``): the packed bits are
    drawn eagerly from the default generator, the same draws as eager, while Inductor fuses the mask's cast, the
    multiply-add and LayerNorm around it. Inductor's own lowering of a random draw is a scalar
    ``normalized_rand_cpu`` per element on a CPU: a dropout + add + LayerNorm block of [1567, 768] took 22.7 ms
    forward with it, against eager's 15.6 ms (2 threads, fp32). ``nondeterministic_seeded``: never reordered or
    deduplicated."""
    return keep_mask(like.shape, p, like.device)  # run eagerly: not compiling here


@packed_keep_mask_op.register_fake
def _(like: torch.Tensor, p: float) -> torch.Tensor:
    return torch.empty_like(like)


def dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """``F.dropout`` with :func:`keep_mask`'s bits (the same distribution up to 2⁻¹⁷ in the keep probability)."""
    if not training or keep_levels(p) == KEEP_LEVELS:
        return x
    return torch.mul(x, keep_factors(x.shape, p, x.dtype, x.device)).mul_(keep_scale(p))


def dropout_add(x: torch.Tensor, residual: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """``residual + dropout(x)`` in one pass (``addcmul``; the backward keeps :func:`keep_factors`)."""
    if not training or keep_levels(p) == KEEP_LEVELS:
        return residual + x
    return _KeptAdd.apply(x, residual, keep_factors(x.shape, p, x.dtype, x.device), keep_scale(p))


class _KeptAdd(torch.autograd.Function):
    """``residual + x · keep · scale``. Autograd's own ``addcmul`` backward would round ``keep · scale`` to the
    factors' dtype (bf16: 1.109375 for 1.11111); this one multiplies by the factors, then by the exact scale."""

    @staticmethod
    def forward(ctx, x, residual, keep, scale: float):
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return torch.addcmul(residual, x, keep, value=scale)

    @staticmethod
    def backward(ctx, grad):
        (keep,) = ctx.saved_tensors
        return torch.mul(grad, keep).mul_(ctx.scale), grad, None, None


class PackedBitsDropout(nn.Dropout):
    """``nn.Dropout`` whose random numbers are :func:`keep_mask`'s packed bits (same ``p``, no parameters)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Dropout's signature
        return dropout(input, self.p, self.training)


def _residual_norm_forward(self, hidden_states: torch.Tensor, input_tensor: torch.Tensor) -> torch.Tensor:
    """``BertSelfOutput.forward`` / ``BertOutput.forward`` (``LayerNorm(dropout(dense(h)) + input)``), the dropout
    fused with the residual add."""
    x = self.dense(hidden_states)
    return self.LayerNorm(dropout_add(x, input_tensor, self.dropout.p, self.training))


def fuse_encoder(model: nn.Module, family) -> list[str]:
    """Swap the fused dropout into ``model`` (a transformers model of ``family``) in place; returns what was fused,
    for the log. Parameters, buffers and module names are untouched; a dropout that is not the stock class (the
    memory kit's) is left as it is, and so is the block around it."""
    fused = {"dropout": 0, "dropout + residual add": 0}
    for module in model.modules():
        if type(module) is nn.Dropout:
            module.__class__ = PackedBitsDropout  # a subclass without state: same attributes, same state dict
            fused["dropout"] += 1
    for module in model.modules():
        if type(module).__name__ in family.residual_norm_blocks and type(getattr(module, "dropout", None)) is (
            PackedBitsDropout
        ):
            module.forward = types.MethodType(_residual_norm_forward, module)
            fused["dropout + residual add"] += 1
    return [f"{what} x{count}" for what, count in fused.items() if count]


__all__ = [
    "KEEP_LEVELS",
    "PackedBitsDropout",
    "dropout",
    "dropout_add",
    "fuse_encoder",
    "keep_factors",
    "keep_levels",
    "keep_mask",
    "keep_scale",
    "packed_keep_mask_op",
    "packed_bits",
]
