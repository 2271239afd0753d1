"""Sizing fine-tuning to a memory budget: which setup, at which micro-batch, fits and runs fastest (or as fast,
within timing noise, and simpler).

Pure part (no measuring): :func:`fit_largest_batch` (a linear fit of peaks against the batch),
:func:`largest_fitting_batch` (a secant search on measured peaks), :func:`probe_batches`, :func:`fitted_batch`,
:func:`estimated_rate` and :func:`rate_bound` (the fast search's two small probes, the batch their line puts under
the budget, and how fast a setup could be), :func:`choose` (the simplest setup whose measured peak fits and whose
throughput is within :data:`TIE_MARGIN` of the fastest that fits), :func:`could_change` (whether an untimed setup
could change that), :func:`candidate_config` (a ``preset: "auto"`` config as one candidate sees it). Glue:
:func:`measure` (peak and step time of one setup, in fresh children, through :mod:`ds_bertopt.wtacrs.memory`),
:func:`size_fast` (every setup probed, the simplest that fits timed first, then only those that could change the
choice) and :func:`resolve_auto` (``wtacrs.preset: "auto"`` at start-up).

"Fastest" is sequences per second at the setup's own batch; at one fixed micro-batch (the training run's) that
is the shortest step. A peak *fits* when it is at most the budget; a step that ran out of memory has an infinite
peak (over every budget), and the search goes on below it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, fields
from typing import Callable, Optional

from ..child import stop_forkserver
from ..configlib import load_section
from ..errors import ConfigError
from ..handoff import Work, job_store, wait_for
from ..log import print_all
from .config import AUTO_CANDIDATES, KIT_DEFAULTS, WTACRS_DEFAULTS, KitConfig, WtaCrsConfig
from .fallback import model_shape, preset_decision

GiB = 1024**3


@dataclass(frozen=True)
class Measured:
    """One setup measured at one micro-batch."""

    setup: str
    """Its name (``full``, ``preset exact``, …)."""
    batch: int
    """Micro-batch (sequences); 0 when not even one sequence fits."""
    peak: float
    """Whole-step peak in bytes (see :func:`ds_bertopt.wtacrs.memory.measure_step`); ``inf``: ran out of memory."""
    step_s: float
    """Seconds per training step at ``batch``, the shortest of those timed (other load only adds time; ``inf`` when
    not measured)."""
    bound: float = 0.0
    """Pruned by the fast search (:func:`size_fast`): not timed, its batch and peak from the probes' line, and the
    most sequences per second it could reach (:func:`rate_bound`); 0: measured."""

    def __post_init__(self) -> None:
        if self.batch < 0 or self.peak < 0 or not self.step_s > 0:
            raise ValueError(f"Measured: batch, peak >= 0 and step_s > 0, got {self}")

    @property
    def rate(self) -> float:
        """Sequences per second."""
        return self.batch / self.step_s if math.isfinite(self.step_s) else 0.0


def fit_largest_batch(points: dict[int, int], budget: float) -> tuple[int, float, float]:
    """``(largest batch, slope, intercept)`` of the line through two ``{batch: peak}`` points at ``budget``
    (0 when the line does not rise: nothing to extrapolate)."""
    (b1, p1), (b2, p2) = sorted(points.items())[-2:]
    slope = (p2 - p1) / (b2 - b1)
    intercept = p1 - slope * b1
    return (max(0, math.floor((budget - intercept) / slope)) if slope > 0 else 0), slope, intercept


def largest_fitting_batch(
    peak_at: Callable[[int], float], budget: float, probe: int, max_batch: int, tries: int = 4
) -> tuple[int, dict[int, float]]:
    """The largest micro-batch ``≤ max_batch`` whose *measured* peak fits ``budget``, and every peak measured.

    Peaks at ``probe // 2`` and ``probe`` start it. Then, ``tries`` times at most: while no measured batch above
    the largest that fits is over the budget, the line through the two largest measured batches is extrapolated
    (a line that does not rise, as RSS noise at small batches can make it, tries ``max_batch``); once one is
    over, the line through the bracket (the largest that fits, the smallest over it) is interpolated, or halved when
    its top ran out of memory (an infinite peak: no line goes through it). Each guess is measured. Returns
    ``(0, peaks)`` when even a batch of 1 does not fit.
    """
    peaks: dict[int, float] = {}

    def measure(batch: int) -> None:
        if batch not in peaks:
            peaks[batch] = float(peak_at(batch))

    def largest_fitting() -> int:
        return max((b for b, p in peaks.items() if p <= budget and b <= max_batch), default=0)

    probe = min(probe, max_batch)
    measure(max(1, probe // 2))
    measure(max(2, probe))
    for _ in range(tries):
        best = largest_fitting()
        over = min((b for b, p in peaks.items() if b > best and p > budget), default=None)
        if over is None:  # everything measured fits: extrapolate
            if best >= max_batch:
                break
            line, slope, _ = fit_largest_batch({b: peaks[b] for b in sorted(peaks)[-2:]}, budget)
            guess = min(max_batch, line) if slope > 0 else max_batch
        elif over - best <= 1:
            break
        else:  # bracketed (with nothing fitting yet: by the two smallest measured)
            pair = (best, over) if best else sorted(peaks)[:2]
            if all(math.isfinite(peaks[b]) for b in pair):
                line, slope, _ = fit_largest_batch({b: peaks[b] for b in pair}, budget)
                guess = max(1, min(over - 1, line)) if slope > 0 else max(1, best)
            else:  # the step ran out of memory there
                guess = max(1, (best + over) // 2)
        if guess <= best or guess in peaks:
            break
        measure(guess)
    return largest_fitting(), peaks


def probe_batches(first: int, max_batch: int) -> tuple[int, int]:
    """The two small batches the fast search measures: ``p`` and ``2p``, ``p`` = ``first`` but at most a sixteenth
    of ``max_batch`` (at least 1). Not smaller: at a few sequences the step's peak is the optimizer's (AdamW's
    temporaries over every weight), flat in the batch, and a line through two such points underestimates the slope
    (MiniLM-L6 at seq 64: the line through batches 8 and 16 put 221 under 2 GiB where 117 fits; through 16 and 32,
    117)."""
    p = max(1, min(first, max_batch // 16))
    return p, 2 * p


def fitted_batch(peaks: dict[int, float], budget: float, max_batch: int) -> tuple[int, float]:
    """``(batch, its peak on the line)``: the largest batch ``≤ max_batch`` that the line through the two largest
    probed ``{batch: peak}`` points puts under ``budget`` (never below the largest probe that fits; ``max_batch``
    when the line does not rise, as RSS noise at small batches can make it: the measured peak there decides);
    ``(0, smallest peak)`` when no probe fits."""
    fitting = [b for b, p in peaks.items() if p <= budget]
    if not fitting:
        return 0, min(peaks.values())
    if not all(math.isfinite(p) for p in peaks.values()):  # a probe ran out of memory: no line goes through it
        return max(fitting), peaks[max(fitting)]
    line, slope, intercept = fit_largest_batch(peaks, budget)
    if slope <= 0:
        return max_batch, max(peaks[b] for b in fitting)
    batch = min(max_batch, max(line, max(fitting)))
    return batch, intercept + slope * batch


def estimated_rate(times: dict[int, float], batch: int) -> float:
    """Sequences per second at ``batch`` from step times ``{batch: s}`` at two smaller ones: the line
    ``t(b) = a + c·b`` through them, with the fixed part ``a`` and the per-sequence part ``c`` at least 0 (timing
    noise never makes a larger batch look cheaper per step than a smaller one, nor a step cost less than nothing)."""
    (b1, t1), (b2, t2) = sorted(times.items())[-2:]
    per_sequence = max(0.0, (t2 - t1) / (b2 - b1))
    fixed = t2 - per_sequence * b2
    if fixed < 0:
        fixed, per_sequence = 0.0, t2 / b2
    return batch / (fixed + per_sequence * batch)


PROBE_REPEATS = 2
"""Timed steps per probe batch, the shortest kept: with one, a single slow or fast step on a shared machine moved a
setup's estimate by up to 3x (full at 74 sequences/s probed, 24 measured) and with it the order of timing."""
PRUNE_MARGIN = 0.25
"""How far a setup's estimate may err low: it is timed unless even 1.25× its calibrated estimate loses."""


