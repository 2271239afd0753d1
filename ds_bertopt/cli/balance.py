"""``ds-bertopt balance``: plan a corpus for a world size with every strategy and print the load balance.

    ds-bertopt balance --corpus ../shared/data/linux_docs.jsonl.gz --max-seq-len 512 \\
        --world-size 1024 --ranks-per-node 8 --micro-batch 16 --plot balance.png
    ds-bertopt balance --lengths lengths.npy --world-size 64 --ranks-per-node 8 --micro-batch 32
    ds-bertopt balance --mlperf-mix --world-size 1024 --ranks-per-node 8 --micro-batch 16
    ds-bertopt balance --sequences 100M --world-size 1024 --ranks-per-node 8

``--corpus`` builds the sequences the way pretraining does (``data.pipeline``, cached), so the
lengths are the ones training will see. When the corpus holds fewer than ``--steps`` global
batches, the plan runs on that many global batches of lengths drawn (with replacement) from the
corpus's length mix: the balance figures depend on the mix, not on which text it is.

For every strategy it prints the per-step max/mean rank work (mean over steps and p99), with the
unpadded cost ``a·L + b·L²`` and the padded one (samples × cost of the padded length), the padding
fraction, real tokens per rank and step, the predicted step time relative to ``random`` with padded
kernels (a synchronous step lasts as long as its busiest rank; per global batch of samples), the
samples per step and per micro-batch, and the planning CPU time per step. These figures need every
rank's plan: they come from the global planner (:func:`~ds_bertopt.data.plan.plan_epoch`), whose rows
training's windowed planner reproduces. ``--peers`` adds the batch planners of transformers and
DeepSpeed, driven as their trainers drive them (:func:`peer_plan`; both global, their own algorithms).
``--plot`` writes a PNG: the corpus length histogram and, per strategy, the distribution of rank work
relative to the step mean.

``--sequences N`` is the seed's scale instead (MLPerf phase 2: 156.7M sequences, 1,024 ranks): one rank's
view of a synthetic corpus of ``N`` sequences, planned by the training sampler a window at a time, each
strategy in a fresh process: time to the first step, time per window, steps that waited for planning
behind a simulated step of ``--step-time`` s, peak RSS; ``--global-plan`` also runs the whole-epoch
planner for every rank in a fresh process (time, peak RSS, and whether the rows are bit-identical).

The benchmark arithmetic lives here, not in the package's data modules: :func:`evaluate`, the length
mixes, and the peers' planners as their trainers drive them (transformers' planner, which training can
also run as ``sampler.strategy: hf_batch_rebalance``, lives with the sampler).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from typing import Optional

import numpy as np

from ..data.config import STRATEGIES, SamplerConfig
from ..data.cost import CostModel, PlanFigures, plan_figures, slot_lengths
from ..data.plan import CHUNK, Plan, plan_epoch, ragged_indices
from ..errors import DataError, check


# ------------------------------------------------------------------------------------------------
# the figures of every planner, ours and the peers' (global plans: every rank of every step)
# ------------------------------------------------------------------------------------------------
PEERS = ("hf_batch_rebalance", "ds_batch_by_seqlens")
"""Other libraries' planners :func:`peer_plan` drives: transformers' ``BatchRebalanceSampler`` and DeepSpeed's
``batch_by_seqlens`` (Hugging Face ``group_by_length`` is ``sorted_megabatch``). Both plan globally (every rank
plans every rank's steps): their algorithms, kept as they are."""

MLPERF_BIN_RATIO = (6, 3, 2, 5)  # bins 1–128 / 129–256 / 257–384 / 385–512 of MLPerf BERT phase 2
MLPERF_SPIKE = 0.8  # share of the last bin at exactly 512 (Wikipedia's full-length spike)


def mlperf_phase2_lengths(n: int, rng: np.random.Generator, spike: float = MLPERF_SPIKE) -> np.ndarray:
    """Lengths in bins 1–128/129–256/257–384/385–512 in the ratio 6:3:2:5, uniform within a bin, with
    ``spike`` of the last bin at exactly 512."""
    ratio = np.asarray(MLPERF_BIN_RATIO, dtype=np.float64)
    which = rng.choice(len(ratio), size=n, p=ratio / ratio.sum())
    lengths = which * 128 + rng.integers(1, 129, size=n)
    lengths[(which == len(ratio) - 1) & (rng.random(n) < spike)] = 512
    return lengths.astype(np.int64)


def read_lengths(path: str) -> np.ndarray:
    """Sequence lengths from ``.npy`` or text (integers separated by white space or commas)."""
    if not os.path.isfile(path):
        raise DataError(f"lengths file {path} does not exist")
    try:
        if path.endswith(".npy"):
            lengths = np.load(path, allow_pickle=False)
        else:
            with open(path, encoding="utf-8") as fh:
                lengths = np.asarray(fh.read().replace(",", " ").split(), dtype=np.int64)
    except (ValueError, OSError) as exc:
        raise DataError(f"lengths file {path}: {str(exc).splitlines()[0]}") from None
    lengths = np.asarray(lengths).ravel()
    if lengths.size == 0 or not np.issubdtype(lengths.dtype, np.integer) or lengths.min() < 1:
        raise DataError(f"lengths file {path}: needs positive integer lengths, one per sequence")
    return lengths.astype(np.int64)


def simulation_lengths(lengths: np.ndarray, global_batch: int, steps: int, rng: np.random.Generator) -> np.ndarray:
    """The corpus itself if it fills ``steps`` global batches, else ``steps + 1`` batches drawn from its mix."""
    if len(lengths) >= steps * global_batch:
        return lengths
    return rng.choice(lengths, size=(steps + 1) * global_batch)  # one spare batch: stratification drops a little


@dataclasses.dataclass
class StrategyResult:
    plan: Plan
    figures: PlanFigures
    seconds: float
    """Planning CPU seconds per step on one rank (every rank plans every step of the plan). CPU, not wall
    time: the planners are single-threaded, and on a shared machine wall time counts the other jobs."""
    note: str = ""


def evaluate(
    lengths: np.ndarray,
    *,
    world_size: int,
    ranks_per_node: int,
    micro_batch: int,
    grad_accum: int,
    cfg: SamplerConfig,
    cost: CostModel,
    seed: int = 0,
    strategies: tuple[str, ...] = STRATEGIES,
    peers: tuple[str, ...] = (),
    peer_budget_s: Optional[float] = None,
) -> dict[str, StrategyResult]:
    """Plan epoch 0 with every strategy (and ``peers``, see :func:`peer_plan`) and measure it with ``cost``."""
    out = {}
    for strategy in strategies:
        start = time.process_time()
        plan = plan_epoch(
            lengths,
            world_size=world_size,
            ranks_per_node=ranks_per_node,
            micro_batch=micro_batch,
            grad_accum=grad_accum,
            strategy=strategy,
            cfg=cfg,
            seed=seed,
            epoch=0,
        )
        seconds = (time.process_time() - start) / plan.steps
        figures = plan_figures(slot_lengths(plan.indices, lengths), cost, cfg.pad_multiple)
        out[strategy] = StrategyResult(plan, figures, seconds)
    for peer in peers:
        plan, seconds, note = peer_plan(
            peer,
            lengths,
            world_size=world_size,
            micro_batch=micro_batch,
            grad_accum=grad_accum,
            seed=seed,
            budget_s=peer_budget_s,
        )
        note = f"global, a peer's algorithm (every rank plans every rank's steps): {note}"
        out[peer] = StrategyResult(
            plan, plan_figures(slot_lengths(plan.indices, lengths), cost, cfg.pad_multiple), seconds, note
        )
    return out


# ------------------------------------------------------------------------------------------------
# other libraries' planners, driven as their trainers drive them
# ------------------------------------------------------------------------------------------------
def ds_token_packs(lengths: np.ndarray, max_tokens: int, seed: int) -> list[np.ndarray]:
    """The micro-batches of DeepSpeed 0.19.8's ``batch_by_seqlens`` (``deepspeed.runtime.data_pipeline.
    data_sampling.variable_batch_size_and_lr``) with ``sequence_picking_order="random"``, ``min_batch_size``
    1, no ``max_batch_size``, before its trim to whole batches, in linear time.

    It shuffles ``(length, id)`` pairs with ``random.Random(seed)``, drops samples longer than
    ``max_tokens``, then from each start keeps the longest run whose lengths sum to at most
    ``max_tokens`` (it tries every end, so its cost grows with the cube of the samples: hopeless at
    16,384 samples a step, hence this copy of its rule, checked against it by :func:`check_ds_token_packs`);
    the ends it tries stop before the last sample, which is never batched.
    """
    metrics = list(zip([int(v) for v in lengths], range(len(lengths))))
    random.Random(seed).shuffle(metrics)
    values = np.fromiter((m[0] for m in metrics), dtype=np.int64, count=len(metrics))
    ids = np.fromiter((m[1] for m in metrics), dtype=np.int64, count=len(metrics))
    keep = values <= max_tokens
    values, ids = values[keep], ids[keep]
    prefix = np.concatenate([[0], np.cumsum(values)])
    last = len(values) - 1  # batch ends are exclusive and stop before the last sample
    packs, start = [], 0
    while start < last:
        end = min(int(np.searchsorted(prefix, prefix[start] + max_tokens, side="right")) - 1, last)
        if end <= start:
            break
        packs.append(ids[start:end])
        start = end
    return packs


def check_ds_token_packs(lengths: np.ndarray, max_tokens: int, effective_batch_size: int, seed: int) -> bool:
    """Whether :func:`ds_token_packs` (trimmed to whole batches) equals DeepSpeed's own ``batch_by_seqlens``."""
    try:
        from deepspeed.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr import batch_by_seqlens
    except ImportError as exc:
        raise DataError(
            f"deepspeed's data_sampling.variable_batch_size_and_lr.batch_by_seqlens is missing ({exc})"
        ) from None

    theirs, _, _ = batch_by_seqlens(
        [int(v) for v in lengths],
        max_tokens,
        sequence_picking_order="random",
        effective_batch_size=effective_batch_size,
        seed=seed,
    )
    ours = ds_token_packs(lengths, max_tokens, seed)
    ours = ours[: len(ours) - len(ours) % effective_batch_size]
    return [list(ids) for _, ids in theirs] == [mb.tolist() for mb in ours]


def ds_max_tokens_for(lengths: np.ndarray, micro_batch: int, seed: int, sample: int = 20_000) -> int:
    """The smallest ``max_tokens`` at which :func:`ds_token_packs` holds ``micro_batch`` samples per pack on
    average (on a random subset of ``sample`` lengths): DeepSpeed's steps then hold a global batch on average."""
    rng = np.random.default_rng(seed)
    subset = rng.choice(lengths, size=min(sample, len(lengths)), replace=False)
    lo, hi = int(lengths.max()), int(micro_batch * lengths.max())
    while lo < hi:
        mid = (lo + hi) // 2
        packs = ds_token_packs(subset, mid, seed)
        if sum(len(p) for p in packs) >= micro_batch * len(packs):
            hi = mid
        else:
            lo = mid + 1
    return lo


def ds_batch_by_seqlens_plan(
    lengths: np.ndarray,
    *,
    world_size: int,
    micro_batch: int,
    grad_accum: int,
    seed: int = 0,
    max_tokens: Optional[int] = None,
    packs_per_micro: int = 1,
) -> tuple[Plan, float, str]:
    """DeepSpeed's dynamic batching as ``get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed``
    wires it: ``effective_batch_size`` = ``train_batch_size`` packs (``packs_per_micro`` = its
    ``train_micro_batch_size_per_gpu`` × accumulation × world) per step, the packs dealt by a
    ``DistributedSampler(shuffle=False)`` (rank ``r`` gets packs ``r, r + world, …``) and a ``DataLoader``
    of ``packs_per_micro`` packs per micro-step. ``max_tokens`` caps a pack (default: the smallest at which a
    pack holds ``micro_batch / packs_per_micro`` samples on average, :func:`ds_max_tokens_for`, so a step
    holds about a global batch); samples per step vary (DeepSpeed scales the LR with them).
    """
    max_tokens = max_tokens or ds_max_tokens_for(lengths, max(1, micro_batch // packs_per_micro), seed)
    start = time.process_time()
    packs = ds_token_packs(lengths, max_tokens, seed)
    per_step = packs_per_micro * grad_accum * world_size
    steps = len(packs) // per_step
    if steps == 0:
        raise DataError(
            f"ds_batch_by_seqlens: {len(packs)} packs of ≤ {max_tokens} tokens, fewer than one step's {per_step}"
        )
    plan_steps = [
        [
            [
                np.concatenate(
                    [
                        packs[((s * grad_accum + a) * packs_per_micro + t) * world_size + r]
                        for t in range(packs_per_micro)
                    ]
                ).tolist()
                for a in range(grad_accum)
            ]
            for r in range(world_size)
        ]
        for s in range(steps)
    ]
    seconds = (time.process_time() - start) / steps
    indices = ragged_indices(plan_steps)
    return (
        Plan(indices, len(lengths) - int((indices >= 0).sum()), "ds_batch_by_seqlens"),
        seconds,
        f"max_tokens {max_tokens}, {packs_per_micro} pack(s) per micro-step, order random",
    )


def peer_plan(
    name: str,
    lengths: np.ndarray,
    *,
    world_size: int,
    micro_batch: int,
    grad_accum: int,
    seed: int = 0,
    budget_s: Optional[float] = None,
) -> tuple[Plan, float, str]:
    """One of :data:`PEERS`: ``(plan, planning seconds per step on one rank, how it was driven)``."""
    if name == "hf_batch_rebalance":  # transformers' planner, global by design: every rank plans every rank's steps
        from ..data.sampler import hf_batch_rebalance_plan  # imports torch

        return hf_batch_rebalance_plan(
            lengths, world_size=world_size, micro_batch=micro_batch, grad_accum=grad_accum, seed=seed, budget_s=budget_s
        )
    if name == "ds_batch_by_seqlens":
        return ds_batch_by_seqlens_plan(
            lengths, world_size=world_size, micro_batch=micro_batch, grad_accum=grad_accum, seed=seed
        )
    raise DataError(f"peer {name!r} is not one of {', '.join(PEERS)}")


def per_global_batch(figures: PlanFigures, global_batch: int) -> float:
    """Scale for a planner whose steps hold a varying number of samples: step time per ``global_batch`` samples."""
    return global_batch / figures.samples_per_step


# ------------------------------------------------------------------------------------------------
# one rank's view at the seed's scale: windows, time to the first step, memory (fresh processes)
# ------------------------------------------------------------------------------------------------
SCALE_STEP_TIME = 0.05  # s: a BERT-large step of 16 × 512 on an A100 takes ~0.1 s padded, about half unpadded
SCALE_TARGETS = {"rss_mib": 1024.0, "first_step_s": 10.0}  # issue 32, at 100M sequences and 1,024 ranks
_CHILD = (
    "import json, sys; from ds_bertopt.cli.balance import measure_in_child; "
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
    from ..data.sampler import PlanBatchSampler  # torch: part of the baseline, as in training

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


def scale_main(args: argparse.Namespace) -> int:
    """``--sequences``: one rank's windowed view of a synthetic corpus of that size, a fresh process a strategy."""
    n = parse_count(args.sequences)
    global_batch = args.world_size * args.micro_batch * args.grad_accum
    check(n >= global_batch, f"--sequences {n} is below one global batch of {global_batch}")
    check(0 <= args.rank < args.world_size, f"--rank {args.rank} is outside world size {args.world_size}")
    started = time.perf_counter()
    label = (
        f"{args.sequences} sequences, {args.world_size} ranks ({args.world_size // args.ranks_per_node} nodes × "
        f"{args.ranks_per_node}) × {args.micro_batch} × {args.grad_accum}, rank {args.rank}"
    )
    print(
        f"corpus: {n} synthetic MLPerf-like lengths (half at 512, the rest uniform 32–511; int16, "
        f"{n * 2 / 2**20:.0f} MiB), seed {args.seed}; every strategy planned by rank {args.rank}'s sampler in a "
        "fresh process (hf_batch_rebalance, a peer's algorithm, plans globally and is not run here)",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="ds_bertopt_balance_") as tmp:
        path = os.path.join(tmp, "lengths.npy")
        np.save(path, synthetic_lengths(n, args.seed))
        results = []
        for strategy in args.strategies:  # one at a time: print as they finish
            results += scale_view(
                path,
                strategies=(strategy,),
                world_size=args.world_size,
                ranks_per_node=args.ranks_per_node,
                micro_batch=args.micro_batch,
                grad_accum=args.grad_accum,
                rank=args.rank,
                windows=args.windows,
                step_time=args.step_time,
                seed=args.seed,
                reference=args.reference,
            )
            print(scale_lines(results[-1:], label, args.step_time)[0], flush=True)
    for line in scale_lines(results, label, args.step_time)[len(results) :]:
        print(line)
    print(f"done in {time.perf_counter() - started:.1f} s")
    return 0


# ------------------------------------------------------------------------------------------------
# the command
# ------------------------------------------------------------------------------------------------
def corpus_lengths(path: str, max_seq_len: int, tokenizer: Optional[str], cache_dir: Optional[str]) -> np.ndarray:
    """Lengths of the training sequences pretraining builds from ``path`` (cached by the pipeline)."""
    from ..config import BertOptConfig
    from ..configlib import load_section
    from ..data.corpus import check_cache_dir, expand_train_files
    from ..data.pipeline import build_pretrain_data
    from ..data.tokenizer import check_tokenizer_location

    expand_train_files([path])  # every path checked before the cache is written
    if tokenizer:
        check_tokenizer_location(tokenizer, "--tokenizer")
    if cache_dir:
        check_cache_dir(cache_dir, "--cache-dir")
    data = {"train_files": [path], "max_seq_length": max_seq_len}
    if tokenizer:
        data["tokenizer"] = tokenizer
    if cache_dir:
        data["cache_dir"] = cache_dir
    cfg = load_section(
        BertOptConfig, {"data": data, "model": {"max_position_embeddings": max(512, max_seq_len)}}, "bertopt"
    )
    return build_pretrain_data(cfg).lengths.astype(np.int64)


def format_table(results: dict[str, StrategyResult], global_batch: Optional[int] = None) -> list[str]:
    """One row per strategy; step times relative to ``random``'s with padded kernels, per global batch."""
    base = results.get("random")
    lines = [
        f"{'strategy':<25} {'work max/mean':>13} {'p99':>6} {'padded max/mean':>15} {'p99':>6} "
        f"{'padding':>8} {'tokens/rank':>11} {'step time / random':>19} {'samples/step':>13} "
        f"{'micro mean/max':>14} {'dropped':>8} {'plan CPU s':>11}",
        f"{'':<25} {'(unpadded)':>13} {'':>6} {'':>15} {'':>6} {'':>8} {'':>11} {'unpadded / padded':>19} "
        f"{'':>13} {'':>14} {'':>8} {'per step':>11}",
    ]
    for name, r in results.items():
        f = r.figures
        scale = per_global_batch(f, global_batch) if global_batch else 1.0
        rel = (
            f"{scale * f.step_time / base.figures.padded_step_time:.3f} / "
            f"{scale * f.padded_step_time / base.figures.padded_step_time:.3f}"
            if base is not None
            else "-"
        )
        samples = (
            f"{f.samples_per_step_min}"
            if f.samples_per_step_min == f.samples_per_step_max
            else f"{f.samples_per_step_min}-{f.samples_per_step_max}"
        )
        micro = f"{f.micro_batch_samples_mean:.1f}/{f.micro_batch_samples_max}"
        lines.append(
            f"{name:<25} {f.imbalance_mean:>13.3f} {f.imbalance_p99:>6.3f} {f.padded_imbalance_mean:>15.3f} "
            f"{f.padded_imbalance_p99:>6.3f} {100 * f.padding:>7.1f}% {f.tokens_per_rank:>11.0f} {rel:>19} "
            f"{samples:>13} {micro:>14} {r.plan.dropped:>8d} {r.seconds:>11.4f}"
        )
    return lines


def plot(path: str, corpus: np.ndarray, results: dict[str, StrategyResult], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (hist_ax, work_ax, padded_ax) = plt.subplots(3, 1, figsize=(11, 12))
    hist_ax.hist(corpus, bins=min(128, int(corpus.max())), color="#4c72b0")
    hist_ax.set(title=f"sequence lengths: {title}", xlabel="tokens", ylabel="sequences")
    names = list(results)
    for ax, attr, what in (
        (work_ax, "work_per_rank", "unpadded cost a·L + b·L²"),
        (padded_ax, "padded_work_per_rank", "padded cost (micro × cost of padded length)"),
    ):
        data = [getattr(results[n].figures, attr).ravel() for n in names]
        ax.boxplot(data, whis=(0, 100), showfliers=False)
        ax.set_xticks(range(1, len(names) + 1), names, rotation=12)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set(
            title=f"rank work / step mean, every rank and step — {what} (whiskers: min, max)", ylabel="work / step mean"
        )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ds-bertopt balance", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--corpus", help="a corpus file (.txt/.jsonl[.gz]); sequences are built as pretraining builds them"
    )
    src.add_argument("--lengths", help="sequence lengths: .npy or text with one integer per sequence")
    src.add_argument(
        "--mlperf-mix",
        action="store_true",
        help="MLPerf BERT phase-2 mix: bins 1-128/129-256/257-384/385-512 as 6:3:2:5, spike at 512",
    )
    src.add_argument(
        "--sequences",
        help="the seed's scale: one rank's windowed plan of this many synthetic sequences (e.g. 100M, 156.7M): "
        "time to the first step, per window, waits, peak RSS",
    )
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--ranks-per-node", type=int, required=True)
    p.add_argument("--micro-batch", type=int, default=16, help="samples per micro-batch (default 16, MLPerf's)")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--max-seq-len", type=int, default=512, help="sequence length the corpus is built for (--corpus)")
    p.add_argument("--tokenizer", help="tokenizer directory for --corpus (default: WordPiece trained on the corpus)")
    p.add_argument("--cache-dir", help="ds_bertopt cache for --corpus (default: the pretraining default)")
    p.add_argument("--steps", type=int, default=50, help="global batches to simulate when the corpus has fewer")
    p.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    p.add_argument("--config", help="DeepSpeed JSON whose bertopt.sampler section to start from")
    p.add_argument("--bins", help="comma-separated upper bin edges, e.g. 128,256,384,512")
    p.add_argument("--bin-counts", help="comma-separated samples per bin in a local batch, e.g. 6,3,2,5")
    p.add_argument("--num-bins", type=int, help="quantile bins when --bins is not given")
    p.add_argument(
        "--hidden-size",
        type=int,
        default=None,
        help="cost model b = 1/(6·hidden) (default: the config's cost_quadratic, BERT-large)",
    )
    objective = p.add_mutually_exclusive_group()
    objective.add_argument(
        "--padded",
        dest="padded",
        action="store_const",
        const=True,
        help="stratified_node_balance balances the padded micro-batch cost (the default)",
    )
    objective.add_argument(
        "--unpadded",
        dest="padded",
        action="store_const",
        const=False,
        help="stratified_node_balance balances the per-sample cost (both costs are printed)",
    )
    p.add_argument(
        "--peers",
        action="store_true",
        help=f"also plan with {' and '.join(PEERS)} (transformers, DeepSpeed; slow at 1,024 ranks)",
    )
    p.add_argument(
        "--peer-budget",
        type=float,
        default=60.0,
        help="seconds of planning after which the transformers peer stops adding steps (at least one)",
    )
    p.add_argument("--micro-batch-tokens", type=int, help="sampler.micro_batch_tokens for the packed strategies")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", help="write a PNG here")
    scale = p.add_argument_group("--sequences")
    scale.add_argument("--rank", type=int, default=0, help="the rank whose view is planned")
    scale.add_argument("--windows", type=int, default=4, help="windows of steps to take (then a resume at the end)")
    scale.add_argument(
        "--step-time",
        type=float,
        default=SCALE_STEP_TIME,
        help=f"simulated seconds of a training step, while the next window is planned (default {SCALE_STEP_TIME})",
    )
    scale.add_argument(
        "--global-plan",
        dest="reference",
        action="store_true",
        help="also the whole epoch for every rank (the global planner) in a fresh process: time, peak RSS, and "
        "whether the windows are bit-identical to it",
    )
    return p


def _int_list(text: Optional[str], flag: str) -> Optional[tuple[int, ...]]:
    if text is None:
        return None
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise DataError(f"{flag}: expected comma-separated integers, got {text!r}") from None


def sampler_config(args: argparse.Namespace) -> SamplerConfig:
    from ..configlib import load_section, to_dict

    base = SamplerConfig()
    if args.config:
        from ..config import load_config

        base = load_config(args.config).bertopt.sampler
    raw = to_dict(base)
    for key, value in (
        ("bins", _int_list(args.bins, "--bins")),
        ("bin_counts", _int_list(args.bin_counts, "--bin-counts")),
        ("num_bins", args.num_bins),
        ("padded", args.padded),
        ("micro_batch_tokens", args.micro_batch_tokens),
    ):
        if value is not None:
            raw[key] = list(value) if isinstance(value, tuple) else value
    if args.hidden_size is not None:
        check(args.hidden_size > 0, f"--hidden-size: must be positive, got {args.hidden_size}")
        raw["cost_quadratic"] = CostModel.for_hidden_size(args.hidden_size).quadratic
    return load_section(SamplerConfig, raw, "sampler")


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    for flag in ("world_size", "ranks_per_node", "micro_batch", "grad_accum", "steps", "max_seq_len"):
        check(getattr(args, flag) > 0, f"--{flag.replace('_', '-')}: must be positive, got {getattr(args, flag)}")
    check(
        args.world_size % args.ranks_per_node == 0,
        f"--world-size {args.world_size} is not a multiple of --ranks-per-node {args.ranks_per_node}",
    )
    if args.sequences:
        check(args.windows > 0, f"--windows: must be positive, got {args.windows}")
        check(args.step_time >= 0, f"--step-time: must not be negative, got {args.step_time}")
        return scale_main(args)
    cfg = sampler_config(args)
    rng = np.random.default_rng(args.seed)
    global_batch = args.world_size * args.micro_batch * args.grad_accum
    started = time.perf_counter()
    if args.mlperf_mix:
        corpus, source = mlperf_phase2_lengths((args.steps + 1) * global_batch, rng), "MLPerf phase-2 mix (synthetic)"
    elif args.lengths:
        corpus, source = read_lengths(args.lengths), args.lengths
    else:
        corpus, source = corpus_lengths(args.corpus, args.max_seq_len, args.tokenizer, args.cache_dir), args.corpus
    lengths = simulation_lengths(corpus, global_batch, args.steps, rng)
    p10, p50, p90 = np.percentile(corpus, [10, 50, 90])
    print(
        f"corpus: {source}: {len(corpus)} sequences, length mean {corpus.mean():.1f}, p10/p50/p90 "
        f"{p10:.0f}/{p50:.0f}/{p90:.0f}, max {corpus.max()}, {np.mean(corpus == corpus.max()):.1%} at the max"
    )
    drawn = " (lengths drawn from the corpus's mix)" if len(lengths) != len(corpus) else ""
    print(
        f"plan: {args.world_size} ranks ({args.world_size // args.ranks_per_node} nodes × {args.ranks_per_node}) × "
        f"micro-batch {args.micro_batch} × accumulation {args.grad_accum} = global batch {global_batch}; "
        f"{len(lengths)} sequences{drawn}"
    )
    cost = cfg.cost_model
    print(
        f"cost model: a·L + b·L² with a = {cost.linear:g}, b = {cost.quadratic:.4g}; padding to a multiple of "
        f"{cfg.pad_multiple}; stratified_node_balance balances the {'padded' if cfg.padded else 'unpadded'} cost"
    )
    results = evaluate(
        lengths,
        world_size=args.world_size,
        ranks_per_node=args.ranks_per_node,
        micro_batch=args.micro_batch,
        grad_accum=args.grad_accum,
        cfg=cfg,
        cost=cost,
        seed=args.seed,
        strategies=tuple(args.strategies),
        peers=PEERS if args.peers else (),
        peer_budget_s=args.peer_budget,
    )
    for name, r in results.items():
        if r.note:
            print(f"{name}: {r.note}")
    for name, r in results.items():
        if r.plan.bin_edges is not None:
            edges = r.plan.bin_edges.tolist()
            shown = edges if len(edges) <= 12 else f"{len(edges)} quantile bins, {edges[:4]} … {edges[-2:]}"
            print(f"bins of {name} (per {r.plan.stratum}): {shown}")
    steps = {r.plan.steps for r in results.values()}
    print(f"figures over {min(steps)}–{max(steps)} steps" if len(steps) > 1 else f"figures over {steps.pop()} steps")
    for line in format_table(results, global_batch):
        print(line)
    print(
        "step time: the busiest rank's work per step (mean over steps, per global batch of samples) relative to "
        "random with padded kernels; unpadded = kernels that skip padding (the packed strategies' micro-batches "
        "compute no padding there)"
    )
    if args.plot:
        plot(args.plot, corpus, results, source)
        print(f"plot written to {args.plot}")
    print(f"done in {time.perf_counter() - started:.1f} s")
    return 0
