"""The batch sampler the training loop iterates: this rank's steps, planned a window at a time, resumable.

Every rank plans from the shared seed, without talking, but only what it needs: a window of
``window_steps`` steps for its own node's ranks (:meth:`~ds_bertopt.data.plan.Planner.window`; the
step's global draw is the same on every rank, only this node's pool is dealt). The next window is planned
in a background thread while this one is consumed, so no step waits for planning; memory is the compact
lengths, every bin's members (2 bytes a sample) and a few windows, not the epoch's plan for every rank.
The rows are bit-identical to the whole-epoch plan (:meth:`PlanBatchSampler.plan`, the reference).
``next_step()`` returns one step's micro-batches; iterating the sampler (as a ``torch.utils.data`` batch
sampler) yields the rest of the epoch micro-batch by micro-batch. With the packed strategies micro-batches
vary in size (the plan's unused ``-1`` slots are never returned).

``hf_batch_rebalance`` runs transformers' ``BatchRebalanceSampler`` as its ``Trainer`` builds it: a peer's
algorithm, global by design (every rank plans every rank's whole epoch), one window = one epoch.

State is ``(epoch, step)`` plus a fingerprint of what the plan depends on (lengths, world, node size,
batch shape, sampler config, seed, the planner's definition): the plan is a pure function of these and
the epoch, so resuming needs only the position (the window around it is planned again), and a checkpoint
from a different setup is refused instead of silently replaying other samples. A new epoch re-plans with
a new order. Copies (``copy.copy``, as the loop's loader takes one) share the planned windows; a pickled
sampler (a DataLoader worker) plans its own.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import threading
import time
from typing import Callable, Iterator, Optional

import numpy as np
import torch.utils.data

from ..errors import BertOptError, ConfigError, DataError
from .config import PEER_STRATEGIES, SamplerConfig
from .plan import Plan, Planner, compact_lengths, plan_epoch, ragged_indices

WINDOW_STEPS = 32  # steps planned at a time: big enough to vectorise, small enough for a quick first step
PLAN_VERSION = 2  # 2: the epoch's order is a keyed permutation (issue 32); 1: numpy's shuffled permutation
KEEP_WINDOWS = 4  # windows kept by the copies of a sampler: the current and the next of each of two readers
LOGGED_WINDOWS = 4096  # planning times and waits kept for the figures (a run may plan millions of windows)


# ------------------------------------------------------------------------------------------------
# transformers' BatchRebalanceSampler: a peer's planner, global
# ------------------------------------------------------------------------------------------------
def hf_batch_rebalance_plan(
    lengths: np.ndarray,
    *,
    world_size: int,
    micro_batch: int,
    grad_accum: int,
    seed: int = 0,
    epoch: int = 0,
    per_rank: Optional[bool] = None,
    budget_s: Optional[float] = None,
) -> tuple[Plan, float, str]:
    """transformers' ``BatchRebalanceSampler`` (``transformers.trainer_pt_utils``), as ``Trainer`` builds it:
    ``effective_batch_size`` = the global batch, one sampler per rank (``Trainer._get_train_sampler``), with
    ``drop_last=True`` (``Trainer`` passes ``dataloader_drop_last``): the partial last batch is left out, as
    our plans leave it out. Global: every rank plans every rank's steps (its algorithm; not windowed here).

    ``per_rank`` (default: up to 64 ranks) iterates every rank's sampler, its public interface; otherwise,
    since every rank computes the whole step plan, the step's samples are taken as its ``__iter__`` takes
    them (``torch.randperm`` seeded with ``seed + epoch``, consecutive global batches) and its ``_assign``
    is called once per step. ``budget_s``: stop after the step that exceeds this many seconds (at least
    one step). Returns ``(plan, planning seconds per step on one rank, note)``.
    """
    try:
        from transformers.trainer_pt_utils import BatchRebalanceSampler
    except ImportError as exc:
        raise DataError(f"transformers.trainer_pt_utils.BatchRebalanceSampler is missing ({exc})") from None
    global_batch = world_size * micro_batch * grad_accum
    values = [int(v) for v in lengths]
    make = lambda rank: BatchRebalanceSampler(
        values,
        effective_batch_size=global_batch,
        dp_size=world_size,
        grad_accum=grad_accum,
        shuffle=True,
        seed=seed,
        rank=rank,
    )
    total = len(values) // global_batch
    if per_rank if per_rank is not None else world_size <= 64:
        per_rank_mbs, seconds = [], []
        for rank in range(world_size):
            sampler = make(rank)
            sampler.set_epoch(epoch)
            start = time.process_time()
            mbs = list(sampler)
            seconds.append((time.process_time() - start) / total)
            per_rank_mbs.append(mbs)
        steps = [
            [[per_rank_mbs[r][s * grad_accum + a] for a in range(grad_accum)] for r in range(world_size)]
            for s in range(total)
        ]
        how = "per-rank iterators"
        per_step = float(np.mean(seconds))
    else:
        sampler = make(0)
        if not callable(getattr(sampler, "_assign", None)):
            raise DataError(
                "transformers' BatchRebalanceSampler has no _assign(indices, lengths) any more; drive it "
                "per rank (per_rank=True)"
            )
        generator = torch.Generator()
        generator.manual_seed(seed + epoch)  # as BatchRebalanceSampler.__iter__ draws its order
        order = torch.randperm(len(values), generator=generator).tolist()
        steps, spent = [], 0.0
        for s in range(total):
            batch = order[s * global_batch : (s + 1) * global_batch]
            start = time.process_time()
            steps.append(sampler._assign(batch, [values[i] for i in batch]))
            spent += time.process_time() - start
            if budget_s is not None and spent > budget_s:
                break
        how = f"_assign once per step, {len(steps)} of {total} steps"
        per_step = spent / len(steps)
    indices = ragged_indices(steps)
    return Plan(indices, len(values) - int((indices >= 0).sum()), "hf_batch_rebalance"), per_step, how


class PeerPlanner:
    """:func:`hf_batch_rebalance_plan` behind the planner's interface: one window is the whole epoch."""

    def __init__(self, lengths, *, world_size: int, ranks_per_node: int, micro_batch: int, grad_accum: int, seed: int):
        self.lengths = compact_lengths(lengths)
        if world_size % ranks_per_node:
            raise ConfigError(f"world size {world_size} is not a multiple of ranks per node {ranks_per_node}")
        self.world_size, self.ranks_per_node = world_size, ranks_per_node
        self.micro_batch, self.grad_accum = micro_batch, grad_accum
        self.seed, self.edges = seed, None
        global_batch = world_size * micro_batch * grad_accum
        self.steps = len(self.lengths) // global_batch
        if self.steps == 0:
            raise ConfigError(
                f"the corpus has {len(self.lengths)} training sequences, fewer than one global batch of {global_batch}"
            )
        self.dropped = len(self.lengths) - self.steps * global_batch

    def plan(self, epoch: int) -> Plan:
        return hf_batch_rebalance_plan(
            self.lengths,
            world_size=self.world_size,
            micro_batch=self.micro_batch,
            grad_accum=self.grad_accum,
            seed=self.seed,
            epoch=epoch,
        )[0]

    def window(self, epoch: int, index: int, size: int, node: int) -> np.ndarray:
        rpn = self.ranks_per_node
        return self.plan(epoch).indices[:, node * rpn : (node + 1) * rpn]


