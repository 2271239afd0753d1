"""The start-up rendezvous in O(world) store operations: simulated ranks (threads, each its own TCP store client)
against one real store. Agreement, launchers that disagree, missing, extra and duplicated ranks all end in the
same verdict on every rank, and the operation count grows linearly with the world (the old protocol made every
rank read every other rank's view: world² operations).

1,024 simulated ranks as 8 processes × 128 threads (`python -m ds_bertopt.testing.rendezvous_sim 1024`, run once
on this 2-core machine): 4,101 store operations (4.0 per rank), the verdict 0.44 s after every client connected;
the test below runs 1,024 as threads of one process.
"""

from __future__ import annotations

import pytest

from ds_bertopt.dist import topology_disagreement
from ds_bertopt.testing.rendezvous_sim import simulate

WORLD = 32
POLL_S = 0.01  # rank 0's shortest poll interval (dist._judge)
OPS_PER_RANK = 4  # set view, append arrival, wait + get verdict (rank 0: set view, append, polls, set verdict)


def _one_verdict(result) -> str:
    verdicts = set(result.verdicts.values())
    assert len(verdicts) == 1, verdicts  # every rank stops with the same line
    return verdicts.pop()


@pytest.mark.timeout(120)
def test_agreement_costs_a_few_operations_per_rank():
    """64 and 1,024 simulated ranks (threads of this process: ~5 s here, the connections included)."""
    for world in (64, 1024):
        result = simulate(world, ranks_per_node=8)
        assert _one_verdict(result) == "ok" and len(result.verdicts) == world
        assert result.ops["set"] == world + 1 and result.ops["append"] == world and result.ops["wait"] == world - 1
        # rank 0's polls are bounded by time, not by the world (at most one get + one multi_get per 10 ms poll while
        # the clients connect, which takes seconds on a loaded machine): O(world) in all, where world² was the old cost
        polls = 2 * (result.connect_seconds + result.seconds) / POLL_S
        assert result.total_ops <= OPS_PER_RANK * world + 20 + polls, result.ops
        print(f"{world} ranks: {result.total_ops} store operations, verdict {result.seconds:.2f} s after connecting")


@pytest.mark.timeout(120)
def test_disagreements_end_in_one_line_on_every_rank():
    bent = simulate(WORLD, ranks_per_node=4, bend={21: {"world_size": 24, "ranks_per_node": 3}})
    assert _one_verdict(bent) == (
        "launchers disagree on the topology: rank 21 on sim-node-5 was started with world size 24 and 3 ranks per "
        "node, rank 0 on sim-node-0 with 32 and 4; every node must use the same hostfile (same hosts, same slots)"
    )
    extra = simulate(WORLD, ranks_per_node=4, extra=(WORLD,))
    assert _one_verdict(extra).startswith(
        f"a rank beyond world size {WORLD} joined the rendezvous (rank {WORLD} on sim-node-8): the launchers "
        "disagree on the world size"
    )
    twice = simulate(WORLD, ranks_per_node=4, twice=(9,))
    assert _one_verdict(twice).startswith("rank 9 joined the rendezvous twice: two launchers were given the same")


@pytest.mark.timeout(120)
def test_missing_ranks_are_named_after_the_timeout():
    result = simulate(WORLD, ranks_per_node=4, absent=(6, 30), timeout_s=1.5)
    assert _one_verdict(result) == (
        f"only {WORLD - 2} of {WORLD} ranks joined within 1.5 s (missing ranks [6, 30]); check that every node was "
        "started, with the same hostfile, and can reach MASTER_ADDR"
    )
    assert result.total_ops <= OPS_PER_RANK * WORLD + 40  # polls back off to 0.25 s while waiting


def test_topology_disagreement_is_pure():
    mine = {"rank": 0, "world_size": 4, "ranks_per_node": 2, "host": "a"}
    assert topology_disagreement(mine, {**mine, "rank": 3, "host": "b"}) is None
    assert "rank 3 on b was started with world size 4 and 1 ranks per node" in topology_disagreement(
        mine, {**mine, "rank": 3, "host": "b", "ranks_per_node": 1}
    )
