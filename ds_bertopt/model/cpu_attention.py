"""Exact attention of packed sequences on the CPU, forward and backward by hand: what a backward needs is kept by the
forward, nothing is recomputed, and attention dropout can draw packed bits.

Pure functions on ``[T, heads, head_dim]`` tensors split into sequences by ``lengths``; ``window`` >= 0 is local
attention (``|i - j| <= window``), -1 global.

* :func:`flash_forward` / :func:`flash_backward` — eager's own no-dropout CPU kernel per sequence
  (``_scaled_dot_product_flash_attention_for_cpu`` and its backward, torch 2.13), keeping the per-row logsumexp.
* :func:`math_forward` / :func:`math_backward` — with dropout: SDPA's CPU math path (scores, softmax, dropout on the
  probabilities, ``@ v``), keeping the probabilities (fp32 for fp32/bf16) and the keep-mask (bool) flat, 5 bytes a
  score where eager's autograd through ``F.scaled_dot_product_attention`` keeps 12 (softmax output, the float noise,
  the dropped probabilities). The mask is drawn one of two ways:

  - ``packed_bits=False``: SDPA's own draws, one ``bernoulli_`` of ``[1, heads, n, n]`` a sequence, in order (the
    compiled op then equals eager SDPA under one seed). On a bool tensor that draw runs one element at a time.
  - ``packed_bits=True`` (``model.fused_dropout``): one :func:`.fused.keep_mask` draw for every score of the
    micro-batch, 16 random bits an element, rescaled by :func:`.fused.keep_scale`.

* :class:`PackedBitsAttention` — the eager autograd glue of the math pair with packed bits: what
  :func:`.unpadded.sdpa_loop_attention` runs on the CPU under ``model.fused_dropout`` when attention dropout is on.
  On 16 sequences of the seq-128 mix (12 heads of 64, fp32, 2 threads, 12 layers forward + backward) it took 0.72x
  the time of the SDPA loop with dropout; a whole BERT-base step showed no measurable gain on an AVX2 CPU.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from . import fused

PROFILE_NAME = "ds_bertopt::packed_attention_dropout"
"""The profiler range around :class:`PackedBitsAttention`'s forward and backward: ``testing.step_split`` counts
what runs inside it as attention (its name holds ``packed_attention``)."""


def band_mask(length: int, window: int, device: torch.device) -> torch.Tensor:
    """``[length, length]`` True where ``|i - j| <= window`` (a bidirectional local-attention layer)."""
    positions = torch.arange(length, device=device)
    return (positions[:, None] - positions[None, :]).abs() <= window


def band(n: int, window: int, device: torch.device) -> Optional[torch.Tensor]:
    """The band a sequence of ``n`` needs, ``None`` where every pair is inside it (or ``window`` is -1)."""
    return band_mask(n, window, device) if 0 <= window < n - 1 else None


def _additive_band(n: int, window: int, like: torch.Tensor) -> Optional[torch.Tensor]:
    """The band as the flash CPU kernel takes it: additive, in the query's dtype (SDPA's
    ``convert_boolean_attn_mask`` before it dispatches)."""
    mask = band(n, window, like.device)
    return None if mask is None else torch.zeros((), dtype=like.dtype).masked_fill(~mask, float("-inf"))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for fp16/bf16 (SDPA's CPU math path computes low precision in fp32), else the inputs' own."""
    return torch.promote_types(dtype, torch.float32)


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """``[n, heads, d]`` -> ``[heads, n, d]`` in :func:`_compute_dtype`."""
    return x.transpose(0, 1).to(_compute_dtype(x.dtype))


def flash_forward(query, key, value, lengths: Sequence[int], scale, window: int):
    """Eager's no-dropout CPU kernel per sequence: the output and its logsumexp, flat (sequence by sequence)."""
    outs, lses = [], []
    for q, k, v in zip(query.split(lengths), key.split(lengths), value.split(lengths)):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            *(x.transpose(0, 1)[None] for x in (q, k, v)), attn_mask=_additive_band(q.shape[0], window, q), scale=scale
        )
        outs.append(out[0].transpose(0, 1))
        lses.append(lse.reshape(-1))
    return torch.cat(outs), torch.cat(lses)


def flash_backward(grad, query, key, value, out, lse, lengths: Sequence[int], scale, window: int):
    grads, offset = [], 0
    for g, q, k, v, o in zip(*(x.split(lengths) for x in (grad, query, key, value, out))):
        n, heads = q.shape[:2]
        grads.append(
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                *(x.transpose(0, 1)[None] for x in (g, q, k, v, o)),
                lse[offset : offset + heads * n].view(1, heads, n),
                0.0,
                False,
                attn_mask=_additive_band(n, window, q),
                scale=scale,
            )
        )
        offset += heads * n
    return tuple(torch.cat([g[i][0].transpose(0, 1) for g in grads]) for i in range(3))