# ------------------------------------------------------------------------------------------------
# windows planned ahead
# ------------------------------------------------------------------------------------------------
class _Job:
    """One window being planned (in a background thread, or by the reader that needs it first)."""

    def __init__(self, plan: Callable[[], np.ndarray]):
        self._plan, self.done = plan, threading.Event()
        self.rows: Optional[np.ndarray] = None
        self.error: Optional[BaseException] = None
        self.seconds = 0.0

    def run(self) -> None:
        started = time.perf_counter()
        try:
            self.rows = self._plan()
        except BaseException as exc:  # handed to the reader of this window, on its thread
            self.error = exc
        finally:
            self.seconds = time.perf_counter() - started
            self.done.set()


class PlannedWindows:
    """Windows of one rank's plan, keyed ``(epoch, index)``: planned in the background when asked ahead,
    kept for the last few keys, shared by the copies of a sampler. Thread-safe."""

    def __init__(self, plan: Callable[[int, int], np.ndarray], keep: int = KEEP_WINDOWS):
        self._plan, self._keep = plan, keep
        self._lock = threading.Lock()
        self._jobs: collections.OrderedDict = collections.OrderedDict()
        self.waits: collections.deque = collections.deque(maxlen=LOGGED_WINDOWS)
        """``(key, seconds)`` for every read that found its window not yet planned (the last ones)."""
        self.planned: collections.deque = collections.deque(maxlen=LOGGED_WINDOWS)
        """``(key, seconds)`` of every window planned, in the order they finished (the last ones)."""

    def _job(self, key: tuple[int, int]) -> tuple[_Job, bool]:
        with self._lock:
            job = self._jobs.get(key)
            fresh = job is None
            if fresh:
                job = self._jobs[key] = _Job(lambda: self._plan(*key))
            self._jobs.move_to_end(key)
            while len(self._jobs) > self._keep:
                self._jobs.popitem(last=False)
        return job, fresh

    def _run(self, key: tuple[int, int], job: _Job) -> None:
        job.run()
        with self._lock:
            self.planned.append((key, job.seconds))

    def prefetch(self, key: tuple[int, int]) -> None:
        """Start planning ``key`` in a background thread (nothing if it is planned or under way)."""
        job, fresh = self._job(key)
        if fresh:
            # not a daemon: the interpreter waits for a window being planned at exit (at most one window's time)
            # instead of killing the thread inside numpy's C++ sorts, which aborts the process
            threading.Thread(target=self._run, args=(key, job), name=f"plan-window-{key}").start()

    def get(self, key: tuple[int, int]) -> np.ndarray:
        """The window's rows: planned already, or waited for, or planned here."""
        job, fresh = self._job(key)
        if not job.done.is_set():
            started = time.perf_counter()
            if fresh:
                self._run(key, job)
            job.done.wait()
            with self._lock:
                self.waits.append((key, time.perf_counter() - started))
        if job.error is not None:
            raise job.error
        return job.rows