def rate_bound(estimate: float, timed: list[tuple[float, float]], margin: float = PRUNE_MARGIN) -> float:
    """The most sequences per second a setup estimated at ``estimate`` (:func:`estimated_rate`) could reach, given
    ``timed``, the ``(estimate, measured)`` pairs of the setups timed so far: its estimate scaled by the largest
    measured/estimated ratio among them, never below 1 (the probes run under a malloc setting that slows every step:
    the ratio undoes that, taken at its most generous; a setup whose probes overestimated it, as a step made of fixed
    overhead extrapolates, must not shrink the others' bounds), times ``1 + margin``. ``inf`` before anything was
    timed."""
    if not timed:
        return math.inf
    return estimate * max(1.0, *(measured / est for est, measured in timed)) * (1.0 + margin)


TIE_MARGIN = 0.30
"""How much faster a more intrusive setup must measure than a simpler one to be recommended over it. Its size is the
run-to-run spread of one setup's measured rate on a quiet 2-core CPU (``bench/wtacrs_budget.py``'s record of
2026-12-06, the same command minutes apart, every core per child): full fine-tuning 20.5 and 27.0 sequences/s
(1.32x), LoRA + ``balanced`` 24.5 and 31.3 (1.28x), ``balanced`` 20.7 and 24.7 (1.19x), while the fastest four
setups of one run were within 2-4 % of each other. A gain inside that spread is noise: nobody is sent to
recomputation, sampled gradients or LoRA for it, and the fast search and the exhaustive one answer the same."""


