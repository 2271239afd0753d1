"""The memory search's children (``ds-bertopt memory --budget-gb``, ``wtacrs.preset: "auto"``), for real: a child
that runs out of memory counts as over the budget, and a child that dies is never waited on (the parent waited out
its 900 s timeout and ended in ``queue.Empty``; on CUDA an out-of-memory error ended the whole search). The children
are ``tests/scripts/memory_children.py``: steps whose allocation fails under a real RLIMIT_AS, and processes killed
by a signal; each answer comes within the poll, the 600 s timeouts below are never reached."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import memory_children  # noqa: E402

from ds_bertopt.child import ChildDied, OutOfMemory, run_in_child, stop_forkserver  # noqa: E402
from ds_bertopt.errors import ConfigError  # noqa: E402
from ds_bertopt.wtacrs import memory, sizing  # noqa: E402

MiB, GiB, PER_EXAMPLE = memory_children.MiB, 1 << 30, memory_children.PER_EXAMPLE
FITS = 24
"""The children's steps fit their memory limit up to this batch."""


STARTS = {"spawned": (), "forked": memory.CHILD_PRELOAD}
"""How a child starts: spawned, or forked from the server the memory measurements use (one per process: the first
call starts it, with what it preloads)."""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("start", STARTS)
def test_a_child_killed_by_sigkill_counts_as_out_of_memory(start):
    with pytest.raises(OutOfMemory, match="killed by SIGKILL"):
        run_in_child(memory_children.killed, timeout=600, preload=STARTS[start])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("start", STARTS)
def test_a_child_that_dies_otherwise_is_named(start):
    with pytest.raises(ChildDied, match="exited with status 3"):
        run_in_child(memory_children.exits, 3, timeout=600, preload=STARTS[start])
    with pytest.raises(ChildDied, match="killed by SIGSEGV"):
        run_in_child(memory_children.crashes, timeout=600, preload=STARTS[start])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("start", STARTS)
def test_an_allocation_over_the_limit_is_out_of_memory(start):
    assert run_in_child(memory_children.step, FITS, FITS, preload=STARTS[start])["step_peak"] == FITS * PER_EXAMPLE
    with pytest.raises(OutOfMemory, match="MemoryError"):
        run_in_child(memory_children.step, FITS + 1, FITS, preload=STARTS[start])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("start", STARTS)
def test_a_child_runs_in_the_callers_environment_plus_env(start, monkeypatch):
    """A forked child takes the environment of the call, not the one its server started with (set after it)."""
    run_in_child(memory_children.environment, timeout=600, preload=STARTS[start])  # the server runs from here on
    monkeypatch.setenv("DS_BERTOPT_CHILD_SET_LATER", "later")
    monkeypatch.delenv("HOME", raising=False)
    seen = run_in_child(
        memory_children.environment,
        "DS_BERTOPT_CHILD_SET_LATER",
        "DS_BERTOPT_CHILD_ENV",
        "HOME",
        env={"DS_BERTOPT_CHILD_ENV": "given"},
        timeout=600,
        preload=STARTS[start],
    )
    assert seen == {"DS_BERTOPT_CHILD_SET_LATER": "later", "DS_BERTOPT_CHILD_ENV": "given", "HOME": None}


def test_only_cpu_measurements_fork_their_children():
    """A CUDA child must not come from a process that may have initialized the driver: it is spawned."""
    assert memory._preload({"device": "cpu"}) == memory._preload({}) == memory.CHILD_PRELOAD
    assert memory._preload({"device": "cuda"}) == memory._preload({"device": "cuda:1"}) == ()


@pytest.mark.timeout(120)
def test_the_fork_server_can_be_stopped_and_starts_again():
    """A training run that measured (``wtacrs.preset: "auto"``) stops the server, which would otherwise hold torch's
    memory for the rest of the run; a later measurement starts another."""
    run_in_child(memory_children.environment, timeout=600, preload=memory.CHILD_PRELOAD)
    assert len(memory_children.fork_servers()) == 1
    stop_forkserver()
    assert memory_children.fork_servers() == []
    seen = run_in_child(memory_children.environment, "PATH", timeout=600, preload=memory.CHILD_PRELOAD)
    assert seen == {"PATH": os.environ.get("PATH")}
    assert len(memory_children.fork_servers()) == 1


@pytest.mark.timeout(180)
def test_the_budget_search_goes_on_below_a_step_that_ran_out_of_memory(monkeypatch):
    """``sizing.measure`` (what ``--compare`` and ``preset: "auto"`` run) with real children: with a budget far above
    what the steps ask, the memory limit alone stops them; each batch above it dies and counts as over budget, and
    the search settles below it instead of ending."""
    monkeypatch.setattr(
        memory, "measure_step_in_child", lambda spec: run_in_child(memory_children.step, spec["batch"], FITS)
    )

    def probe_in_child(spec, batches, budget=None):  # the peak in a real child, the step time made up
        return {
            "peaks": {b: run_in_child(memory_children.step, b, FITS)["step_peak"] for b in batches},
            "step_s": {b: 0.01 for b in batches},
        }

    monkeypatch.setattr(memory, "probe_in_child", probe_in_child)
    found = sizing.measure({"device": "cpu"}, "full", budget=4 * GiB, probe=16, max_batch=64)
    assert 16 <= found.batch <= FITS and found.peak == found.batch * PER_EXAMPLE and math.isfinite(found.step_s)
    over = sizing.measure({"device": "cpu"}, "full", budget=4 * GiB, batch=32)  # the run's own micro-batch
    assert over.peak == math.inf and "out of memory" in sizing.describe(over, 4 * GiB)
    with pytest.raises(ConfigError, match="every setup ran out of memory"):
        sizing.choose([over], 4 * GiB)


def test_the_search_halves_a_bracket_whose_top_ran_out_of_memory():
    """The pure search: no line goes through an infinite peak."""
    measured = []

    def peak_at(batch: int) -> float:
        measured.append(batch)
        return math.inf if batch > 40 else batch * MiB

    best, peaks = sizing.largest_fitting_batch(peak_at, GiB, probe=16, max_batch=256, tries=8)
    assert best == 40 and peaks[best] == 40 * MiB
    assert measured[:3] == [8, 16, 256] and measured[3] == (16 + 256) // 2  # halved, not interpolated


def test_on_cuda_a_step_peak_counts_what_the_process_holds(monkeypatch):
    """``measure_step_in_child`` adds the device's overhead (context, NCCL buffers: measured once per device, in its
    own child) to the allocator's reserved peak; on the CPU there is none to add (the peak is RSS already)."""
    calls = []
    monkeypatch.setattr(memory, "run_in_child", lambda fn, *args, **kw: calls.append(fn) or {"step_peak": 5 * MiB})
    assert memory.measure_step_in_child({"device": "cpu", "batch": 1})["step_peak"] == 5 * MiB
    memory.device_overhead.cache_clear()
    monkeypatch.setattr(
        memory,
        "run_in_child",
        lambda fn, *args, **kw: (
            calls.append(fn)
            or ({"overhead": 600 * MiB} if fn is memory.device_overhead_in_process else {"step_peak": 5 * MiB})
        ),
    )
    try:
        first = memory.measure_step_in_child({"device": "cuda:0", "batch": 1})
        second = memory.measure_step_in_child({"device": "cuda:0", "batch": 2})
    finally:
        memory.device_overhead.cache_clear()
    assert first["step_peak"] == second["step_peak"] == 605 * MiB and first["overhead"] == 600 * MiB
    assert calls.count(memory.device_overhead_in_process) == 1
