"""Batch planning: which samples each rank processes in each step (pure, no communication).

``plan_epoch`` returns an int64 array ``[steps, world_size, grad_accum, micro_batch]`` of sample
indices. Every rank computes the same plan from (seed, epoch), so ranks agree without talking.
Samples that do not fill a whole global batch at the end of an epoch are dropped and counted.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError


@dataclass(frozen=True)
class Plan:
    indices: np.ndarray
    """``[steps, world_size, grad_accum, micro_batch]`` sample indices."""
    dropped: int
    """Samples left out this epoch (fewer than one global batch)."""

    @property
    def steps(self) -> int:
        return self.indices.shape[0]


def _epoch_rng(seed: int, epoch: int) -> np.random.Generator:
    return np.random.default_rng([seed, epoch])


def plan_epoch(lengths: np.ndarray, *, world_size: int, ranks_per_node: int, micro_batch: int, grad_accum: int,
               strategy: str = "random", seed: int = 0, epoch: int = 0) -> Plan:
    n = len(lengths)
    global_batch = world_size * grad_accum * micro_batch
    steps = n // global_batch
    if steps == 0:
        raise ConfigError(f"the corpus has {n} training sequences, fewer than one global batch of {global_batch} "
                          f"(world {world_size} × accumulation {grad_accum} × micro-batch {micro_batch})")
    rng = _epoch_rng(seed, epoch)
    if strategy != "random":
        raise ConfigError(f"sampler.strategy: {strategy!r} is not implemented yet")
    order = rng.permutation(n)[: steps * global_batch]
    return Plan(indices=order.reshape(steps, world_size, grad_accum, micro_batch).astype(np.int64),
                dropped=n - steps * global_batch)
