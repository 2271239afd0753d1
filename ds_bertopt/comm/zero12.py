"""ZeRO stage 1/2 adapter: clip each of DeepSpeed's IPG buckets just before DeepSpeed reduces it.

In every supported DeepSpeed (0.16-0.19) each gradient reduction of ``DeepSpeedZeroOptimizer`` (stages 1 and 2) goes
through ``DeepSpeedZeroOptimizer.reduce_ipg_grads``: the backward hooks
(``reduce_independent_p_g_buckets_and_remove_grads``) call it for a full bucket, and the epilogue
(``independent_gradient_partition_epilogue``) calls it for the last partial one. At that point the
bucket ``optimizer.ipg_buckets[dtype]`` holds this rank's unreduced gradients: with
``contiguous_gradients`` in ``bucket.buffer[bucket.index][:bucket.elements]`` (a parameter larger
than the bucket is alone in ``bucket.grads``), otherwise as the tensors in ``bucket.grads``.
We wrap that one method on the optimizer instance: clip, then call DeepSpeed's own. Every internal this reads goes
through :mod:`ds_bertopt.compat.deepspeed` (hooks ``zero.reduce_ipg_grads`` and ``zero.ipg_bucket``), which also
answers for 0.16's bucket (fields of the optimizer instead of an ``IPGBucket``).

The ``1/world`` of the average is folded into the clip's multiply, and DeepSpeed's own division
is switched off for the duration of that call (``optimizer.gradient_average``, read by
``average_tensor``, ``gradient_reduction_w_predivide`` and ``allreduce_bucket`` in 0.19), so
the bucket is scaled once instead of twice. With a ``gradient_predivide_factor`` other than 1 (or
``postscale_gradients`` off), and before 0.19 (no such switch), DeepSpeed's own averaging is left in place and only
the clip runs: the same result, the bucket written twice.

Streams (CUDA): the bucket may have been filled by copies on several streams; DeepSpeed records
them in ``bucket.copy_streams`` and makes its reduction stream wait on each (``average_tensor``,
DeepSpeed issue #8061), or, with ZeRO-Offload, records an event per producer in ``bucket.ready_events``
and waits on those alone. The clip reads and writes the bucket, so it first makes the current stream
wait on those producers, and then registers itself in both, so that the reduction waits for the clip
(:func:`wait_for_bucket_producers`, :func:`register_clip_as_producer`).

The buckets are DeepSpeed's: filled in the order the gradients become ready, closed when the next
one would overflow ``reduce_bucket_size``, which we set to ``bucket_clip.bucket_size``.

What is clipped, with gradient accumulation (GAS micro-batches per step, each backward scaled by 1/GAS):

* stage 1 reduces once, at the accumulation boundary: the bucket holds the locally accumulated
  gradient, clipped to tau_b — the same quantity as at stage 0;
* stage 2 reduces every micro-batch: the bucket holds that micro-batch's gradient (already
  divided by GAS), clipped to tau_b / GAS. Each micro-batch is clipped as if it were a whole step,
  and by the triangle inequality the rank's accumulated bucket still has norm <= tau_b.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from ..compat import deepspeed as ds_compat
from ..log import print0
from .clip import assign_buckets, clip_bucket_, clip_tensors_
from .config import BucketClipConfig
from .scaling import averaging_factors, loss_scale_reader


class ZeroStage12BucketClip:
    """Installed by :func:`ds_bertopt.comm.install_bucket_clip` at ZeRO stages 1 and 2."""

    def __init__(self, engine, cfg: BucketClipConfig):
        self.engine = engine
        self.cfg = cfg
        self.optimizer = opt = engine.optimizer
        self.stage = engine.zero_optimization_stage()
        reduction = ds_compat.zero_reduction(opt)
        if reduction.bucket_size != cfg.bucket_size:
            print0(
                f"bucket_clip: ZeRO reduce bucket size {reduction.bucket_size} -> bucket_clip.bucket_size "
                f"{cfg.bucket_size} (the clip buckets are DeepSpeed's IPG buckets)"
            )
            ds_compat.set_zero_bucket_size(opt, cfg.bucket_size)
        self.reduction = reduction = ds_compat.zero_reduction(opt)
        self.params = [p for group in reduction.groups for p in group if p.requires_grad and p.numel() > 0]
        self.total_numel = sum(p.numel() for p in self.params)
        self.expected_layout = self._expected_layout()
        self.num_buckets = len(self.expected_layout)
        """B of the uniform threshold: the number of buckets DeepSpeed's rule gives in the expected order."""
        self._micro_divisor = engine.gradient_accumulation_steps() if reduction.stage2 else 1
        world = dist.get_world_size(group=reduction.group)
        before, after = averaging_factors(
            world, average=reduction.average, postscale=reduction.postscale, predivide=reduction.predivide
        )
        # fold the average into the clip only when DeepSpeed's split is "all of it before the reduction" and this
        # release lets the reduction skip its own division (0.19)
        self.fold_average = reduction.average and after == 1.0 and ds_compat.can_suspend_average(opt)
        self.post_scale = before if self.fold_average else 1.0
        self.scale_of_loss = loss_scale_reader(opt, engine.fp16_enabled())
        self._warned_layout = False
        self._current: list[list[torch.nn.Parameter]] = []
        self.last_layout: list[list[torch.nn.Parameter]] = []
        """The parameters of each bucket reduced in the last backward, in reduction order."""
        self.last_coefficients: list[torch.Tensor] = []
        """Clip coefficient of each of those buckets (0-d tensors; 1 = not clipped)."""
        self._coefficients: list[torch.Tensor] = []
        self._original = ds_compat.replace_zero_reduce(opt, self.clip_then_reduce)
        ds_compat.after_backward_reduction(opt, self._end_of_backward)

    def _expected_layout(self) -> list[list[torch.nn.Parameter]]:
        """Buckets as DeepSpeed will fill them: reverse registration order when the backward hooks
        reduce (stage 2, or stage 1 with overlap_comm), group order otherwise (stage 1 reduces after
        backward in ``DeepSpeedZeroOptimizer.reduce_gradients``)."""
        opt, reduction = self.optimizer, self.reduction
        if reduction.stage2 or reduction.overlapped:
            registered = [p for p in self.engine.module.parameters() if p.requires_grad and p.numel() > 0]
            order = list(reversed(registered))
        else:
            order = list(self.params)
        buckets = assign_buckets(
            [p.numel() for p in order], reduction.bucket_size, [ds_compat.param_comm_dtype(opt, p) for p in order]
        )
        return [[order[i] for i in members] for members in buckets]

    def threshold(self, numel: int):
        if self.cfg.threshold == "uniform":
            tau = self.cfg.max_norm / math.sqrt(self.num_buckets)
        else:
            tau = self.cfg.max_norm * math.sqrt(numel / self.total_numel)
        return tau * self.scale_of_loss() / self._micro_divisor

    def _clip(self, comm_dtype) -> None:
        bucket = ds_compat.ipg_bucket(self.optimizer, comm_dtype)
        if not bucket.params:
            return
        accelerator = get_accelerator()
        current = ds_compat.wait_for_bucket_producers(bucket, accelerator)
        if bucket.flat is not None:
            threshold = self.threshold(bucket.elements)
            coef = clip_bucket_(bucket.flat, threshold, eps=self.cfg.eps, post_scale=self.post_scale)
        else:
            threshold = self.threshold(sum(g.numel() for g in bucket.grads))
            coef = clip_tensors_(bucket.grads, threshold, eps=self.cfg.eps, post_scale=self.post_scale)
        ds_compat.register_as_producer(bucket, accelerator, current)
        self._coefficients.append(coef)
        self._current.append([self.reduction.groups[g][i] for g, i, _ in bucket.params])

    def clip_then_reduce(self, comm_dtype: Optional[torch.dtype] = None):
        """Clip the bucket(s) about to be reduced, then run DeepSpeed's ``reduce_ipg_grads``."""
        dtypes = [comm_dtype] if comm_dtype is not None else ds_compat.ipg_bucket_dtypes(self.optimizer)
        for dtype in dtypes:
            self._clip(dtype)
        with ds_compat.average_suspended(self.optimizer, self.fold_average):  # done in the clip
            return self._original(comm_dtype)

    def _end_of_backward(self) -> None:
        """After DeepSpeed's epilogue: this backward's reduction is complete."""
        if not self._current:
            return  # stage 1 between accumulation boundaries reduces nothing
        self.last_layout, self._current = self._current, []
        self.last_coefficients, self._coefficients = self._coefficients, []
        if not self._warned_layout and len(self.last_layout) != self.num_buckets:
            self._warned_layout = True
            print0(
                f"bucket_clip: warning: DeepSpeed reduced {len(self.last_layout)} buckets, expected "
                f"{self.num_buckets} (gradients became ready in an unexpected order); uniform thresholds keep "
                f"using B = {self.num_buckets}"
            )

    def layout(self) -> list[list[torch.nn.Parameter]]:
        """The parameters of each bucket DeepSpeed is expected to reduce, in order."""
        return self.expected_layout

    def remove(self) -> None:
        ds_compat.restore_zero_reduce(self.optimizer)
