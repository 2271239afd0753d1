"""LAMB under ZeRO 1/2 at every world size from 1 to 4,096, for every shipped LAMB config's model (docs/optim.md).

DeepSpeed pads each flat parameter group to a multiple of 2 × world and splits it evenly (``stage_1_and_2.py``);
at large worlds the last ranks of a small group (biases and LayerNorms) hold padding only. Their LAMB layout is
empty, and the step crashed there (``torch._foreach_norm([])``): that rank died, the others hung.

* **The sweep.** Every group of every shipped LAMB config's model (built on the meta device by our own builder) at
  every world size: each group padded by DeepSpeed's ``align_dense_tensors`` (what ``flatten_dense_tensors_aligned``
  pads with) to its ``nccl_start_alignment_factor × world``, split by ``DeepSpeedZeroOptimizer.
  get_data_parallel_partitions`` (both called as DeepSpeed defines them, on stand-ins that carry only sizes), each
  rank's fragments computed from those bounds (vectorised): every rank's fragments lie in its shard and the ranks'
  fragments tile every layer exactly once, so the all-reduced per-layer sums are ZeRO 0's; the ranks holding
  padding only are counted.
* **Real tensors, a sample of sizes.** DeepSpeed flattens and partitions real groups and links them
  (``link_hp_params``: the ``_hp_mapping`` that ``attach_lamb`` reads), our layouts come from
  ``layouts_from_hp_mapping``, and every rank's real LAMB step runs (the all-reduce done in-process), padding-only
  ranks included: trust ratios and weights equal ZeRO 0's.
* **Real gloo ranks.** A model whose groups leave padding-only ranks at world 4, trained through
  ``ds_bertopt.engine.initialize`` at ZeRO 1 and 2 against ZeRO 0 (``tests/scripts/lamb_padding_worker.py``).
"""

from __future__ import annotations

import functools
import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from ds_bertopt import optim
from ds_bertopt.config import load_config
from ds_bertopt.optim.lamb import Lamb, Layout, lamb_update
from ds_bertopt.optim.zero import layouts_from_hp_mapping

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "scripts"))
import lamb_padding_worker  # noqa: E402

MAX_WORLD = 4096
NCCL_START_ALIGNMENT_FACTOR = 2
"""``DeepSpeedZeroOptimizer.__init__``: ``self.nccl_start_alignment_factor = 2`` (an instance attribute: the gloo
test reads it off a real engine and checks it is this)."""
PHASE1_SHAPE = {"runs/bert_large/final": "bert_large.json", "checkpoints/bert_large_phase1": "bert_large.json"}
"""The configs that start from a checkpoint train its architecture: BERT-large phase 1, as ``bert_large.json``
writes it (vocabulary 30,522, MLPerf's too)."""


def lamb_configs() -> list[Path]:
    return sorted(
        path
        for path in (ROOT / "ds_configs").glob("*.json")
        if json.loads(path.read_text()).get("bertopt", {}).get("optimizer", {}).get("type") == "lamb"
    )


class _Vocabulary:
    """What ``build_pretraining_model`` reads of a tokenizer: its size and padding id."""

    def __init__(self, size: int):
        self.size, self.pad_token_id = size, 0

    def __len__(self) -> int:
        return self.size


@functools.lru_cache(maxsize=None)
def group_numels(config: str) -> tuple[tuple[int, ...], ...]:
    """Per parameter group (decay, no decay: ``optim.param_groups``), the element count of each parameter in the
    order DeepSpeed flattens them, of the model ``config`` trains (built on the meta device: no memory)."""
    from ds_bertopt.model.bert import build_pretraining_model

    cfg = load_config(config)
    checkpoint = cfg.bertopt.model.init_checkpoint
    shape = load_config(str(ROOT / "ds_configs" / PHASE1_SHAPE[checkpoint])) if checkpoint else cfg
    model_cfg, data_cfg = shape.bertopt.model, shape.bertopt.data
    with torch.device("meta"):
        model = build_pretraining_model(model_cfg, _Vocabulary(data_cfg.tokenizer_vocab_size), data_cfg.max_seq_length)
    groups = optim.param_groups(model, cfg.bertopt.optimizer.weight_decay)
    return tuple(tuple(p.numel() for p in group["params"]) for group in groups)


