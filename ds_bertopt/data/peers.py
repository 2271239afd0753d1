"""The figures of every planner, ours and the peers', on global plans (every rank of every step): what
``ds-bertopt balance`` and ``bench/balance*.py`` print.

* the length mixes the comparisons run on (:func:`mlperf_phase2_lengths`, :func:`read_lengths`,
  :func:`simulation_lengths`);
* :func:`evaluate`: every strategy's epoch plan and its figures under a cost model;
* the peers, other libraries' planners driven as their trainers drive them (:data:`PEERS`, :func:`peer_plan`):
  transformers' ``BatchRebalanceSampler`` (which training can also run, so it lives with the sampler) and
  DeepSpeed's ``batch_by_seqlens`` (hook ``data_sampling.batch_by_seqlens`` in :mod:`ds_bertopt.compat.deepspeed`).

Benchmark arithmetic: the sampler, the plan and the cost model never import it.
"""

from __future__ import annotations

import dataclasses
import os
import random
import time
from typing import Optional

import numpy as np

from ..compat import deepspeed as ds_compat
from ..errors import DataError
from .config import STRATEGIES, SamplerConfig
from .cost import CostModel, PlanFigures, plan_figures, slot_lengths
from .plan import Plan, plan_epoch, ragged_indices


# ------------------------------------------------------------------------------------------------
# the figures of every planner, ours and the peers' (global plans: every rank of every step)
# ------------------------------------------------------------------------------------------------
PEERS = ("hf_batch_rebalance", "ds_batch_by_seqlens")
"""Other libraries' planners :func:`peer_plan` drives: transformers' ``BatchRebalanceSampler`` and DeepSpeed's
``batch_by_seqlens`` (Hugging Face ``group_by_length`` is ``sorted_megabatch``). Both plan globally (every rank
plans every rank's steps): their algorithms, kept as they are."""

MLPERF_BIN_RATIO = (6, 3, 2, 5)  # bins 1–128 / 129–256 / 257–384 / 385–512 of MLPerf BERT phase 2
MLPERF_SPIKE = 0.8  # share of the last bin at exactly 512 (Wikipedia's full-length spike)


def mlperf_phase2_lengths(n: int, rng: np.random.Generator, spike: float = MLPERF_SPIKE) -> np.ndarray:
    """Lengths in bins 1–128/129–256/257–384/385–512 in the ratio 6:3:2:5, uniform within a bin, with
    ``spike`` of the last bin at exactly 512."""
    ratio = np.asarray(MLPERF_BIN_RATIO, dtype=np.float64)
    which = rng.choice(len(ratio), size=n, p=ratio / ratio.sum())
    lengths = which * 128 + rng.integers(1, 129, size=n)
    lengths[(which == len(ratio) - 1) & (rng.random(n) < spike)] = 512
    return lengths.astype(np.int64)


def read_lengths(path: str) -> np.ndarray:
    """Sequence lengths from ``.npy`` or text (integers separated by white space or commas)."""
    if not os.path.isfile(path):
        raise DataError(f"lengths file {path} does not exist")
    try:
        if path.endswith(".npy"):
            lengths = np.load(path, allow_pickle=False)
        else:
            with open(path, encoding="utf-8") as fh:
                lengths = np.asarray(fh.read().replace(",", " ").split(), dtype=np.int64)
    except (ValueError, OSError) as exc:
        raise DataError(f"lengths file {path}: {str(exc).splitlines()[0]}") from None
    lengths = np.asarray(lengths).ravel()
    if lengths.size == 0 or not np.issubdtype(lengths.dtype, np.integer) or lengths.min() < 1:
        raise DataError(f"lengths file {path}: needs positive integer lengths, one per sequence")
    return lengths.astype(np.int64)


def simulation_lengths(lengths: np.ndarray, global_batch: int, steps: int, rng: np.random.Generator) -> np.ndarray:
    """The corpus itself if it fills ``steps`` global batches, else ``steps + 1`` batches drawn from its mix."""
    if len(lengths) >= steps * global_batch:
        return lengths
    return rng.choice(lengths, size=(steps + 1) * global_batch)  # one spare batch: stratification drops a little


@dataclasses.dataclass
class StrategyResult:
    plan: Plan
    figures: PlanFigures
    seconds: float
    """Planning CPU seconds per step on one rank (every rank plans every step of the plan). CPU, not wall
    time: the planners are single-threaded, and on a shared machine wall time counts the other jobs."""
    note: str = ""