# ------------------------------------------------------------------------------------------------
# the sampler
# ------------------------------------------------------------------------------------------------
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
        window_steps: int = WINDOW_STEPS,
        prefetch: bool = True,
    ):
        if not 0 <= rank < world_size:
            raise BertOptError(f"sampler: rank {rank} is outside world size {world_size}")
        if window_steps < 1:
            raise BertOptError(f"sampler: window_steps must be at least 1, got {window_steps}")
        shape = dict(
            world_size=world_size, ranks_per_node=ranks_per_node, micro_batch=micro_batch, grad_accum=grad_accum
        )
        if cfg.strategy in PEER_STRATEGIES:
            self.planner = PeerPlanner(lengths, seed=seed, **shape)
            window_steps = self.planner.steps  # a peer plans whole epochs
        else:
            self.planner = Planner(lengths, cfg=cfg, seed=seed, **shape)
        self.lengths = self.planner.lengths
        self.rank, self.node = rank, rank // ranks_per_node
        self.world_size = world_size
        self.ranks_per_node = ranks_per_node
        self.micro_batch = micro_batch
        self.grad_accum = grad_accum
        self.cfg = cfg
        self.seed = seed
        self.window_steps = window_steps
        self.epoch = 0
        self.step = 0  # next step within the epoch
        self.fingerprint = self._fingerprint()
        self._runtime()
        if prefetch:
            self.windows.prefetch(self._key(self.epoch, self.step))

    def _runtime(self) -> None:
        """What a copy shares and a pickle leaves behind: the planned windows, the one being read, the reference."""
        self.windows = PlannedWindows(self._plan_window)
        self._current: Optional[tuple[tuple[int, int], np.ndarray]] = None
        self._reference: Optional[tuple[int, Plan]] = None

    def _plan_window(self, epoch: int, index: int) -> np.ndarray:
        return self.planner.window(epoch, index, self.window_steps, self.node)

    def _fingerprint(self) -> str:
        digest = hashlib.sha1(self.lengths.data)  # the compact lengths, without a copy
        digest.update(
            json.dumps(
                [
                    self.world_size,
                    self.ranks_per_node,
                    self.micro_batch,
                    self.grad_accum,
                    self.seed,
                    dataclasses.asdict(self.cfg),
                    {"plan": PLAN_VERSION},
                ],
                sort_keys=True,
                default=list,
            ).encode()
        )
        return digest.hexdigest()[:16]

    def __copy__(self) -> "PlanBatchSampler":
        other = object.__new__(type(self))
        other.__dict__.update(self.__dict__)  # the planner and the planned windows are shared, the position is not
        return other

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        for key in ("windows", "_current", "_reference"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._runtime()

    def plan(self) -> Plan:
        """The current epoch's plan for every rank, whole: the global reference (tests and tools; training
        never builds it). Cached for the epoch."""
        if self._reference is None or self._reference[0] != self.epoch:
            if isinstance(self.planner, PeerPlanner):
                plan = self.planner.plan(self.epoch)
            else:
                plan = plan_epoch(
                    self.lengths,
                    world_size=self.world_size,
                    ranks_per_node=self.ranks_per_node,
                    micro_batch=self.micro_batch,
                    grad_accum=self.grad_accum,
                    cfg=self.cfg,
                    seed=self.seed,
                    epoch=self.epoch,
                    bin_edges=self.planner.edges,
                )
            self._reference = self.epoch, plan
        return self._reference[1]

    @property
    def steps_per_epoch(self) -> int:
        return self.planner.steps

    @property
    def dropped(self) -> int:
        """Samples left out of every epoch (they do not fill a global batch, or the bins cannot split them)."""
        return self.planner.dropped

    def _key(self, epoch: int, step: int) -> tuple[int, int]:
        return epoch, step // self.window_steps

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.step = epoch, 0
            self.windows.prefetch(self._key(epoch, 0))

    def advance(self) -> None:
        """Move past one step without planning it (a position kept for checkpoints while a copy reads the steps)."""
        if self.step >= self.steps_per_epoch:
            self.epoch, self.step = self.epoch + 1, 0
        self.step += 1

    def next_step(self) -> list[list[int]]:
        """This rank's micro-batches for the next optimizer step (moves to a new epoch when one ends).

        ``grad_accum`` lists of sample indices, each non-empty, longest sample first. Fixed-size strategies:
        ``micro_batch`` indices each. Packed strategies: any number (at most ``max_micro_batch_samples``); the
        rank's step holds a varying number of samples while the step's global batch holds exactly ``world ×
        grad_accum × micro_batch``, so normalise the loss over the whole step, not per micro-batch.
        """
        if self.step >= self.steps_per_epoch:
            self.set_epoch(self.epoch + 1)
        key = self._key(self.epoch, self.step)
        if self._current is None or self._current[0] != key:
            self._current = key, self.windows.get(key)
            last = (key[1] + 1) * self.window_steps >= self.steps_per_epoch
            self.windows.prefetch((key[0] + 1, 0) if last else (key[0], key[1] + 1))
        micro = self._current[1][self.step - key[1] * self.window_steps, self.rank - self.node * self.ranks_per_node]
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
                f"{self.fingerprint} (corpus, world size, ranks per node, batch shape, sampler config, seed "
                "or the planner's definition changed); resume with the same setup or start a new output_dir"
            )
        epoch, step = int(state["epoch"]), int(state["step"])
        if not 0 <= step <= self.steps_per_epoch:
            raise BertOptError(f"sampler: checkpoint step {step} is outside the epoch's {self.steps_per_epoch} steps")
        self.epoch, self.step = epoch, step
        self.windows.prefetch(self._key(epoch, step) if step < self.steps_per_epoch else (epoch + 1, 0))