def _fits(m: Measured, budget: float) -> bool:
    return m.batch > 0 and m.peak <= budget


def choose(measured: list[Measured], budget: float, margin: float = TIE_MARGIN) -> Measured:
    """The setup to recommend among ``measured``, listed simplest first: the first (simplest) setup whose peak fits
    ``budget`` and whose throughput is within ``margin`` (:data:`TIE_MARGIN`) of the fastest that fits, i.e. the
    fastest unless a simpler one is at most ``1 + margin`` times slower. Simplest first is how far a setup departs
    from full fine-tuning's math: full; transformers' activation checkpointing (the model's own modules, only
    recomputed); preset ``exact`` (the kit's module swaps, exact gradients); ``balanced`` (sampled weight
    gradients); ``max_saving`` (``balanced`` + checkpointing); and any of them with LoRA (it changes what is
    trained) after all of those (:data:`~ds_bertopt.wtacrs.config.AUTO_CANDIDATES`, ``ds-bertopt memory``'s
    ``COMPARED``). A fitting setup that was not timed (pruned, or its step not measured) counts only when none
    was timed. A one-line :class:`~ds_bertopt.errors.ConfigError` naming the smallest peak when none fits."""
    fitting = [m for m in measured if _fits(m, budget)]
    if not fitting:
        smallest = min(measured, key=lambda m: m.peak)
        found = (
            f"the smallest peak is {smallest.setup}'s {smallest.peak / GiB:.2f} GiB at batch {max(smallest.batch, 1)}"
            if math.isfinite(smallest.peak)
            else f"every setup ran out of memory (at batch {max(smallest.batch, 1)} at the least)"
        )
        raise ConfigError(
            f"memory budget {budget / GiB:.2f} GiB: no setup fits; {found} (raise the budget, shorten the "
            f"sequences or lower the micro-batch)"
        )
    fastest = max(m.rate for m in fitting)
    return next(m for m in fitting if m.rate * (1.0 + margin) >= fastest)


def could_change(
    measured: list[Measured], candidate: Measured, order: list[str], budget: float, margin: float = TIE_MARGIN
) -> bool:
    """Whether ``candidate`` (a setup not yet timed, at the most it could reach: its :func:`rate_bound`) could
    change :func:`choose`'s answer among ``measured`` (those timed so far); ``order``: every setup's name, simplest
    first. The rule is monotone in a setup's rate (a slower one changes no more than a faster one), so a setup
    that would not change the answer at its bound is safely left untimed."""
    timed = [m for m in measured if m.rate > 0]
    if not any(_fits(m, budget) for m in timed):
        return True

    def rank(m: Measured) -> int:
        return order.index(m.setup)

    return choose(sorted(timed + [candidate], key=rank), budget, margin) is not choose(
        sorted(timed, key=rank), budget, margin
    )


