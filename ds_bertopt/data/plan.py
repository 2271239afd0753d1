"""Batch planning: which samples each rank processes in each step (pure numpy, no communication).

``plan_epoch`` returns ``Plan.indices``, an int64 array ``[steps, world_size, grad_accum, slots]``
of sample indices. Every rank computes the same plan from (seed, epoch), so ranks agree without
talking, and every rank gets exactly ``steps × grad_accum`` micro-batches. Each sample appears at most
once per epoch; the samples that do not fill a whole global batch are left out and counted
(``Plan.dropped``), different ones each epoch.

For the fixed-size strategies ``slots`` is the micro-batch and every slot holds a sample. The packed
strategies (``packed_node_balance``, ``padded_node_balance``) make micro-batches of varying size: a
step still holds the same ``G`` samples (the global batch keeps its meaning), every rank still gets
``grad_accum`` non-empty micro-batches, but ``slots`` is the largest micro-batch of the epoch and the
unused slots of smaller ones hold ``-1`` (always after the used ones; :func:`ds_bertopt.data.cost.slot_lengths`
turns them into length 0 for the figures). Micro-batch sizes: ``(Plan.indices >= 0).sum(-1)``.

Strategies (``G`` = global batch, ``B = grad_accum × micro_batch`` = a rank's local batch):

* ``random`` — a random permutation cut into global batches: DistributedSampler's behaviour.
* ``sorted_megabatch`` — Hugging Face ``group_by_length`` under Accelerate: random permutation,
  mega-batches of ``megabatch_mult × B`` sorted by length descending
  (``transformers.trainer_pt_utils.get_length_grouped_indices``), cut into micro-batches that
  are dealt round-robin, micro-batch ``j`` to rank ``j % world`` (``accelerate.data_loader.
  BatchSamplerShard._iter_with_no_split``). Little padding, but the ranks of a step hold different
  parts of a sorted mega-batch.
* ``global_sort`` — the step's ``G`` random samples sorted by length and dealt across *all* ranks in
  snake order (needs every rank to load any sample).
* ``stratified`` — length bins; every local batch of a step holds the same number of samples from
  each bin (the counts of :func:`step_bin_counts`), so every rank gets the same length mix.
* ``stratified_node_sort`` — stratified, then the ranks of each node pool their samples, sort them
  and deal them in snake order (0, 1, …, n−1, n−1, …, 0, …): the MLPerf recipe.
* ``stratified_node_balance`` — ours: the stratified draw of ``stratified`` (so a step's global batch
  is the same whatever the node size), then the step's samples are split into node pools with the same
  length profile: sorted by length, consecutive groups of ``nodes`` samples give one sample to every
  node, the longest to the least-loaded node so far (:func:`split_across_nodes`). Each pool is then dealt
  by the cost model: longest first to the least-loaded rank that still has room (every rank gets exactly
  ``B``), then swaps between the busiest and the least-loaded rank. Snake dealing balances a node's
  ranks only approximately and leaves the nodes as unequal as their random draws; both gaps close here.
  With the padded cost and accumulation, micro-batches are runs of consecutive lengths dealt whole
  (see :func:`deal`).
* ``packed_node_balance`` — for kernels that skip padding (cost ``Σ a·L + b·L²`` per micro-batch): the
  draw and node pools of ``stratified_node_balance``; each node pool is packed by the cost model with
  micro-batches of any size: longest first to the least-loaded rank that has room (at most
  ``grad_accum × max_micro_batch_samples`` samples and ``grad_accum × micro_batch_tokens`` tokens), then
  moves and swaps between the busiest and the least-loaded rank, then every rank's samples are packed
  the same way into its ``grad_accum`` micro-batches under the per-micro-batch budget. With
  ``balance_each_micro_batch`` the pool is packed straight into ``ranks × grad_accum`` equal-cost
  micro-batches and micro-step ``a`` of the ranks gets the ``a``-th band of them (by cost).
* ``padded_node_balance`` — for kernels that compute on padding (a micro-batch of ``n`` costs
  ``n × cost(padded longest)``): the node pool is sorted by length and cut into ``ranks × grad_accum``
  runs of consecutive lengths (least padding) with the smallest possible largest cost
  (:func:`contiguous_groups`: long runs hold few samples, short runs many), under the same budgets;
  the runs are dealt whole, as ``stratified_node_balance`` deals micro-batches with the padded cost.

The node strategies never move a sample to another node: each node deals exactly the samples of its
pool (for ``stratified_node_sort``, the samples ``stratified`` gives its ranks; for
``stratified_node_balance`` and the packed strategies, its share of :func:`split_across_nodes`). Every
strategy's set of samples per step depends on the world size and batch shape, not on the node size, so
2 nodes × 2 ranks and 1 node × 4 ranks train on the same global batches.
Within a pool (a node's, or for ``global_sort`` the world's), samples are sorted by length, so
micro-batches hold similar lengths (little padding) and each rank's micro-batches come longest first.
Samples that do not fill a global batch (and, for stratified plans, at most ``units × bins`` that the
bins cannot split evenly) are dropped and counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..errors import ConfigError, DataError
from .config import PACKED_STRATEGIES, PEER_STRATEGIES, STRATEGIES, SamplerConfig
from .cost import CostModel, padded_lengths

SWAP_ROUNDS = 4  # per rank of a pool: rounds of busiest/least-loaded swaps after the greedy dealing


@dataclass(frozen=True)
class Plan:
    indices: np.ndarray
    """``[steps, world_size, grad_accum, slots]`` int64 sample indices. Fixed-size strategies: ``slots`` =
    the micro-batch, no ``-1``. Packed strategies: ``slots`` = the epoch's largest micro-batch, unused slots
    ``-1`` after the used ones; every micro-batch holds at least one sample."""
    dropped: int
    """Samples left out this epoch (they do not fill a global batch, or, with explicit
    ``bin_counts``, their bin has more samples than the counts consume)."""
    strategy: str
    """The strategy that made it."""
    bin_edges: Optional[np.ndarray] = None
    """Stratified strategies: upper edges of the length bins."""
    bin_counts: Optional[np.ndarray] = None
    """Stratified strategies: ``[steps, bins]`` samples per bin in every stratum of the step."""
    stratum: Optional[str] = None
    """What holds ``bin_counts``: ``"rank"`` — every local batch (``stratified``; for
    ``stratified_node_sort`` before the node's dealing), or ``"node"`` — every node's pool
    (``stratified_node_balance`` and the packed strategies, ``ranks_per_node ×`` the per-rank counts of
    their draw)."""

    @property
    def steps(self) -> int:
        return self.indices.shape[0]

    @property
    def micro_batch_sizes(self) -> np.ndarray:
        """``[steps, world_size, grad_accum]`` samples per micro-batch."""
        return (self.indices >= 0).sum(axis=-1)

    def micro_batch(self, step: int, rank: int, slot: int) -> np.ndarray:
        """The sample indices of one micro-batch, without unused slots."""
        row = self.indices[step, rank, slot]
        return row[row >= 0]


def epoch_rng(seed: int, epoch: int) -> np.random.Generator:
    return np.random.default_rng([seed, epoch])


# ------------------------------------------------------------------------------------------------
# bins
# ------------------------------------------------------------------------------------------------
def quantile_bin_edges(lengths: np.ndarray, num_bins: int) -> np.ndarray:
    """Upper edges at the length quantiles ``k/num_bins`` (ascending, unique, the last = the longest)."""
    qs = np.quantile(lengths, np.arange(1, num_bins + 1) / num_bins, method="inverted_cdf")
    return np.unique(qs.astype(np.int64))


def resolve_bin_edges(lengths: np.ndarray, cfg: SamplerConfig, default_bins: int) -> np.ndarray:
    """``cfg.bins``, or ``default_bins`` quantile bins of the corpus when they are not given."""
    if not cfg.bins:
        return quantile_bin_edges(lengths, default_bins)
    edges = np.asarray(cfg.bins, dtype=np.int64)
    if lengths.max() > edges[-1]:
        raise ConfigError(f"sampler.bins: the last edge {edges[-1]} is below the longest sequence {lengths.max()}")
    return edges


def bin_index(lengths: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Bin of each length: bin ``k`` holds ``edges[k-1] < L <= edges[k]``."""
    return np.searchsorted(edges, lengths, side="left")


def _apportion(total: int, weights: np.ndarray, caps: np.ndarray) -> np.ndarray:
    """Split ``total`` in proportion to ``weights`` (largest remainder), never above ``caps``."""
    quota = total * weights / weights.sum()
    out = np.minimum(np.floor(quota).astype(np.int64), caps)
    short = total - out.sum()
    for b in np.argsort(-(quota - out), kind="stable"):
        if short == 0:
            break
        room = min(caps[b] - out[b], short)
        out[b] += room
        short -= room
    return out


def step_bin_counts(totals: np.ndarray, steps: int, rng: np.random.Generator) -> np.ndarray:
    """``[steps, bins]`` per-step counts with column sums ``totals`` and equal row sums.

    Every count is ``floor`` or ``ceil`` of ``totals / steps``: the base ``floor`` plus one extra
    for ``totals % steps`` of the steps. The extras are laid out bin after bin along the steps,
    wrapping around from a random step, so a bin never gets two extras in one step and every step
    gets the same number of extras.
    """
    base, extra = np.divmod(totals, steps)
    counts = np.repeat(base[None, :], steps, axis=0)
    owners = np.repeat(np.arange(len(totals)), extra)  # bin of each extra, bin after bin
    slots = (rng.integers(steps) + np.arange(len(owners))) % steps
    np.add.at(counts, (slots, owners), 1)
    return counts


def stratified_draw(lengths, edges, explicit_counts, units: int, unit_size: int, rng):
    """``[steps, units, unit_size]`` indices; every unit of a step holds the same number from each bin.

    A unit is a rank's local batch. Returns ``(indices, counts [steps, bins], dropped)``.
    """
    n = len(lengths)
    which = bin_index(lengths, edges)
    per_bin = np.bincount(which, minlength=len(edges))
    capacity = per_bin // units  # what a bin can give every unit over the epoch
    if explicit_counts is not None:
        counts_row = np.asarray(explicit_counts, dtype=np.int64)
        used = counts_row > 0
        steps = int(np.min(capacity[used] // counts_row[used]))
        counts = np.repeat(counts_row[None, :], steps, axis=0)
    else:
        steps = min(n // (units * unit_size), int(capacity.sum()) // unit_size)
        if steps > 0:
            totals = _apportion(steps * unit_size, per_bin.astype(np.float64), capacity)
            counts = step_bin_counts(totals, steps, rng)
    if steps == 0:
        raise DataError(
            f"sampler: the length bins {edges.tolist()} hold {per_bin.tolist()} sequences, too few for "
            f"one step of {units} × {unit_size} with the bin counts"
        )
    # every bin's samples in a random order, bins one after another
    perm = rng.permutation(n)
    by_bin = perm[np.argsort(which[perm], kind="stable")]
    bin_start = np.concatenate([[0], np.cumsum(per_bin)[:-1]])
    # step s: bin b hands out its next units × c[s, b] unused samples, unit u the u-th run of c[s, b]
    used_before = units * (np.cumsum(counts, axis=0) - counts)  # [steps, bins]
    col_end = np.cumsum(counts, axis=1)
    slot = np.arange(unit_size)
    col_bin = (slot[None, :, None] >= col_end[:, None, :]).sum(axis=2)  # [steps, unit_size]
    rows = np.arange(steps)[:, None]
    count = counts[rows, col_bin]
    col_in_bin = slot[None, :] - (col_end - counts)[rows, col_bin]
    base = bin_start[col_bin] + used_before[rows, col_bin] + col_in_bin
    positions = base[:, None, :] + np.arange(units)[None, :, None] * count[:, None, :]
    return by_bin[positions], counts, n - steps * units * unit_size


# ------------------------------------------------------------------------------------------------
# dealing a sorted pool to ranks
# ------------------------------------------------------------------------------------------------
def snake_order(ranks: int, per_rank: int) -> np.ndarray:
    """``[ranks, per_rank]``: position, in a descending-sorted pool, of rank r's j-th sample."""
    j = np.arange(per_rank)[None, :]
    r = np.arange(ranks)[:, None]
    return j * ranks + np.where(j % 2 == 0, r, ranks - 1 - r)


def balance_order(costs: np.ndarray, ranks: int, micro: int, carry_load: bool = True) -> np.ndarray:
    """Cost-model dealing (greedy longest-processing-time with equal counts), vectorised over pools.

    ``costs``: ``[pools, ranks × accum × micro]`` items, each pool sorted by cost descending; group
    ``a`` = positions ``[a·ranks·micro, (a+1)·ranks·micro)`` becomes every rank's micro-batch ``a``.
    Each item in turn goes to the least-loaded rank that has fewer than ``micro`` items of this group;
    ``carry_load``: the load counts earlier groups (balances step totals), else each group on its own.
    Returns ``[pools, ranks, accum × micro]`` positions.
    """
    pools, size = costs.shape
    group = ranks * micro
    load = np.zeros((pools, ranks))
    out = np.empty((pools, ranks, size // ranks), dtype=np.int64)
    rows = np.arange(pools)
    for start in range(0, size, group):
        if not carry_load:
            load[:] = 0
        filled = np.zeros((pools, ranks), dtype=np.int64)
        taken_before = start // ranks  # every rank already holds this many (earlier groups)
        for i in range(start, start + group):
            target = np.argmin(np.where(filled < micro, load, np.inf), axis=1)
            out[rows, target, taken_before + filled[rows, target]] = i
            load[rows, target] += costs[:, i]
            filled[rows, target] += 1
    return out


def refine_by_swaps(positions: np.ndarray, costs: np.ndarray, micro: int, rounds: int) -> np.ndarray:
    """Lower the busiest rank's load by swapping items of one micro-batch slot with the least-loaded rank.

    ``positions``: ``[pools, ranks, accum × micro]`` (from :func:`balance_order`), ``costs``:
    ``[pools, items]``. Each round, in every pool, the busiest and the least-loaded rank exchange the
    pair of same-slot items whose cost difference is closest to half their gap (if any is below the
    gap): the pair's larger load strictly drops, and the slot structure is kept. Returns a new array.
    """
    positions = positions.copy()
    pools, ranks, per_rank = positions.shape
    slots = per_rank // micro
    rows = np.arange(pools)
    for _ in range(rounds):
        item_cost = np.take_along_axis(costs, positions.reshape(pools, -1), axis=1).reshape(pools, ranks, per_rank)
        load = item_cost.sum(axis=2)
        hi, lo = load.argmax(axis=1), load.argmin(axis=1)
        gap = (load[rows, hi] - load[rows, lo])[:, None, None, None]
        diff = item_cost[rows, hi].reshape(pools, slots, micro, 1) - item_cost[rows, lo].reshape(
            pools, slots, 1, micro
        )  # moved from hi to lo by the swap
        score = np.where((diff > 0) & (diff < gap), np.abs(gap / 2 - diff), np.inf).reshape(pools, -1)
        best = score.argmin(axis=1)
        ok = np.isfinite(score[rows, best])
        if not ok.any():
            break
        slot, pair = np.divmod(best[ok], micro * micro)
        from_hi, from_lo = slot * micro + pair // micro, slot * micro + pair % micro
        p, h, lw = rows[ok], hi[ok], lo[ok]
        positions[p, h, from_hi], positions[p, lw, from_lo] = positions[p, lw, from_lo], positions[p, h, from_hi]
    return positions


def split_across_nodes(pools: np.ndarray, lengths: np.ndarray, nodes: int, cost: CostModel) -> np.ndarray:
    """Split every step's global pool ``[steps, G]`` into ``[steps, nodes, G / nodes]`` node pools.

    The pool is sorted by length (descending) and cut into consecutive groups of ``nodes`` samples;
    every node gets one sample of every group, the group's longest going to the node with the least
    work so far. Node pools thus have the same length profile (a bin whose count is a multiple of
    ``nodes`` is split evenly) and near-equal totals.
    """
    order = np.argsort(-lengths[pools], axis=1, kind="stable")
    ranked = np.take_along_axis(pools, order, axis=1)
    steps, size = ranked.shape
    groups = ranked.reshape(steps, size // nodes, nodes)
    group_cost = cost.sample(lengths[groups])
    load = np.zeros((steps, nodes))
    out = np.empty((steps, nodes, size // nodes), dtype=np.int64)
    rows = np.arange(steps)[:, None]
    for j in range(size // nodes):
        lightest_first = np.argsort(load, axis=1, kind="stable")  # group item i -> i-th least-loaded node
        out[rows, lightest_first, j] = groups[:, j]
        load[rows, lightest_first] += group_cost[:, j]
    return out


def deal(
    indices: np.ndarray,
    lengths: np.ndarray,
    *,
    ranks: int,
    micro: int,
    accum: int,
    method: str,
    cost: CostModel,
    padded: bool = False,
    pad_multiple: int = 8,
    each_micro_batch: bool = False,
) -> np.ndarray:
    """Deal pools ``[..., ranks × accum × micro]`` to ``[..., ranks, accum, micro]``.

    Each pool is sorted by length (descending) first.

    * ``snake``: the sorted pool is dealt 0, 1, …, n−1, n−1, …, 0, …; consecutive groups of
      ``ranks × micro`` samples become micro-batch 0, 1, … of the ranks.
    * ``balance``: :func:`balance_order` then :func:`refine_by_swaps` with the per-sample ``cost``.
    * ``balance`` with ``padded`` (and ``accum > 1``): a micro-batch costs ``micro × cost(padded
      length)``, so the least padding comes from micro-batches of *consecutive* sorted samples; those
      micro-batches are dealt whole. With one micro-batch per step every rank pays for the longest
      sample it gets whatever the dealing, and the per-sample dealing also balances the unpadded work,
      so that is used.

    ``each_micro_batch``: balance every micro-batch slot across the ranks (items of the ``a``-th
    group of the sorted pool go to slot ``a``), for setups that synchronise at every micro-step;
    otherwise balance each rank's step total, then order each rank's micro-batches longest first.
    """
    lead = indices.shape[:-1]
    flat = indices.reshape(-1, indices.shape[-1])
    order = np.argsort(-lengths[flat], axis=1, kind="stable")
    pools = np.take_along_axis(flat, order, axis=1)
    if method == "snake":
        return pools[:, snake_order(ranks, accum * micro)].reshape(*lead, ranks, accum, micro)
    if padded and accum > 1:
        items = pools.reshape(len(pools), ranks * accum, micro)  # consecutive micro-batches, longest first
        item_cost = micro * cost.sample(padded_lengths(lengths[items[:, :, 0]], pad_multiple))
        per_group = 1 if each_micro_batch else accum
    else:
        items = pools
        item_cost = cost.sample(lengths[pools])
        per_group = micro if each_micro_batch else accum * micro
    positions = balance_order(item_cost, ranks, per_group, carry_load=not each_micro_batch)
    if each_micro_batch:  # swaps within each slot: every micro-step on its own
        for start in range(0, positions.shape[2], per_group):
            positions[:, :, start : start + per_group] = refine_by_swaps(
                positions[:, :, start : start + per_group], item_cost, per_group, SWAP_ROUNDS * ranks
            )
    else:  # positions ascend with descending cost: longest micro-batch first
        positions = np.sort(refine_by_swaps(positions, item_cost, per_group, SWAP_ROUNDS * ranks), axis=2)
    dealt = np.take_along_axis(items[:, None], positions.reshape(*positions.shape, *([1] * (items.ndim - 2))), axis=2)
    return dealt.reshape(*lead, ranks, accum, micro)


def sort_within_rank(indices: np.ndarray, lengths: np.ndarray, accum: int, micro: int) -> np.ndarray:
    """``[steps, world, local]`` → ``[steps, world, accum, micro]``, longest micro-batch first."""
    order = np.argsort(-lengths[indices], axis=-1, kind="stable")
    return np.take_along_axis(indices, order, axis=-1).reshape(*indices.shape[:2], accum, micro)


# ------------------------------------------------------------------------------------------------
# packing a pool into micro-batches of varying size
# ------------------------------------------------------------------------------------------------
def _gather(values: np.ndarray, members: np.ndarray) -> np.ndarray:
    """``values[pool, member]`` for ``members [pools, bins, slots]`` of positions, 0 where a slot is ``-1``."""
    pools = values.shape[0]
    padded = np.concatenate([values, np.zeros((pools, 1), dtype=values.dtype)], axis=1)  # position -1 -> 0
    flat = np.where(members >= 0, members, values.shape[1]).reshape(pools, -1)
    return np.take_along_axis(padded, flat, axis=1).reshape(members.shape)


def _compact(members: np.ndarray) -> np.ndarray:
    """Every bin's positions ascending (longest sample first in a descending pool), unused slots last."""
    size = np.iinfo(np.int64).max
    ordered = np.sort(np.where(members >= 0, members, size), axis=-1)
    return np.where(ordered == size, -1, ordered)


def pack_by_cost(
    costs: np.ndarray, tokens: np.ndarray, bins: int, max_samples: int, max_tokens: int, min_samples: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """Greedy longest-processing-time packing into ``bins`` bins of any size, vectorised over pools.

    ``costs``, ``tokens``: ``[pools, items]``, each pool sorted by cost descending; items with 0 tokens are
    absent (a ragged pool's padding, last). Each item in turn goes to the least-loaded bin that has room:
    fewer than ``max_samples`` items and ``tokens + its tokens <= max_tokens``; once the items left are
    just enough to give every bin ``min_samples``, only bins short of that take them. Every bin thus gets
    at least ``min_samples`` items when the pool has ``bins × min_samples``. Returns ``(members [pools, bins,
    max_samples]`` positions, ``-1`` for unused slots, ``feasible [pools]``); a pool where an item fits
    nowhere is infeasible (its packing is incomplete and must not be used).
    """
    pools, size = costs.shape
    rows = np.arange(pools)
    present = tokens > 0
    left = np.cumsum(present[:, ::-1], axis=1)[:, ::-1]  # present items from position i on
    load = np.zeros((pools, bins))
    count = np.zeros((pools, bins), dtype=np.int64)
    held = np.zeros((pools, bins), dtype=np.int64)
    members = np.full((pools, bins, max_samples), -1, dtype=np.int64)
    feasible = np.ones(pools, dtype=bool)
    deficit = np.full(pools, bins * min_samples)  # placements still owed to bins short of min_samples
    for i in range(size):
        room = (count < max_samples) & (held + tokens[:, i : i + 1] <= max_tokens)
        if min_samples > 1:  # (one each comes free: an empty bin is the least loaded)
            forced = left[:, i] <= deficit
            room &= (count < min_samples) | ~forced[:, None]
        target = np.argmin(np.where(room, load, np.inf), axis=1)
        ok = room[rows, target]
        feasible &= ok | ~present[:, i]
        place = ok & present[:, i]
        r, t = rows[place], target[place]
        deficit[r] -= count[r, t] < min_samples
        members[r, t, count[r, t]] = i
        load[r, t] += costs[place, i]
        held[r, t] += tokens[place, i]
        count[r, t] += 1
    return members, feasible


def refine_packing(
    members: np.ndarray,
    costs: np.ndarray,
    tokens: np.ndarray,
    max_samples: int,
    max_tokens: int,
    rounds: int,
    min_samples: int = 1,
    tolerance: float = 1e-3,
) -> np.ndarray:
    """Lower the busiest bin's cost by moving or swapping items with the least-loaded bin.

    ``members``: ``[pools, bins, slots]`` positions (``-1`` unused), ``costs``/``tokens``: ``[pools, items]``.
    Each round, in every pool, the busiest bin moves to the least-loaded one the item whose cost is closest
    to half their gap (and below it, so the pair's larger load strictly drops; the busiest keeps at least
    ``min_samples``) or, where no item can move, the two swap the pair whose cost difference is closest to
    half the gap (and below it), all within the bins' budgets. A pool whose gap is within ``tolerance`` of
    its mean load, or that has no such move, is done. Returns a new array, each bin's positions ascending.
    """
    members = members.copy()
    pools, bins, slots = members.shape
    room = min(max_samples, slots)  # a move needs a free slot in the array as well
    cost, tok = _gather(costs, members), _gather(tokens, members)  # kept in step with members
    load, held, count = cost.sum(axis=2), tok.sum(axis=2), (members >= 0).sum(axis=2)
    active = np.arange(pools)  # pools where the last round found a move or a swap
    for _ in range(rounds):
        hi, lo = load[active].argmax(axis=1), load[active].argmin(axis=1)
        gap = load[active, hi] - load[active, lo]
        open_ = gap > tolerance * load[active].mean(axis=1)
        active, hi, lo, gap = active[open_], hi[open_], lo[open_], gap[open_]
        if active.size == 0:
            break
        hi_cost, lo_cost = cost[active, hi], cost[active, lo]  # [pools, slots]
        hi_tok, lo_tok = tok[active, hi], tok[active, lo]
        # move slot j of the busiest bin to the least-loaded one
        move_ok = (
            (members[active, hi] >= 0)
            & (count[active, hi] > min_samples)[:, None]
            & (count[active, lo] < room)[:, None]
            & (held[active, lo][:, None] + hi_tok <= max_tokens)
            & (hi_cost < gap[:, None])
        )
        move_score = np.where(move_ok, np.abs(gap[:, None] / 2 - hi_cost), np.inf)
        best_move = move_score.argmin(axis=1)
        moving = np.isfinite(move_score[np.arange(active.size), best_move])
        p, h, lw, j = active[moving], hi[moving], lo[moving], best_move[moving]
        free = np.argmax(members[p, lw] < 0, axis=1)  # the least-loaded bin has a free slot: count < room
        c, t = cost[p, h, j], tok[p, h, j]
        members[p, lw, free], cost[p, lw, free], tok[p, lw, free] = members[p, h, j], c, t
        members[p, h, j], cost[p, h, j], tok[p, h, j] = -1, 0, 0
        load[p, h] -= c
        load[p, lw] += c
        held[p, h] -= t
        held[p, lw] += t
        count[p, h] -= 1
        count[p, lw] += 1
        # where no move helps: swap slot j of the busiest with slot k of the least-loaded
        q = np.flatnonzero(~moving)
        diff = hi_cost[q, :, None] - lo_cost[q, None, :]
        tok_diff = hi_tok[q, :, None] - lo_tok[q, None, :]
        swap_ok = (
            (members[active[q], hi[q]] >= 0)[:, :, None]
            & (members[active[q], lo[q]] >= 0)[:, None, :]
            & (diff > 0)
            & (diff < gap[q, None, None])
            & (held[active[q], lo[q]][:, None, None] + tok_diff <= max_tokens)
            & (held[active[q], hi[q]][:, None, None] - tok_diff <= max_tokens)
        )
        swap_score = np.where(swap_ok, np.abs(gap[q, None, None] / 2 - diff), np.inf).reshape(q.size, slots * slots)
        best_swap = swap_score.argmin(axis=1)
        found = np.isfinite(swap_score[np.arange(q.size), best_swap])
        swapping = np.zeros(active.size, dtype=bool)
        swapping[q[found]] = True
        p, h, lw = active[swapping], hi[swapping], lo[swapping]
        j, k = np.divmod(best_swap[found], slots)
        d, e = cost[p, h, j] - cost[p, lw, k], tok[p, h, j] - tok[p, lw, k]
        for array in (members, cost, tok):
            array[p, h, j], array[p, lw, k] = array[p, lw, k], array[p, h, j]
        load[p, h] -= d
        load[p, lw] += d
        held[p, h] -= e
        held[p, lw] += e
        active = active[moving | swapping]
    return _compact(members)


def contiguous_groups(
    unit_cost: np.ndarray, capacity: np.ndarray, groups: int, iterations: int = 48
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut every pool into ``groups`` non-empty runs of consecutive items minimising the largest run cost.

    A run of ``n`` items starting at item ``i`` costs ``n × unit_cost[i]`` (a micro-batch padded to its
    first, longest sample) and holds at most ``capacity[i]`` items (the sample and token budgets at that
    padded length). ``unit_cost`` must not increase along a pool. For a threshold ``T`` the greedy cut
    (each run as long as ``T`` and the capacity allow) uses the fewest runs, so the smallest feasible
    ``T`` is found by bisection; runs the greedy cut leaves unused are made by halving the costliest
    runs (a part never costs more than the whole). Returns ``(starts [pools, groups]`` ascending,
    ``counts [pools, groups]``, ``feasible [pools]``).
    """
    pools, size = unit_cost.shape
    rows = np.arange(pools)
    unit = np.concatenate([unit_cost, np.full((pools, 1), np.inf)], axis=1)  # position `size`: past the end
    cap = np.concatenate([np.minimum(capacity, size - np.arange(size)), np.zeros((pools, 1), dtype=np.int64)], axis=1)
    inverse, cap_flat = (1.0 / unit).ravel(), cap.ravel()  # flat: one take per jump instead of 2-D indexing
    row_start = rows * (size + 1)

    def cut(limit: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        pos = np.zeros(pools, dtype=np.int64)
        starts = np.empty((pools, groups), dtype=np.int64)
        scaled = limit * (1 + 1e-12)  # a run of exactly `limit` must fit despite rounding
        for g in range(groups):
            starts[:, g] = pos
            at = row_start + pos
            pos = pos + np.minimum(cap_flat.take(at), (scaled * inverse.take(at)).astype(np.int64))
        return starts, pos == size

    hi = (cap[:, :size] * unit_cost).max(axis=1)  # every run as long as its capacity allows
    starts, feasible = cut(hi)
    lo = np.maximum(unit_cost[:, 0], unit_cost.sum(axis=1) / groups)  # a run's cost is at least its items' units
    lo_ok = cut(lo)[1]
    hi = np.where(lo_ok, lo, hi)
    for _ in range(iterations):
        if (hi - lo <= 1e-9 * hi).all():
            break
        mid = (lo + hi) / 2
        ok = cut(mid)[1]
        hi, lo = np.where(ok, mid, hi), np.where(ok, lo, mid)
    starts, reached = cut(hi)
    feasible &= reached
    counts = np.diff(np.concatenate([starts, np.full((pools, 1), size)], axis=1), axis=1)
    while True:  # split the costliest run of two or more into halves while some run is empty
        empty = counts == 0
        short = empty.any(axis=1) & feasible
        if not short.any():
            break
        run_cost = np.where(counts > 1, counts * unit[rows[:, None], np.minimum(starts, size - 1)], -np.inf)
        p = rows[short]
        victim = run_cost[p].argmax(axis=1)
        starts[p, empty[p].argmax(axis=1)] = starts[p, victim] + counts[p, victim] // 2
        starts[p] = np.sort(starts[p], axis=1)
        counts = np.diff(np.concatenate([starts, np.full((pools, 1), size)], axis=1), axis=1)
    return starts, counts, feasible


def _deal_bins(members: np.ndarray, bin_cost: np.ndarray, ranks: int, accum: int, each_micro_batch: bool) -> np.ndarray:
    """``ranks × accum`` bins ``[pools, bins, slots]`` → ``[pools, ranks, accum, slots]``, bins dealt whole.

    Bins sorted by cost (descending) are dealt by :func:`balance_order`: each rank's step total
    (then :func:`refine_by_swaps`, micro-batches longest first), or, with ``each_micro_batch``, every
    micro-step on its own: micro-step ``a`` gets the ``a``-th band of ``ranks`` bins.
    """
    pools = members.shape[0]
    order = np.argsort(-bin_cost, axis=1, kind="stable")
    costs = np.take_along_axis(bin_cost, order, axis=1)
    if each_micro_batch:
        positions = balance_order(costs, ranks, 1)
    else:
        positions = balance_order(costs, ranks, accum)
        positions = np.sort(refine_by_swaps(positions, costs, accum, SWAP_ROUNDS * ranks), axis=2)
    chosen = np.take_along_axis(order, positions.reshape(pools, -1), axis=1)  # [pools, ranks × accum] bins
    return np.take_along_axis(members, chosen[:, :, None], axis=1).reshape(pools, ranks, accum, -1)


def _deal_runs(
    starts: np.ndarray, counts: np.ndarray, unit: np.ndarray, ranks: int, accum: int, each_micro_batch: bool
) -> np.ndarray:
    """Runs ``[pools, runs]`` (start, count) of a sorted pool, costing ``count × unit[start]``, dealt whole."""
    slots = np.arange(int(counts.max()))
    members = np.where(slots < counts[..., None], starts[..., None] + slots, -1)
    run_cost = counts * np.take_along_axis(unit, np.minimum(starts, unit.shape[1] - 1), axis=1)
    return _deal_bins(members, run_cost, ranks, accum, each_micro_batch)


def _padded_step_cost(dealt: np.ndarray, unit: np.ndarray, each_micro_batch: bool) -> np.ndarray:
    """Per pool: the busiest rank's padded work (or, ``each_micro_batch``, the sum over micro-steps of the
    busiest rank's), for micro-batches ``[pools, ranks, accum, slots]`` of positions in a descending pool."""
    pools = dealt.shape[0]
    first = np.take_along_axis(unit, np.maximum(dealt[..., 0], 0).reshape(pools, -1), axis=1).reshape(dealt.shape[:3])
    work = (dealt >= 0).sum(axis=3) * first  # [pools, ranks, accum]
    return work.max(axis=1).sum(axis=1) if each_micro_batch else work.sum(axis=2).max(axis=1)


def pack_pools(
    pools: np.ndarray,
    lengths: np.ndarray,
    *,
    ranks: int,
    accum: int,
    cost: CostModel,
    padded: bool,
    pad_multiple: int,
    max_samples: int,
    max_tokens: int,
    each_micro_batch: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Pack pools ``[pools, items]`` into ``[pools, ranks, accum, slots]`` micro-batches of varying size.

    Every rank gets ``accum`` non-empty micro-batches of at most ``max_samples`` samples and
    ``max_tokens`` tokens (padded: samples × padded length), ``slots`` = the largest, ``-1`` unused.

    * unpadded (``Σ a·L + b·L²``): the pool goes to the ranks by :func:`pack_by_cost` (rank budgets
      ``accum ×`` the micro-batch's) and :func:`refine_packing`, then each rank's samples into its
      ``accum`` micro-batches the same way; ``each_micro_batch``: straight into ``ranks × accum``
      micro-batches, dealt by :func:`_deal_bins` micro-step by micro-step.
    * ``padded`` (``n × cost(padded longest)``): :func:`contiguous_groups` cuts the sorted pool into
      ``ranks × accum`` runs, dealt whole by :func:`_deal_bins`. With accumulation, runs of ``micro``
      samples each (``stratified_node_balance``'s) are dealt as well and each pool keeps whichever cut
      gives the lower padded step cost: equal-cost runs win when each rank has few micro-batches to even
      out, equal-count runs (least padding) when it has many.

    Returns ``(micro-batches, feasible [pools])``; an infeasible pool's micro-batches must not be used.
    """
    count, size = pools.shape
    order = np.argsort(-lengths[pools], axis=1, kind="stable")
    ranked = np.take_along_axis(pools, order, axis=1)  # longest first
    pool_lengths = lengths[ranked]
    if padded:
        padded_len = padded_lengths(pool_lengths, pad_multiple)
        unit = cost.sample(padded_len)
        capacity = np.minimum(max_samples, max_tokens // padded_len)
        starts, counts, feasible = contiguous_groups(unit, capacity, ranks * accum)
        dealt = _deal_runs(starts, counts, unit, ranks, accum, each_micro_batch)
        if accum > 1:  # runs of `micro` samples each (stratified_node_balance's), where within budget and better
            micro = size // (ranks * accum)
            fixed_starts = np.broadcast_to(np.arange(ranks * accum) * micro, starts.shape)
            fits = (np.take_along_axis(capacity, fixed_starts, axis=1) >= micro).all(axis=1)
            fixed = _deal_runs(fixed_starts, np.full_like(counts, micro), unit, ranks, accum, each_micro_batch)
            width = max(dealt.shape[3], fixed.shape[3])
            widen = lambda a: np.pad(a, ((0, 0),) * 3 + ((0, width - a.shape[3]),), constant_values=-1)
            dealt, fixed = widen(dealt), widen(fixed)
            better = _padded_step_cost(fixed, unit, each_micro_batch) < _padded_step_cost(dealt, unit, each_micro_batch)
            better = fits & (better | ~feasible)
            feasible |= fits
            dealt = np.where(better[:, None, None, None], fixed, dealt)
    else:
        item_cost = cost.sample(pool_lengths)
        rounds = SWAP_ROUNDS * ranks * (accum if each_micro_batch else 1)
        if each_micro_batch:
            members, feasible = pack_by_cost(item_cost, pool_lengths, ranks * accum, max_samples, max_tokens)
            members = refine_packing(members, item_cost, pool_lengths, max_samples, max_tokens, rounds)
            dealt = _deal_bins(members, _gather(item_cost, members).sum(axis=2), ranks, accum, True)
        else:
            members, feasible = pack_by_cost(
                item_cost, pool_lengths, ranks, accum * max_samples, accum * max_tokens, min_samples=accum
            )
            members = members[:, :, : min(accum * max_samples, int((members >= 0).sum(axis=2).max()) + 4)]
            members = refine_packing(
                members, item_cost, pool_lengths, accum * max_samples, accum * max_tokens, rounds, min_samples=accum
            )
            # each rank's samples (pool positions, longest first, -1 last) into its accum micro-batches
            local = members.reshape(count * ranks, -1)
            local_cost = _gather(item_cost, members).reshape(count * ranks, -1)
            local_tokens = _gather(pool_lengths, members).reshape(count * ranks, -1)
            micro, micro_ok = pack_by_cost(local_cost, local_tokens, accum, max_samples, max_tokens)
            feasible &= micro_ok.reshape(count, ranks).all(axis=1)
            micro = np.where(micro >= 0, np.take_along_axis(local[:, None, :], np.maximum(micro, 0), axis=2), -1)
            micro_cost = _gather(item_cost, micro.reshape(count, ranks * accum, -1)).sum(axis=2)
            # every rank's micro-batches costliest first
            order_in_rank = np.argsort(-micro_cost.reshape(count, ranks, accum), axis=2, kind="stable")
            dealt = np.take_along_axis(micro.reshape(count, ranks, accum, -1), order_in_rank[..., None], axis=2)
    used = max(1, int((dealt >= 0).sum(axis=3).max()))
    dealt = dealt[..., :used]
    out = np.where(
        dealt >= 0, np.take_along_axis(ranked, np.maximum(dealt, 0).reshape(count, -1), axis=1).reshape(dealt.shape), -1
    )
    return out, feasible


# ------------------------------------------------------------------------------------------------
# the planner
# ------------------------------------------------------------------------------------------------
def _megabatch_order(lengths: np.ndarray, local: int, mult: Optional[int], rng) -> np.ndarray:
    n = len(lengths)
    if mult is None:  # transformers' default in get_length_grouped_indices
        mult = max(1, min(n // (local * 4), 50))
    perm = rng.permutation(n)
    megabatch = np.arange(n) // (mult * local)
    return perm[np.lexsort((-lengths[perm], megabatch))]  # sorted descending within each mega-batch


def packing_budget(lengths: np.ndarray, cfg: SamplerConfig, micro_batch: int, padded: bool) -> tuple[int, int]:
    """``(max samples, max tokens)`` of one packed micro-batch (``SamplerConfig`` defaults resolved), checked
    against the micro-batch and the longest sample."""
    max_samples = cfg.max_micro_batch_samples or 4 * micro_batch
    longest = int(lengths.max())
    padded_longest = int(padded_lengths(longest, cfg.pad_multiple))
    max_tokens = cfg.micro_batch_tokens or micro_batch * padded_longest
    if max_samples < micro_batch:
        raise ConfigError(
            f"sampler.max_micro_batch_samples: {max_samples} is below the micro-batch {micro_batch}, "
            "so a step's samples cannot fit its micro-batches"
        )
    needed = padded_longest if padded else longest
    if max_tokens < needed:
        raise ConfigError(
            f"sampler.micro_batch_tokens: {max_tokens} is below the longest sample "
            f"({needed} tokens{' padded' if padded else ''})"
        )
    return max_samples, max_tokens


def _pack_epoch(
    pools: np.ndarray,
    lengths: np.ndarray,
    cfg: SamplerConfig,
    *,
    padded: bool,
    ranks_per_node: int,
    micro_batch: int,
    grad_accum: int,
) -> np.ndarray:
    """Node pools ``[steps, nodes, P]`` → ``[steps, world, accum, slots]`` by :func:`pack_pools`."""
    steps, nodes, size = pools.shape
    max_samples, max_tokens = packing_budget(lengths, cfg, micro_batch, padded)
    packed, feasible = pack_pools(
        pools.reshape(steps * nodes, size),
        lengths,
        ranks=ranks_per_node,
        accum=grad_accum,
        cost=cfg.cost_model,
        padded=padded,
        pad_multiple=cfg.pad_multiple,
        max_samples=max_samples,
        max_tokens=max_tokens,
        each_micro_batch=cfg.balance_each_micro_batch,
    )
    if not feasible.all():
        step, node = divmod(int(np.argmin(feasible)), nodes)
        raise DataError(
            f"sampler: step {step}, node {node}: its {size} samples do not fit {ranks_per_node} ranks × "
            f"{grad_accum} micro-batches of at most {max_samples} samples and {max_tokens} tokens; raise "
            "sampler.micro_batch_tokens or sampler.max_micro_batch_samples"
        )
    return packed.reshape(steps, nodes * ranks_per_node, grad_accum, -1)


def plan_epoch(
    lengths: np.ndarray,
    *,
    world_size: int,
    ranks_per_node: int,
    micro_batch: int,
    grad_accum: int,
    strategy: Optional[str] = None,
    cfg: Optional[SamplerConfig] = None,
    seed: int = 0,
    epoch: int = 0,
    bin_edges: Optional[np.ndarray] = None,
) -> Plan:
    """The plan of one epoch (see the module docstring). ``strategy`` overrides ``cfg.strategy``.

    ``bin_edges`` lets a caller that plans many epochs resolve quantile bins once.
    """
    cfg = cfg or SamplerConfig()
    strategy = strategy or cfg.strategy
    if strategy in PEER_STRATEGIES:  # the peers module drives other libraries' planners (and imports this one)
        from .peers import hf_batch_rebalance_plan

        return hf_batch_rebalance_plan(
            np.asarray(lengths, dtype=np.int64),
            world_size=world_size,
            micro_batch=micro_batch,
            grad_accum=grad_accum,
            seed=seed,
            epoch=epoch,
        )[0]
    if strategy not in STRATEGIES:
        raise ConfigError(f"sampler.strategy: {strategy!r} is not one of {', '.join(STRATEGIES + PEER_STRATEGIES)}")
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.ndim != 1 or len(lengths) == 0 or lengths.min() < 1:
        raise DataError("sampler: lengths must be a non-empty 1-D array of positive sequence lengths")
    if world_size % ranks_per_node:
        raise ConfigError(f"world size {world_size} is not a multiple of ranks per node {ranks_per_node}")
    n = len(lengths)
    local = micro_batch * grad_accum
    global_batch = world_size * local
    steps = n // global_batch
    if steps == 0:
        raise ConfigError(
            f"the corpus has {n} training sequences, fewer than one global batch of {global_batch} "
            f"(world {world_size} × accumulation {grad_accum} × micro-batch {micro_batch})"
        )
    rng = epoch_rng(seed, epoch)
    used = steps * global_batch
    shape = (steps, world_size, grad_accum, micro_batch)

    if strategy == "random":
        return Plan(rng.permutation(n)[:used].reshape(shape), n - used, strategy)
    if strategy == "sorted_megabatch":
        order = _megabatch_order(lengths, local, cfg.megabatch_mult, rng)[:used]
        # micro-batch j goes to rank j % world; a rank's consecutive micro-batches fill its accumulation slots
        dealt = order.reshape(steps, grad_accum, world_size, micro_batch).transpose(0, 2, 1, 3)
        return Plan(np.ascontiguousarray(dealt), n - used, strategy)
    if strategy == "global_sort":
        pools = rng.permutation(n)[:used].reshape(steps, global_batch)
        dealt = deal(
            pools, lengths, ranks=world_size, micro=micro_batch, accum=grad_accum, method="snake", cost=cfg.cost_model
        )
        return Plan(dealt.reshape(shape), n - used, strategy)

    nodes = world_size // ranks_per_node
    by_node = strategy == "stratified_node_balance" or strategy in PACKED_STRATEGIES
    if bin_edges is not None:
        edges = np.asarray(bin_edges, dtype=np.int64)
    else:  # a bin loses up to world - 1 samples to rounding: on a corpus that small, fewer bins
        edges = resolve_bin_edges(
            lengths, cfg, default_bins=max(1, min(cfg.num_bins, (n - global_batch) // world_size))
        )
    if cfg.bin_counts and sum(cfg.bin_counts) != local:
        raise ConfigError(
            f"sampler.bin_counts: they sum to {sum(cfg.bin_counts)}, but a local batch holds "
            f"{local} samples (micro-batch {micro_batch} × accumulation {grad_accum})"
        )
    # per-rank draw: the global batch of a step does not depend on the node size
    drawn, counts, dropped = stratified_draw(lengths, edges, cfg.bin_counts or None, world_size, local, rng)
    if strategy == "stratified":
        indices = sort_within_rank(drawn, lengths, grad_accum, micro_batch)
    elif strategy == "stratified_node_sort":
        pools = drawn.reshape(len(drawn), nodes, ranks_per_node * local)
        indices = deal(
            pools,
            lengths,
            ranks=ranks_per_node,
            micro=micro_batch,
            accum=grad_accum,
            method="snake",
            cost=cfg.cost_model,
        ).reshape(len(drawn), *shape[1:])
    elif strategy in PACKED_STRATEGIES:
        pools = split_across_nodes(drawn.reshape(len(drawn), global_batch), lengths, nodes, cfg.cost_model)
        indices = _pack_epoch(
            pools,
            lengths,
            cfg,
            padded=strategy == "padded_node_balance",
            ranks_per_node=ranks_per_node,
            micro_batch=micro_batch,
            grad_accum=grad_accum,
        )
        counts = counts * ranks_per_node
    else:
        pools = split_across_nodes(drawn.reshape(len(drawn), global_batch), lengths, nodes, cfg.cost_model)
        indices = deal(
            pools,
            lengths,
            ranks=ranks_per_node,
            micro=micro_batch,
            accum=grad_accum,
            method="balance",
            cost=cfg.cost_model,
            padded=cfg.padded,
            pad_multiple=cfg.pad_multiple,
            each_micro_batch=cfg.balance_each_micro_batch,
        ).reshape(len(drawn), *shape[1:])
        counts = counts * ranks_per_node
    return Plan(indices, dropped, strategy, bin_edges=edges, bin_counts=counts, stratum="node" if by_node else "rank")
