"""``PlanBatchSampler``: per-rank slices of the plan, epochs, resume, and agreement between real processes."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch.utils.data
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_bertopt.data.config import PACKED_STRATEGIES, STRATEGIES, SamplerConfig
from ds_bertopt.data.plan import plan_epoch
from ds_bertopt.data.sampler import PlanBatchSampler
from ds_bertopt.errors import BertOptError, DataError

WORLD, RPN, MICRO, ACCUM = 4, 2, 3, 2


def corpus(n: int = 400, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.where(rng.random(n) < 0.5, 128, rng.integers(2, 129, size=n))


def samplers(
    lengths,
    strategy: str,
    seed: int = 7,
    world: int = WORLD,
    rpn: int = RPN,
    micro: int = MICRO,
    accum: int = ACCUM,
    ranks=None,
    window_steps: int = 32,
    prefetch: bool = True,
    **options,
) -> list[PlanBatchSampler]:
    cfg = SamplerConfig(strategy=strategy, **options)
    return [
        PlanBatchSampler(
            lengths,
            rank=r,
            world_size=world,
            ranks_per_node=rpn,
            micro_batch=micro,
            grad_accum=accum,
            cfg=cfg,
            seed=seed,
            window_steps=window_steps,
            prefetch=prefetch,
        )
        for r in (range(world) if ranks is None else ranks)
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


def test_checkpoints_of_the_previous_planner_are_refused():
    """Version 1 of the planner (numpy's shuffled permutation) wrote fingerprint 722ebc1d8c4a4fea for this setup
    (value computed with that code); its plan is not this one, so its checkpoint must not resume."""
    lengths = np.arange(1, 401) % 128 + 1
    kw = dict(rank=0, world_size=4, ranks_per_node=2, micro_batch=3, grad_accum=2, seed=7)
    sampler = PlanBatchSampler(lengths, cfg=SamplerConfig(strategy="stratified_node_balance"), **kw)
    old = {**sampler.state_dict(), "fingerprint": "722ebc1d8c4a4fea"}
    with pytest.raises(BertOptError, match="or the planner's definition changed"):
        sampler.load_state_dict(old)
    budgeted = PlanBatchSampler(
        lengths, cfg=SamplerConfig(strategy="stratified_node_balance", micro_batch_tokens=999), **kw
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


# ------------------------------------------------------------------------------------------------
# windows: each rank plans its node's steps a window at a time, ahead, in the background
# ------------------------------------------------------------------------------------------------
def reference_rows(lengths, strategy, epoch, rank, micro, accum, **options) -> list:
    """The global plan's micro-batches of ``rank``, step by step (the reference the windows must equal)."""
    plan = plan_epoch(
        lengths,
        world_size=16,
        ranks_per_node=4,
        micro_batch=micro,
        grad_accum=accum,
        cfg=SamplerConfig(strategy=strategy, **options),
        seed=7,
        epoch=epoch,
    )
    return [[plan.micro_batch(s, rank, a).tolist() for a in range(accum)] for s in range(plan.steps)]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("micro, accum, options", [(3, 1, {}), (2, 2, {"balance_each_micro_batch": True})])
def test_every_rank_reads_the_global_plan_across_epoch_ends_and_resumes_inside_a_window(
    strategy, micro, accum, options
):
    """16 ranks × 4 per node, windows of 7 steps: one rank of every node (each at another place in its node)
    reads exactly the global plan's rows through two epoch ends; a fresh sampler resumed from a checkpoint taken
    inside a window goes on with the same rows."""
    lengths = corpus(1500, seed=2)
    ranks = samplers(
        lengths, strategy, world=16, rpn=4, micro=micro, accum=accum, ranks=(0, 5, 10, 15), window_steps=7, **options
    )
    expected = {
        (epoch, s.rank): reference_rows(lengths, strategy, epoch, s.rank, micro, accum, **options)
        for epoch in (0, 1, 2)
        for s in ranks
    }
    steps = ranks[0].steps_per_epoch
    assert steps == len(expected[0, 0]) and steps % 7  # the last window is a short one
    for s in ranks:
        for epoch in (0, 1):
            assert [s.next_step() for _ in range(steps)] == expected[epoch, s.rank]
        assert s.next_step() == expected[2, s.rank][0] and (s.epoch, s.step) == (2, 1)
    middle = samplers(
        lengths, strategy, world=16, rpn=4, micro=micro, accum=accum, ranks=(10,), window_steps=7, **options
    )[0]
    for _ in range(steps + 9):  # into epoch 1, inside its second window
        middle.next_step()
    resumed = samplers(
        lengths, strategy, world=16, rpn=4, micro=micro, accum=accum, ranks=(10,), window_steps=7, **options
    )[0]
    resumed.load_state_dict(middle.state_dict())
    assert [resumed.next_step() for _ in range(steps)] == expected[1, 10][9:] + expected[2, 10][:9]


def test_copies_share_the_planned_windows_and_pickles_plan_their_own():
    """The loop's loader reads from ``copy.copy(sampler)``: the same rows, the windows planned once for both.
    A pickled sampler (as a DataLoader worker would get it) plans its own and reads the same rows."""
    lengths = corpus(600)
    sampler = samplers(lengths, "packed_node_balance", ranks=(3,), window_steps=4)[0]
    sampler.next_step()
    cursor = copy.copy(sampler)
    assert cursor.windows is sampler.windows and cursor.planner is sampler.planner
    revived = pickle.loads(pickle.dumps(sampler))
    assert revived.windows is not sampler.windows
    planned = len(sampler.windows.planned)
    rows = [cursor.next_step() for _ in range(3)]  # the rest of window 0, then window 1 (planned ahead)
    assert [revived.next_step() for _ in range(3)] == rows
    assert [sampler.next_step() for _ in range(3)] == rows  # the copy's reading moved only the copy
    assert len(sampler.windows.planned) <= planned + 1  # window 1 once for both readers, no window 0 again


def test_the_next_window_is_planned_ahead_and_its_errors_reach_the_step_that_needs_it(monkeypatch):
    lengths = corpus(600)
    sampler = samplers(lengths, "stratified_node_balance", ranks=(1,), window_steps=3)[0]
    sampler.next_step()  # window 0 read: window 1 is under way in the background
    ahead = sampler.windows._jobs[(0, 1)]
    assert ahead.done.wait(30) and ahead.error is None
    waits = len(sampler.windows.waits)
    for _ in range(3):
        sampler.next_step()
    assert len(sampler.windows.waits) == waits  # window 1 was ready: no step waited for it
    broken = samplers(lengths, "stratified_node_balance", ranks=(1,), window_steps=3, prefetch=False)[0]
    plan_window = broken.planner.window
    monkeypatch.setattr(
        broken.planner,
        "window",
        lambda epoch, index, size, node: (
            (_ for _ in ()).throw(DataError("window 2 broke")) if index == 2 else plan_window(epoch, index, size, node)
        ),
    )
    for _ in range(6):
        broken.next_step()
    with pytest.raises(DataError, match="window 2 broke"):
        broken.next_step()
    infeasible = samplers(lengths, "packed_node_balance", ranks=(2,), micro_batch_tokens=130)[0]
    with pytest.raises(DataError, match=r"sampler: step 0, node 1: its \d+ samples do not fit"):
        infeasible.next_step()


def _arrays(obj, seen: set) -> int:
    """Bytes of the numpy arrays reachable from ``obj``'s attributes (each array once)."""
    if isinstance(obj, np.ndarray):
        if id(obj) in seen:
            return 0
        seen.add(id(obj))
        return obj.nbytes
    if isinstance(obj, (list, tuple)):
        return sum(_arrays(x, seen) for x in obj)
    if isinstance(obj, dict):
        return sum(_arrays(x, seen) for x in obj.values())
    if hasattr(obj, "__dict__") and type(obj).__module__.startswith("ds_bertopt"):
        if id(obj) in seen:
            return 0
        seen.add(id(obj))
        return _arrays(vars(obj), seen)
    return 0


@pytest.mark.parametrize("strategy", ["random", "packed_node_balance"])
def test_a_rank_holds_its_lengths_members_and_a_few_windows_not_the_epoch(strategy):
    """The memory model: 2 bytes a sequence of lengths, 2 of every bin's members (stratified strategies), and a
    few windows of its node's rows, however long the epoch; the global plan holds every rank's epoch."""
    n = 200_000
    lengths = np.where(np.random.default_rng(0).random(n) < 0.5, 512, np.random.default_rng(1).integers(32, 512, n))
    sampler = samplers(lengths, strategy, world=64, rpn=8, micro=16, accum=1, ranks=(9,), window_steps=8)[0]
    for _ in range(40):  # several windows
        sampler.next_step()
    window = 8 * 8 * 1 * 4 * 16 * 8  # steps × node ranks × accumulation × slots (≤ 4 × micro) × int64
    held = _arrays(sampler, set()) + sum(_arrays(job.rows, set()) for job in sampler.windows._jobs.values())
    per_sequence = 4 if strategy != "random" else 2
    assert held <= per_sequence * n + 4 * window + 64 * 1024
    assert (
        held
        < plan_epoch(
            lengths, world_size=64, ranks_per_node=8, micro_batch=16, grad_accum=1, strategy=strategy
        ).indices.nbytes
    )


def test_the_transformers_peer_is_planned_a_whole_epoch_at_a_time():
    """``hf_batch_rebalance`` is transformers' algorithm, global by design: one window is the whole epoch, and every
    rank reads its rows of the peer's own plan."""
    from ds_bertopt.data.sampler import hf_batch_rebalance_plan

    lengths = corpus(300)
    ranks = samplers(lengths, "hf_batch_rebalance")
    assert ranks[0].window_steps == ranks[0].steps_per_epoch == 300 // (WORLD * MICRO * ACCUM)
    plan = hf_batch_rebalance_plan(lengths, world_size=WORLD, micro_batch=MICRO, grad_accum=ACCUM, seed=7, epoch=1)[0]
    for s in ranks:
        s.set_epoch(1)
        rows = [s.next_step() for _ in range(s.steps_per_epoch)]
        assert rows == [[plan.micro_batch(t, s.rank, a).tolist() for a in range(ACCUM)] for t in range(plan.steps)]