def inverse_keep(dropout_p: float, packed_bits: bool) -> float:
    """What kept probabilities are multiplied by: ``1 / (1 - p)``, or the packed bits' exact inverse keep rate."""
    return fused.keep_scale(dropout_p) if packed_bits else 1.0 / (1.0 - dropout_p)


def math_forward(query, key, value, lengths: Sequence[int], dropout_p: float, scale, window: int, packed_bits: bool):
    """Attention with dropout on its probabilities, per sequence: ``(out, probs, keep)``, the last two flat
    (``heads * sum(n^2)``, sequence by sequence) for :func:`math_backward`. The mask comes from torch's default
    generator (``packed_bits``: see the module docstring)."""
    heads, dim = query.shape[1:]
    root = (dim**-0.5 if scale is None else scale) ** 0.5  # SDPA scales q and k by its square root each
    count = heads * sum(n * n for n in lengths)
    probs = query.new_empty(count, dtype=_compute_dtype(query.dtype))
    if packed_bits:
        keep = fused.keep_mask((count,), dropout_p, query.device)
    else:
        keep = torch.empty(count, dtype=torch.bool, device=query.device)
    rescale = inverse_keep(dropout_p, packed_bits)
    outs, offset = [], 0
    for q, k, v in zip(query.split(lengths), key.split(lengths), value.split(lengths)):
        n = q.shape[0]
        scores = torch.matmul(_heads_first(q) * root, (_heads_first(k) * root).transpose(-2, -1))
        mask = band(n, window, q.device)
        if mask is not None:
            scores.masked_fill_(~mask, float("-inf"))
        p = probs[offset : offset + heads * n * n].view(1, heads, n, n)
        torch.ops.aten._softmax.out(scores[None], -1, False, out=p)
        kept = keep[offset : offset + heads * n * n].view(1, heads, n, n)
        if not packed_bits:
            kept.bernoulli_(1.0 - dropout_p)
        out = torch.matmul(p[0] * kept[0], _heads_first(v)).mul_(rescale)
        outs.append(out.transpose(0, 1).to(query.dtype))
        offset += heads * n * n
    return torch.cat(outs), probs, keep


def math_backward(grad, query, key, value, probs, keep, lengths: Sequence[int], dropout_p, scale, packed_bits: bool):
    """Gradients of :func:`math_forward`'s output with respect to ``query``, ``key``, ``value``, from its kept
    probabilities and mask (the band is already in the probabilities: zero outside it)."""
    heads, dim = query.shape[1:]
    scale = dim**-0.5 if scale is None else scale
    rescale = inverse_keep(dropout_p, packed_bits)
    grads, offset = [], 0
    for g, q, k, v in zip(*(x.split(lengths) for x in (grad, query, key, value))):
        n = q.shape[0]
        p = probs[offset : offset + heads * n * n].view(heads, n, n)
        kept = keep[offset : offset + heads * n * n].view(heads, n, n)
        g = _heads_first(g)
        grad_v = torch.matmul((p * kept).transpose(-2, -1), g).mul_(rescale)
        grad_p = torch.matmul(g, _heads_first(v).transpose(-2, -1)).mul_(kept)  # rescale folded in below
        grad_s = torch._softmax_backward_data(grad_p, p, -1, p.dtype)
        grad_q = torch.matmul(grad_s, _heads_first(k)).mul_(scale * rescale)
        grad_k = torch.matmul(grad_s.transpose(-2, -1), _heads_first(q)).mul_(scale * rescale)
        grads.append((grad_q, grad_k, grad_v))
        offset += heads * n * n
    return tuple(torch.cat([g[i].transpose(0, 1) for g in grads]).to(query.dtype) for i in range(3))


class PackedBitsAttention(torch.autograd.Function):
    """Eager attention with packed-bits dropout: ``apply(query, key, value, lengths, dropout_p, scale, window)``.

    Activation checkpointing replays it: the mask is drawn from torch's default generator, whose state
    ``torch.utils.checkpoint`` restores before recomputing."""

    @staticmethod
    def forward(ctx, query, key, value, lengths, dropout_p, scale, window):
        with torch.profiler.record_function(PROFILE_NAME), torch.autocast(query.device.type, enabled=False):
            out, probs, keep = math_forward(query, key, value, lengths, dropout_p, scale, window, packed_bits=True)
        ctx.save_for_backward(query, key, value, probs, keep)
        ctx.options = (lengths, dropout_p, scale)
        return out

    @staticmethod
    def backward(ctx, grad):
        query, key, value, probs, keep = ctx.saved_tensors
        lengths, dropout_p, scale = ctx.options
        with torch.profiler.record_function(PROFILE_NAME), torch.autocast(query.device.type, enabled=False):
            grads = math_backward(grad, query, key, value, probs, keep, lengths, dropout_p, scale, packed_bits=True)
        return (*grads, None, None, None, None)
