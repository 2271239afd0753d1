"""Multi-node hostfile jobs, simulated as 2 nodes × 2 ranks with the real deepspeed launcher (--no_ssh); nodes with
their own data caches."""

from __future__ import annotations

import json
import re
import socket
import time
from pathlib import Path

import pytest
from _launch import metrics, pretrain_args, processes_mentioning

from ds_bertopt.testing.multinode import run_local_multinode

pytestmark = pytest.mark.slow
STEPS = 6


def samples(out: Path, world: int) -> dict[int, dict[int, list[int]]]:
    """step -> rank -> flat sample indices."""
    by_step: dict[int, dict[int, list[int]]] = {}
    for rank in range(world):
        for line in (out / "samples" / f"rank{rank}.jsonl").read_text().splitlines():
            row = json.loads(line)
            assert row["rank"] == rank and row["node"] == rank // 2
            by_step.setdefault(row["step"], {})[rank] = [i for mb in row["indices"] for i in mb]
    return by_step


@pytest.mark.timeout(400)
# stratified_node_balance only: it exercises everything the random strategy does (same global set per step,
# each sample once) plus the node-local presort; `random` is compared 2x2 vs 1x4 by tests/test_plan.py.
@pytest.mark.parametrize("strategy", ["stratified_node_balance"])
def test_two_nodes_by_two_ranks_match_one_node_by_four(tmp_path, cache_dir, repo_root, strategy):
    from _launch import deepspeed_cmd, run

    extra = (
        "--max_steps",
        str(STEPS),
        "--log_every",
        "1",
        "--eval_every",
        "0",
        "--sampler",
        strategy,
        "-o",
        "train.log_samples=true",
        "-o",
        "deepspeed.train_micro_batch_size_per_gpu=8",
    )
    two = tmp_path / "2x2"
    start = time.monotonic()
    results = run_local_multinode(2, 2, pretrain_args(two, cache_dir, *extra), cwd=str(repo_root), timeout=300)
    wall = time.monotonic() - start
    assert [r.returncode for r in results] == [0, 0], results[0].output[-3000:] + results[1].output[-3000:]
    assert "world 4 (2 node(s) × 2)" in results[0].output
    train, _ = metrics(two)
    assert train[-1]["loss"] < train[0]["loss"]
    per_step = samples(two, 4)
    assert sorted(per_step) == list(range(1, STEPS + 1))
    for step, ranks in per_step.items():
        flat = [i for r in range(4) for i in ranks[r]]
        assert len(flat) == len(set(flat)) == 32, f"step {step}: a sample used twice or missing"
    print(f"2 nodes x 2 ranks, {STEPS} steps ({strategy}): {wall:.1f} s wall")
    if strategy == "stratified_node_balance":
        check_node_shares(per_step, cache_dir, repo_root)

    one = tmp_path / "1x4"
    run(deepspeed_cmd("--num_gpus", "4", *pretrain_args(one, cache_dir, *extra)), 300)
    per_step_one = samples_one_node(one)
    for step in per_step:
        assert sorted(i for r in per_step[step].values() for i in r) == sorted(per_step_one[step]), (
            f"step {step}: the 2x2 job and the 1x4 job saw different global batches"
        )