# --- DeepSpeed's own code, on stand-ins that carry sizes only --------------------------------------------------------
class _Sized:
    """A tensor as ``align_dense_tensors`` and ``get_data_parallel_partitions`` see it: a size (and where a pad of
    its kind would be made)."""

    __slots__ = ("size",)
    device, dtype = torch.device("meta"), torch.float32

    def __init__(self, size: int):
        self.size = size

    def numel(self) -> int:
        return self.size

    @staticmethod
    def narrow(dim: int, start: int, length: int) -> tuple[int, int]:  # noqa: ARG004 - torch.Tensor.narrow's
        return start, length


class _World:
    __slots__ = ("size",)

    def __init__(self, size: int):
        self.size = size


DEEPSPEED_SPLIT_WORLDS = (*range(1, 1025), *range(1088, MAX_WORLD + 1, 64))
"""Where ``get_data_parallel_partitions`` itself is run for every group (a Python loop over the ranks: Σ world
= 8.4M iterations per group up to 4,096, ~1.4 s each, so not at every world size)."""


@functools.lru_cache(maxsize=None)
def padded_sizes(total: int) -> np.ndarray:
    """Per world size 1 … 4,096, the group's flat size after DeepSpeed's padding: ``align_dense_tensors`` (what
    ``flatten_dense_tensors_aligned`` pads with) to ``nccl_start_alignment_factor × world``."""
    from deepspeed.runtime.utils import align_dense_tensors

    worlds = range(1, MAX_WORLD + 1)
    pieces = (align_dense_tensors([_Sized(total)], NCCL_START_ALIGNMENT_FACTOR * w) for w in worlds)
    return np.array([sum(t.numel() for t in padded) for padded in pieces], dtype=np.int64)


@pytest.fixture(scope="module")
def deepspeed_split(request):
    """``split(padded, world) -> [(start, size)] per rank``: ``DeepSpeedZeroOptimizer.get_data_parallel_partitions``
    as DeepSpeed runs it. It asks ``deepspeed.comm`` for the world size of its group: a world of up to 4,096 ranks
    exists here only as that number, given through that one lookup (nothing else of DeepSpeed is replaced)."""
    from deepspeed.runtime.zero import stage_1_and_2
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    patch = pytest.MonkeyPatch()
    patch.setattr(stage_1_and_2, "dist", types.SimpleNamespace(get_world_size=lambda group: group.size))
    request.addfinalizer(patch.undo)
    holder = types.SimpleNamespace(real_dp_process_group=[None])

    def split(padded: int, world: int) -> list[tuple[int, int]]:
        holder.real_dp_process_group[0] = _World(world)
        return DeepSpeedZeroOptimizer.get_data_parallel_partitions(holder, _Sized(padded), 0)

    return split


# --- our layouts on those bounds, every rank of every world at once -------------------------------------------------
def fragment_table(numels: np.ndarray, starts: np.ndarray, sizes: np.ndarray):
    """Every rank's fragments as ``attach_lamb`` builds them from ``_hp_mapping`` (``get_hp_fragment_mapping``: a
    parameter's elements inside the rank's ``[start, start + size)`` of the flat group), one rank per entry of
    ``starts``/``sizes``: arrays ``(rank, layer, begin, end)`` in flat-group positions, rank-major, and the number of
    fragments per rank."""
    offsets = np.concatenate(([0], np.cumsum(numels)[:-1])).astype(starts.dtype)
    ends = offsets + numels.astype(starts.dtype)
    first = np.searchsorted(ends, starts, side="right")  # the first layer ending after the shard's start
    stop = np.searchsorted(offsets, starts + sizes, side="left")  # the layers starting before its end
    counts = np.maximum(stop - first, 0)
    rank = np.repeat(np.arange(len(starts), dtype=starts.dtype), counts)
    layer = np.repeat(first - np.cumsum(counts) + counts, counts) + np.arange(counts.sum(), dtype=starts.dtype)
    begin = np.maximum(offsets[layer], starts[rank])
    end = np.minimum(ends[layer], starts[rank] + sizes[rank])
    return rank, layer, begin, end, counts


