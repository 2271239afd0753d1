"""ZeRO stage 0 adapter: our own buckets, filled by per-parameter hooks, reduced asynchronously.

DeepSpeed (0.16-0.19) at stage 0 reduces nothing until backward has finished:
``DeepSpeedEngine._backward_epilogue`` calls ``DeepSpeedEngine.allreduce_gradients``, which
flattens every gradient (``buffered_allreduce_fallback`` -> ``allreduce_bucket``), allreduces,
and copies the result back (``allreduce_and_copy``). Here instead:

* parameters are grouped into buckets of ``bucket_size`` elements in reverse registration order
  (:func:`~ds_bertopt.comm.clip.reverse_registration_buckets`);
* at the accumulation boundary, ``register_post_accumulate_grad_hook`` copies each finished
  gradient into its slot of the bucket's flat buffer and points ``param.grad`` at that slot;
* when a bucket is complete it is clipped (:func:`~ds_bertopt.comm.clip.clip_bucket_`, with the
  pre-allreduce factor of the average folded in, :func:`~ds_bertopt.comm.scaling.averaging_factors`;
  a ``gradient_predivide_factor`` other than 1 leaves a post-allreduce factor, applied after the
  wait) and its ``all_reduce(async_op=True)`` is launched on the
  data-parallel group while backward continues. Buckets are launched strictly in index order so
  every rank issues the same collectives in the same order;
* the engine's ``allreduce_gradients`` is replaced by :meth:`ZeroStage0BucketClip.finish_reduction`:
  stage what the hooks did not see (unused parameters get zeros, as DeepSpeed's
  ``_get_gradients_for_reduction`` does), launch the remaining buckets, wait on all handles.

Non-boundary micro-batches accumulate in ``param.grad`` as usual; nothing is sent for them. The engine's
internals this reads and replaces go through :mod:`ds_bertopt.compat.deepspeed` (hook ``engine.allreduce_gradients``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..compat import deepspeed as ds_compat
from .clip import bucket_thresholds, clip_bucket_, reverse_registration_buckets
from .config import BucketClipConfig
from .scaling import averaging_factors, loss_scale_reader


class ZeroStage0BucketClip:
    """Installed by :func:`ds_bertopt.comm.install_bucket_clip` at ZeRO stage 0."""

    stage = 0

    def __init__(self, engine, cfg: BucketClipConfig):
        self.engine = engine
        self.cfg = cfg
        reduction = ds_compat.engine_reduction(engine)
        self.group = reduction.group
        self.world = dist.get_world_size(group=reduction.group)
        self.params = [p for p in engine.module.parameters() if p.requires_grad and p.numel() > 0]
        self.comm_dtype = reduction.comm_dtype
        self.pre_scale, self.post_scale = averaging_factors(
            self.world, average=reduction.average, postscale=reduction.postscale, predivide=reduction.predivide
        )
        self.scale_of_loss = loss_scale_reader(engine.optimizer, engine.fp16_enabled())
        self.buckets = reverse_registration_buckets(self.params, cfg.bucket_size)
        self.bucket_numels = [sum(self.params[i].numel() for i in members) for members in self.buckets]
        self.thresholds = bucket_thresholds(self.bucket_numels, cfg.max_norm, cfg.threshold)
        self._where: list[tuple[int, int]] = [(-1, -1)] * len(self.params)  # param -> (bucket, offset)
        for b, members in enumerate(self.buckets):
            offset = 0
            for i in members:
                self._where[i] = (b, offset)
                offset += self.params[i].numel()
        self._buffers: list[Optional[torch.Tensor]] = [None] * len(self.buckets)
        self._copy_back = any(p.dtype != self.comm_dtype for p in self.params)
        self.last_coefficients: list[Optional[torch.Tensor]] = [None] * len(self.buckets)
        """Clip coefficient of each bucket in the last reduction (0-d tensors; 1 = not clipped)."""
        self._reset()
        self._hook_handles = [
            p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self.params)
        ]
        ds_compat.replace_engine_allreduce(engine, self.finish_reduction)

    # -- per-backward state --------------------------------------------------------------------
    def _reset(self) -> None:
        self._staged = [False] * len(self.params)
        self._pending = [len(members) for members in self.buckets]
        self._next_launch = 0
        self._handles: list = []

    def _buffer(self, b: int) -> torch.Tensor:
        if self._buffers[b] is None:
            device = self.params[self.buckets[b][0]].device
            self._buffers[b] = torch.empty(self.bucket_numels[b], dtype=self.comm_dtype, device=device)
        return self._buffers[b]

    def _slot(self, i: int) -> torch.Tensor:
        b, offset = self._where[i]
        return self._buffer(b).narrow(0, offset, self.params[i].numel())

    def _stage(self, i: int) -> None:
        """Move parameter ``i``'s gradient into its bucket slot (zeros if it has none)."""
        param, slot = self.params[i], self._slot(i)
        grad = param.grad
        if grad is None:
            slot.zero_()
        elif grad.is_sparse:
            raise RuntimeError("bucket_clip: sparse gradients (e.g. nn.Embedding(sparse=True)) are not supported")
        elif grad.data_ptr() != slot.data_ptr():
            slot.view_as(param).copy_(grad)
        if not self._copy_back:
            param.grad = slot.view_as(param)
        self._staged[i] = True

    def _make_hook(self, i: int):
        def on_grad_ready(param: torch.Tensor) -> None:
            if ds_compat.engine_defers_reduction(self.engine):
                return  # accumulate locally; reduce once at the boundary
            if self._staged[i]:
                raise RuntimeError(
                    f"bucket_clip: a parameter of shape {tuple(param.shape)} received its gradient twice in one "
                    "backward (reentrant activation checkpointing?); use non-reentrant checkpointing "
                    "(use_reentrant=False) with bucket_clip at ZeRO stage 0"
                )
            self._stage(i)
            b = self._where[i][0]
            self._pending[b] -= 1
            if self._pending[b] == 0:
                self._launch_ready()

        return on_grad_ready

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets) and self._pending[self._next_launch] == 0:
            self._launch(self._next_launch)
            self._next_launch += 1

    def _launch(self, b: int) -> None:
        flat = self._buffer(b)
        threshold = self.thresholds[b] * self.scale_of_loss()
        self.last_coefficients[b] = clip_bucket_(flat, threshold, eps=self.cfg.eps, post_scale=self.pre_scale)
        self._handles.append(dist.all_reduce(flat, group=self.group, async_op=True))

    # -- replaces DeepSpeedEngine.allreduce_gradients -------------------------------------------
    def finish_reduction(self, bucket_size=None) -> None:  # noqa: ARG002 - DeepSpeed's allreduce_gradients signature
        """Finish the reduction started in backward: flush the remaining buckets, wait for all."""
        engine = self.engine
        boundary = engine.is_gradient_accumulation_boundary()
        ds_compat.tell_optimizer_boundary(engine.optimizer, boundary)
        if not boundary:
            return
        for b in range(self._next_launch, len(self.buckets)):
            for i in self.buckets[b]:
                if not self._staged[i]:
                    self._stage(i)
            self._pending[b] = 0
        self._launch_ready()
        for handle in self._handles:
            handle.wait()
        if self.post_scale != 1.0:
            for b in range(len(self.buckets)):
                self._buffer(b).mul_(self.post_scale)
        if self._copy_back:
            for i, param in enumerate(self.params):
                reduced = self._slot(i).view_as(param)
                if param.grad is None:
                    param.grad = reduced.to(param.dtype)
                else:
                    param.grad.copy_(reduced)
        self._reset()

    def layout(self) -> list[list[torch.nn.Parameter]]:
        """The parameters of each bucket, in launch order."""
        return [[self.params[i] for i in members] for members in self.buckets]

    def remove(self) -> None:
        """Take the hooks out and give the engine its own ``allreduce_gradients`` back."""
        for handle in self._hook_handles:
            handle.remove()
        ds_compat.restore_engine_allreduce(self.engine)