def check_node_shares(per_step: dict[int, dict[int, list[int]]], cache_dir: Path, repo_root: Path) -> None:
    """Node-local presort: every rank ran exactly the pure planner's samples for it, and each node's ranks
    drew only from their node's share of the step (the planner's node pool), so no sample crossed nodes."""
    import numpy as np

    from ds_bertopt.config import load_config
    from ds_bertopt.data.pipeline import build_pretrain_data
    from ds_bertopt.data.plan import plan_epoch

    cfg = load_config(
        str(repo_root / "ds_configs" / "bert.json"), [f"data.cache_dir={cache_dir}", "data.max_documents=150"]
    ).bertopt
    plan = plan_epoch(
        build_pretrain_data(cfg).lengths,
        world_size=4,
        ranks_per_node=2,
        micro_batch=8,
        grad_accum=1,
        strategy="stratified_node_balance",
        cfg=cfg.sampler,
        seed=cfg.train.seed,
        epoch=0,
    )
    for step, ranks in per_step.items():
        for rank, used in ranks.items():
            assert used == plan.indices[step - 1, rank].reshape(-1).tolist(), f"step {step} rank {rank}: not the plan"
        for node in (0, 1):
            share = np.sort(plan.indices[step - 1, 2 * node : 2 * node + 2].reshape(-1))
            got = np.sort(np.concatenate([ranks[2 * node], ranks[2 * node + 1]]))
            np.testing.assert_array_equal(got, share, err_msg=f"step {step}: node {node} used another node's samples")
            other = plan.indices[step - 1, 2 * (1 - node) : 2 * (1 - node) + 2].reshape(-1)
            assert not set(got.tolist()) & set(other.tolist())


def samples_one_node(out: Path) -> dict[int, list[int]]:
    by_step: dict[int, list[int]] = {}
    for rank in range(4):
        for line in (out / "samples" / f"rank{rank}.jsonl").read_text().splitlines():
            row = json.loads(line)
            by_step.setdefault(row["step"], []).extend(i for mb in row["indices"] for i in mb)
    return by_step


@pytest.mark.timeout(200)
def test_misdeclared_topology_fails_fast_with_a_message(tmp_path, cache_dir, repo_root):
    out = tmp_path / "mis"
    start = time.monotonic()
    results = run_local_multinode(
        2,
        2,
        pretrain_args(out, cache_dir, "--max_steps", "2"),
        cwd=str(repo_root),
        per_node_slots=[[2, 2], [2, 1]],
        timeout=150,
    )
    elapsed = time.monotonic() - start
    assert any(r.returncode != 0 for r in results)
    text = "".join(r.output for r in results)
    assert "launchers disagree on the topology" in text and "same hostfile" in text, text[-3000:]
    assert elapsed < 90, f"took {elapsed:.0f} s to fail"
    assert not processes_mentioning(str(out))