def describe(m: Measured, budget: float) -> str:
    """``"preset exact: batch 64, peak 1.23 GiB (fits 2.00), 0.412 s/step, 155.3 sequences/s"``."""
    verdict = "fits" if m.peak <= budget else "over"
    speed = f"{m.step_s:.3f} s/step, {m.rate:.1f} sequences/s" if math.isfinite(m.step_s) else "not timed"
    peak = f"peak {m.peak / GiB:.2f} GiB" if math.isfinite(m.peak) else "out of memory"
    if m.bound:
        peak, speed = f"fitted peak {m.peak / GiB:.2f} GiB", f"pruned: at most {m.bound:.1f} sequences/s"
    return f"{m.setup}: batch {max(m.batch, 1)}, {peak} ({verdict} {budget / GiB:.2f}), {speed}"


def recommendation(chosen: Measured, measured: list[Measured], budget: float, margin: float = TIE_MARGIN) -> str:
    """The one line saying what was chosen and why: ``"<setup> (batch, peak, rate): the fastest that fits …; next:
    …"``, or, where the tie margin decided, ``"…: fits … and is simpler than the fastest, <setup> at <rate>
    (1.16x), within the 30% tie margin …"``; then the setups pruned untimed."""
    others = [m for m in measured if m is not chosen and _fits(m, budget) and m.rate > 0]
    fastest = max(others, key=lambda m: m.rate, default=None)
    head = f"{chosen.setup} (batch {chosen.batch}, peak {chosen.peak / GiB:.2f} GiB, {chosen.rate:.1f} sequences/s)"
    if fastest is not None and fastest.rate > chosen.rate:
        why = (
            f"fits {budget / GiB:.2f} GiB and is simpler than the fastest, {fastest.setup} at {fastest.rate:.1f} "
            f"({fastest.rate / chosen.rate:.2f}x), within the {margin:.0%} tie margin (run-to-run spread)"
        )
    else:
        why = f"the fastest that fits {budget / GiB:.2f} GiB" + (
            f"; next: {fastest.setup} at {fastest.rate:.1f} ({chosen.rate / fastest.rate:.2f}x slower)"
            if fastest is not None and fastest.rate > 0
            else ""
        )
    pruned = [m for m in measured if m.bound]
    if pruned:
        why += f"; not timed, could not change the choice: {', '.join(m.setup for m in pruned)}"
    return f"{head}: {why}"


# ---------------------------------------------------------------- preset "auto": the candidates as configs
def _as_given(section, dataclass_type, fillable: dict) -> dict:
    """The fields of ``section`` as the user gave them: fillable ones only when given (so a preset can fill them)."""
    given = getattr(section, "_given", frozenset())
    raw = {}
    for f in fields(dataclass_type):
        if f.name in fillable and f.name not in given:
            continue
        value = getattr(section, f.name)
        raw[f.name] = list(value) if isinstance(value, tuple) else value
    return raw


def candidate_config(cfg: WtaCrsConfig, candidate: str) -> dict:
    """The ``wtacrs`` config dict that ``candidate`` (one of :data:`~ds_bertopt.wtacrs.config.AUTO_CANDIDATES`)
    stands for under ``cfg`` (``preset: "auto"``): the fields given next to ``auto`` plus the candidate's preset, or
    none (``checkpointing``: activation checkpointing of every layer unless ``kit.checkpoint_every`` was given)."""
    raw = _as_given(cfg, WtaCrsConfig, WTACRS_DEFAULTS)
    kit = _as_given(cfg.kit, KitConfig, KIT_DEFAULTS)
    for name in ("memory_budget", "budget_seq_length", "auto_candidates"):
        raw.pop(name)
    raw["preset"] = candidate if candidate in ("exact", "balanced", "max_saving") else None
    if candidate == "checkpointing":
        kit.setdefault("checkpoint_every", 1)
    raw["kit"] = kit
    raw["lora"] = {f.name: _plain(getattr(cfg.lora, f.name)) for f in fields(type(cfg.lora))}
    return raw


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


CANDIDATE_LABELS = {"none": "no preset", "checkpointing": "checkpointing"}