def check_worlds(numels: np.ndarray, worlds: np.ndarray, split: np.ndarray) -> np.ndarray:
    """Every rank of each world in ``worlds`` (``split[i]``: each rank's shard size in ``worlds[i]``, the shards back
    to back): assert that a world's ranks' fragments tile each layer exactly once, in order, so the all-reduced
    per-layer sums are ZeRO 0's; return the number of ranks holding padding only, per world."""
    world_of = np.repeat(np.arange(len(worlds), dtype=np.int32), worlds)  # one entry per rank of every world
    sizes = split.astype(np.int32)[world_of]
    starts = (
        np.arange(len(world_of), dtype=np.int32) - np.repeat((np.cumsum(worlds) - worlds).astype(np.int32), worlds)
    ) * sizes
    rank, layer, begin, end, counts = fragment_table(numels, starts, sizes)
    assert (end > begin).all(), "an empty fragment"
    key = world_of[rank] * len(numels) + layer  # a layer of one world
    # rank-major rows run through each world's flat group in order, so a layer's fragments are consecutive rows
    assert (np.diff(key) >= 0).all(), "fragments out of the flat group's order"
    first = np.concatenate(([True], key[1:] != key[:-1]))
    last = np.concatenate((first[1:], [True]))
    offsets = np.concatenate(([0], np.cumsum(numels)[:-1]))
    assert np.array_equal(key[first], np.arange(len(worlds) * len(numels))), "a layer is held by no rank"
    assert (begin[first] == np.tile(offsets, len(worlds))).all(), "a layer's first fragment does not start it"
    assert (begin[~first] == end[np.flatnonzero(~first) - 1]).all(), "a layer's fragments leave a gap or overlap"
    assert (end[last] == np.tile(offsets + numels, len(worlds))).all(), "a layer's last fragment does not end it"
    return np.bincount(world_of[counts == 0], minlength=len(worlds))


CHUNK = 16
"""World sizes checked at once (arrays of a few MB, reused by the allocator instead of page-faulted anew)."""


@functools.lru_cache(maxsize=None)
def sweep(numels: tuple[int, ...]) -> dict[int, int]:
    """``{world: ranks holding padding only}`` of one group over every world size 1 … 4,096 (where there are
    any), each rank's shard the ``padded // world`` elements from ``rank × that`` that ``_link_all_hp_params``
    links (checked against ``get_data_parallel_partitions`` by the test)."""
    group = np.asarray(numels, dtype=np.int32)
    worlds = np.arange(1, MAX_WORLD + 1, dtype=np.int32)
    padded = padded_sizes(int(group.sum()))
    assert padded.max() < 2**31  # int32 positions in the flat group
    split = padded // worlds
    chunks = range(0, MAX_WORLD, CHUNK)
    empty = np.concatenate([check_worlds(group, worlds[i : i + CHUNK], split[i : i + CHUNK]) for i in chunks])
    return {int(w): int(n) for w, n in zip(worlds, empty) if n}


@pytest.mark.parametrize("config", lamb_configs(), ids=lambda p: p.name)
def test_every_rank_of_every_world_size_holds_whole_layers_or_padding(config, deepspeed_split):
    groups = group_numels(str(config))
    assert len(groups) == 2
    for numels in groups:
        padded = padded_sizes(sum(numels))
        assert (padded >= sum(numels)).all() and (padded % (2 * np.arange(1, MAX_WORLD + 1)) == 0).all()
        for world in DEEPSPEED_SPLIT_WORLDS:  # DeepSpeed's data partitions are the shards its linkage maps
            size = padded[world - 1] // world
            assert deepspeed_split(int(padded[world - 1]), world) == [(r * size, size) for r in range(world)]
    padding_only = [sweep(numels) for numels in groups]
    assert any(padding_only), "no world size leaves a rank with padding only: the sweep would not test that step"
    if load_config(str(config)).bertopt.model.init_checkpoint:  # the arithmetic: BERT-large at 1,024 ranks
        assert padding_only[1].get(1024) == 3 and padding_only[0].get(1024) is None


# --- real tensors: DeepSpeed's linkage, our layouts, every rank's step ---------------------------------------------
LR, BETAS, EPS, WD = 0.02, (0.9, 0.999), 1e-6, 0.01


def _lamb_args(adapt: bool) -> dict:
    return dict(lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WD, bias_correction=True, adapt=adapt)


class _Captured(Exception):
    pass


