"""The batch sampler the training loop iterates: this rank's slice of the epoch plan, resumable.

Every rank builds the same :func:`~ds_bertopt.data.plan.plan_epoch` from the shared seed and takes
its own row, so no communication is needed and every rank gets exactly ``grad_accum`` micro-batches
per optimizer step. ``next_step()`` returns one step's micro-batches; iterating the sampler (as a
``torch.utils.data`` batch sampler) yields the rest of the epoch micro-batch by micro-batch. With the
packed strategies micro-batches vary in size (the plan's unused ``-1`` slots are never returned).

State is ``(epoch, step)`` plus a fingerprint of what the plan depends on (lengths, world, node size,
batch shape, sampler config, seed): the plan is a pure function of these and the epoch, so resuming
needs only the position, and a checkpoint from a different setup is refused instead of silently
replaying other samples. A new epoch re-plans with a new order.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Iterator, Optional

import numpy as np
import torch.utils.data

from ..errors import BertOptError
from .config import SamplerConfig
from .plan import Plan, plan_epoch

LATER_KEYS = ("micro_batch_tokens", "max_micro_batch_samples")  # SamplerConfig keys added with the packed plans


class PlanBatchSampler(torch.utils.data.Sampler):
    def __init__(
        self,
        lengths: np.ndarray,
        *,
        rank: int,
        world_size: int,
        ranks_per_node: int,
        micro_batch: int,
        grad_accum: int,
        cfg: SamplerConfig,
        seed: int,
    ):
        if not 0 <= rank < world_size:
            raise BertOptError(f"sampler: rank {rank} is outside world size {world_size}")
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.rank = rank
        self.world_size = world_size
        self.ranks_per_node = ranks_per_node
        self.micro_batch = micro_batch
        self.grad_accum = grad_accum
        self.cfg = cfg
        self.seed = seed
        self.epoch = 0
        self.step = 0  # next step within the epoch
        self._plan: Optional[Plan] = None
        self._edges: Optional[np.ndarray] = None
        self.fingerprint = self._fingerprint()

    def _fingerprint(self) -> str:
        digest = hashlib.sha1(self.lengths.tobytes())
        cfg = dataclasses.asdict(self.cfg)
        for key in LATER_KEYS:  # unset, they change no plan: checkpoints from before they existed still resume
            if cfg[key] is None:
                del cfg[key]
        digest.update(
            json.dumps(
                [self.world_size, self.ranks_per_node, self.micro_batch, self.grad_accum, self.seed, cfg],
                sort_keys=True,
                default=list,
            ).encode()
        )
        return digest.hexdigest()[:16]

    def plan(self) -> Plan:
        """The current epoch's plan for all ranks (computed once per epoch)."""
        if self._plan is None:
            self._plan = plan_epoch(
                self.lengths,
                world_size=self.world_size,
                ranks_per_node=self.ranks_per_node,
                micro_batch=self.micro_batch,
                grad_accum=self.grad_accum,
                cfg=self.cfg,
                seed=self.seed,
                epoch=self.epoch,
                bin_edges=self._edges,
            )
            self._edges = self._plan.bin_edges  # quantile bins depend on the corpus only
        return self._plan

    @property
    def steps_per_epoch(self) -> int:
        return self.plan().steps

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.step, self._plan = epoch, 0, None

    def next_step(self) -> list[list[int]]:
        """This rank's micro-batches for the next optimizer step (moves to a new epoch when one ends).

        ``grad_accum`` lists of sample indices, each non-empty, longest sample first. Fixed-size strategies:
        ``micro_batch`` indices each. Packed strategies: any number (at most ``max_micro_batch_samples``); the
        rank's step holds a varying number of samples while the step's global batch holds exactly ``world ×
        grad_accum × micro_batch``, so normalise the loss over the whole step, not per micro-batch.
        """
        if self.step >= self.steps_per_epoch:
            self.set_epoch(self.epoch + 1)
        micro = self.plan().indices[self.step, self.rank]
        self.step += 1
        return [row[row >= 0].tolist() for row in micro]  # packed plans: -1 marks an unused slot

    def __iter__(self) -> Iterator[list[int]]:
        """The rest of the current epoch, micro-batch by micro-batch."""
        while self.step < self.steps_per_epoch:
            yield from self.next_step()

    def __len__(self) -> int:
        return (self.steps_per_epoch - self.step) * self.grad_accum

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "step": self.step,
            "seed": self.seed,
            "strategy": self.cfg.strategy,
            "num_samples": int(len(self.lengths)),
            "world_size": self.world_size,
            "fingerprint": self.fingerprint,
        }

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("fingerprint")
        if saved is not None and saved != self.fingerprint:
            raise BertOptError(
                f"sampler: the checkpoint's plan fingerprint {saved} differs from this run's "
                f"{self.fingerprint} (corpus, world size, ranks per node, batch shape, sampler config "
                "or seed changed); resume with the same setup or start a new output_dir"
            )
        epoch, step = int(state["epoch"]), int(state["step"])
        self.epoch, self._plan = epoch, None
        if not 0 <= step <= self.steps_per_epoch:
            raise BertOptError(f"sampler: checkpoint step {step} is outside the epoch's {self.steps_per_epoch} steps")
        self.step = step