@pytest.mark.netns
@pytest.mark.timeout(300)
def test_two_nodes_with_their_own_addresses(tmp_path, cache_dir, repo_root):
    """Each simulated node in its own network namespace (own IP, a veth link): traffic really crosses an
    interface, and only the launcher's MASTER_ADDR / GLOO_SOCKET_IFNAME tell the ranks where to go."""
    import subprocess

    from ds_bertopt.testing.netns import NetNamespaces, netns_unavailable_reason

    reason = netns_unavailable_reason()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "ns"
    with NetNamespaces(2) as net:
        results = run_local_multinode(
            2,
            2,
            pretrain_args(out, cache_dir, "--max_steps", "4", "--eval_every", "0", "--log_every", "1"),
            cwd=str(repo_root),
            timeout=240,
            master_addr=net.addresses[0],
            env={"GLOO_SOCKET_IFNAME": net.ifname},
            node_prefix=[net.exec_argv(i, []) for i in range(2)],
        )
        rx = int(
            subprocess.run(
                net.exec_argv(1, ["cat", f"/sys/class/net/{net.ifname}/statistics/rx_bytes"]),
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        )
    assert [r.returncode for r in results] == [0, 0], results[0].output[-3000:] + results[1].output[-3000:]
    assert "world 4 (2 node(s) × 2)" in results[0].output
    assert rx > 1_000_000, f"only {rx} bytes reached node 1 over its interface"


@pytest.mark.timeout(600)
def test_two_nodes_with_their_own_caches_train_on_the_same_data(tmp_path, repo_root):
    """The README's two-node recipe with a node-local ``data.cache_dir`` each (``~/.cache`` on local disk).
    Silently wrong before: the default tokenizer, trained on each node, differed (1,458 of 8,192 ids) and both
    nodes exited 0 having trained one embedding table with two vocabularies."""
    from itertools import islice

    import datasets

    from ds_bertopt.data.corpus import stdlib_docstring_documents
    from ds_bertopt.data.tokenizer import train_wordpiece

    caches = [tmp_path / "node0_cache", tmp_path / "node1_cache"]
    common = ("--max_steps", "2", "--eval_every", "0", "-o", "train.save_model=false")
    node_args = [[], ["-o", f"data.cache_dir={caches[1]}"]]  # the later -o wins over pretrain_args' cache
    results = run_local_multinode(
        2, 1, pretrain_args(tmp_path / "run", caches[0], *common), cwd=str(repo_root), timeout=300, node_args=node_args
    )
    assert [r.returncode for r in results] == [0, 0], results[0].output[-3000:] + results[1].output[-3000:]
    for node, result in enumerate(results):  # each node detected that it is alone in its cache directory
        assert f"is node {node}'s own (no other node's file is seen there): node {node} builds its own copy" in (
            result.output
        )
    vocabularies = [
        json.loads(next(c.glob("tokenizers/*/tokenizer.json")).read_text())["model"]["vocab"] for c in caches
    ]
    assert vocabularies[0] == vocabularies[1] and len(vocabularies[0]) > 1000  # each node trained its own: the same

    # a given tokenizer on one node only: the job stops before anything is written, naming both nodes and caches
    given = tmp_path / "given_tokenizer"
    texts = [doc["text"] for doc in islice(stdlib_docstring_documents(), 30)]
    train_wordpiece(datasets.Dataset.from_dict({"text": texts}), 1000, str(given))
    node_args[1] += ["--tokenizer", str(given)]
    out = tmp_path / "run2"
    results = run_local_multinode(
        2, 1, pretrain_args(out, caches[0], *common), cwd=str(repo_root), timeout=300, node_args=node_args
    )
    assert all(r.returncode != 0 for r in results)
    lines = [line for r in results for line in r.output.splitlines() if "error:" in line and "other data" in line]
    assert len(lines) == 1, "".join(r.output for r in results)[-4000:]
    assert (
        f"node 1 (rank 1 on {socket.gethostname()}, data.cache_dir {caches[1]}, data.tokenizer {given}) would train "
        f"on other data than node 0 (rank 0 on {socket.gethostname()}, data.cache_dir {caches[0]}): its vocabulary "
        "differs ("
    ) in lines[0]
    assert "Traceback" not in "".join(r.output for r in results)
    assert not out.exists()


@pytest.mark.timeout(300)
def test_a_data_build_slower_than_the_collective_timeout_completes_on_two_nodes(tmp_path, repo_root):
    """The first run of a corpus: its build outlasts train.dist_timeout_s (node 0's first part, counting words, made
    12 s slower; the timeout 10 s). It died before, rank 1 saying "lost contact with the other ranks"; now the nodes,
    which share one cache directory, build it together and wait for each other on the store, saying so."""
    cache = tmp_path / "shared_cache"
    args = pretrain_args(
        tmp_path / "run", cache, "--max_steps", "1", "--eval_every", "0", "-o", "train.save_model=false",
        "-o", "train.dist_timeout_s=10", "-o", "data.num_proc=1",
    )  # fmt: skip
    env = {"DS_BERTOPT_FAULT": "sleep12@build:rank=0:step=1"}
    results = run_local_multinode(2, 1, args, cwd=str(repo_root), timeout=240, env=env)
    text = results[0].output + results[1].output
    assert [r.returncode for r in results] == [0, 0], text[-4000:]
    assert "is shared by nodes 0, 1 (each sees the others' files there)" in results[1].output
    waits = [line for line in results[1].output.splitlines() if "waiting for node 0's data build: " in line]
    assert waits and "lost contact" not in text, text[-4000:]  # which stage a wait line names depends on the load
    built = re.search(r"data: built in ([0-9.]+) s", results[0].output)
    assert built and float(built.group(1)) > 10, text[-4000:]  # the build outlasted train.dist_timeout_s
    assert "done: 1 steps" in results[0].output
