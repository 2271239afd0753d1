"""Batch planning: which samples each rank processes in each step (pure numpy, no communication).

``plan_epoch`` returns ``Plan.indices``, an int64 array ``[steps, world_size, grad_accum, micro_batch]``
of sample indices. Every rank computes the same plan from (seed, epoch), so ranks agree without
talking, and every rank gets exactly ``steps × grad_accum`` micro-batches. Each sample appears at most
once per epoch; the samples that do not fill a whole global batch are left out and counted
(``Plan.dropped``), different ones each epoch.

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

The node strategies never move a sample to another node: each node deals exactly the samples of its
pool (for ``stratified_node_sort``, the samples ``stratified`` gives its ranks; for
``stratified_node_balance``, its share of :func:`split_across_nodes`). Every strategy's set of samples
per step depends on the world size and batch shape, not on the node size, so 2 nodes × 2 ranks and
1 node × 4 ranks train on the same global batches.
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
from .config import STRATEGIES, SamplerConfig
from .cost import CostModel, padded_lengths

SWAP_ROUNDS = 4  # per rank of a pool: rounds of busiest/least-loaded swaps after the greedy dealing


@dataclass(frozen=True)
class Plan:
    indices: np.ndarray
    """``[steps, world_size, grad_accum, micro_batch]`` sample indices."""
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
    (``stratified_node_balance``, ``ranks_per_node ×`` the per-rank counts of its draw)."""

    @property
    def steps(self) -> int:
        return self.indices.shape[0]


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
        raise DataError(f"sampler: the length bins {edges.tolist()} hold {per_bin.tolist()} sequences, too few for "
                        f"one step of {units} × {unit_size} with the bin counts")
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
    ``carry_load``: the load counts earlier groups (balances step totals), else each group on its own. Returns ``[pools, ranks, accum × micro]`` positions.
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
        diff = (item_cost[rows, hi].reshape(pools, slots, micro, 1)
                - item_cost[rows, lo].reshape(pools, slots, 1, micro))  # moved from hi to lo by the swap
        score = np.where((diff > 0) & (diff < gap), np.abs(gap / 2 - diff), np.inf).reshape(pools, -1)
        best = score.argmin(axis=1)
        ok = np.isfinite(score[rows, best])
        if not ok.any():
            break
        slot, pair = np.divmod(best[ok], micro * micro)
        from_hi, from_lo = slot * micro + pair // micro, slot * micro + pair % micro
        p, h, l = rows[ok], hi[ok], lo[ok]
        positions[p, h, from_hi], positions[p, l, from_lo] = positions[p, l, from_lo], positions[p, h, from_hi]
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


def deal(indices: np.ndarray, lengths: np.ndarray, *, ranks: int, micro: int, accum: int, method: str,
         cost: CostModel, padded: bool = False, pad_multiple: int = 8, each_micro_batch: bool = False) -> np.ndarray:
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
            positions[:, :, start:start + per_group] = refine_by_swaps(
                positions[:, :, start:start + per_group], item_cost, per_group, SWAP_ROUNDS * ranks)
    else:  # positions ascend with descending cost: longest micro-batch first
        positions = np.sort(refine_by_swaps(positions, item_cost, per_group, SWAP_ROUNDS * ranks), axis=2)
    dealt = np.take_along_axis(items[:, None], positions.reshape(*positions.shape, *([1] * (items.ndim - 2))), axis=2)
    return dealt.reshape(*lead, ranks, accum, micro)


def sort_within_rank(indices: np.ndarray, lengths: np.ndarray, accum: int, micro: int) -> np.ndarray:
    """``[steps, world, local]`` → ``[steps, world, accum, micro]``, longest micro-batch first."""
    order = np.argsort(-lengths[indices], axis=-1, kind="stable")
    return np.take_along_axis(indices, order, axis=-1).reshape(*indices.shape[:2], accum, micro)


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


def plan_epoch(lengths: np.ndarray, *, world_size: int, ranks_per_node: int, micro_batch: int, grad_accum: int,
               strategy: Optional[str] = None, cfg: Optional[SamplerConfig] = None, seed: int = 0,
               epoch: int = 0, bin_edges: Optional[np.ndarray] = None) -> Plan:
    """The plan of one epoch (see the module docstring). ``strategy`` overrides ``cfg.strategy``.

    ``bin_edges`` lets a caller that plans many epochs resolve quantile bins once.
    """
    cfg = cfg or SamplerConfig()
    strategy = strategy or cfg.strategy
    if strategy not in STRATEGIES:
        raise ConfigError(f"sampler.strategy: {strategy!r} is not one of {', '.join(STRATEGIES)}")
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
        raise ConfigError(f"the corpus has {n} training sequences, fewer than one global batch of {global_batch} "
                          f"(world {world_size} × accumulation {grad_accum} × micro-batch {micro_batch})")
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
        dealt = deal(pools, lengths, ranks=world_size, micro=micro_batch, accum=grad_accum, method="snake",
                     cost=cfg.cost_model)
        return Plan(dealt.reshape(shape), n - used, strategy)

    nodes = world_size // ranks_per_node
    by_node = strategy == "stratified_node_balance"
    if bin_edges is not None:
        edges = np.asarray(bin_edges, dtype=np.int64)
    else:  # a bin loses up to world - 1 samples to rounding: on a corpus that small, fewer bins
        edges = resolve_bin_edges(lengths, cfg, default_bins=max(1, min(cfg.num_bins, (n - global_batch) // world_size)))
    if cfg.bin_counts and sum(cfg.bin_counts) != local:
        raise ConfigError(f"sampler.bin_counts: they sum to {sum(cfg.bin_counts)}, but a local batch holds "
                          f"{local} samples (micro-batch {micro_batch} × accumulation {grad_accum})")
    # per-rank draw: the global batch of a step does not depend on the node size
    drawn, counts, dropped = stratified_draw(lengths, edges, cfg.bin_counts or None, world_size, local, rng)
    if strategy == "stratified":
        indices = sort_within_rank(drawn, lengths, grad_accum, micro_batch)
    elif strategy == "stratified_node_sort":
        pools = drawn.reshape(len(drawn), nodes, ranks_per_node * local)
        indices = deal(pools, lengths, ranks=ranks_per_node, micro=micro_batch, accum=grad_accum, method="snake",
                       cost=cfg.cost_model).reshape(len(drawn), *shape[1:])
    else:
        pools = split_across_nodes(drawn.reshape(len(drawn), global_batch), lengths, nodes, cfg.cost_model)
        indices = deal(pools, lengths, ranks=ranks_per_node, micro=micro_batch, accum=grad_accum, method="balance",
                       cost=cfg.cost_model, padded=cfg.padded, pad_multiple=cfg.pad_multiple,
                       each_micro_batch=cfg.balance_each_micro_batch).reshape(len(drawn), *shape[1:])
        counts = counts * ranks_per_node
    return Plan(indices, dropped, strategy, bin_edges=edges, bin_counts=counts, stratum="node" if by_node else "rank")
