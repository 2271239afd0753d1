"""``model.compile``: the unpadded encoder's layers under ``torch.compile``, one graph per layer for every length.

Two things keep a compiled layer whole and its compiles few:

* **Attention is one opaque op.** The exact per-sequence attention (:func:`.unpadded.packed_attention`) loops over the
  packed sequences, whose lengths change every step; traced, each length mix would be a new graph. Under compile the
  layer calls :func:`packed_attention_op` instead (``torch.library.custom_op``: Dynamo puts it in the graph as one
  node, reads nothing but tensor shapes, and Inductor calls it as it is), so the graph holds no sequence length and
  no break. The forward op also returns what its backward needs, so nothing is computed twice (:func:`saving_mode`):
  on the CPU, the kernels of :mod:`.cpu_attention` and what they keep (without dropout the flash kernel and its
  logsumexp; with dropout the math path's probabilities and keep-mask, drawn from a seed drawn in the graph as eager
  SDPA draws them, or as packed bits under ``model.fused_dropout``), whose count ``heads * sum(n^2)`` enters the
  graph as the dynamic size of the packing's stride-0 ``scores`` tensor; on CUDA the backward op recomputes the
  forward under autograd from that seed.
* **The packed length is a dynamic dimension.** Every token-wise op runs on ``[1, T, hidden]``; the first length
  compiles a static graph, the second one recompiles it with ``T`` symbolic (Dynamo's automatic dynamic shapes), and
  every later length reuses it: two graphs per layer kind for a whole epoch, and no padding (so nothing to mask: the
  result is exact). The only host integer the op takes, ``max_seqlen`` (flash varlen's grid bound; the SDPA loop does
  not read it), is rounded up the :func:`max_seqlen_bucket` ladder so that it adds at most one graph per power of two.

Compiling uses ``nn.Module.compile`` on each layer: the layer's ``__call__`` runs the compiled code, while its
parameters, module names and ``state_dict`` stay the stock ones (no ``_orig_mod.`` prefix), so checkpoints, ZeRO
partitioning, resume and ``save_pretrained`` are unchanged. Embeddings, heads and the loss stay eager.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from . import cpu_attention, unpadded

OP_NAMESPACE = "ds_bertopt"
OP_VERSION = 4
"""In the ops' names (``torch.ops.ds_bertopt.packed_attention_v4`` / ``packed_attention_backward_v4``): Inductor's
on-disk cache keeps compiled code that calls an op by name, whatever its schema became, so a changed schema takes a
new name."""
LAYER_LISTS = ("layer", "layers")
"""Names of the ``nn.ModuleList`` holding the encoder layers (BERT's ``encoder.layer``, DistilBERT's
``transformer.layer``, ModernBERT's ``layers``)."""


def max_seqlen_bucket(max_seqlen: int) -> int:
    """The power of two at or above ``max_seqlen`` (at least 8): an upper bound flash varlen accepts in place of the
    longest sequence (its grid covers it; blocks past a sequence's end do nothing), from a ladder of few values."""
    return max(8, 1 << (max(1, int(max_seqlen)) - 1).bit_length())


def _autograd_dispatch():
    """Autograd back on inside an op's implementation, which torch runs below autograd (``custom_ops.py``'s
    ``forward_no_grad`` under ``_AutoDispatchBelowAutograd``; torch 2.13): the backward op records the recomputed
    attention to differentiate it. The TLS exclude set, less the autograd keys, nothing else (autocast stays as set)."""
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.AutogradOther)
    for key in ("AutogradCPU", "AutogradCUDA", "AutogradNestedTensor"):
        keys = keys | torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))
    exclude = torch._C._dispatch_tls_local_exclude_set() - keys
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


def _attend(query, key, value, cu_seqlens, seed, max_seqlen, dropout_p, scale, window, backend) -> torch.Tensor:
    """The eager attention on ``[T, heads, head_dim]``, attention dropout drawn from ``seed`` (replayed in backward)."""
    lengths = unpadded.sequence_lengths(cu_seqlens)  # a host sync on an accelerator, as the eager path without hints
    device = query.device
    seeded = dropout_p > 0.0
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], enabled=seeded):
        if seeded:  # the generator SDPA / flash draw from, reseeded inside the fork (restored after)
            generator = torch.cuda.default_generators[device.index or 0] if device.type == "cuda" else None
            (generator or torch.default_generator).manual_seed(int(seed))
        return unpadded.packed_attention(
            query,
            key,
            value,
            cu_seqlens,
            max_seqlen,
            lengths,
            dropout_p=dropout_p,
            scale=scale,
            backend=backend,
            window=None if window < 0 else window,
        )


