"""bench/wtacrs.py's ``frontier`` and ``budget`` sections: the memory–time frontier per precision and batch shape,
and the budget mode's choice checked against re-timed throughput (see bench/wtacrs.py's docstring)."""

from __future__ import annotations

from bench._common import figure, TABLES, cpu_kind, interleaved, maybe_lock, md_row, md_table, median, say, status
from ds_bertopt.wtacrs.memory import MiB, measure_step_in_child, step_fn, variant

LOCK = "/tmp/ds_bertopt_cpu.lock"

# the memory–time frontier: every setup a fine-tuner would pick, on the same batch
FRONTIER_VARIANTS = {
    "full": variant(),
    "HF gradient checkpointing": variant(kit=["checkpoint"]),
    "shipped kit + WTA@0.3": variant(0.3, kit=["exact"]),
    "shipped kit + WTA@0.3 + checkpointing": variant(0.3, kit=["exact", "checkpoint"]),
    "preset exact": variant(preset="exact"),
    "preset balanced": variant(preset="balanced"),
    "preset max_saving": variant(preset="max_saving"),
    "LoRA": variant(lora=True),
    "LoRA + checkpointing": variant(lora=True, kit=["checkpoint"]),
    "LoRA + preset balanced": variant(lora=True, preset="balanced"),
}
# quick mode: without the kit and LoRA under checkpointing
FRONTIER_QUICK = [n for n in FRONTIER_VARIANTS if not n.endswith(" + checkpointing")]
BASELINES = ("full", "HF gradient checkpointing")
MAX_SAVING_TARGET = (3.5, 1.35)  # the max-saving preset: peak reduction, step time vs full
FRONTIER_TIME_LIMIT = 1.10  # the "no step-time cost": at most 1.10× full fine-tuning
PRESET_TIME_LIMITS = {"preset exact": 1.10, "preset balanced": 1.15}  # issue 31, at every cell (bf16 16 × 64 first)
PRESET_FALLBACK_TARGETS = {(16, 64): (None, 1.05), (64, 128): (3.1, 0.80)}
"""Issue 40, presets as a run resolves them (the fallback): (lowest peak saving or None, highest step time vs full)."""
FRONTIER_CELLS = "bf16:16x64,fp32:16x64,bf16:64x128,fp32:64x128"  # precision:batch x seq, the order they run in
QUICK_CELLS = "fp32:64x128"  # bench/wtacrs.py --quick with the default sections
EMULATED_BF16_TOKENS = 1024  # a bf16 cell larger than 16 × 64 on a CPU that emulates bf16 runs ~15x an fp32 step


def locked(fn, *args, **kwargs):
    """Run ``fn`` holding the shared CPU lock (one measurement at a time, others interleave between)."""
    with maybe_lock(LOCK):
        return fn(*args, **kwargs)


def isa(precision: str) -> str:
    """The CPU's instruction set as a target line names it; "(bf16 emulated)" is said only of bf16 cells."""
    kind = cpu_kind().rsplit(", ", 1)[-1]
    return kind if precision != "fp32" else kind.split(" (")[0]


def timed(model_dir, specs: dict, batches: dict, seq: int, repeats: int, model_config=None, precision="fp32"):
    """Each setup's step times at its batch (``step_fn``, built once), interleaved in this process under the lock."""
    setup = {"model": model_dir, "model_config": model_config, "seq": seq, "precision": precision}
    with maybe_lock(LOCK):
        fns = {n: step_fn({**setup, "wtacrs": spec, "batch": batches[n]}) for n, spec in specs.items()}
        return interleaved(fns, repeats=repeats, warmup=1)


def measured(base: dict, specs: dict) -> dict:
    """Each setup's step measured in a fresh child (``measure_step_in_child``), one at a time under the lock."""
    return {name: locked(measure_step_in_child, {**base, "wtacrs": spec}) for name, spec in specs.items()}


def pareto_front(points: dict[str, tuple[float, float]]) -> set[str]:
    """Names whose (memory, time) no other point beats in both (ties count as not beaten)."""
    beaten = {a for a, pa in points.items() for pb in points.values() if pb != pa and pb[0] <= pa[0] and pb[1] <= pa[1]}
    return set(points) - beaten


