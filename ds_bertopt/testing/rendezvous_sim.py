"""Simulate the start-up rendezvous (``ds_bertopt.dist.rendezvous_verdict``) of many ranks on one machine.

Every simulated rank is a thread with its own TCP store client (its own connection), spread over worker
processes, against one TCP store server, as real ranks connect to rank 0's store. Each client counts the
store operations it makes; the result gives their total, the verdicts, the time from "go" (every client
connected) to the last rank's verdict, and the time the connections took. Views can be bent per rank
(another world size: launchers that disagree), ranks left out (they never start) or added beyond the world
size.

Connections are timed apart because they are torch's, not the protocol's, and on a machine without a
reachable DNS server they stall: torch's socket code reverse-resolves socket addresses (c10d's
``The hostname of the client socket cannot be retrieved``) and each lookup waits for the resolver's
timeout. The workers set ``RES_OPTIONS=timeout:1 attempts:1`` to keep those stalls short.

    python -m ds_bertopt.testing.rendezvous_sim 1024 [--processes 8] [--ranks-per-node 8]
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

from ..dist import Topology, free_port, rendezvous_verdict
from ..errors import BertOptError


class CountingStore:
    """A store whose every call is counted (by method name); the calls go to ``store`` unchanged."""

    def __init__(self, store):
        self.store, self.ops = store, Counter()

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def counted(*args, **kwargs):
            self.ops[name] += 1
            return method(*args, **kwargs)

        return counted


@dataclass
class SimResult:
    verdicts: dict[int, str] = field(default_factory=dict)
    """Rank → ``"ok"`` or the line its rendezvous raised."""
    ops: Counter = field(default_factory=Counter)
    """Store operations of all ranks together, by method."""
    seconds: float = 0.0
    """From "go" (every client connected) to the last simulated rank's verdict."""
    connect_seconds: float = 0.0
    """How long the clients took to connect (the slowest worker), before "go"."""

    @property
    def total_ops(self) -> int:
        return sum(self.ops.values())


def _rank(port, rank, world, ranks_per_node, bend, timeout_s, connected, go, out) -> None:
    import torch.distributed as dist

    node = rank // ranks_per_node
    view = {"rank": rank, "world_size": world, "ranks_per_node": ranks_per_node, "node_rank": node}
    view = {**view, "host": f"sim-node-{node}", **bend.get(rank, {})}
    topo = Topology(rank, view["world_size"], rank % view["ranks_per_node"], view["ranks_per_node"], node)

    store = CountingStore(
        dist.TCPStore(
            "127.0.0.1",
            port,
            world_size=world,
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout_s + 60),
            wait_for_workers=False,
        )
    )
    connected.wait()
    go.wait()
    try:
        rendezvous_verdict(store, topo, view, timeout_s)
        verdict = "ok"
    except BertOptError as exc:
        verdict = str(exc)
    out.append((rank, verdict, dict(store.ops), time.monotonic()))


def _run_threads(port, ranks, world, ranks_per_node, bend, timeout_s, connected, go) -> list:
    """Every rank of ``ranks`` in its own thread; ``connected`` (a barrier) is passed once all clients are up."""
    threading.stack_size(1 << 20)
    out: list = []
    args = (world, ranks_per_node, bend, timeout_s, connected, go, out)
    threads = [threading.Thread(target=_rank, args=(port, r, *args), daemon=True) for r in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return out


def _process(port, ranks, world, ranks_per_node, bend, timeout_s, ready, go, results) -> None:
    event = threading.Event()
    connected = threading.Barrier(len(ranks) + 1)

    def relay():
        started = time.monotonic()
        connected.wait()
        ready.put(time.monotonic() - started)
        go.wait()
        event.set()

    threading.Thread(target=relay, daemon=True).start()
    results.put(_run_threads(port, ranks, world, ranks_per_node, bend, timeout_s, connected, event))


def simulate(
    world: int,
    *,
    ranks_per_node: int = 8,
    processes: int = 1,
    bend: Optional[dict[int, dict]] = None,
    absent: tuple[int, ...] = (),
    extra: tuple[int, ...] = (),
    twice: tuple[int, ...] = (),
    timeout_s: float = 60,
) -> SimResult:
    """Rendezvous of ``world`` simulated ranks (minus ``absent``, plus the out-of-range ranks ``extra``, whose
    views say world ``max(extra) + 1``, plus a second rank of each number in ``twice``) against one store;
    ``bend[r]`` overrides keys of rank r's view."""
    import torch.distributed as dist

    # read by each new thread's resolver and inherited by the workers: short DNS stalls (see the docstring)
    os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
    bend = dict(bend or {})
    for r in extra:
        bend[r] = {"world_size": max(extra) + 1, **bend.get(r, {})}
    port = free_port()
    server = dist.TCPStore(  # noqa: F841 - the server lives as long as this object
        "127.0.0.1", port, world_size=world, is_master=True, wait_for_workers=False
    )
    ranks = [r for r in range(world) if r not in absent] + list(extra) + list(twice)
    result = SimResult()
    if processes <= 1:
        go, connected = threading.Event(), threading.Barrier(len(ranks) + 1)
        holder: list = []
        args = (port, ranks, world, ranks_per_node, bend, timeout_s, connected, go)
        runner = threading.Thread(target=lambda: holder.extend(_run_threads(*args)))
        started = time.monotonic()
        runner.start()
        connected.wait()
        result.connect_seconds = time.monotonic() - started
        start = time.monotonic()
        go.set()
        runner.join()
        rows = holder
    else:
        ctx = mp.get_context("spawn")
        ready, go, results = ctx.Queue(), ctx.Event(), ctx.Queue()
        shares = [ranks[i::processes] for i in range(processes)]
        procs = [
            ctx.Process(target=_process, args=(port, share, world, ranks_per_node, bend, timeout_s, ready, go, results))
            for share in shares
        ]
        for proc in procs:
            proc.start()
        result.connect_seconds = max(ready.get(timeout=600) for _ in procs)
        start = time.monotonic()
        go.set()
        rows = [row for _ in procs for row in results.get(timeout=timeout_s + 300)]
        for proc in procs:
            proc.join()
    for rank, verdict, ops, ended in rows:
        result.verdicts[rank] = verdict
        result.ops.update(ops)
        result.seconds = max(result.seconds, ended - start)
    return result


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ds_bertopt.testing.rendezvous_sim", description=__doc__)
    p.add_argument("world", type=int)
    p.add_argument("--processes", type=int, default=8)
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--target-s", type=float, default=10.0)
    args = p.parse_args(argv)
    result = simulate(args.world, ranks_per_node=args.ranks_per_node, processes=args.processes)
    agreed = sum(v == "ok" for v in result.verdicts.values())
    ops = ", ".join(f"{name} {n}" for name, n in sorted(result.ops.items()))
    print(
        f"rendezvous of {args.world} simulated ranks ({args.processes} processes, one store): {agreed} agreed; "
        f"{result.total_ops} store operations ({result.total_ops / args.world:.2f} per rank: {ops}); "
        f"verdict {result.seconds:.2f} s after every client connected (target <= {args.target_s:g} s: "
        f"{'met' if result.seconds <= args.target_s and agreed == args.world else 'NOT met'}); "
        f"connecting took {result.connect_seconds:.1f} s"
    )
    return 0 if agreed == args.world else 1


if __name__ == "__main__":
    sys.exit(main())
