"""``PlanBatchSampler``: per-rank slices of the plan, epochs, resume, and agreement between real processes."""

from __future__ import annotations

import numpy as np
import pytest
import torch.utils.data
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_bertopt.data.config import PACKED_STRATEGIES, STRATEGIES, SamplerConfig
from ds_bertopt.data.sampler import PlanBatchSampler
from ds_bertopt.errors import BertOptError

WORLD, RPN, MICRO, ACCUM = 4, 2, 3, 2


def corpus(n: int = 400, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.where(rng.random(n) < 0.5, 128, rng.integers(2, 129, size=n))


def samplers(
    lengths, strategy: str, seed: int = 7, world: int = WORLD, rpn: int = RPN, **options
) -> list[PlanBatchSampler]:
    cfg = SamplerConfig(strategy=strategy, **options)
    return [
        PlanBatchSampler(
            lengths,
            rank=r,
            world_size=world,
            ranks_per_node=rpn,
            micro_batch=MICRO,
            grad_accum=ACCUM,
            cfg=cfg,
            seed=seed,
        )
        for r in range(world)
    ]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_ranks_split_each_epoch_exactly_and_reorder_every_epoch(strategy):
    lengths = corpus()
    ranks = samplers(lengths, strategy)
    steps = ranks[0].steps_per_epoch
    epochs = []
    for epoch in range(3):
        seen = []
        for _ in range(steps):
            per_rank = [s.next_step() for s in ranks]
            assert all(len(mbs) == ACCUM for mbs in per_rank)  # every rank: grad_accum micro-batches
            sizes = [len(mb) for mbs in per_rank for mb in mbs]
            if strategy in PACKED_STRATEGIES:  # any size but never empty; the step keeps its global batch
                assert min(sizes) >= 1 and all(i >= 0 for mbs in per_rank for mb in mbs for i in mb)
            else:
                assert set(sizes) == {MICRO}
            assert sum(sizes) == WORLD * ACCUM * MICRO
            seen.extend(i for mbs in per_rank for mb in mbs for i in mb)
        assert {s.epoch for s in ranks} == {epoch}
        assert len(seen) == len(set(seen)) == steps * WORLD * ACCUM * MICRO
        assert len(lengths) - len(seen) == ranks[0].plan().dropped
        epochs.append(seen)
    assert epochs[0] != epochs[1] != epochs[2]
    ranks[0].next_step()
    assert ranks[0].epoch == 3 and ranks[0].step == 1


@pytest.mark.parametrize("strategy", STRATEGIES)
@settings(max_examples=10, deadline=None)
@given(stop=st.integers(0, 130))
def test_resume_at_any_step_reproduces_the_rest(strategy, stop):
    lengths = corpus()
    straight = samplers(lengths, strategy)[1]
    interrupted = samplers(lengths, strategy)[1]
    for _ in range(stop):
        straight.next_step()
        interrupted.next_step()
    state = interrupted.state_dict()
    resumed = samplers(lengths, strategy)[1]  # a fresh process: only the checkpointed state carries over
    resumed.load_state_dict(state)
    assert (resumed.epoch, resumed.step) == (straight.epoch, straight.step)
    for _ in range(straight.steps_per_epoch + 5):  # the rest of this epoch and into the next
        assert resumed.next_step() == straight.next_step()


def test_works_as_a_dataloader_batch_sampler():
    lengths = corpus()
    sampler = samplers(lengths, "stratified_node_balance")[3]
    dataset = list(range(len(lengths)))
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=list)
    batches = list(loader)
    assert len(batches) == sampler.steps_per_epoch * ACCUM
    expected = sampler.plan().indices[:, 3].reshape(-1, MICRO).tolist()
    assert batches == expected
    assert len(sampler) == 0  # the epoch is used up