def frontier_section(
    model_dir, label: str, batch: int, seq: int, threads: int, repeats: int, names, model_config=None, precision="fp32"
) -> None:
    """Step peak (fresh child each) and step time (interleaved, in process) per setup; the Pareto front; how each
    setup sits against HF gradient checkpointing. ``precision``: the weights' dtype (bf16: as DeepSpeed's bf16 mode
    holds them, fp32 master weights and AdamW state)."""
    specs = {name: FRONTIER_VARIANTS[name] for name in names if name != AUTO}
    base = dict(model=model_dir, model_config=model_config, batch=batch, seq=seq, threads=threads, precision=precision)
    peaks = {n: r["step_peak"] for n, r in measured(base, specs).items()}
    resolved = resolved_presets(model_dir, model_config, names, batch, seq, precision, threads, peaks)
    specs.update({name: spec for name, (spec, _) in resolved.items()})
    peaks.update({n: r["step_peak"] for n, r in measured(base, {n: specs[n] for n in resolved}).items()})
    times = timed(model_dir, specs, dict.fromkeys(specs, batch), seq, repeats, model_config, precision)
    points = {n: (peaks[n] / peaks["full"], median(times[n]) / median(times["full"])) for n in specs}
    front, (gc_memory, gc_time) = pareto_front(points), points["HF gradient checkpointing"]
    target, gc = f"[target] {label} {batch}x{seq} {precision} on {isa(precision)}:", f"{1 / gc_memory:.2f}x"
    print(
        f"\n== memory–time frontier, {label}, batch {batch} × seq {seq}, {precision}, {threads} threads "
        f"(peak: fresh child; time: median of {repeats}, interleaved); {cpu_kind()} =="
    )
    rows, series = [], []
    for name, (memory, step) in points.items():
        mark = " *" if name in front else ""
        rows.append(md_row([f"{name}{mark}", f"{peaks[name] / MiB:.0f}", f"{1 / memory:.2f}x", f"{step:.2f}x"]))
        series.append({"label": name, "x": memory, "y": step, "front": name in front})
    table = md_table(["setup", "step peak (MiB)", "saving vs full", "step time vs full"], rows)
    print("\n".join(table))
    ours = {n: p for n, p in points.items() if n not in BASELINES}
    for name, (memory, step) in ours.items():
        say(
            f"{label} {batch}x{seq} {precision}: {name}: peak {1 / memory:.2f}x lower than full (HF gradient "
            f"checkpointing {gc}), step time {step:.2f}x full (checkpointing {gc_time:.2f}x; median of {repeats})"
        )
    dominating = [n for n, (memory, step) in ours.items() if memory <= gc_memory and step <= FRONTIER_TIME_LIMIT]
    say(
        f"{target} a setup saving at least HF gradient checkpointing's memory ({gc}) at <= {FRONTIER_TIME_LIMIT:.2f}x "
        f"full step time: {'met by ' + ', '.join(dominating) if dominating else 'NOT met'}"
    )
    for name, limit in PRESET_TIME_LIMITS.items():
        if name in points:
            (memory, step), also = points[name], name == "preset exact"  # exact must also save what checkpointing saves
            say(
                f"{target} {name} <= {limit:.2f}x full step time{' saving at least checkpointing' if also else ''}: "
                f"{status(step <= limit and (not also or memory <= gc_memory))} "
                f"({step:.2f}x, peak {1 / memory:.2f}x lower vs checkpointing's {gc} at {gc_time:.2f}x)"
            )
    fallback_targets(target, resolved, points, (batch, seq), repeats)
    if "preset max_saving" in points:
        (memory, step), (lowest, limit) = points["preset max_saving"], MAX_SAVING_TARGET
        say(
            f"{target} preset max_saving >= {lowest}x lower peak than full at <= {limit}x step time: "
            f"{status(1 / memory >= lowest and step <= limit)} ({1 / memory:.2f}x at {step:.2f}x)"
        )
    file = f"frontier_{label.split()[0].lower()}_{batch}x{seq}_{precision}"
    title = f"Fine-tuning memory vs step time, {label}, batch {batch} x seq {seq}, {precision}"
    axes = {"xlabel": "whole-step peak / full fine-tuning", "ylabel": "step time / full fine-tuning"}
    note = "one point per setup; ringed: the Pareto front; dashed: 1.10x full step time"
    figure("scatter", file, title, series, **axes, note=note, reference=FRONTIER_TIME_LIMIT)
    heading = f"**{label}, batch {batch} × seq {seq}** ({precision}; * = on the Pareto front)"
    TABLES.append("\n".join([heading, "", *table]))


