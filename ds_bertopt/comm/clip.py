"""The math of bucket-wise clipping: pure functions on tensors, no DeepSpeed, no process group.

For rank r and bucket b with local gradient g_b^r (accumulated over micro-batches, loss scale
included when there is one)::

    g_b^r  <-  g_b^r * min(1, tau_b / (||g_b^r|| + eps))          then allreduce-average over ranks

* ``uniform`` thresholds: tau_b = max_norm / sqrt(B) for B buckets, so
  ||g^r||^2 = sum_b ||g_b^r||^2 <= B * tau_b^2 = max_norm^2: each rank's whole local gradient has
  norm <= max_norm after clipping.
* ``proportional`` thresholds: tau_b = max_norm * sqrt(n_b / n) (n_b elements in the bucket, n in
  all buckets); again sum_b tau_b^2 = max_norm^2, but big buckets get a bigger share.
* B = 1 is "local clipping before allreduce".
* A bucket whose norm is inf or NaN is left exactly as it is (coefficient 1), so DeepSpeed's
  overflow check and loss scaler still see the overflow after the allreduce.
* Nothing here calls ``.item()``: the coefficient stays a 0-d tensor on the gradient's device.
"""

from __future__ import annotations

import math
from typing import Iterable, Literal, Optional, Sequence, Union

import torch

Threshold = Union[float, torch.Tensor]


def bucket_thresholds(
    bucket_numels: Sequence[int], max_norm: float, mode: Literal["uniform", "proportional"] = "uniform"
) -> list[float]:
    """Per-bucket thresholds tau_b whose squares sum to ``max_norm**2`` (see module docstring)."""
    if not bucket_numels:
        return []
    if mode == "uniform":
        return [max_norm / math.sqrt(len(bucket_numels))] * len(bucket_numels)
    if mode == "proportional":
        total = sum(bucket_numels)
        return [max_norm * math.sqrt(n / total) for n in bucket_numels]
    raise ValueError(f"threshold mode must be 'uniform' or 'proportional', got {mode!r}")


def _norm_dtype(dtype: torch.dtype) -> torch.dtype:
    # bf16/fp16 norms are computed in fp32; fp64 stays fp64
    return torch.promote_types(dtype, torch.float32)


def clip_coefficient(norm: torch.Tensor, threshold: Threshold, eps: float) -> torch.Tensor:
    """``min(1, threshold / (norm + eps))``, or exactly 1 where ``norm`` is inf/NaN."""
    coef = (threshold / (norm + eps)).clamp(max=1.0)
    return torch.where(torch.isfinite(norm), coef, torch.ones_like(coef))


def clip_bucket_(
    flat: torch.Tensor, threshold: Threshold, *, eps: float = 1e-6, post_scale: float = 1.0
) -> torch.Tensor:
    """Clip one flat gradient bucket in place; return the clip coefficient (a 0-d tensor).

    ``post_scale`` is folded into the same multiply (e.g. ``1 / world`` to pre-divide for an
    allreduce-average), so the bucket is read twice (norm) and written once.
    """
    norm = torch.linalg.vector_norm(flat, dtype=_norm_dtype(flat.dtype))
    coef = clip_coefficient(norm, threshold, eps)
    flat.mul_(coef * post_scale if post_scale != 1.0 else coef)
    return coef


def clip_tensors_(
    tensors: Sequence[torch.Tensor], threshold: Threshold, *, eps: float = 1e-6, post_scale: float = 1.0
) -> torch.Tensor:
    """:func:`clip_bucket_` for a bucket held as separate tensors (their joint norm is clipped)."""
    if not tensors:
        raise ValueError("clip_tensors_: empty bucket")
    dtype = _norm_dtype(tensors[0].dtype)
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t, dtype=dtype) for t in tensors]))
    coef = clip_coefficient(norm, threshold, eps)
    factor = coef * post_scale if post_scale != 1.0 else coef
    for t in tensors:
        t.mul_(factor)
    return coef


def assign_buckets(numels: Sequence[int], bucket_size: int, keys: Optional[Sequence[object]] = None) -> list[list[int]]:
    """Group items, taken in the order given, into buckets of at most ``bucket_size`` elements.

    Items are gradients in the order they are expected to become ready (reverse registration
    order for a module). A bucket is closed when the next item of its key (dtype) would overflow
    it, so an item larger than ``bucket_size`` gets a bucket of its own; this is the rule of
    DeepSpeed's IPG buckets (``DeepSpeedZeroOptimizer.reduce_independent_p_g_buckets_and_remove_grads``
    in 0.19.8). Items of different ``keys`` never share a bucket. Buckets are returned in the
    order they close (the last one of each key at the end), as lists of indices into ``numels``.
    """
    if bucket_size <= 0:
        raise ValueError(f"bucket_size must be positive, got {bucket_size}")
    keys = [None] * len(numels) if keys is None else list(keys)
    if len(keys) != len(numels):
        raise ValueError("assign_buckets: keys and numels differ in length")
    open_buckets: dict[object, tuple[list[int], int]] = {}
    closed: list[list[int]] = []
    for index, (numel, key) in enumerate(zip(numels, keys)):
        members, size = open_buckets.get(key, ([], 0))
        if members and size + numel > bucket_size:
            closed.append(members)
            members, size = [], 0
        members.append(index)
        open_buckets[key] = (members, size + numel)
    tail = [members for members, _ in open_buckets.values() if members]
    return closed + sorted(tail, key=lambda members: members[-1])


def reverse_registration_buckets(
    params: Iterable[torch.Tensor], bucket_size: int, key=lambda p: p.dtype
) -> list[list[int]]:
    """Buckets over ``params`` (registration order) filled from the last parameter backwards.

    Returns lists of indices into ``list(params)``.
    """
    params = list(params)
    order = list(range(len(params) - 1, -1, -1))
    buckets = assign_buckets([params[i].numel() for i in order], bucket_size, [key(params[i]) for i in order])
    return [[order[j] for j in members] for members in buckets]
