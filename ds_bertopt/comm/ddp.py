"""The same clip as a ``torch.nn.parallel.DistributedDataParallel`` communication hook.

For users outside DeepSpeed: ``register_ddp_bucket_clip(ddp_model, cfg)`` makes every DDP bucket be
clipped on each rank (:func:`~ds_bertopt.comm.clip.clip_bucket_`) right before its allreduce.
DDP decides its buckets itself and rebuilds them after the first iteration, so the number of
buckets B is not known when the first bucket is ready: only ``threshold: "proportional"``
(tau_b = max_norm * sqrt(n_b / n), which needs no B) is offered here.
"""

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..errors import ConfigError
from .clip import clip_bucket_
from .config import BucketClipConfig


@dataclass
class DDPBucketClipState:
    max_norm: float
    eps: float
    total_numel: int
    """Elements of all gradients DDP reduces (n)."""
    group: Optional[dist.ProcessGroup]
    loss_scale: Optional[Callable[[], object]] = None
    """Returns the current loss scale (e.g. a GradScaler's scale tensor) when gradients are scaled."""


def ddp_bucket_clip_hook(state: DDPBucketClipState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    # no `from __future__ import annotations` here: DDP checks this return annotation at registration
    flat = bucket.buffer()
    threshold = state.max_norm * math.sqrt(flat.numel() / state.total_numel)
    if state.loss_scale is not None:
        threshold = threshold * state.loss_scale()
    clip_bucket_(flat, threshold, eps=state.eps, post_scale=1.0 / dist.get_world_size(group=state.group))
    work = dist.all_reduce(flat, group=state.group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def register_ddp_bucket_clip(
    ddp_model: torch.nn.parallel.DistributedDataParallel,
    cfg: BucketClipConfig,
    loss_scale: Optional[Callable[[], object]] = None,
) -> DDPBucketClipState:
    """Register :func:`ddp_bucket_clip_hook` on ``ddp_model``; return its state."""
    if cfg.threshold != "proportional":
        raise ConfigError(
            f"bucket_clip.threshold: {cfg.threshold!r} is not available with torch DDP (its bucket "
            'count is only known after backward); use "proportional"'
        )
    total = sum(p.numel() for p in ddp_model.module.parameters() if p.requires_grad)
    state = DDPBucketClipState(
        max_norm=cfg.max_norm, eps=cfg.eps, total_numel=total, group=ddp_model.process_group, loss_scale=loss_scale
    )
    ddp_model.register_comm_hook(state, ddp_bucket_clip_hook)
    return state