AUTO = "preset auto"  # measured only as a run resolves it, under a budget set from full's peak in the cell


def meta_model(model_dir, model_config):
    """The encoder on the meta device (no weights read): what the run's fallback estimate reads."""
    import torch
    from transformers import AutoConfig, AutoModel

    if model_config is None:
        config = AutoConfig.from_pretrained(model_dir)
    else:
        kwargs = dict(model_config)
        config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    with torch.device("meta"):
        return AutoModel.from_config(config)


def resolved_presets(model_dir, model_config, names, batch: int, seq: int, precision: str, threads: int, peaks) -> dict:
    """``{"preset exact, as run": (its wtacrs spec, the candidate chosen)}`` for each preset among ``names`` that a
    run may resolve to another setup: the setup a run of this cell uses, decided by the run's own code
    (``ds_bertopt.wtacrs.sizing.resolve_preset``: the fallback, and ``auto``'s measurement; ``peaks``: the cell's
    measured step peaks, full's at least)."""
    from ds_bertopt.configlib import load_section
    from ds_bertopt.wtacrs.config import WtaCrsConfig
    from ds_bertopt.wtacrs.fallback import FALLBACK_PRESETS
    from ds_bertopt.wtacrs.sizing import GiB, candidate_config, resolve_preset

    model, out = meta_model(model_dir, model_config), {}
    # auto's budget: full's peak over the saving the cell's target keeps (so only a setup keeping it fits), or a
    # quarter above full's peak where the target asks no saving (full fits)
    lowest = PRESET_FALLBACK_TARGETS.get((batch, seq), (None, None))[0]
    auto_budget = peaks["full"] / lowest if lowest else peaks["full"] * 1.25
    for name in names:
        if name == AUTO:
            spec = {"preset": "auto", "memory_budget": auto_budget / GiB}
            print(f"{AUTO}: memory_budget {spec['memory_budget']:.2f} GiB (full's peak {peaks['full'] / GiB:.2f} GiB)")
        else:
            spec = FRONTIER_VARIANTS[name]
        if spec.get("preset") not in FALLBACK_PRESETS or spec.get("lora"):
            continue
        cfg = load_section(WtaCrsConfig, spec, "wtacrs")
        auto = {"model_dir": model_dir, "threads": threads} if name == AUTO else {}
        resolved, _, lines = locked(resolve_preset, cfg, model, batch=batch, seq=seq, precision=precision, **auto)
        print("\n".join(lines))
        chosen = resolved.preset or ("checkpointing" if resolved.kit.checkpoint_every else "none")
        out[f"{name}, as run"] = (spec if chosen == cfg.preset else candidate_config(cfg, chosen), chosen)
    return out


def fallback_targets(target: str, resolved: dict, points: dict, shape: tuple[int, int], repeats: int) -> None:
    """Issue 40's lines for the presets as a run resolves them: never slower than full where they cannot save
    (16 × 64), the savings kept where they matter (64 × 128)."""
    if shape not in PRESET_FALLBACK_TARGETS or not resolved:
        return
    lowest, limit = PRESET_FALLBACK_TARGETS[shape]
    ok = all(points[n][1] <= limit and (lowest is None or 1 / points[n][0] >= lowest) for n in resolved)
    shown = "; ".join(
        f"{name.split(', ')[0]} ran {'full' if chosen == 'none' else chosen}: peak {1 / points[name][0]:.2f}x lower, "
        f"{points[name][1]:.2f}x step time"
        for name, (_, chosen) in resolved.items()
    )
    unmeasured = "" if f"{AUTO}, as run" in resolved else "; preset auto not measured here"
    saving = f">= {lowest}x lower peak at " if lowest else ""
    say(
        f"{target} presets as a run resolves them (fallback_min_saving), {saving}<= {limit:.2f}x full step time: "
        f"{status(ok)} ({shown}; median of {repeats}{unmeasured})"
    )


