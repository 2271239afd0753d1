"""Bucket-wise gradient clipping before allreduce (``"bertopt": {"bucket_clip": {...}}``).

Each rank clips each bucket of its local gradient to a per-bucket threshold as soon as the bucket
is ready in backward, then the bucket is allreduce-averaged; no global norm is computed. See
``docs/bucket_clip.md`` for the math, the config keys and measured figures.

* :mod:`.clip` — the pure math (:func:`clip_bucket_`, :func:`bucket_thresholds`, :func:`assign_buckets`);
* :mod:`.zero0` / :mod:`.zero12` — one small adapter per ZeRO stage (DeepSpeed internals via :mod:`ds_bertopt.compat`);
* :func:`install_bucket_clip` — called by ``ds_bertopt.engine.initialize`` when enabled;
* :func:`register_ddp_bucket_clip` — the same clip as a ``DistributedDataParallel`` comm hook.
"""

from .clip import (
    assign_buckets,
    bucket_thresholds,
    clip_bucket_,
    clip_coefficient,
    clip_tensors_,
    reverse_registration_buckets,
)
from .config import BucketClipConfig
from .ddp import register_ddp_bucket_clip
from .install import install_bucket_clip

__all__ = [
    "BucketClipConfig",
    "install_bucket_clip",
    "register_ddp_bucket_clip",
    "clip_bucket_",
    "clip_tensors_",
    "clip_coefficient",
    "bucket_thresholds",
    "assign_buckets",
    "reverse_registration_buckets",
]