def evaluate(
    lengths: np.ndarray,
    *,
    world_size: int,
    ranks_per_node: int,
    micro_batch: int,
    grad_accum: int,
    cfg: SamplerConfig,
    cost: CostModel,
    seed: int = 0,
    strategies: tuple[str, ...] = STRATEGIES,
    peers: tuple[str, ...] = (),
    peer_budget_s: Optional[float] = None,
) -> dict[str, StrategyResult]:
    """Plan epoch 0 with every strategy (and ``peers``, see :func:`peer_plan`) and measure it with ``cost``."""
    out = {}
    for strategy in strategies:
        start = time.process_time()
        plan = plan_epoch(
            lengths,
            world_size=world_size,
            ranks_per_node=ranks_per_node,
            micro_batch=micro_batch,
            grad_accum=grad_accum,
            strategy=strategy,
            cfg=cfg,
            seed=seed,
            epoch=0,
        )
        seconds = (time.process_time() - start) / plan.steps
        figures = plan_figures(slot_lengths(plan.indices, lengths), cost, cfg.pad_multiple)
        out[strategy] = StrategyResult(plan, figures, seconds)
    for peer in peers:
        plan, seconds, note = peer_plan(
            peer,
            lengths,
            world_size=world_size,
            micro_batch=micro_batch,
            grad_accum=grad_accum,
            seed=seed,
            budget_s=peer_budget_s,
        )
        note = f"global, a peer's algorithm (every rank plans every rank's steps): {note}"
        out[peer] = StrategyResult(
            plan, plan_figures(slot_lengths(plan.indices, lengths), cost, cfg.pad_multiple), seconds, note
        )
    return out


# ------------------------------------------------------------------------------------------------
# other libraries' planners, driven as their trainers drive them
# ------------------------------------------------------------------------------------------------
def ds_token_packs(lengths: np.ndarray, max_tokens: int, seed: int) -> list[np.ndarray]:
    """The micro-batches of DeepSpeed's ``batch_by_seqlens`` (the same in 0.16-0.19) (``deepspeed.runtime.data_pipeline.
    data_sampling.variable_batch_size_and_lr``) with ``sequence_picking_order="random"``, ``min_batch_size``
    1, no ``max_batch_size``, before its trim to whole batches, in linear time.

    It shuffles ``(length, id)`` pairs with ``random.Random(seed)``, drops samples longer than
    ``max_tokens``, then from each start keeps the longest run whose lengths sum to at most
    ``max_tokens`` (it tries every end, so its cost grows with the cube of the samples: hopeless at
    16,384 samples a step, hence this copy of its rule, checked against it by :func:`check_ds_token_packs`);
    the ends it tries stop before the last sample, which is never batched.
    """
    metrics = list(zip([int(v) for v in lengths], range(len(lengths))))
    random.Random(seed).shuffle(metrics)
    values = np.fromiter((m[0] for m in metrics), dtype=np.int64, count=len(metrics))
    ids = np.fromiter((m[1] for m in metrics), dtype=np.int64, count=len(metrics))
    keep = values <= max_tokens
    values, ids = values[keep], ids[keep]
    prefix = np.concatenate([[0], np.cumsum(values)])
    last = len(values) - 1  # batch ends are exclusive and stop before the last sample
    packs, start = [], 0
    while start < last:
        end = min(int(np.searchsorted(prefix, prefix[start] + max_tokens, side="right")) - 1, last)
        if end <= start:
            break
        packs.append(ids[start:end])
        start = end
    return packs


def check_ds_token_packs(lengths: np.ndarray, max_tokens: int, effective_batch_size: int, seed: int) -> bool:
    """Whether :func:`ds_token_packs` (trimmed to whole batches) equals DeepSpeed's own ``batch_by_seqlens``."""
    batch_by_seqlens = ds_compat.batch_by_seqlens()
    if batch_by_seqlens is None:
        raise DataError("deepspeed's data_sampling.variable_batch_size_and_lr.batch_by_seqlens is missing or changed")

    theirs, _, _ = batch_by_seqlens(
        [int(v) for v in lengths],
        max_tokens,
        sequence_picking_order="random",
        effective_batch_size=effective_batch_size,
        seed=seed,
    )
    ours = ds_token_packs(lengths, max_tokens, seed)
    ours = ours[: len(ours) - len(ours) % effective_batch_size]
    return [list(ids) for _, ids in theirs] == [mb.tolist() for mb in ours]