def budget_section(model_dir: str, seq: int, threads: int, budget_gb: float, max_batch: int, repeats: int) -> None:
    """``ds-bertopt memory --compare``'s own code (``sizing.measure``, ``sizing.choose``), then every setup that fits
    re-timed at its batch, interleaved in one process: the same rule on the re-timed rates must choose it again."""
    from ds_bertopt.cli.memory import COMPARED
    from ds_bertopt.wtacrs.sizing import TIE_MARGIN, GiB, Measured, choose, describe, measure

    budget, base = budget_gb * GiB, {"model": model_dir, "seq": seq, "threads": threads}
    print(f"\n== budget mode: {budget_gb} GiB, seq {seq}, fp32, micro-batch <= {max_batch}; {cpu_kind()} ==")
    found = []
    for name, spec in COMPARED.items():
        found.append(locked(measure, {**base, "wtacrs": spec}, name, budget, max_batch=max_batch))
        print(f"  {describe(found[-1], budget)}", flush=True)
    chosen, fitting = choose(found, budget), {m.setup: m for m in found if m.batch > 0 and m.peak <= budget}
    times = timed(model_dir, {n: COMPARED[n] for n in fitting}, {n: m.batch for n, m in fitting.items()}, seq, repeats)
    rate = {n: m.batch / median(times[n]) for n, m in fitting.items()}
    for n, m in fitting.items():
        print(f"  re-timed {n}: batch {m.batch}, {rate[n]:.1f} sequences/s (median of {repeats})")
    best, ratio = max(rate, key=rate.get), rate[chosen.setup] / max(rate.values())
    again = choose([Measured(n, m.batch, m.peak, m.batch / rate[n]) for n, m in fitting.items()], budget)
    say(
        f"[target] budget mode {budget_gb} GiB, seq {seq}, fp32 on {isa('fp32')}: chose "
        f"{chosen.setup} (batch {chosen.batch}, measured peak {chosen.peak / GiB:.2f} GiB fits), re-timed "
        f"{rate[chosen.setup]:.1f} sequences/s = {ratio:.2f}x the fastest that fits ({best}, {rate[best]:.1f}); "
        f"the rule (simplest within {TIE_MARGIN:.0%} of the fastest) on the re-timed rates chooses {again.setup}; "
        f"target: the same choice: {status(again.setup == chosen.setup and chosen.peak <= budget)}"
    )


def minilm_cells(model_dir: str, args, cells: str) -> None:
    """The MiniLM-L6 frontier at each ``precision:BATCHxSEQ`` of ``cells`` (``args``: bench/wtacrs.py's). On a CPU
    without native bf16 the bf16 cells measure emulation: they run without LoRA, with ``--frontier-bf16-repeats``
    timed rounds (default 2), and a cell of more than ``--frontier-bf16-tokens`` is skipped with a line saying so."""
    emulated, repeats = "bf16 emulated" in cpu_kind(), args.frontier_repeats or (3 if args.quick else 5)
    setups, tokens = args.frontier_setups.split(",") if args.frontier_setups else None, args.frontier_bf16_tokens
    for cell in cells.split(","):
        precision, shape = cell.split(":")
        batch, seq = (int(v) for v in shape.split("x"))
        low = precision != "fp32"
        if low and emulated and batch * seq > tokens:
            say(
                f"[target] MiniLM-L6 {batch}x{seq} {precision} on {isa(precision)}: not measured "
                f"(emulated bf16: a step here is ~15x fp32's; cells above {tokens} tokens need "
                "--frontier-bf16-tokens, or a CPU/GPU with native bf16)"
            )
            continue
        names = setups or (FRONTIER_QUICK[:6] if low else FRONTIER_QUICK if args.quick else list(FRONTIER_VARIANTS))
        rounds = (args.frontier_bf16_repeats or (2 if emulated else repeats)) if low else repeats
        frontier_section(model_dir, "MiniLM-L6", batch, seq, args.threads, rounds, list(names), precision=precision)
