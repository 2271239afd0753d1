"""``model.compile``: the unpadded encoder's layers under ``torch.compile``, one graph per layer for every length.

Two things keep a compiled layer whole and its compiles few:

* **Attention is one opaque op.** The exact per-sequence attention (:func:`.unpadded.packed_attention`) loops over the
  packed sequences, whose lengths change every step; traced, each length mix would be a new graph. Under compile the
  layer calls :func:`packed_attention_op` instead (``torch.library.custom_op``: Dynamo puts it in the graph as one
  node, reads nothing but tensor shapes, and Inductor calls it as it is), so the graph holds no sequence length and
  no break. Its backward is a second op that recomputes the attention with autograd (the same kernels as eager) from
  a seed drawn in the graph, so attention dropout's mask is the forward's.
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

from . import unpadded

OP_NAMESPACE = "ds_bertopt"
OP_VERSION = 2
"""In the ops' names (``torch.ops.ds_bertopt.packed_attention_v2`` / ``packed_attention_backward_v2``): Inductor's
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


@torch.library.custom_op(f"{OP_NAMESPACE}::packed_attention_v{OP_VERSION}", mutates_args=())
def packed_attention_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    seed: torch.Tensor,
    max_seqlen: int,
    dropout_p: float,
    scale: Optional[float],
    window: int,
    backend: str,
) -> torch.Tensor:
    """:func:`.unpadded.packed_attention` as one op: ``[T, heads, head_dim]`` in and out; ``seed`` (an int64 scalar on
    the CPU) seeds the attention dropout; ``window`` -1: global attention."""
    out = _attend(query, key, value, cu_seqlens, seed, max_seqlen, dropout_p, scale, window, backend)
    return out.clone() if out.data_ptr() == query.data_ptr() else out  # an op's output never aliases its input


@packed_attention_op.register_fake
def _(query, key, value, cu_seqlens, seed, max_seqlen, dropout_p, scale, window, backend):
    return torch.empty_like(query)


@torch.library.custom_op(f"{OP_NAMESPACE}::packed_attention_backward_v{OP_VERSION}", mutates_args=())
def packed_attention_backward_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    seed: torch.Tensor,
    grad: torch.Tensor,
    max_seqlen: int,
    dropout_p: float,
    scale: Optional[float],
    window: int,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`packed_attention_op` with respect to ``query``, ``key``, ``value``: the forward recomputed
    under autograd with the same seed (the same dropout mask), then its backward."""
    with torch.enable_grad(), _autograd_dispatch():
        inputs = [x.detach().requires_grad_() for x in (query, key, value)]
        out = _attend(*inputs, cu_seqlens, seed, max_seqlen, dropout_p, scale, window, backend)
        grads = torch.autograd.grad(out, inputs, grad)
    return tuple(g.contiguous() for g in grads)


@packed_attention_backward_op.register_fake
def _(query, key, value, cu_seqlens, seed, grad, max_seqlen, dropout_p, scale, window, backend):
    return tuple(torch.empty_like(x) for x in (query, key, value))


def _setup_context(ctx, inputs, output) -> None:
    query, key, value, cu_seqlens, seed, *ctx.options = inputs
    ctx.save_for_backward(query, key, value, cu_seqlens, seed)


def _backward(ctx, grad):
    query, key, value, cu_seqlens, seed = ctx.saved_tensors
    grads = packed_attention_backward_op(query, key, value, cu_seqlens, seed, grad, *ctx.options)
    return (*grads, None, None, None, None, None, None, None)


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
        max_seqlen,
        float(dropout_p),
        scale,
        -1 if window is None else int(window),
        packing.backend,
    )


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
