"""Topology from every launcher's variables, and its consistency check on real gloo ranks."""
from __future__ import annotations

import pytest

from ds_bertopt.dist import Topology, topology_from_env, verify_topology
from ds_bertopt.errors import BertOptError
from ds_bertopt.testing.distributed import spawn_ranks


def test_bare_process_is_rank_0_of_1():
    assert topology_from_env({}) == Topology(rank=0, world_size=1, local_rank=0, ranks_per_node=1, node_rank=0)


def test_deepspeed_launcher_variables():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_SIZE": "4", "CROSS_RANK": "1", "CROSS_SIZE": "2"}
    topo = topology_from_env(env)
    assert (topo.rank, topo.local_rank, topo.ranks_per_node, topo.node_rank, topo.num_nodes) == (5, 1, 4, 1, 2)
    assert list(topo.node_ranks) == [4, 5, 6, 7]


def test_torchrun_variables():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"}
    topo = topology_from_env(env)
    assert (topo.rank, topo.local_rank, topo.ranks_per_node, topo.node_rank) == (3, 1, 2, 1)


def test_mpi_and_slurm_variables():
    ompi = {"OMPI_COMM_WORLD_RANK": "6", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    assert topology_from_env(ompi).node_rank == 1
    slurm = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "2(x2)",
             "SLURM_NODEID": "1"}
    topo = topology_from_env(slurm)
    assert (topo.rank, topo.world_size, topo.ranks_per_node, topo.node_rank) == (3, 4, 2, 1)


def test_local_rank_argument_is_used_when_env_lacks_it():
    assert topology_from_env({"RANK": "1", "WORLD_SIZE": "2"}, local_rank_arg=1).local_rank == 1


@pytest.mark.parametrize("env, message", [
    ({"RANK": "4", "WORLD_SIZE": "4"}, "outside world size"),
    ({"RANK": "0", "WORLD_SIZE": "6", "LOCAL_SIZE": "4"}, "not a multiple of ranks per node"),
    ({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_SIZE": "2", "LOCAL_RANK": "3"}, "outside ranks per node"),
    ({"RANK": "x"}, "RANK='x' is not an integer"),
])
def test_bad_variables(env, message):
    with pytest.raises(BertOptError, match=message):
        topology_from_env(env)


def _verify(rank, world_size, lie):
    topo = topology_from_env()
    if lie and rank == 1:  # this rank believes nodes have 1 rank each
        topo = Topology(rank=topo.rank, world_size=topo.world_size, local_rank=0, ranks_per_node=1,
                        node_rank=topo.rank)
    try:
        verify_topology(topo)
        return "ok"
    except BertOptError as exc:
        return str(exc)


@pytest.mark.timeout(120)
def test_verify_topology_on_real_ranks():
    assert spawn_ranks(_verify, 2, False) == ["ok", "ok"]
    results = spawn_ranks(_verify, 2, True)
    assert all(r.startswith("inconsistent topology") for r in results), results
