"""One rank's view of the planner at the seed's scale (MLPerf phase 2: 156.7M sequences, 1,024 ranks), each
strategy in a fresh process: time to the first step, time per window, steps that waited for planning behind a
simulated step, peak RSS, and (``reference``) the whole-epoch global plan with a bit-identity check.
``ds-bertopt balance --sequences`` prints it."""

from __future__ import annotations

import dataclasses
import json
import resource
import subprocess
import sys
import time
from typing import Optional

import numpy as np

from ..errors import DataError
from .config import SamplerConfig
from .plan import CHUNK, plan_epoch


# ------------------------------------------------------------------------------------------------
# one rank's view at the seed's scale: windows, time to the first step, memory (fresh processes)
# ------------------------------------------------------------------------------------------------
SCALE_STEP_TIME = 0.05  # s: a BERT-large step of 16 × 512 on an A100 takes ~0.1 s padded, about half unpadded
SCALE_TARGETS = {"rss_mib": 1024.0, "first_step_s": 10.0}  # issue 32, at 100M sequences and 1,024 ranks
_CHILD = (
    "import json, sys; from ds_bertopt.data.scale import measure_in_child; "
    "print(json.dumps(measure_in_child(json.loads(sys.argv[1]))))"
)


def parse_count(text: str) -> int:
    """``100M``, ``156.7M``, ``1.5k``, ``2G`` or a plain integer."""
    scale = {"k": 10**3, "m": 10**6, "g": 10**9}.get(text[-1:].lower(), 1)
    try:
        value = float(text[:-1] if scale > 1 else text) * scale
    except ValueError:
        raise DataError(f"--sequences: expected a count such as 100M or 156.7M, got {text!r}") from None
    if value < 1 or value != int(value):
        raise DataError(f"--sequences: expected a positive whole number of sequences, got {text!r}")
    return int(value)


def synthetic_lengths(n: int, seed: int = 0) -> np.ndarray:
    """MLPerf-like phase-2 lengths as issue 32 measured them: half at 512, the rest uniform 32–511; int16, made in
    chunks (the lengths of 100M sequences are 200 MB)."""
    out = np.empty(n, dtype=np.int16)
    rng = np.random.default_rng(seed)
    for start in range(0, n, CHUNK):
        size = min(CHUNK, n - start)
        out[start : start + size] = np.where(rng.random(size) < 0.5, 512, rng.integers(32, 512, size=size))
    return out


def _peak_rss_mib() -> float:
    """This process's peak RSS. Linux: ``VmHWM``, the high-water mark of this program's memory; ``ru_maxrss``
    would count the parent's RSS at the fork that started it (it survives the exec)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            return next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:")) / 1024  # kB
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _shape(job: dict) -> dict:
    """The job's world and batch shape, as the sampler and ``plan_epoch`` take it."""
    return {key: job[key] for key in ("world_size", "ranks_per_node", "micro_batch", "grad_accum")}


def _window_view(job: dict) -> dict:
    """In a fresh process: the training sampler of one rank on the corpus in ``job["path"]``. The first step, then
    ``windows`` windows' steps each after a simulated step of ``step_time`` s (the next window is planned
    meanwhile, in the sampler's background thread), then a resume at the epoch's last window."""
    from .sampler import PlanBatchSampler  # torch: part of the baseline, as in training

    before = _peak_rss_mib()
    lengths = np.load(job["path"])
    started = time.perf_counter()
    sampler = PlanBatchSampler(
        lengths, rank=job["rank"], cfg=SamplerConfig(strategy=job["strategy"]), seed=job["seed"], **_shape(job)
    )
    set_up = time.perf_counter() - started
    steps = [sampler.next_step()]
    first_step = time.perf_counter() - started
    count = min(job["windows"] * sampler.window_steps, sampler.steps_per_epoch)
    for _ in range(count - 1):
        time.sleep(job["step_time"])  # the step's compute; planning runs meanwhile
        steps.append(sampler.next_step())
    waits = [seconds for key, seconds in sampler.windows.waits if key != (0, 0)]
    planned = [seconds for _, seconds in sampler.windows.planned]
    last = (sampler.steps_per_epoch - 1) // sampler.window_steps * sampler.window_steps
    sampler.load_state_dict({**sampler.state_dict(), "epoch": 0, "step": last})  # resume inside the last window
    resumed = [sampler.next_step() for _ in range(last, sampler.steps_per_epoch)]
    return {
        "set_up_s": set_up,
        "first_step_s": first_step,
        "window_steps": sampler.window_steps,
        "window_s": planned,
        "steps": count - 1,  # after the first
        "waits": len(waits),
        "wait_s": float(sum(waits)),
        "baseline_mib": before,
        "rss_mib": _peak_rss_mib(),
        "rows": {"0": steps, str(last): resumed},
    }


def _global_view(job: dict) -> dict:
    """In a fresh process: the whole epoch's plan for every rank (the reference); this rank's rows at the steps
    the window run took, for the identity check."""
    before = _peak_rss_mib()
    lengths = np.load(job["path"])
    started = time.perf_counter()
    plan = plan_epoch(lengths, strategy=job["strategy"], seed=job["seed"], epoch=0, **_shape(job))
    seconds = time.perf_counter() - started
    rows = {}
    for first, count in job["rows"].items():
        rows[first] = [
            [plan.micro_batch(step, job["rank"], a).tolist() for a in range(plan.indices.shape[2])]
            for step in range(int(first), int(first) + count)
        ]
    return {"plan_s": seconds, "baseline_mib": before, "rss_mib": _peak_rss_mib(), "rows": rows}