# ---------------------------------------------------------------- glue: measuring
def measure(
    spec: dict,
    setup: str,
    budget: float,
    batch: Optional[int] = None,
    probe: int = 16,
    max_batch: int = 256,
    steps: int = 2,
    probed: Optional[dict[int, float]] = None,
) -> Measured:
    """``setup`` (``spec["wtacrs"]``) measured in fresh children: at ``batch`` when given (the run's micro-batch,
    or the fast search's fitted batch), else at the largest batch ``≤ max_batch`` that fits
    (:func:`largest_fitting_batch` from ``probe``, a child per peak). The batch's step time is the shortest of
    ``steps`` timed steps, taken in the child that measures its peak (:func:`~.memory.probe_in_child`: the peak
    step, the allocator switched to its warm default behaviour, one untimed step, then the timed ones); at a given
    ``batch`` that one child both verifies and times it, and does not time a batch over the budget. Not timed when
    it does not fit; a batch whose child runs out of memory is over the budget. ``probed``: peaks already measured
    (the fast search's); with ``batch``, a ``batch`` over the budget goes on with the search from them."""
    from ..child import OutOfMemory
    from .memory import measure_step_in_child, probe_in_child

    known = dict(probed or {})

    def peak_at(b: int) -> float:
        if b not in known:
            try:
                known[b] = measure_step_in_child({**spec, "batch": b, "saved": False})["step_peak"]
            except OutOfMemory:
                known[b] = math.inf
        return known[b]

    def timed_at(b: int, fitting_only: bool) -> tuple[float, float]:
        try:
            result = probe_in_child({**spec, "repeats": steps}, [b], budget if fitting_only else None)
        except OutOfMemory:
            return math.inf, math.inf
        return result["peaks"][b], result["step_s"][b]

    if batch is not None:
        peak, seconds = timed_at(batch, fitting_only=True)
        if peak <= budget or probed is None:
            return Measured(setup, batch, peak, seconds if peak <= budget else math.inf)
        known[batch] = peak
    found, peaks = largest_fitting_batch(peak_at, budget, probe, max_batch)
    if found == 0:
        return Measured(setup, 0, min(peaks.values()), math.inf)
    peak, seconds = timed_at(found, fitting_only=False)
    # the default allocator's layout did not fit where the measured one did: over
    return Measured(setup, found, peaks[found] if math.isfinite(peak) else math.inf, seconds)


def size_fast(
    specs: dict[str, dict],
    budget: float,
    probe: int = 16,
    max_batch: int = 256,
    steps: int = 2,
    margin: float = PRUNE_MARGIN,
    say: Callable[[str], None] = print,
    tie_margin: float = TIE_MARGIN,
) -> list[Measured]:
    """Every setup of ``specs`` (``{name: spec}``, simplest first, as :func:`choose` takes them; each as
    :func:`measure` takes it) sized to ``budget``, timing only those that can change the choice. Each is probed in a
    fresh child (:func:`~ds_bertopt.wtacrs.memory.probe_setups_in_child`: peaks and step times at the two
    :func:`probe_batches`, each setup's line said as it arrives), its batch taken from the line through the peaks
    (:func:`fitted_batch`) and its throughput there estimated (:func:`estimated_rate`). Then the simplest setup
    that fits is measured first (the reference every other must beat by ``tie_margin``), the others best estimate
    first (:func:`measure` at the fitted batch: peak verified and steps timed in one child, the search going on
    below it if over), each unless even at its :func:`rate_bound` it would not change :func:`choose`'s answer
    (:func:`could_change`): then it is pruned, not timed. Says a line per setup as it goes, with the seconds each
    phase took. Returns :class:`Measured` in ``specs``' order."""
    from .memory import probe_setups_in_child

    batches, found, names = probe_batches(probe, max_batch), {}, list(specs)
    clock = [time.monotonic()]

    def took() -> str:
        now = time.monotonic()
        seconds, clock[0] = now - clock[0], now
        return f"{seconds:.0f} s"

    def probed(index: int, result: Optional[dict]) -> None:
        name = names[index]
        if result is None:  # it ran out of memory at a probe
            result = {"peaks": {b: math.inf for b in batches}, "step_s": {b: math.inf for b in batches}}
        batch, peak = fitted_batch(result["peaks"], budget, max_batch)
        timed_probes = all(math.isfinite(t) for t in result["step_s"].values())
        # a setup whose larger probe ran out of memory has no estimate: it is timed first (at its small batch)
        estimate = (estimated_rate(result["step_s"], batch) if timed_probes else math.inf) if batch else 0.0
        found[name] = (batch, peak, estimate, result["peaks"], result["step_s"])
        shown = ", ".join(f"{p / GiB:.3f}" if math.isfinite(p) else "out of memory" for p in result["peaks"].values())
        say(
            f"  [{index + 1}/{len(specs)}] {name}: peaks {shown} GiB at batch {' and '.join(map(str, batches))}: "
            + (f"fits batch {batch} by their line, about {estimate:.1f} sequences/s" if batch else "nothing fits")
            + f" ({took()})"
        )

    start = time.monotonic()
    probe_setups_in_child([{**specs[name], "repeats": PROBE_REPEATS} for name in names], list(batches), probed)
    say(f"  probed {len(names)} setups in {time.monotonic() - start:.0f} s")
    results: dict[str, Measured] = {}
    timed: list[tuple[float, float]] = []
    fitting = [n for n in names if found[n][0] > 0]
    order = fitting[:1] + sorted(fitting[1:], key=lambda n: -found[n][2])
    for name in [n for n in names if found[n][0] == 0]:
        results[name] = Measured(name, 0, found[name][1], math.inf)
    for name in order:
        batch, peak, estimate, peaks, times = found[name]
        bound = rate_bound(estimate, timed, margin)
        so_far = [results[n] for n in names if n in results]
        at_bound = Measured(name, batch, peak, batch / bound if 0 < bound < math.inf else math.inf)
        if math.isfinite(bound) and not could_change(so_far, at_bound, names, budget, tie_margin):
            results[name] = Measured(name, batch, peak, math.inf, bound=bound)
            say(f"  {name}: pruned at batch {batch}: at most {bound:.1f} sequences/s would not change the choice")
            continue
        say(f"  {name}: verifying batch {batch} and timing {steps} step(s) there ...")
        clock[0] = time.monotonic()
        measured = measure(specs[name], name, budget, batch, batches[-1], max_batch, steps, probed=peaks)
        results[name] = measured
        say(f"  {describe(measured, budget)} ({took()})")
        if measured.rate > 0 and math.isfinite(estimate):
            timed.append((estimated_rate(times, measured.batch), measured.rate))
    return [results[name] for name in specs]


