"""Topology from every launcher's variables, and its consistency check on real gloo ranks."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from ds_bertopt.dist import Topology, shutdown, topology_from_env, verify_topology
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
    ompi = {
        "OMPI_COMM_WORLD_RANK": "6",
        "OMPI_COMM_WORLD_SIZE": "8",
        "OMPI_COMM_WORLD_LOCAL_RANK": "2",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
    }
    assert topology_from_env(ompi).node_rank == 1
    slurm = {
        "SLURM_PROCID": "3",
        "SLURM_NTASKS": "4",
        "SLURM_LOCALID": "1",
        "SLURM_NTASKS_PER_NODE": "2(x2)",
        "SLURM_NODEID": "1",
    }
    topo = topology_from_env(slurm)
    assert (topo.rank, topo.world_size, topo.ranks_per_node, topo.node_rank) == (3, 4, 2, 1)


def test_local_rank_argument_is_used_when_env_lacks_it():
    assert topology_from_env({"RANK": "1", "WORLD_SIZE": "2"}, local_rank_arg=1).local_rank == 1


@pytest.mark.parametrize(
    "env, message",
    [
        ({"RANK": "4", "WORLD_SIZE": "4"}, "outside world size"),
        ({"RANK": "0", "WORLD_SIZE": "6", "LOCAL_SIZE": "4"}, "not a multiple of ranks per node"),
        ({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_SIZE": "2", "LOCAL_RANK": "3"}, "outside ranks per node"),
        ({"RANK": "x"}, "RANK='x' is not an integer"),
    ],
)
def test_bad_variables(env, message):
    with pytest.raises(BertOptError, match=message):
        topology_from_env(env)


def _verify(rank, world_size, lie):
    topo = topology_from_env()
    if lie and rank == 1:  # this rank believes nodes have 1 rank each
        topo = Topology(rank=topo.rank, world_size=topo.world_size, local_rank=0, ranks_per_node=1, node_rank=topo.rank)
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


def _gather_async_then_shut_down(rank, world_size):
    import torch.distributed as dist

    out = [torch.empty(1) for _ in range(world_size)]
    work = dist.all_gather(out, torch.tensor([float(rank)]), async_op=True)  # the work gloo's threads hold
    work.wait()
    shutdown()
    shutdown()  # a second call (an error path after a clean end) is a no-op
    return [t.item() for t in out], dist.is_initialized()


@pytest.mark.timeout(120)
def test_shutdown_destroys_the_group_before_the_interpreter_exits():
    """A run that ends cleanly destroys its process group itself: left to interpreter finalisation, gloo's
    threads can abort the process after training succeeded (the launcher then reports exit -6)."""
    assert spawn_ranks(_gather_async_then_shut_down, 2) == [([0.0, 1.0], False)] * 2


_EXIT_SCRIPT = """
import atexit, sys, tempfile
import torch.distributed as dist
from ds_bertopt.dist import shutdown_at_exit
# registered first, so it runs last: after shutdown_at_exit's hook, still before finalisation
atexit.register(lambda: print("group at exit:", dist.is_initialized(), flush=True))
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
shutdown_at_exit()
shutdown_at_exit()  # every Trainer built registers it: once is enough
if sys.argv[1] == "raise":
    raise RuntimeError("the script failed")
"""


@pytest.mark.timeout(120)
def test_a_script_we_do_not_end_destroys_its_group_at_exit_unless_it_failed():
    """A user's Trainer script ends where we cannot call :func:`shutdown`: the group goes at exit, before the
    interpreter finalises it, on a clean end only (after an uncaught exception a peer may be gone)."""
    procs = {
        how: subprocess.Popen([sys.executable, "-c", _EXIT_SCRIPT, how], stdout=subprocess.PIPE, text=True)
        for how in ("return", "raise")
    }
    outputs = {how: proc.communicate(timeout=100)[0] for how, proc in procs.items()}
    assert procs["return"].returncode == 0 and outputs["return"].splitlines() == ["group at exit: False"]
    assert procs["raise"].returncode == 1 and outputs["raise"].splitlines() == ["group at exit: True"]


class _Accelerator:
    """Stands in for a CUDA accelerator (none here) and records what it was asked to do."""

    def __init__(self, name: str, count: int):
        self.name, self.count, self.bound = name, count, []

    def device_name(self):
        return self.name

    def device_count(self):
        return self.count

    def set_device(self, index):
        self.bound.append(index)


def test_each_rank_binds_its_own_gpu_before_any_collective():
    from ds_bertopt.dist import Topology, bind_device

    topo = Topology(rank=5, world_size=8, local_rank=1, ranks_per_node=4, node_rank=1)
    gpus = _Accelerator("cuda", 4)
    bind_device(topo, gpus)
    assert gpus.bound == [1]
    cpu = _Accelerator("cpu", 1)
    bind_device(topo, cpu)
    assert cpu.bound == []
    with pytest.raises(BertOptError, match="local rank 1 needs its own cuda device, but this node shows 1"):
        bind_device(topo, _Accelerator("cuda", 1))


def test_init_distributed_binds_the_device_first(monkeypatch):
    """The bind happens before the rendezvous store and the process group exist (read from the call order)."""
    import ds_bertopt.dist as dist_mod

    calls = []
    monkeypatch.setattr(dist_mod, "bind_device", lambda topo, acc: calls.append("bind"))

    def rendezvous(*args, **kwargs):
        calls.append("rendezvous")
        raise BertOptError("stop here")

    monkeypatch.setattr(dist_mod, "_rendezvous", rendezvous)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)  # an earlier test may have made one
    with pytest.raises(BertOptError, match="stop here"):
        dist_mod.init_distributed(dist_mod.Topology(0, 1, 0, 1, 0))
    assert calls == ["bind", "rendezvous"]