def measure_in_child(job: dict) -> dict:
    """The entry point of the fresh processes of :func:`scale_view`."""
    return _window_view(job) if job["kind"] == "window" else _global_view(job)


def _run_child(job: dict, timeout: float) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(job)], capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode:
        tail = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        return {"error": f"exit {proc.returncode}: {tail}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


@dataclasses.dataclass
class ScaleResult:
    strategy: str
    window: dict
    """What :func:`_window_view` measured (or ``{"error": ...}``)."""
    reference: Optional[dict] = None
    """What :func:`_global_view` measured, when it ran."""
    identical: Optional[bool] = None
    """This rank's windowed rows == the global plan's, at the steps both cover."""


def scale_view(
    lengths_path: str,
    *,
    strategies: tuple[str, ...],
    world_size: int,
    ranks_per_node: int,
    micro_batch: int,
    grad_accum: int,
    rank: int = 0,
    windows: int = 4,
    step_time: float = SCALE_STEP_TIME,
    seed: int = 0,
    reference: bool = False,
    timeout: float = 3600,
) -> list[ScaleResult]:
    """Every strategy in fresh processes: one rank's windowed sampler, and (``reference``) the global plan."""
    out = []
    for strategy in strategies:
        job = dict(
            path=lengths_path,
            strategy=strategy,
            world_size=world_size,
            ranks_per_node=ranks_per_node,
            micro_batch=micro_batch,
            grad_accum=grad_accum,
            rank=rank,
            windows=windows,
            step_time=step_time,
            seed=seed,
        )
        window = _run_child({**job, "kind": "window"}, timeout)
        result = ScaleResult(strategy, window)
        if reference and "error" not in window:
            counts = {first: len(rows) for first, rows in window["rows"].items()}
            result.reference = _run_child({**job, "kind": "global", "rows": counts}, timeout)
            if "error" not in result.reference:
                result.identical = result.reference["rows"] == window["rows"]
        out.append(result)
    return out


def _mib(value: float) -> str:
    return f"{value / 1024:.2f} GiB" if value >= 1024 else f"{value:.0f} MiB"


def scale_lines(results: list[ScaleResult], label: str, step_time: float) -> list[str]:
    """One line per strategy, then the issue's targets with met / NOT met."""
    lines = []
    for r in results:
        w = r.window
        if "error" in w:
            lines.append(f"[scale] {label}: {r.strategy}: window run failed: {w['error']}")
            continue
        per_window = w["window_s"]
        line = (
            f"[scale] {label}: {r.strategy}: first step {w['first_step_s']:.2f} s (sampler set-up "
            f"{w['set_up_s']:.2f} s), a window of {w['window_steps']} steps {np.mean(per_window):.3f} s mean, "
            f"{max(per_window):.3f} s max ({1000 * max(per_window) / w['window_steps']:.1f} ms per step), "
            f"waited {w['waits']} time(s) over the {w['steps']} steps after it, at {1000 * step_time:.0f} ms a step, "
            "peak RSS "
            f"{_mib(w['rss_mib'])} ({_mib(w['baseline_mib'])} of it python, numpy and torch before planning)"
        )
        if r.reference is not None:
            g = r.reference
            line += (
                f"; global plan: {g['error']}"
                if "error" in g
                else f"; global plan (every rank, whole epoch) {g['plan_s']:.1f} s, peak RSS {_mib(g['rss_mib'])} "
                f"({_mib(g['baseline_mib'])} before planning, no torch), "
                f"bit-identical: {'yes' if r.identical else 'NO'}"
            )
        lines.append(line)
    done = [r for r in results if "error" not in r.window]
    if not done:
        return lines
    status = lambda ok: "met" if ok else "NOT met"  # noqa: E731
    worst = lambda key: max(done, key=lambda r: r.window[key])  # noqa: E731
    rss, first = worst("rss_mib"), worst("first_step_s")
    lines.append(
        f"[scale] {label}: target ≤ 1 GiB peak RSS per rank for the planner, every strategy: "
        f"{status(len(done) == len(results) and rss.window['rss_mib'] <= SCALE_TARGETS['rss_mib'])}: worst "
        f"{_mib(rss.window['rss_mib'])} ({rss.strategy}; the process, torch included)"
    )
    lines.append(
        f"[scale] {label}: target ≤ 10 s before the first step: "
        f"{status(len(done) == len(results) and first.window['first_step_s'] <= SCALE_TARGETS['first_step_s'])}: "
        f"worst {first.window['first_step_s']:.2f} s ({first.strategy})"
    )
    waits = sum(r.window["waits"] for r in done)
    slowest = max(done, key=lambda r: max(r.window["window_s"]) / r.window["window_steps"])
    per_step = max(slowest.window["window_s"]) / slowest.window["window_steps"]
    lines.append(
        f"[scale] {label}: target no step waits for planning: {status(waits == 0)}: {waits} wait(s) over "
        f"{sum(r.window['steps'] for r in done)} steps after the first, at {1000 * step_time:.0f} ms a step; "
        f"the slowest window planned at {1000 * per_step:.1f} ms a step ({slowest.strategy})"
    )
    compared = [r for r in done if r.identical is not None]
    if compared:
        same = [r for r in compared if r.identical]
        lines.append(
            f"[scale] {label}: target bit-identical to the global plan where both run: "
            f"{status(len(same) == len(compared))}: {len(same)} of {len(compared)} strategies (the first windows "
            "and a resume inside the epoch's last one)"
        )
    return lines