def resolve_auto(
    cfg: WtaCrsConfig,
    *,
    model_dir: str,
    batch: int,
    seq: int,
    precision: str = "fp32",
    device: str = "cpu",
    num_labels: int = 2,
    threads: int = 1,
    search_batch: bool = False,
    stale_s: float = 120.0,
    task: Optional[dict] = None,
    full_first: bool = False,
) -> tuple[WtaCrsConfig, int, list[str]]:
    """``cfg`` with ``preset: "auto"`` replaced by the fastest of its ``auto_candidates`` that fits
    ``memory_budget``; returns ``(config, micro-batch, log lines)``. Any other ``cfg`` comes back as it is.
    ``task``: what the run trains, as :func:`~ds_bertopt.wtacrs.memory.measure_step` builds it (``build``, ``task``,
    ``packed``: e.g. ``ds_bertopt.train.finetune_memory.task_variant`` on packed rows of ``batch`` sequences of
    ``seq`` tokens); default: sequence classification, padded.

    Each candidate is measured at ``batch`` × ``seq`` in ``precision`` on ``device`` (fresh children; minutes on a
    CPU). With ``search_batch`` (``TrainingArguments.auto_find_batch_size``) each gets the largest batch up to
    ``batch`` that fits, and the fastest in sequences per second wins. Under ``torch.distributed`` rank 0
    measures and every rank takes its choice, waiting on the job's store (:mod:`ds_bertopt.handoff`: no collective
    timeout, a progress line every 30 s, rank 0's error on every rank; rank 0 silent for ``stale_s`` is given up).
    One-line :class:`~ds_bertopt.errors.ConfigError`: a device whose peak cannot be measured here, a budget nothing
    fits. ``full_first`` (the preset fallback, :func:`resolve_preset`): ``none`` is measured first and taken, without
    measuring the others, when it fits at ``batch``.
    """
    if cfg.preset != "auto":
        return cfg, batch, []
    import torch.distributed as torch_dist

    from .memory import peak_unmeasurable

    budget = cfg.memory_budget * GiB
    why = peak_unmeasurable(device)
    if why is not None:
        raise ConfigError(
            f"wtacrs.memory_budget: cannot measure peak memory on {device}: {why}; set wtacrs.preset yourself"
        )
    args = (cfg, budget, model_dir, batch, seq, precision, device, num_labels, threads, search_batch, task or {})
    args += (full_first and "none" in cfg.auto_candidates,)
    if not (torch_dist.is_available() and torch_dist.is_initialized() and torch_dist.get_world_size() > 1):
        name, found, lines = _measure_candidates(*args)
    else:  # rank 0 measures (minutes); the others wait on the store, where no collective timeout applies
        _AUTO_CALLS.append(len(_AUTO_CALLS))  # every rank makes the same calls: each has its own keys
        work_name = f"wtacrs/auto{_AUTO_CALLS[-1]}"
        labels = {work_name: "rank 0's wtacrs preset auto measurement"}
        if torch_dist.get_rank() == 0:
            with Work(job_store(), work_name, labels[work_name]) as work:
                name, found, lines = _measure_candidates(*args, progress=work)
                work.finish([name, found, lines])
        else:
            say = print_all if torch_dist.get_rank() == 1 else None
            name, found, lines = wait_for(job_store(), [work_name], labels, stale_s=stale_s, say=say)[work_name]
    chosen = load_section(WtaCrsConfig, candidate_config(cfg, name), "wtacrs")
    return chosen, found, lines


