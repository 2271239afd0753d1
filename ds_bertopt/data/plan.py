"""Batch planning: which samples each rank processes in each step (pure numpy, no communication).

A plan is ``[steps, ranks, grad_accum, slots]`` sample indices. Every rank computes the same plan from
(seed, epoch), so ranks agree without talking, and every rank gets exactly ``steps × grad_accum``
micro-batches. Each sample appears at most once per epoch; the samples that do not fill a whole global
batch are left out and counted (``Plan.dropped``), different ones each epoch.

**Windows.** A step's plan depends only on the step: its global batch is drawn from the epoch's random
order at the step's positions, and the draw's per-step bin counts are a small ``[steps, bins]`` table. So
a rank plans a window of steps at a time, and only its own node's share of each step
(:meth:`Planner.window`): besides the lengths (and 2 bytes a sample of every bin's members), its memory
grows with the window, not with the epoch's plan for every rank. :func:`plan_epoch`
plans the whole epoch for every rank (the global reference: the balance tool, the tests), and the windows
are bit-identical to its rows (tested for every strategy). What makes that possible at any position:

* the epoch's random order is a keyed permutation (:func:`keyed_permutation`, a Feistel network keyed
  from (seed, epoch)), evaluated at the positions a step needs, not a shuffled array of every sample
  (since issue 32: the same seed draws other samples than numpy's shuffle did before);
* the stratified draw takes every bin's samples in such an order; a bin's samples are found by rank
  through :class:`BinMembers` (2 bytes a sample), the bins and counts from a length histogram;
* every dealing step below works on each pool on its own (the result for a pool never depends on the
  other pools planned with it), so one node's pools give the rows the whole-world plan gives that node.

For the fixed-size strategies ``slots`` is the micro-batch and every slot holds a sample. The packed
strategies (``packed_node_balance``, ``padded_node_balance``) make micro-batches of varying size: a
step still holds the same ``G`` samples (the global batch keeps its meaning), every rank still gets
``grad_accum`` non-empty micro-batches, but ``slots`` is the largest micro-batch of the plan and the
unused slots of smaller ones hold ``-1`` (always after the used ones; :func:`ds_bertopt.data.cost.slot_lengths`
turns them into length 0 for the figures). Micro-batch sizes: ``(Plan.indices >= 0).sum(-1)``.

Strategies (``G`` = global batch, ``B = grad_accum × micro_batch`` = a rank's local batch):

* ``random`` — the epoch's random order cut into global batches: DistributedSampler's behaviour.
* ``sorted_megabatch`` — Hugging Face ``group_by_length`` under Accelerate: the random order,
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
from typing import Callable, Optional

import numpy as np

from ..errors import ConfigError, DataError
from .config import NODE_POOLED, PACKED_STRATEGIES, PEER_STRATEGIES, STRATEGIES, STRATIFIED, SamplerConfig
from .cost import CostModel, padded_lengths

SWAP_ROUNDS = 4  # per rank of a pool: rounds of busiest/least-loaded swaps after the greedy dealing
CHUNK = 1 << 22  # samples per pass over the corpus: a chunk's int64 temporaries stay at 32 MiB


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


def ragged_indices(steps: list) -> np.ndarray:
    """``steps[s][rank][slot]`` lists of sample indices → ``[steps, world, accum, slots]``, ``-1`` unused."""
    width = max(len(mb) for step in steps for rank in step for mb in rank)
    out = np.full((len(steps), len(steps[0]), len(steps[0][0]), width), -1, dtype=np.int64)
    for s, step in enumerate(steps):
        for r, rank in enumerate(step):
            for a, mb in enumerate(rank):
                out[s, r, a, : len(mb)] = mb
    return out


def epoch_rng(seed: int, epoch: int) -> np.random.Generator:
    return np.random.default_rng([seed, epoch])


def compact_lengths(lengths) -> np.ndarray:
    """The lengths as the planner keeps them: int16 where they fit (sequences up to 32,767 tokens), else int32
    (no copy when they already are). Checked: a non-empty 1-D array of positive lengths."""
    lengths = np.asarray(lengths)
    if lengths.ndim != 1 or len(lengths) == 0 or not np.issubdtype(lengths.dtype, np.integer) or lengths.min() < 1:
        raise DataError("sampler: lengths must be a non-empty 1-D array of positive sequence lengths")
    if len(lengths) >= 2**31 or lengths.max() >= 2**31:
        raise DataError(f"sampler: {len(lengths)} sequences up to {lengths.max()} tokens: beyond 32-bit indices")
    dtype = np.int16 if lengths.max() <= np.iinfo(np.int16).max else np.int32
    return np.ascontiguousarray(lengths, dtype=dtype)


# ------------------------------------------------------------------------------------------------
# the epoch's random order, at any position
# ------------------------------------------------------------------------------------------------
FEISTEL_ROUNDS = 4  # Luby-Rackoff: four rounds of a pseudo-random function give a pseudo-random permutation
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijective 64-bit mix, the Feistel rounds' function (uint64 wraps)."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def permutation_keys(rng: np.random.Generator, streams: int) -> np.ndarray:
    """``[streams, FEISTEL_ROUNDS]`` round keys, one permutation per stream."""
    return rng.integers(np.iinfo(np.uint64).max, size=(streams, FEISTEL_ROUNDS), dtype=np.uint64, endpoint=True)


def keyed_permutation(positions, size: int, keys: np.ndarray) -> np.ndarray:
    """The values at ``positions`` of a pseudo-random permutation of ``range(size)`` chosen by ``keys``.

    A Feistel network on the ``b``-bit integers (``2^b`` the smallest power of two ≥ ``size``; the halves
    may differ by a bit) is a bijection whatever its round function; a value at or above ``size`` is sent
    through it again until it lands in range (cycle walking: it stays a bijection of ``range(size)``, and
    ``2^b < 2·size`` keeps the walks short). Any position costs the same, so a window of a permutation of
    10⁸ samples costs what the window holds, where a shuffled array would cost the whole epoch (numpy's
    permutation fixes its first positions last). Returns int64, the shape of ``positions``.
    """
    shape = np.shape(positions)
    x = np.array(positions, dtype=np.uint64).ravel()
    if size <= 1:
        return x.astype(np.int64).reshape(shape)
    bits = int(size - 1).bit_length()

    def encrypt(v: np.ndarray) -> np.ndarray:
        lw, rw = bits // 2, bits - bits // 2  # widths of the left and right halves; they swap every round
        left, right = v >> np.uint64(rw), v & np.uint64((1 << rw) - 1)
        for key in keys:
            left, right = right, left ^ (_mix(right + key) & np.uint64((1 << lw) - 1))
            lw, rw = rw, lw
        return (left << np.uint64(rw)) | right

    x = encrypt(x)
    walking = np.flatnonzero(x >= size)
    while walking.size:
        x[walking] = encrypt(x[walking])
        walking = walking[x[walking] >= size]
    return x.astype(np.int64).reshape(shape)


# ------------------------------------------------------------------------------------------------
# bins
# ------------------------------------------------------------------------------------------------
def length_histogram(lengths: np.ndarray) -> np.ndarray:
    """``counts[L]``: sequences of length ``L`` (chunked: ``bincount`` copies its input to int64)."""
    top = int(lengths.max()) + 1
    counts = np.zeros(top, dtype=np.int64)
    for start in range(0, len(lengths), CHUNK):
        counts += np.bincount(lengths[start : start + CHUNK], minlength=top)
    return counts


def quantile_bin_edges(lengths: np.ndarray, num_bins: int, histogram: Optional[np.ndarray] = None) -> np.ndarray:
    """Upper edges at the length quantiles ``k/num_bins`` (ascending, unique, the last = the longest).

    The inverted-CDF quantile (numpy's ``method="inverted_cdf"``): the shortest length ``L`` with at least
    ``k/num_bins`` of the corpus at or below it, in exact integer arithmetic on the length histogram.
    """
    counts = length_histogram(lengths) if histogram is None else histogram
    below = np.cumsum(counts)  # sequences of length <= L
    n = int(below[-1])
    targets = n * np.arange(1, num_bins + 1)  # num_bins × the quantile's share of n
    return np.unique(np.searchsorted(below * num_bins, targets, side="left")).astype(np.int64)


def resolve_bin_edges(
    lengths: np.ndarray, cfg: SamplerConfig, default_bins: int, histogram: Optional[np.ndarray] = None
) -> np.ndarray:
    """``cfg.bins``, or ``default_bins`` quantile bins of the corpus when they are not given."""
    if not cfg.bins:
        return quantile_bin_edges(lengths, default_bins, histogram)
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


class BinMembers:
    """Every bin's samples in corpus order, found by rank without an index array per sample.

    Position ``p`` of the bin-major order (bin 0's samples, then bin 1's, …, each in corpus order) is kept as
    the sample's 16-bit offset within its block of ``block`` samples; the block comes from the segment table
    (a bin's samples of one block are one segment). 2 bytes a sample, where an index array takes 4 or 8.
    """

    def __init__(self, lengths: np.ndarray, edges: np.ndarray, per_bin: np.ndarray, block: int = 1 << 16):
        if not 1 <= block <= 1 << 16:
            raise ValueError(f"block {block}: offsets are 16-bit")
        self.block = block
        lookup = bin_index(np.arange(int(lengths.max()) + 1), edges).astype(np.uint8 if len(edges) < 256 else np.int32)
        blocks, bins = -(-len(lengths) // block), len(edges)
        cursor = np.concatenate([[0], np.cumsum(per_bin)[:-1]]).astype(np.int64)  # next free position of each bin
        starts = np.empty((bins, blocks), dtype=np.int64)
        self.offsets = np.empty(len(lengths), dtype=np.uint16)
        for b in range(blocks):
            which = lookup[lengths[b * block : (b + 1) * block]]
            order = np.argsort(which, kind="stable")  # radix sort: by bin, corpus order within
            count = np.bincount(which, minlength=bins)
            starts[:, b] = cursor
            within = np.arange(len(order)) - np.repeat(np.cumsum(count) - count, count)  # rank within its bin
            self.offsets[np.repeat(cursor, count) + within] = order
            cursor += count
        self._segments = starts.ravel()  # bin-major, non-decreasing
        self._blocks = blocks

    def __getitem__(self, positions: np.ndarray) -> np.ndarray:
        """Sample indices at ``positions`` of the bin-major order."""
        segment = np.searchsorted(self._segments, positions, side="right") - 1  # the last segment starting at or before
        return (segment % self._blocks) * self.block + self.offsets[positions]


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
    room: Optional[np.ndarray] = None,
) -> np.ndarray:
    """Lower the busiest bin's cost by moving or swapping items with the least-loaded bin.

    ``members``: ``[pools, bins, slots]`` positions (``-1`` unused), ``costs``/``tokens``: ``[pools, items]``.
    Each round, in every pool, the busiest bin moves to the least-loaded one the item whose cost is closest
    to half their gap (and below it, so the pair's larger load strictly drops; the busiest keeps at least
    ``min_samples``) or, where no item can move, the two swap the pair whose cost difference is closest to
    half the gap (and below it), all within the bins' budgets. A pool whose gap is within ``tolerance`` of
    its mean load, or that has no such move, is done. ``room`` (per pool, at most ``max_samples`` and the
    slots) caps a bin's items below ``max_samples``. Returns a new array, each bin's positions ascending.
    """
    members = members.copy()
    pools, bins, slots = members.shape
    room = np.broadcast_to(min(max_samples, slots) if room is None else room, (pools,))
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
            & (count[active, lo] < room[active])[:, None]
            & (held[active, lo][:, None] + hi_tok <= max_tokens)
            & (hi_cost < gap[:, None])
        )
        move_score = np.where(move_ok, np.abs(gap[:, None] / 2 - hi_cost), np.inf)
        best_move = move_score.argmin(axis=1)
        moving = np.isfinite(move_score[np.arange(active.size), best_move])
        p, h, lw, j = active[moving], hi[moving], lo[moving], best_move[moving]
        free = np.argmax(members[p, lw] < 0, axis=1)  # count < room: a free slot (slots fill lowest first)
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
        open_ = hi - lo > 1e-9 * hi  # a converged pool stops: its cut never depends on the other pools
        if not open_.any():
            break
        mid = (lo + hi) / 2
        ok = cut(mid)[1]
        hi, lo = np.where(open_ & ok, mid, hi), np.where(open_ & ~ok, mid, lo)
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
    pool_lengths = lengths[ranked].astype(np.int64)
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
            # a rank may grow by a few samples past the greedy packing's fullest: fewer slots to search; per pool,
            # so that a pool's packing does not depend on the pools planned with it
            room = np.minimum(accum * max_samples, (members >= 0).sum(axis=2).max(axis=1) + 4)
            members = refine_packing(
                members[:, :, : int(room.max())],
                item_cost,
                pool_lengths,
                accum * max_samples,
                accum * max_tokens,
                rounds,
                min_samples=accum,
                room=room,
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
# the planner: the whole epoch for every rank (the reference), or a window of steps for one node
# ------------------------------------------------------------------------------------------------
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


@dataclass(frozen=True)
class EpochDraw:
    """What one epoch's plan draws from besides the corpus: small, ``[steps, bins]`` at most."""

    keys: np.ndarray
    """``[streams, FEISTEL_ROUNDS]`` keys of the epoch's random orders: one over all samples, or one per bin."""
    counts: Optional[np.ndarray] = None
    """Stratified strategies: ``[steps, bins]`` samples per bin in every local batch of the step."""
    taken: Optional[np.ndarray] = None
    """… ``[steps, bins]``: samples each bin gave the steps before (``units ×`` the counts so far)."""


Order = Callable[[np.ndarray], np.ndarray]  # positions of the epoch's random order -> sample indices


class Planner:
    """Plans of one corpus, world and batch shape: any window of steps of any epoch, for one node or all.

    Built once (the bins, the steps per epoch, and for windows every bin's members); each epoch adds only its
    :class:`EpochDraw`. :meth:`plan` is the whole epoch for every rank, by arrays of the whole epoch's order
    (the reference); :meth:`window` plans a window of steps for one node from the order evaluated at the
    positions the window needs. Both give the same rows. Thread-safe for concurrent windows (nothing is
    written after construction but a cache of the last epochs' draws).
    """

    def __init__(
        self,
        lengths,
        *,
        world_size: int,
        ranks_per_node: int,
        micro_batch: int,
        grad_accum: int,
        strategy: Optional[str] = None,
        cfg: Optional[SamplerConfig] = None,
        seed: int = 0,
        bin_edges: Optional[np.ndarray] = None,
        windows: bool = True,
    ):
        cfg = cfg or SamplerConfig()
        strategy = strategy or cfg.strategy
        if strategy in PEER_STRATEGIES:
            raise ConfigError(
                f"sampler.strategy: {strategy!r} is another library's planner; "
                "ds_bertopt.data.sampler.PlanBatchSampler runs it (a whole epoch at a time)"
            )
        if strategy not in STRATEGIES:
            raise ConfigError(f"sampler.strategy: {strategy!r} is not one of {', '.join(STRATEGIES + PEER_STRATEGIES)}")
        self.lengths = compact_lengths(lengths)
        if world_size % ranks_per_node:
            raise ConfigError(f"world size {world_size} is not a multiple of ranks per node {ranks_per_node}")
        self.strategy, self.cfg, self.seed = strategy, cfg, seed
        self.world_size, self.ranks_per_node = world_size, ranks_per_node
        self.micro_batch, self.grad_accum = micro_batch, grad_accum
        self.nodes = world_size // ranks_per_node
        self.local = micro_batch * grad_accum
        self.global_batch = world_size * self.local
        n = len(self.lengths)
        steps = n // self.global_batch
        if steps == 0:
            raise ConfigError(
                f"the corpus has {n} training sequences, fewer than one global batch of {self.global_batch} "
                f"(world {world_size} × accumulation {grad_accum} × micro-batch {micro_batch})"
            )
        self.edges = self.per_bin = self.totals = self.members = None
        if strategy in STRATIFIED:
            steps = self._resolve_bins(bin_edges, windows)
        self.steps = steps
        self.dropped = n - steps * self.global_batch
        if strategy == "sorted_megabatch":  # transformers' default in get_length_grouped_indices
            self.megabatch = self.local * (cfg.megabatch_mult or max(1, min(n // (self.local * 4), 50)))
        if strategy in PACKED_STRATEGIES:
            self.budget = packing_budget(self.lengths, cfg, micro_batch, strategy == "padded_node_balance")
        self._draws: dict[int, EpochDraw] = {}

    def _resolve_bins(self, bin_edges: Optional[np.ndarray], windows: bool) -> int:
        """Bins, per-bin counts and (for windows) every bin's members; returns the steps per epoch."""
        cfg, n = self.cfg, len(self.lengths)
        histogram = length_histogram(self.lengths)
        if bin_edges is not None:
            edges = np.asarray(bin_edges, dtype=np.int64)
        else:  # a bin loses up to world - 1 samples to rounding: on a corpus that small, fewer bins
            default = max(1, min(cfg.num_bins, (n - self.global_batch) // self.world_size))
            edges = resolve_bin_edges(self.lengths, cfg, default, histogram)
        if cfg.bin_counts and sum(cfg.bin_counts) != self.local:
            raise ConfigError(
                f"sampler.bin_counts: they sum to {sum(cfg.bin_counts)}, but a local batch holds "
                f"{self.local} samples (micro-batch {self.micro_batch} × accumulation {self.grad_accum})"
            )
        at_most = np.concatenate([[0], np.cumsum(histogram)])  # at_most[L + 1]: sequences of length <= L
        below = lambda e: at_most[np.minimum(e, len(histogram) - 1) + 1]
        per_bin = below(edges) - np.concatenate([[0], below(edges[:-1])])
        units = self.world_size
        capacity = per_bin // units  # what a bin can give every unit over the epoch
        if cfg.bin_counts:
            counts_row = np.asarray(cfg.bin_counts, dtype=np.int64)
            used = counts_row > 0
            steps = int(np.min(capacity[used] // counts_row[used]))
        else:
            steps = min(n // self.global_batch, int(capacity.sum()) // self.local)
            if steps > 0:
                self.totals = _apportion(steps * self.local, per_bin.astype(np.float64), capacity)
        if steps == 0:
            raise DataError(
                f"sampler: the length bins {edges.tolist()} hold {per_bin.tolist()} sequences, too few for "
                f"one step of {units} × {self.local} with the bin counts"
            )
        self.edges, self.per_bin = edges, per_bin
        self.bin_start = np.concatenate([[0], np.cumsum(per_bin)[:-1]])
        if windows:
            self.members = BinMembers(self.lengths, edges, per_bin)
        return steps

    # --- one epoch's draw ---------------------------------------------------------------------------
    def draw(self, epoch: int) -> EpochDraw:
        """The epoch's bin counts and permutation keys (cached for the last two epochs)."""
        cached = self._draws.get(epoch)
        if cached is not None:
            return cached
        rng = epoch_rng(self.seed, epoch)
        if self.edges is None:
            out = EpochDraw(permutation_keys(rng, 1))
        else:
            if self.cfg.bin_counts:
                counts = np.repeat(np.asarray(self.cfg.bin_counts, dtype=np.int64)[None, :], self.steps, axis=0)
            else:
                counts = step_bin_counts(self.totals, self.steps, rng)
            keys = permutation_keys(rng, len(self.edges))
            out = EpochDraw(keys, counts, self.world_size * (np.cumsum(counts, axis=0) - counts))
        self._draws[epoch] = out
        for old in [e for e in list(self._draws) if e < epoch - 1]:
            self._draws.pop(old, None)
        return out

    def _lazy_order(self, draw: EpochDraw) -> Order:
        """The epoch's order evaluated where asked (windows)."""
        if self.edges is None:
            return lambda positions: keyed_permutation(positions, len(self.lengths), draw.keys[0])

        def order(positions: np.ndarray) -> np.ndarray:
            flat = positions.ravel()
            which = np.searchsorted(self.bin_start, flat, side="right") - 1  # empty bins share the next one's start
            rank = flat - self.bin_start[which]
            for b in np.unique(which):
                here = which == b
                rank[here] = keyed_permutation(rank[here], int(self.per_bin[b]), draw.keys[b])
            return self.members[self.bin_start[which] + rank].reshape(positions.shape)

        return order

    def _full_order(self, draw: EpochDraw) -> Order:
        """The epoch's order as one array of every sample (the reference)."""
        n = len(self.lengths)
        if self.edges is None:
            return keyed_permutation(np.arange(n), n, draw.keys[0]).__getitem__
        members = np.argsort(bin_index(self.lengths, self.edges), kind="stable")  # bin-major, corpus order within
        for b, (start, size) in enumerate(zip(self.bin_start, self.per_bin)):
            segment = members[start : start + size]
            segment[:] = segment[keyed_permutation(np.arange(size), int(size), draw.keys[b])]
        return members.__getitem__

    def _positions(self, draw: EpochDraw, steps: np.ndarray, units: np.ndarray) -> np.ndarray:
        """``[steps, units, local]`` positions of the stratified draw in the bin-major order: step ``s``, bin ``b``
        hands out its next ``world × c[s, b]`` samples, unit ``u`` the ``u``-th run of ``c[s, b]``."""
        counts = draw.counts[steps]
        col_end = np.cumsum(counts, axis=1)
        slot = np.arange(self.local)
        col_bin = (slot[None, :, None] >= col_end[:, None, :]).sum(axis=2)  # [steps, local]
        rows = np.arange(len(steps))[:, None]
        count = counts[rows, col_bin]
        col_in_bin = slot[None, :] - (col_end - counts)[rows, col_bin]
        base = self.bin_start[col_bin] + draw.taken[steps][rows, col_bin] + col_in_bin
        return base[:, None, :] + units[None, :, None] * count[:, None, :]

    # --- rows of steps ------------------------------------------------------------------------------
    def rows(self, epoch: int, start: int, stop: int, node: Optional[int], order: Order) -> np.ndarray:
        """Steps ``[start, stop)`` of ``epoch``: ``[steps, ranks, grad_accum, slots]`` for ``node``'s ranks
        (``None``: every rank), from the epoch's order ``order``."""
        draw = self.draw(epoch)
        lengths, cfg, G, local = self.lengths, self.cfg, self.global_batch, self.local
        micro, accum, rpn, world = self.micro_batch, self.grad_accum, self.ranks_per_node, self.world_size
        steps = np.arange(start, stop)
        first, ranks = (0, world) if node is None else (node * rpn, rpn)
        shape = (len(steps), ranks, accum, micro)
        strategy = self.strategy
        if strategy == "random":
            return order(steps[:, None] * G + first * local + np.arange(ranks * local)).reshape(shape)
        if strategy == "sorted_megabatch":
            size = self.megabatch  # whole mega-batches around the steps: each is sorted as a whole
            lo, hi = start * G // size * size, min(len(lengths), -(-stop * G // size) * size)
            span = np.arange(lo, hi)
            samples = order(span)
            ordered = samples[np.lexsort((-lengths[samples], span // size))]  # descending within each mega-batch
            # micro-batch j goes to rank j % world; a rank's consecutive micro-batches fill its accumulation slots
            taken = ordered[start * G - lo : stop * G - lo].reshape(len(steps), accum, world, micro)
            return np.ascontiguousarray(taken.transpose(0, 2, 1, 3)[:, first : first + ranks])
        if strategy == "global_sort":
            pools = order(steps[:, None] * G + np.arange(G))
            dealt = deal(pools, lengths, ranks=world, micro=micro, accum=accum, method="snake", cost=cfg.cost_model)
            return dealt[:, first : first + ranks]
        if strategy in ("stratified", "stratified_node_sort"):  # the node's own units of the per-rank draw
            drawn = order(self._positions(draw, steps, np.arange(first, first + ranks)))
            if strategy == "stratified":
                return sort_within_rank(drawn, lengths, accum, micro)
            pools = drawn.reshape(len(steps), ranks // rpn, rpn * local)
            snake = deal(pools, lengths, ranks=rpn, micro=micro, accum=accum, method="snake", cost=cfg.cost_model)
            return snake.reshape(shape)
        # node pools: every node's share of the whole step (split_across_nodes sorts the step's global batch)
        drawn = order(self._positions(draw, steps, np.arange(world))).reshape(len(steps), G)
        pools = split_across_nodes(drawn, lengths, self.nodes, cfg.cost_model)
        pools = pools if node is None else pools[:, node : node + 1]
        if strategy in PACKED_STRATEGIES:
            return self._pack(pools, start, node)
        dealt = deal(
            pools,
            lengths,
            ranks=rpn,
            micro=micro,
            accum=accum,
            method="balance",
            cost=cfg.cost_model,
            padded=cfg.padded,
            pad_multiple=cfg.pad_multiple,
            each_micro_batch=cfg.balance_each_micro_batch,
        )
        return dealt.reshape(shape)

    def _pack(self, pools: np.ndarray, start: int, node: Optional[int]) -> np.ndarray:
        """Node pools ``[steps, nodes, P]`` → ``[steps, nodes × ranks, accum, slots]`` by :func:`pack_pools`."""
        steps, nodes, size = pools.shape
        max_samples, max_tokens = self.budget
        packed, feasible = pack_pools(
            pools.reshape(steps * nodes, size),
            self.lengths,
            ranks=self.ranks_per_node,
            accum=self.grad_accum,
            cost=self.cfg.cost_model,
            padded=self.strategy == "padded_node_balance",
            pad_multiple=self.cfg.pad_multiple,
            max_samples=max_samples,
            max_tokens=max_tokens,
            each_micro_batch=self.cfg.balance_each_micro_batch,
        )
        if not feasible.all():
            step, index = divmod(int(np.argmin(feasible)), nodes)
            raise DataError(
                f"sampler: step {start + step}, node {index if node is None else node}: its {size} samples do not "
                f"fit {self.ranks_per_node} ranks × {self.grad_accum} micro-batches of at most {max_samples} samples "
                f"and {max_tokens} tokens; raise sampler.micro_batch_tokens or sampler.max_micro_batch_samples"
            )
        return packed.reshape(steps, nodes * self.ranks_per_node, self.grad_accum, -1)

    def window(self, epoch: int, index: int, size: int, node: int) -> np.ndarray:
        """Window ``index`` (steps ``[index × size, (index + 1) × size)``, the last one shorter) of ``epoch``
        for ``node``'s ranks: ``[steps, ranks_per_node, grad_accum, slots]``."""
        start = index * size
        if not 0 <= start < self.steps:
            raise ValueError(f"window {index} of {size} steps is outside the epoch's {self.steps} steps")
        if self.edges is not None and self.members is None:
            raise ValueError("this planner was built without windows (windows=False)")
        return self.rows(epoch, start, min(self.steps, start + size), node, self._lazy_order(self.draw(epoch)))

    def plan(self, epoch: int) -> Plan:
        """The whole epoch for every rank, by arrays of the epoch's whole order: the global reference."""
        draw = self.draw(epoch)
        indices = self.rows(epoch, 0, self.steps, None, self._full_order(draw))
        if self.edges is None:
            return Plan(indices, self.dropped, self.strategy)
        by_node = self.strategy in NODE_POOLED
        counts = draw.counts * (self.ranks_per_node if by_node else 1)
        stratum = "node" if by_node else "rank"
        return Plan(indices, self.dropped, self.strategy, bin_edges=self.edges, bin_counts=counts, stratum=stratum)


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
    """The plan of one epoch for every rank (see the module docstring). ``strategy`` overrides ``cfg.strategy``.

    ``bin_edges`` lets a caller that plans many epochs resolve quantile bins once. Every rank would build
    the whole epoch here: training plans windows instead (:meth:`Planner.window`, the same rows).
    """
    planner = Planner(
        lengths,
        world_size=world_size,
        ranks_per_node=ranks_per_node,
        micro_batch=micro_batch,
        grad_accum=grad_accum,
        strategy=strategy,
        cfg=cfg,
        seed=seed,
        bin_edges=bin_edges,
        windows=False,
    )
    return planner.plan(epoch)
