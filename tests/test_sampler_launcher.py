"""The planner inside real DeepSpeed jobs: ``launch/pretrain.py`` under the ``deepspeed`` launcher with
``train.log_samples``; every rank's logged samples must be exactly its rows of the plan.

* 2 ranks, gradient accumulation 2: stop mid-epoch, resume from the checkpoint, run past the epoch end;
* 2 simulated nodes × 2 ranks (``--no_ssh`` launchers, ``ds_bertopt.testing.multinode``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ds_bertopt.config import load_config
from ds_bertopt.data.pipeline import build_pretrain_data
from ds_bertopt.data.sampler import PlanBatchSampler
from ds_bertopt.testing.distributed import free_port

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
MICRO, ACCUM = 8, 2


def overrides(corpus: Path, cache_dir: Path, strategy: str) -> list[str]:
    return [
        f"data.train_files={json.dumps([str(corpus)])}",
        f"data.cache_dir={json.dumps(str(cache_dir))}",
        f"sampler.strategy={strategy}",
        "train.log_samples=true",
        "train.eval_every=0",
        "train.save_model=false",
        "train.log_every=1",
        f"deepspeed.train_micro_batch_size_per_gpu={MICRO}",
        f"deepspeed.gradient_accumulation_steps={ACCUM}",
        "deepspeed.csv_monitor.enabled=false",
    ]


def expected_plan(corpus: Path, cache_dir: Path, strategy: str, world: int, rpn: int):
    """What the loop builds, built here (also warms the cache the ranks then read)."""
    cfg = load_config(
        str(ROOT / "ds_configs" / "bert.json"),
        [o for o in overrides(corpus, cache_dir, strategy) if not o.startswith("deepspeed.")],
    )
    lengths = build_pretrain_data(cfg.bertopt).lengths
    return PlanBatchSampler(
        lengths,
        rank=0,
        world_size=world,
        ranks_per_node=rpn,
        micro_batch=MICRO,
        grad_accum=ACCUM,
        cfg=cfg.bertopt.sampler,
        seed=cfg.bertopt.train.seed,
    )


def cli_args(out: Path, corpus: Path, cache_dir: Path, strategy: str, max_steps: int, *extra: str) -> list[str]:
    args = [
        "launch/pretrain.py",
        "--deepspeed_config",
        "ds_configs/bert.json",
        "--output_dir",
        str(out),
        "--max_steps",
        str(max_steps),
        *extra,
    ]
    for o in overrides(corpus, cache_dir, strategy):
        args += ["-o", o]
    return args


def launch(args: list[str], timeout: int) -> str:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [
        os.path.join(os.path.dirname(sys.executable), "deepspeed"),
        "--num_gpus",
        "2",
        "--master_port",
        str(free_port()),
        *args,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def logged(out: Path, world: int) -> dict[int, list[dict]]:
    runs = {}
    for rank in range(world):
        lines = [json.loads(x) for x in (out / "samples" / f"rank{rank}.jsonl").read_text().splitlines()]
        runs[rank] = lines
    return runs


def check_against_plan(runs: dict[int, list[dict]], sampler: PlanBatchSampler, total_steps: int, rpn: int) -> None:
    steps_per_epoch = sampler.steps_per_epoch
    plans = {}
    for rank, lines in runs.items():
        first = lines[0]["step"]  # the loop numbers the step being taken from 0 or from 1
        assert first in (0, 1) and [x["step"] - first for x in lines] == list(range(total_steps)), (
            f"rank {rank} logged steps {[x['step'] for x in lines]}"
        )
        for x in lines:
            epoch, within = divmod(x["step"] - first, steps_per_epoch)
            assert x["epoch"] == epoch and x["rank"] == rank and x["node"] == rank // rpn
            if epoch not in plans:
                sampler.set_epoch(epoch)
                plans[epoch] = sampler.plan().indices
            assert x["indices"] == plans[epoch][within, rank].tolist(), (rank, x["step"])
    for epoch in plans:  # across all ranks: nothing twice within an epoch
        seen = [i for lines in runs.values() for x in lines if x["epoch"] == epoch for mb in x["indices"] for i in mb]
        assert len(seen) == len(set(seen))


@pytest.mark.timeout(420)
def test_two_ranks_resume_mid_epoch_and_cross_the_epoch_end(tmp_path, small_corpus, cache_dir):
    strategy = "stratified_node_balance"
    sampler = expected_plan(small_corpus, cache_dir, strategy, world=2, rpn=2)
    steps = sampler.steps_per_epoch
    assert 4 <= steps <= 60, f"corpus gives {steps} steps per epoch; the test wants a short epoch"
    stop, total = steps - 2, steps + 2
    out = tmp_path / "run"
    first = launch(cli_args(out, small_corpus, cache_dir, strategy, stop), timeout=200)
    assert f"plan: {steps} steps per epoch ({strategy})" in first
    second = launch(cli_args(out, small_corpus, cache_dir, strategy, total, "--resume"), timeout=200)
    assert f"resumed from step{stop:08d}: step {stop}, epoch 0, step {stop} of {steps}" in second
    check_against_plan(logged(out, 2), sampler, total, rpn=2)


@pytest.mark.timeout(420)
def test_two_nodes_of_two_ranks(tmp_path, small_corpus, cache_dir):
    from ds_bertopt.testing.multinode import run_local_multinode

    strategy = "stratified_node_sort"
    sampler = expected_plan(small_corpus, cache_dir, strategy, world=4, rpn=2)
    total = min(sampler.steps_per_epoch + 1, 12)
    out = tmp_path / "nodes"
    results = run_local_multinode(
        2,
        2,
        cli_args(out, small_corpus, cache_dir, strategy, total),
        cwd=str(ROOT),
        env={"PYTHONUNBUFFERED": "1"},
        timeout=360,
    )
    for r in results:
        assert r.returncode == 0, f"node {r.node_rank} exit {r.returncode}\n{r.output[-4000:]}"
    assert "world 4 (2 node(s) × 2)" in results[0].output
    check_against_plan(logged(out, 4), sampler, total, rpn=2)