@pytest.mark.parametrize("strategy", PACKED_STRATEGIES)
def test_packed_plans_feed_a_dataloader_and_resume_mid_epoch(strategy):
    """Ragged plans: the loader yields every micro-batch without the plan's -1 slots, and a resumed
    sampler (new object, checkpointed state) continues with exactly the same micro-batches."""
    rng = np.random.default_rng(3)
    lengths = np.where(rng.random(600) < 0.3, 128, rng.integers(2, 129, size=600))
    sampler = samplers(lengths, strategy, world=4, rpn=2)[2]
    plan = sampler.plan()
    assert (plan.indices < 0).any() and plan.indices.shape[3] > MICRO  # really ragged
    loader = torch.utils.data.DataLoader(list(range(len(lengths))), batch_sampler=sampler, collate_fn=list)
    batches = list(loader)
    expected = [plan.micro_batch(step, 2, slot).tolist() for step in range(plan.steps) for slot in range(ACCUM)]
    assert batches == expected and all(batches)
    straight, interrupted = samplers(lengths, strategy)[1], samplers(lengths, strategy)[1]
    for _ in range(5):
        straight.next_step()
        interrupted.next_step()
    resumed = samplers(lengths, strategy)[1]
    resumed.load_state_dict(interrupted.state_dict())
    for _ in range(straight.steps_per_epoch + 3):
        assert resumed.next_step() == straight.next_step()
    # a different packing budget is a different plan: its checkpoint is refused
    other = samplers(lengths, strategy, max_micro_batch_samples=2 * MICRO)[1]
    with pytest.raises(BertOptError, match="plan fingerprint"):
        other.load_state_dict(interrupted.state_dict())


def test_checkpoints_from_before_the_packed_keys_still_resume():
    """The fingerprint of a plan that does not set the packed strategies' keys is the one the sampler wrote
    before they existed (value computed with that code), so older checkpoints keep resuming."""
    lengths = np.arange(1, 401) % 128 + 1
    sampler = PlanBatchSampler(
        lengths,
        rank=0,
        world_size=4,
        ranks_per_node=2,
        micro_batch=3,
        grad_accum=2,
        cfg=SamplerConfig(strategy="stratified_node_balance"),
        seed=7,
    )
    assert sampler.fingerprint == "722ebc1d8c4a4fea"
    budgeted = PlanBatchSampler(
        lengths,
        rank=0,
        world_size=4,
        ranks_per_node=2,
        micro_batch=3,
        grad_accum=2,
        cfg=SamplerConfig(strategy="stratified_node_balance", micro_batch_tokens=999),
        seed=7,
    )
    assert budgeted.fingerprint != sampler.fingerprint


def test_a_checkpoint_from_another_setup_is_refused():
    lengths = corpus()
    state = samplers(lengths, "stratified")[0].state_dict()
    for other in (
        samplers(lengths, "stratified", seed=8)[0],
        samplers(lengths[:-1], "stratified")[0],
        samplers(lengths, "stratified", world=2, rpn=2)[0],
        samplers(lengths, "random")[0],
    ):
        with pytest.raises(BertOptError, match="plan fingerprint"):
            other.load_state_dict(state)
    fine = samplers(lengths, "stratified")[0]
    with pytest.raises(BertOptError, match="checkpoint step 999 is outside"):
        fine.load_state_dict({**state, "step": 999})


def _plan_on_rank(rank: int, world: int, lengths: np.ndarray, strategy: str) -> list:
    """Each real process plans on its own and all-gathers what it will train on."""
    import torch.distributed as dist

    sampler = PlanBatchSampler(
        lengths,
        rank=rank,
        world_size=world,
        ranks_per_node=2,
        micro_batch=MICRO,
        grad_accum=ACCUM,
        cfg=SamplerConfig(strategy=strategy),
        seed=11,
    )
    mine = [sampler.next_step() for _ in range(sampler.steps_per_epoch)]
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    return everyone


@pytest.mark.timeout(180)
def test_real_processes_agree_without_talking():
    from ds_bertopt.testing.distributed import spawn_ranks

    lengths = corpus(600)
    results = spawn_ranks(_plan_on_rank, 4, lengths, "stratified_node_balance", ranks_per_node=2)
    gathered = results[0]
    assert all(r == gathered for r in results)
    seen = [i for rank in gathered for step in rank for mb in step for i in mb]
    assert len(seen) == len(set(seen))
    assert all(len(rank) == len(gathered[0]) for rank in gathered)
    # the node's pool of a step stays on the node: ranks 0, 1 are node 0 and ranks 2, 3 node 1
    local = samplers(lengths, "stratified_node_balance", seed=11)[0].plan()
    for node in (0, 1):
        for step in range(local.steps):
            theirs = sorted(i for r in (2 * node, 2 * node + 1) for mb in gathered[r][step] for i in mb)
            assert theirs == sorted(local.indices[step, 2 * node : 2 * node + 2].ravel().tolist())