def ds_max_tokens_for(lengths: np.ndarray, micro_batch: int, seed: int, sample: int = 20_000) -> int:
    """The smallest ``max_tokens`` at which :func:`ds_token_packs` holds ``micro_batch`` samples per pack on
    average (on a random subset of ``sample`` lengths): DeepSpeed's steps then hold a global batch on average."""
    rng = np.random.default_rng(seed)
    subset = rng.choice(lengths, size=min(sample, len(lengths)), replace=False)
    lo, hi = int(lengths.max()), int(micro_batch * lengths.max())
    while lo < hi:
        mid = (lo + hi) // 2
        packs = ds_token_packs(subset, mid, seed)
        if sum(len(p) for p in packs) >= micro_batch * len(packs):
            hi = mid
        else:
            lo = mid + 1
    return lo


def ds_batch_by_seqlens_plan(
    lengths: np.ndarray,
    *,
    world_size: int,
    micro_batch: int,
    grad_accum: int,
    seed: int = 0,
    max_tokens: Optional[int] = None,
    packs_per_micro: int = 1,
) -> tuple[Plan, float, str]:
    """DeepSpeed's dynamic batching as ``get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed``
    wires it: ``effective_batch_size`` = ``train_batch_size`` packs (``packs_per_micro`` = its
    ``train_micro_batch_size_per_gpu`` × accumulation × world) per step, the packs dealt by a
    ``DistributedSampler(shuffle=False)`` (rank ``r`` gets packs ``r, r + world, …``) and a ``DataLoader``
    of ``packs_per_micro`` packs per micro-step. ``max_tokens`` caps a pack (default: the smallest at which a
    pack holds ``micro_batch / packs_per_micro`` samples on average, :func:`ds_max_tokens_for`, so a step
    holds about a global batch); samples per step vary (DeepSpeed scales the LR with them).
    """
    max_tokens = max_tokens or ds_max_tokens_for(lengths, max(1, micro_batch // packs_per_micro), seed)
    start = time.process_time()
    packs = ds_token_packs(lengths, max_tokens, seed)
    per_step = packs_per_micro * grad_accum * world_size
    steps = len(packs) // per_step
    if steps == 0:
        raise DataError(
            f"ds_batch_by_seqlens: {len(packs)} packs of ≤ {max_tokens} tokens, fewer than one step's {per_step}"
        )
    plan_steps = [
        [
            [
                np.concatenate(
                    [
                        packs[((s * grad_accum + a) * packs_per_micro + t) * world_size + r]
                        for t in range(packs_per_micro)
                    ]
                ).tolist()
                for a in range(grad_accum)
            ]
            for r in range(world_size)
        ]
        for s in range(steps)
    ]
    seconds = (time.process_time() - start) / steps
    indices = ragged_indices(plan_steps)
    return (
        Plan(indices, len(lengths) - int((indices >= 0).sum()), "ds_batch_by_seqlens"),
        seconds,
        f"max_tokens {max_tokens}, {packs_per_micro} pack(s) per micro-step, order random",
    )


def peer_plan(
    name: str,
    lengths: np.ndarray,
    *,
    world_size: int,
    micro_batch: int,
    grad_accum: int,
    seed: int = 0,
    budget_s: Optional[float] = None,
) -> tuple[Plan, float, str]:
    """One of :data:`PEERS`: ``(plan, planning seconds per step on one rank, how it was driven)``."""
    if name == "hf_batch_rebalance":  # transformers' planner, global by design: every rank plans every rank's steps
        from .sampler import hf_batch_rebalance_plan  # imports torch

        return hf_batch_rebalance_plan(
            lengths, world_size=world_size, micro_batch=micro_batch, grad_accum=grad_accum, seed=seed, budget_s=budget_s
        )
    if name == "ds_batch_by_seqlens":
        return ds_batch_by_seqlens_plan(
            lengths, world_size=world_size, micro_batch=micro_batch, grad_accum=grad_accum, seed=seed
        )
    raise DataError(f"peer {name!r} is not one of {', '.join(PEERS)}")


def per_global_batch(figures: PlanFigures, global_batch: int) -> float:
    """Scale for a planner whose steps hold a varying number of samples: step time per ``global_batch`` samples."""
    return global_batch / figures.samples_per_step
