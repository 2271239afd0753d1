"""The batch sampler the training loop iterates: this rank's slice of the epoch plan, resumable.

Yields one list of sample indices per micro-batch (``grad_accum`` of them per optimizer step).
State is ``(epoch, step)``: the plan is a pure function of (seed, epoch), so resuming only needs
the position. A new epoch re-plans with a new order.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np
import torch.utils.data

from .config import SamplerConfig
from .plan import Plan, plan_epoch


class PlanBatchSampler(torch.utils.data.Sampler):
    def __init__(self, lengths: np.ndarray, *, rank: int, world_size: int, ranks_per_node: int,
                 micro_batch: int, grad_accum: int, cfg: SamplerConfig, seed: int):
        self.lengths = np.asarray(lengths)
        self.rank = rank
        self.world_size = world_size
        self.ranks_per_node = ranks_per_node
        self.micro_batch = micro_batch
        self.grad_accum = grad_accum
        self.cfg = cfg
        self.seed = seed
        self.epoch = 0
        self.step = 0  # next step within the epoch
        self._plan: Plan | None = None

    def plan(self) -> Plan:
        if self._plan is None:
            self._plan = plan_epoch(self.lengths, world_size=self.world_size, ranks_per_node=self.ranks_per_node,
                                    micro_batch=self.micro_batch, grad_accum=self.grad_accum,
                                    strategy=self.cfg.strategy, seed=self.seed, epoch=self.epoch)
        return self._plan

    @property
    def steps_per_epoch(self) -> int:
        return self.plan().steps

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.step, self._plan = epoch, 0, None

    def next_step(self) -> list[list[int]]:
        """This rank's micro-batches for the next optimizer step (moves to a new epoch when one ends)."""
        if self.step >= self.steps_per_epoch:
            self.set_epoch(self.epoch + 1)
        micro = self.plan().indices[self.step, self.rank]
        self.step += 1
        return [row.tolist() for row in micro]

    def __iter__(self) -> Iterator[list[int]]:
        """The rest of the current epoch, micro-batch by micro-batch."""
        while self.step < self.steps_per_epoch:
            yield from self.next_step()

    def __len__(self) -> int:
        return (self.steps_per_epoch - self.step) * self.grad_accum

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "step": self.step, "seed": self.seed, "strategy": self.cfg.strategy,
                "num_samples": int(len(self.lengths)), "world_size": self.world_size}

    def load_state_dict(self, state: dict) -> None:
        self.set_epoch(int(state["epoch"]))
        self._plan = None
        self.step = int(state["step"])