def saving_mode(device: torch.device, dropout_p: float, backend: str) -> str:
    """What the forward op keeps for its backward. On the CPU, what eager's SDPA keeps for its own backward
    (``F.scaled_dot_product_attention`` dispatches to ``_scaled_dot_product_flash_attention_for_cpu`` without dropout,
    to the composite ``_scaled_dot_product_attention_math`` with it; torch 2.13): ``"flash"`` keeps the per-row
    logsumexp (``[heads, T]``: nothing quadratic), ``"math"`` the softmax probabilities and the dropout keep-mask
    (bool), 5 bytes a score where eager's autograd keeps 12 (softmax output, float noise, dropped probabilities).
    ``"recompute"`` (CUDA, either backend: eager runs flash / memory-efficient kernels there, which keep nothing
    quadratic and draw dropout their own way) keeps the seed and runs the forward again under autograd."""
    if device.type != "cpu" or backend == "varlen":
        return "recompute"
    return "flash" if dropout_p == 0.0 else "math"


def _nothing(like: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return like.new_empty(0, dtype=dtype)  # a fresh one each time: an op's outputs never alias


@torch.library.custom_op(f"{OP_NAMESPACE}::packed_attention_v{OP_VERSION}", mutates_args=())
def packed_attention_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    seed: torch.Tensor,
    scores: torch.Tensor,
    max_seqlen: int,
    dropout_p: float,
    scale: Optional[float],
    window: int,
    backend: str,
    packed_bits: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`.unpadded.packed_attention` as one op: ``[T, heads, head_dim]`` in and out; ``seed`` (an int64 scalar on
    the CPU) seeds the attention dropout; ``scores``: any tensor of ``sum(n^2)`` elements (the packing's stride-0 one),
    so that the graph knows the size of what ``"math"`` keeps; ``window`` -1: global attention; ``packed_bits``: the
    ``"math"`` mode's dropout draws packed bits (``model.fused_dropout``, :mod:`.cpu_attention`). Also returns what its
    backward needs (:func:`saving_mode`): the logsumexp (``[heads * T]``, ``"flash"``), the probabilities and keep-mask
    (flat, ``heads * sum(n^2)``, ``"math"``); empty where a mode does not keep them."""
    mode = saving_mode(query.device, dropout_p, backend)
    if mode == "recompute":
        out = _attend(query, key, value, cu_seqlens, seed, max_seqlen, dropout_p, scale, window, backend)
        out = out.clone() if out.data_ptr() == query.data_ptr() else out  # an op's output never aliases its input
        return out, _nothing(query), _nothing(query), _nothing(query, torch.bool)
    lengths = unpadded.sequence_lengths(cu_seqlens)
    with torch.autocast(query.device.type, enabled=False):
        if mode == "flash":
            out, lse = cpu_attention.flash_forward(query, key, value, lengths, scale, window)
            return out, lse, _nothing(query), _nothing(query, torch.bool)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(seed))
            out, probs, keep = cpu_attention.math_forward(
                query, key, value, lengths, dropout_p, scale, window, packed_bits
            )
        return out, _nothing(query), probs, keep


@packed_attention_op.register_fake
def _(query, key, value, cu_seqlens, seed, scores, max_seqlen, dropout_p, scale, window, backend, packed_bits):
    mode = saving_mode(query.device, dropout_p, backend)
    none = query.new_empty(0, dtype=torch.float32)
    if mode == "math":  # heads * sum(n^2), a dynamic dimension like T (a size computed inside would break the graph)
        kept = scores.shape[0] * query.shape[1]
        return torch.empty_like(query), none, none.new_empty(kept), none.new_empty(kept, dtype=torch.bool)
    lse = none.new_empty(query.shape[0] * query.shape[1]) if mode == "flash" else none
    return torch.empty_like(query), lse, none, none.new_empty(0, dtype=torch.bool)


@torch.library.custom_op(f"{OP_NAMESPACE}::packed_attention_backward_v{OP_VERSION}", mutates_args=())
def packed_attention_backward_op(
    grad: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    probs: torch.Tensor,
    keep: torch.Tensor,
    cu_seqlens: torch.Tensor,
    seed: torch.Tensor,
    max_seqlen: int,
    dropout_p: float,
    scale: Optional[float],
    window: int,
    backend: str,
    packed_bits: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`packed_attention_op` with respect to ``query``, ``key``, ``value`` from what its forward
    kept (``"flash"``: eager's own backward kernel; ``"math"``: the math path's formulas on the kept probabilities
    and mask); ``"recompute"``: the forward again under autograd with the same seed (the same dropout mask)."""
    mode = saving_mode(query.device, dropout_p, backend)
    if mode == "recompute":
        with torch.enable_grad(), _autograd_dispatch():
            inputs = [x.detach().requires_grad_() for x in (query, key, value)]
            attended = _attend(*inputs, cu_seqlens, seed, max_seqlen, dropout_p, scale, window, backend)
            grads = torch.autograd.grad(attended, inputs, grad)
        return tuple(g.contiguous() for g in grads)
    lengths = unpadded.sequence_lengths(cu_seqlens)
    with torch.autocast(query.device.type, enabled=False):
        if mode == "flash":
            return cpu_attention.flash_backward(grad, query, key, value, out, lse, lengths, scale, window)
        return cpu_attention.math_backward(grad, query, key, value, probs, keep, lengths, dropout_p, scale, packed_bits)


@packed_attention_backward_op.register_fake
def _(grad, query, key, value, out, lse, probs, keep, cu_seqlens, seed, max_seqlen, dropout_p, scale, window, *_modes):
    return tuple(torch.empty_like(x) for x in (query, key, value))


def _setup_context(ctx, inputs, output) -> None:
    query, key, value, cu_seqlens, seed, _scores, *ctx.options = inputs
    out, lse, probs, keep = output
    ctx.mark_non_differentiable(lse, probs, keep)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(query, key, value, out, lse, probs, keep, cu_seqlens, seed)


def _backward(ctx, grad, *_kept):
    grads = packed_attention_backward_op(grad, *ctx.saved_tensors, *ctx.options)
    return (*grads, None, None, None, None, None, None, None, None, None)


packed_attention_op.register_autograd(_backward, setup_context=_setup_context)


def compiled_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, packing, dropout_p: float, scale, window
) -> torch.Tensor:
    """What :func:`.unpadded.hf_packed_attention` runs inside a compiled layer: the op, a fresh dropout seed drawn in
    the graph (Inductor's generator, seeded from torch's), ``max_seqlen`` on the :func:`max_seqlen_bucket` ladder."""
    seed = torch.randint(1 << 62, (), dtype=torch.int64) if dropout_p > 0.0 else torch.zeros((), dtype=torch.int64)
    max_seqlen = max_seqlen_bucket(packing.max_seqlen) if packing.backend == "varlen" else 0
    return packed_attention_op(
        query,
        key,
        value,
        packing.cu_seqlens,
        seed,
        packing.scores,
        max_seqlen,
        float(dropout_p),
        scale,
        -1 if window is None else int(window),
        packing.backend,
        packing.packed_bits,
    )[0]


def encoder_layers(model: nn.Module) -> nn.ModuleList:
    """The encoder's layers of a transformers model (the first ``ModuleList`` named in :data:`LAYER_LISTS`)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] in LAYER_LISTS and len(module):
            return module
    raise ValueError(f"model.compile: no encoder layer list ({' / '.join(LAYER_LISTS)}) in {type(model).__name__}")


def compile_layers(model: nn.Module, backend: str = "inductor") -> str:
    """Compile every encoder layer of ``model`` in place (``nn.Module.compile``: parameters and state dict unchanged);
    returns one line for the log. The one place the launcher and ``BertOptTrainer`` compile (through
    :class:`.unpadded.UnpaddedEncoder`'s ``compile``)."""
    layers = encoder_layers(model)
    for layer in layers:
        layer.compile(backend=backend)
    return f"compiled: {len(layers)} {type(layers[0]).__name__} ({backend}, packed length dynamic)"


__all__ = [
    "LAYER_LISTS",
    "compile_layers",
    "compiled_attention",
    "encoder_layers",
    "max_seqlen_bucket",
    "packed_attention_backward_op",
    "packed_attention_op",
]