_AUTO_CALLS: list[int] = []


def _measure_candidates(
    cfg,
    budget,
    model_dir,
    batch,
    seq,
    precision,
    device,
    num_labels,
    threads,
    search_batch,
    task,
    full_first,
    progress=None,
):
    base = {
        "model": model_dir,
        "seq": seq,
        "precision": precision,
        "device": device,
        "num_labels": num_labels,
        "threads": threads,
        **task,
    }
    results = []
    # simplest first, as choose() prefers them; the fallback (full_first): full alone if it fits the run's batch
    order = sorted(cfg.auto_candidates, key=AUTO_CANDIDATES.index)
    if progress is not None:
        progress.stage("measuring the candidates", total=len(order), unit="candidates")
    try:
        for name in order:
            if full_first and results and results[0].batch == batch and results[0].peak <= budget:
                break
            spec = {**base, "wtacrs": candidate_config(cfg, name)}
            label = CANDIDATE_LABELS.get(name, f"preset {name}")
            if search_batch:
                results.append(measure(spec, label, budget, probe=batch, max_batch=batch))
            else:
                results.append(measure(spec, label, budget, batch=batch))
            if progress is not None:
                progress.advance()
    finally:  # the training run that follows needs no more children
        stop_forkserver()
    shape = f"up to batch {batch}" if search_batch else f"batch {batch}"
    what = f", {task.get('task', 'classification').replace('_', ' ')}" + (", packed rows" if task.get("packed") else "")
    lines = [
        f"wtacrs: preset auto, memory budget {cfg.memory_budget:g} GiB: measured {shape} × seq {seq}{what}, {precision}"
    ]
    lines += [f"wtacrs: preset auto: {describe(m, budget)}" for m in results]
    if len(results) < len(order):
        lines.append(f"wtacrs: preset auto: not measured (recomputation does not pay here): {', '.join(order[1:])}")
    chosen = choose(results, budget)
    name = order[results.index(chosen)]
    lines.append(f"wtacrs: preset auto chose {recommendation(chosen, results, budget)}")
    return name, chosen.batch, lines


def resolve_preset(
    cfg: WtaCrsConfig,
    model,
    *,
    batch: int,
    seq: int,
    precision: str = "fp32",
    zero_stage: int = 0,
    world: int = 1,
    **auto,
) -> tuple[WtaCrsConfig, int, list[str]]:
    """The setup a run uses, ``(config, micro-batch, log lines)``: the one place where the fine-tuning task and
    ``BertOptTrainer`` resolve ``wtacrs.preset``. First the fallback (:func:`.fallback.preset_decision` on
    ``model``'s figures at ``batch`` × ``seq``): ``exact``/``balanced`` whose estimated saving is below
    ``fallback_min_saving`` become full fine-tuning (the fields given next to them kept), ``auto`` measures ``none``
    first; then ``auto`` as :func:`resolve_auto` (``auto``: its keyword arguments)."""
    shape = model_shape(model, cfg.lora.enabled)
    decision = preset_decision(cfg, shape, batch, seq, precision, zero_stage, world)
    lines = [] if decision is None else [decision[1]]
    falls_back = decision is not None and not decision[0]
    if cfg.preset != "auto":
        if falls_back:
            return load_section(WtaCrsConfig, candidate_config(cfg, "none"), "wtacrs"), batch, lines
        return cfg, batch, lines
    resolved, found, auto_lines = resolve_auto(
        cfg, batch=batch, seq=seq, precision=precision, full_first=falls_back, **auto
    )
    return resolved, found, lines + auto_lines