def ranks_step(numels: list[int], world: int, adapt: bool, seed: int = 0):
    """One LAMB step of every rank of ``world`` over one group of layers of ``numels`` elements, on real tensors laid
    out by DeepSpeed (flatten, partition, ``link_hp_params``) with our layouts (``layouts_from_hp_mapping``);
    the all-reduce of the per-layer sums done in-process; LAMB's foreach path, a GPU's (the fused CPU kernel's
    padding cases: the unit tests below and the gloo ranks). Returns ``(per-rank ratios, per-rank shards, layouts,
    ZeRO 0 ratios, ZeRO 0 flat weights)``."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from deepspeed.utils.mixed_precision_linkage import link_hp_params
    from torch._utils import _flatten_dense_tensors

    gen = torch.Generator().manual_seed(seed)
    weights = [torch.randn(n, generator=gen) for n in numels]
    grads = [torch.randn(n, generator=gen) for n in numels]
    holder = types.SimpleNamespace(flatten=_flatten_dense_tensors, real_dp_process_group=[_World(world)])
    alignment = NCCL_START_ALIGNMENT_FACTOR * world
    flat = DeepSpeedZeroOptimizer.flatten_dense_tensors_aligned(holder, weights, alignment)
    flat_grad = DeepSpeedZeroOptimizer.flatten_dense_tensors_aligned(holder, grads, alignment)
    shards = [t.clone() for t in DeepSpeedZeroOptimizer.get_data_parallel_partitions(holder, flat, 0)]
    grad_shards = [t.clone() for t in DeepSpeedZeroOptimizer.get_data_parallel_partitions(holder, flat_grad, 0)]
    size = shards[0].numel()
    layouts = []
    for rank, shard in enumerate(shards):
        link_hp_params(weights, shard, {}, None, False, 0, rank * size, size, None)
        wrapper = types.SimpleNamespace(
            bit16_groups=[weights], single_partition_of_fp32_groups=[shard], real_dp_process_group=[None]
        )
        layouts.append(layouts_from_hp_mapping(Lamb([shard]), wrapper)[0])
    states = [(torch.zeros(size), torch.zeros(size)) for _ in shards]

    def step(rank: int, allreduce, in_place: bool):
        m, v = states[rank] if in_place else (states[rank][0].clone(), states[rank][1].clone())
        shard = shards[rank] if in_place else shards[rank].clone()
        return lamb_update(
            [shard], [grad_shards[rank]], [m], [v], [1], layout=layouts[rank], allreduce=allreduce, kernel="foreach",
            **_lamb_args(adapt),
        )  # fmt: skip

    sums = []

    def capture(tensor):
        sums.append(tensor.clone())
        raise _Captured

    for rank in range(world):  # the all-reduce's inputs, on copies of each rank's state
        try:
            step(rank, capture, in_place=False)
        except _Captured:
            pass
    total = torch.stack(sums).sum(0) if sums else None
    ratios = [step(rank, lambda t: t.copy_(total), in_place=True) for rank in range(world)]
    ref_weights = [w.clone() for w in weights]
    ref_ratios = lamb_update(
        ref_weights, grads, [torch.zeros(n) for n in numels], [torch.zeros(n) for n in numels], [1] * len(numels),
        kernel="foreach", **_lamb_args(adapt),
    )  # fmt: skip
    return ratios, shards, layouts, ref_ratios, torch.cat(ref_weights)


def sample_cases() -> list[tuple[str, int, int, bool]]:
    """(config, group, world, trust ratio on the group): each distinct group small enough to hold in memory (not
    BERT-large's weights, nor bert_lamb's 5M, whose first padding-only world is 1,679 ranks) at 3 ranks and at the
    first world size where a rank holds padding only; the decay group with the trust ratio, the no-decay group both
    ways (the shipped configs take plain Adam steps there, ``adapt_no_decay`` false)."""
    cases, seen = [], set()
    for config in lamb_configs():
        for g, numels in enumerate(group_numels(str(config))):
            if numels in seen or sum(numels) > 2_000_000:
                continue
            seen.add(numels)
            total, padded = sum(numels), padded_sizes(sum(numels))
            worlds = {3}
            for world in range(1, MAX_WORLD + 1):
                if padded[world - 1] - total >= padded[world - 1] // world:  # the last rank holds padding only
                    worlds.add(world)
                    break
            cases += [
                (config.name, g, w, adapt) for w in sorted(worlds) for adapt in ((True,) if g == 0 else (True, False))
            ]
    return cases


@pytest.mark.parametrize(
    "case", sample_cases(), ids=lambda c: f"{c[0]}-group{c[1]}-world{c[2]}-{'lamb' if c[3] else 'adam'}"
)
def test_every_rank_steps_and_takes_the_zero0_ratios_on_real_tensors(case, deepspeed_split):  # noqa: ARG001
    config, group, world, adapt = case
    numels = list(group_numels(str(ROOT / "ds_configs" / config))[group])
    ratios, shards, layouts, ref_ratios, ref_weights = ranks_step(numels, world, adapt)
    total, size = sum(numels), shards[0].numel()
    assert any(not layout.fragments for layout in layouts) or world == 3
    # The foreach path takes each fragment's norm in fp32 (torch._foreach_norm): a 1M-element embedding normed whole
    # or in pieces differs by up to ~3e-5 of itself; a missing or doubled fragment, or a per-shard ratio, by far more.
    for rank, (rank_ratios, shard) in enumerate(zip(ratios, shards)):
        torch.testing.assert_close(rank_ratios, ref_ratios, rtol=1e-4, atol=0, msg=f"rank {rank} ratios")
        held = max(0, min(size, total - rank * size))  # real elements in this shard; the rest is padding
        torch.testing.assert_close(shard[:held], ref_weights[rank * size : rank * size + held], rtol=1e-5, atol=1e-6)
        assert not layouts[rank].fragments or held > 0


def test_a_padding_only_layout_steps_without_reading_anything():
    """The unit case: an empty layout joins the reduction with zeros and changes nothing (both kernels)."""
    shard, grad = torch.zeros(4), torch.ones(4)
    for kernel in ("auto", "foreach"):
        seen = []
        ratios = lamb_update(
            [shard], [grad], [torch.zeros(4)], [torch.zeros(4)], [1], layout=Layout((), 3),
            allreduce=seen.append, kernel=kernel, **_lamb_args(True),
        )  # fmt: skip
        assert len(seen) == 1 and seen[0].shape == (2, 3) and not seen[0].any()
        assert torch.equal(ratios, torch.ones(3, dtype=torch.float64)) and not shard.any()


def test_a_shard_whose_one_fragment_ends_before_its_padding_steps():
    """The last rank with real elements: one fragment, of the group's first layer, then padding. The fused kernel's
    piece table took it for a whole tensor and refused it (found by the gloo test below)."""
    from ds_bertopt.optim.lamb import Fragment

    for kernel in ("auto", "foreach"):
        shard = torch.tensor([3.0, 0.0])
        lamb_update(
            [shard], [torch.tensor([1.0, 0.0])], [torch.zeros(2)], [torch.zeros(2)], [1],
            layout=Layout((Fragment(0, 0, 1, 0),), 1), kernel=kernel, **_lamb_args(True),
        )  # fmt: skip
        assert shard[0] != 3.0 and shard[1] == 0.0, kernel


# --- real gloo ranks ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gloo_results():
    from ds_bertopt.testing.distributed import spawn_ranks

    return spawn_ranks(lamb_padding_worker.run, lamb_padding_worker.WORLD, timeout=300)


def test_padding_only_ranks_step_under_real_deepspeed_zero(gloo_results):
    world = lamb_padding_worker.WORLD
    numels = lamb_padding_worker.group_numels()
    for g, group in enumerate(numels):
        size = padded_sizes(sum(group))[world - 1] // world
        starts, sizes = size * np.arange(world), np.full(world, size)
        expected = [int(n) for n in fragment_table(np.asarray(group), starts, sizes)[4]]
        for stage in (1, 2):
            got = [rank[f"stage{stage}"]["fragments"][g] for rank in gloo_results]
            assert got == expected, f"ZeRO {stage} group {g}: fragments per rank {got}, the sweep's {expected}"
    assert any(0 in rank["stage1"]["fragments"] for rank in gloo_results), "no rank held padding only"
    for rank, result in enumerate(gloo_results):
        assert result["alignment_factor"] == NCCL_START_ALIGNMENT_FACTOR
        zero0 = result["stage0"]
        assert zero0["moved"] > 1e-3
        for stage in (1, 2):
            got = result[f"stage{stage}"]
            params, reference = torch.tensor(got["params"]), torch.tensor(zero0["params"])
            torch.testing.assert_close(params, reference, rtol=1e-5, atol=1e-6, msg=f"rank {rank} ZeRO {stage}")
            # ZeRO 1/2 step the optimizer once per group (the ratios of the last: the no-decay group, whose ranks 2
            # and 3 hold padding only), ZeRO 0 once for both
            ratios, reference = torch.tensor(got["ratios"][-1]), torch.tensor(zero0["ratios"][-1])
            torch.testing.assert_close(ratios, reference, rtol=1e-5, atol=0, msg=f"rank {rank} ZeRO {stage}")
