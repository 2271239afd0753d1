"""Run a function on N real gloo ranks on loopback (tests and benchmarks; no mocks).

``spawn_ranks(fn, world_size, *args)`` starts ``world_size`` processes with the environment
the ``deepspeed`` launcher would give them (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_SIZE, CROSS_RANK,
MASTER_ADDR/PORT, DS_ACCELERATOR=cpu, OMP_NUM_THREADS=1), calls ``fn(rank, world_size, *args)`` in
each after ``deepspeed.init_distributed`` (gloo), and returns the per-rank results. A rank that
raises fails the call with that rank's traceback; a hang is killed after ``timeout`` seconds.

Ranks fork from one server that imported torch, DeepSpeed and transformers once (``forkserver``), so a call costs
a fork, not three imports per rank; each rank takes the caller's environment, as a spawned one would.
``start_processes`` is ``torch.multiprocessing.spawn`` on the same server.
"""

from __future__ import annotations

import os
import queue as queue_mod
import traceback
from typing import Any, Callable

from ..buildlocks import clear_stale_build_locks
from ..child import forkserver_context, take_environment
from ..dist import free_port, release_shm_buffer, shutdown

__all__ = ["free_port", "spawn_ranks", "start_processes"]


FORKSERVER_PRELOAD = ("torch", "deepspeed", "transformers")
"""Imported once by the fork server that ranks start from: a rank then costs a fork instead of an import of torch,
DeepSpeed and transformers (about 3 s of CPU each, 2 ranks per call, hundreds of calls in the test suite). With
them, what the memory measurements' children preload (:data:`~ds_bertopt.wtacrs.memory.CHILD_PRELOAD`): one server
per process serves both, whichever starts it."""
_SERVER_ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
"""What the fork server's imports must see: DeepSpeed picks its accelerator at import (``get_accelerator`` in
``deepspeed/accelerator/real_accelerator.py``), torch its thread pool size."""


def _context():
    """The ``forkserver`` context (:func:`~ds_bertopt.child.forkserver_context`: :data:`FORKSERVER_PRELOAD` under
    :data:`_SERVER_ENV`)."""
    from ..wtacrs.memory import CHILD_PRELOAD

    return forkserver_context(FORKSERVER_PRELOAD + CHILD_PRELOAD, _SERVER_ENV)


def _with_environment(index, fn, environ, *args):
    take_environment(environ)
    return fn(index, *args)


def start_processes(fn: Callable, args: tuple, nprocs: int) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)`` (``fn(index, *args)`` in each, joined, a failure raised
    with its traceback), its processes forked from the preloaded server with this process's environment."""
    import torch.multiprocessing

    _context()
    torch.multiprocessing.start_processes(
        _with_environment, args=(fn, dict(os.environ), *args), nprocs=nprocs, start_method="forkserver"
    )


def _worker(fn, rank, world_size, ranks_per_node, port, env, args, results, parent_env):
    take_environment(parent_env)
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank % ranks_per_node),
            "WORLD_SIZE": str(world_size),
            "LOCAL_SIZE": str(ranks_per_node),
            "CROSS_RANK": str(rank // ranks_per_node),
            "CROSS_SIZE": str(world_size // ranks_per_node),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "DS_ACCELERATOR": "cpu",
            "OMP_NUM_THREADS": "1",
            **env,
        }
    )
    try:
        import datetime

        import deepspeed
        import torch

        torch.set_num_threads(1)
        if rank % ranks_per_node == 0:
            clear_stale_build_locks()
        deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=120), verbose=False)
        torch.distributed.barrier()  # every rank has mapped every peer's shm buffer: unlink ours
        release_shm_buffer(rank)
        results.put((rank, "ok", fn(rank, world_size, *args)))
    except BaseException:  # report every failure to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            shutdown()
        except Exception:  # noqa: BLE001 - shutting down anyway
            pass


def spawn_ranks(
    fn: Callable,
    world_size: int,
    *args,
    ranks_per_node: int | None = None,
    timeout: float = 240,
    env: dict | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank.

    ``fn`` and ``args`` must be picklable (module-level function). ``ranks_per_node`` simulates
    several nodes in the launcher variables (default: all ranks on one node).
    """
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    rpn = ranks_per_node or world_size
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, rpn, port, env or {}, args, results, dict(os.environ)))
        for r in range(world_size)
    ]
    for proc in procs:
        proc.start()
    out: dict[int, Any] = {}
    failures: dict[int, str] = {}
    try:
        while len(out) + len(failures) < world_size:
            try:
                rank, status, value = results.get(timeout=timeout if not failures else 20)
            except queue_mod.Empty:
                if failures:
                    break  # the others are stuck on the failed rank
                raise TimeoutError(
                    f"ranks {sorted(set(range(world_size)) - set(out))} did not finish within {timeout:.0f} s"
                ) from None
            if status == "ok":
                out[rank] = value
            else:
                failures[rank] = value
        if failures:
            for r, proc in enumerate(procs):  # a rank that died without a word (a signal): say how
                if r not in failures and r not in out:
                    proc.join(timeout=5)
                    failures[r] = f"no report; process exit code {proc.exitcode} (negative: killed by that signal)"
            # the root cause first: a peer's "connection reset" only says that some rank died
            order = sorted(
                failures, key=lambda r: ("Connection reset" in failures[r] or "Connection closed" in failures[r], r)
            )
            raise RuntimeError("\n".join(f"rank {r} failed:\n{failures[r]}" for r in order))
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [out[r] for r in range(world_size)]
