"""Large-batch optimizer study, LAMB vs AdamW, on real text; the gradient noise scale behind it; LAMB's step time.

Method of the convergence study and of the gradient noise scale (McCandlish et al. 2018, App. A): docs/time_to_train.md
("Large batches"). Step time: ``optimizer.step()`` of our LAMB (the fused CPU kernel; with clipping; the foreach path
it replaced) vs torch's fused AdamW (target ≤ 1.5×) and vs ``torch_optimizer.Lamb`` when importable (a separate bench
environment only: docs/optim.md), on a 4 × 256 BERT's parameters, 1 thread, interleaved, median of 7
(``--skip-convergence`` runs only this part).

    python bench/optim.py [--quick]                  # full: batch 32 vs 1,024, 2 seeds, compact grid (~1.5 h)
    python bench/optim.py --grid full --write-presets  # 8-point grid per optimizer; rewrite the presets
    python bench/optim.py --factor 8                 # the earlier 32 vs 256 study

``--quick`` (about 4 min on 2 cores): batch 32 vs 256, one seed, no grid (the LRs sqrt-scaled, MLPerf-style schedule),
a tenth of the sample budget and a target at the unigram plateau (a smoke run of the study, not a result), and the
step-time part. ``--write-presets`` writes ``ds_configs/bert_large_batch_{adamw,lamb}.json`` from the chosen grid
points (see docs/time_to_train.md).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import argv, cpu_env, deepspeed_launcher, environment_line, figure, median, ratio_line, record, say
from bench.optim_parts import (
    CONFIGS,
    DATA,
    REFERENCE_BATCH,
    SHIPPED_LR,
    SMALL_MODEL,
    Point,
    Result,
    grid,
    noise_study,
    step_time_study,
    write_preset,
)

CURVES: list[dict] = []
TABLE: list[str] = []


def pretrain(point: Point, args, out: Path, save_every: int = 0) -> Result:
    """One ``launch/pretrain.py`` run of ``point``; a run stopped by non-finite gradients is a diverged result."""
    steps = max(1, args.samples // point.batch)
    eval_every = max(1, args.eval_samples // point.batch)
    overrides = [
        *SMALL_MODEL,
        *point.overrides(args.micro, 2),
        "train.save_model=false",
        f"train.save_every={save_every}",
        "train.keep_last=1000",
        "deepspeed.csv_monitor.enabled=false",
    ]
    cmd = argv(
        *args.run_prefix.split(),
        *deepspeed_launcher(2),
        ROOT / "launch" / "pretrain.py",
        deepspeed_config=ROOT / "ds_configs" / CONFIGS[point.optimizer],
        train_file=DATA,
        max_steps=steps,
        eval_every=eval_every,
        log_every=eval_every,
        max_seq_length=args.seq,
        output_dir=out,
        overwrite_output_dir=True,
        seed=point.seed,
        overrides=overrides,
    )
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=cpu_env(), capture_output=True, text=True, check=False)
    diverged = proc.returncode != 0 and "non-finite gradients" in proc.stdout + proc.stderr
    if proc.returncode != 0 and not diverged:
        raise RuntimeError(f"pretrain {point.label} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    for line in proc.stdout.splitlines():
        if "peak lr" in line:
            print(f"  {point.label}: {line.split('] ', 1)[-1]}", flush=True)
    metrics = out / "metrics.jsonl"
    records = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.exists() else []
    return Result(point, records, diverged, (time.perf_counter() - started) / 60)


def describe(result: Result, target: float) -> str:
    samples = result.samples_to(target)
    reached = (
        f"accuracy {target} at {samples:,.0f} samples"
        if not math.isinf(samples)
        else f"did not reach {target}" + (" (diverged: non-finite gradients)" if result.diverged else "")
    )
    return (
        f"{result.point.label}, seed {result.point.seed}: {reached}; best {result.best:.4f} ({result.minutes:.1f} min)"
    )


def run_point(point: Point, args, tmp: Path, save_every: int = 0) -> Result:
    out = tmp / f"run{len(CURVES):03d}"
    result = pretrain(point, args, out, save_every)
    CURVES.append(
        {
            "label": f"{point.label}, seed {point.seed}",
            "x": [r["step"] * point.batch for r in result.evals],
            "y": [r["eval_accuracy"] for r in result.evals],
        }
    )
    samples = result.samples_to(args.target)
    TABLE.append(
        f"| {point.optimizer} | {point.batch} | {point.lr:g} | {point.scaling} | {point.warmup_fraction:g} | "
        f"{point.beta2:g} | {point.seed} | {'not reached' if math.isinf(samples) else f'{samples:,.0f}'}"
        f"{' (diverged)' if result.diverged else ''} | {result.best:.4f} |"
    )
    print(describe(result, args.target), flush=True)
    return result


def pick_best(results: list[Result], target: float) -> Result:
    """Fewest samples to the target; among those that never reach it, the best accuracy."""
    return min(results, key=lambda r: (r.samples_to(target), -r.best))


def convergence_study(args, tmp: Path) -> dict:
    if not DATA.exists():
        print(f"convergence study skipped: {DATA} is absent")
        return {}
    small, large = args.micro * 2, args.micro * 2 * args.factor
    seeds, target = args.seeds, args.target
    print(
        f"convergence: small BERT (128 hidden, 2 layers), seq {args.seq}, 2 ranks ZeRO 1, {args.samples} samples per "
        f"run, target held-out MLM accuracy {target}; batches {small} and {large} (×{args.factor} accumulation); "
        f"MLPerf-style schedule (warmup, linear decay from step 0), LR scaled from batch {REFERENCE_BATCH}; seeds "
        f"{seeds}; large-batch grid {args.grid}",
        flush=True,
    )
    small_runs: dict[str, list[Result]] = {"adamw": [], "lamb": []}
    checkpoints = None
    for i, seed in enumerate(seeds):
        for optimizer in ("adamw", "lamb") if i % 2 == 0 else ("lamb", "adamw"):
            point = Point(optimizer, small, SHIPPED_LR[optimizer], seed=seed)
            keep = args.noise_micro_batches and optimizer == "adamw" and seed == seeds[0]
            steps = args.samples // small
            small_runs[optimizer].append(run_point(point, args, tmp, save_every=max(1, steps // 4) if keep else 0))
            if keep:
                checkpoints = tmp / f"run{len(CURVES) - 1:03d}" / "checkpoints"
    candidates = {
        opt: (grid(opt, large, args.grid) if args.grid != "none" else [Point(opt, large, SHIPPED_LR[opt])])
        for opt in ("adamw", "lamb")
    }
    tuned: dict[str, list[Result]] = {}
    for optimizer, points in candidates.items():
        first = [run_point(replace(p, seed=seeds[0]), args, tmp) for p in points]
        best = pick_best(first, target)
        if len(first) > 1:
            say(f"{optimizer} batch {large}: best of {len(first)} grid points on seed {seeds[0]}: {best.point.label}")
        tuned[optimizer] = [best] + [run_point(replace(best.point, seed=s), args, tmp) for s in seeds[1:]]
    for optimizer in ("adamw", "lamb"):
        say(
            f"{optimizer} batch {small}: samples to {target}: "
            + " / ".join(_samples_text(r, target) for r in small_runs[optimizer])
            + f" (seeds {seeds})"
        )
        say(
            f"{optimizer} batch {large} ({tuned[optimizer][0].point.label}): samples to {target}: "
            + " / ".join(_samples_text(r, target) for r in tuned[optimizer])
            + f" (seeds {seeds})"
        )
    ratios = {}
    for optimizer in ("adamw", "lamb"):
        big = [r.samples_to(target) for r in tuned[optimizer]]
        ref = [r.samples_to(target) for r in small_runs[optimizer]]
        if any(math.isinf(v) for v in big + ref):
            say(
                f"{optimizer} samples to accuracy {target} at batch {large} vs batch {small}: n/a (not reached in "
                "every run)"
            )
            ratios[optimizer] = math.inf
            continue
        paired = [b / s for b, s in zip(big, ref)]  # paired by seed (ours evaluates with seed-dependent masks)
        ratios[optimizer] = median(paired)
        say(
            f"{optimizer} samples to accuracy {target} at batch {large} vs batch {small}: {median(paired):.2f}x "
            f"(median of {len(paired)} seed-paired ratios: {', '.join(f'{v:.2f}' for v in paired)})"
        )
    for batch, runs in ((small, small_runs), (large, tuned)):
        lamb, adam = [r.samples_to(target) for r in runs["lamb"]], [r.samples_to(target) for r in runs["adamw"]]
        if not any(math.isinf(v) for v in lamb + adam):
            say(ratio_line(f"samples to accuracy {target} at batch {batch}: lamb", lamb, adam, "adamw"))
    best_large = min(("adamw", "lamb"), key=lambda o: median([r.samples_to(target) for r in tuned[o]]))
    best_small = min(median([r.samples_to(target) for r in small_runs[o]]) for o in ("adamw", "lamb"))
    value = median([r.samples_to(target) for r in tuned[best_large]])
    own = ratios[best_large]
    against_best = value / best_small
    ok = own <= 1.3 and against_best <= 1.3
    say(
        f"[target] at batch ~{large} the best optimizer ({best_large}) needs ≤ 1.3× the samples of batch {small}: "
        f"{'met' if ok else 'NOT met'} ({'not reached' if math.isinf(own) else f'{own:.2f}x'} of its own batch-{small} "
        f"run, {'not reached' if math.isinf(against_best) else f'{against_best:.2f}x'} of the best batch-{small} run)"
    )
    noise = noise_study(checkpoints, small_runs["adamw"][0], args, small, large) if checkpoints else None
    if args.write_presets and (args.grid == "none" or large != 1024):
        say(
            f"presets not written: they are for batch 1,024 chosen by a grid "
            f"(this run: batch {large}, grid {args.grid})"
        )
    elif args.write_presets:
        for optimizer in ("adamw", "lamb"):
            path = write_preset(tuned[optimizer][0].point, args)
            say(f"preset written: {path.relative_to(ROOT)} ({tuned[optimizer][0].point.label})")
    return {
        "ratios": ratios,
        "best_large": best_large,
        "noise": noise,
        "chosen": {o: vars(tuned[o][0].point) for o in tuned},
    }


def _samples_text(result: Result, target: float) -> str:
    samples = result.samples_to(target)
    return "not reached" if math.isinf(samples) else f"{samples:,.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="about 4 minutes: batch 32 vs 256, one seed, no grid")
    parser.add_argument("--micro", type=int, default=16, help="sequences per rank per micro-batch")
    parser.add_argument("--factor", type=int, help="large batch = factor × 32 (gradient accumulation); full 32")
    parser.add_argument("--samples", type=int, help="training samples per run")
    parser.add_argument("--eval-samples", type=int, help="evaluate every this many samples (at least every step)")
    parser.add_argument("--target", type=float, help="held-out MLM accuracy to reach")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--seeds", nargs="+", type=int, help="full: 1 2; quick: 1")
    parser.add_argument(
        "--grid",
        choices=["none", "compact", "full"],
        help="large-batch tuning grid per optimizer: none (sqrt-scaled shipped LR), compact (4 "
        "points: sqrt/linear × (warmup 0.1, β₂ 0.999)/(0.3, 0.95)), full (8 points)",
    )
    parser.add_argument(
        "--noise-micro-batches", type=int, help="micro-batches per gradient-noise-scale estimate (0: skip); full 32"
    )
    parser.add_argument(
        "--write-presets",
        action="store_true",
        help="write ds_configs/bert_large_batch_{adamw,lamb}.json from the chosen grid points",
    )
    parser.add_argument("--skip-convergence", action="store_true")
    parser.add_argument("--skip-step-time", action="store_true")
    parser.add_argument("--record-as", default="optim", help="name of the recorded results (report section)")
    parser.add_argument(
        "--run-prefix",
        default="",
        help="command prefix for each training run, e.g. a lock: 'flock /tmp/ds_bertopt_cpu.lock'",
    )
    args = parser.parse_args()
    defaults = QUICK if args.quick else FULL
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    print(environment_line(), flush=True)
    study = {}
    if not args.skip_convergence:
        with tempfile.TemporaryDirectory(prefix="bench_optim_") as tmp:
            study = convergence_study(args, Path(tmp))
    if not args.skip_step_time:
        step_time_study(repeats=25)
    if CURVES:
        title = f"LAMB vs AdamW at batch 32 and {32 * args.factor}"
        labels = {"xlabel": "training samples", "ylabel": "held-out MLM accuracy"}
        figure("curves", "convergence", title, CURVES, reference=args.target, **labels)
    if study.get("noise"):
        rows = study["noise"]["rows"]
        figure(
            "curves",
            "noise_scale",
            "Gradient noise scale; dashed: what a 1.3x samples ratio at the large batch needs",
            [{"label": "B_simple", "x": [r["samples"] for r in rows], "y": [r["b_simple"] for r in rows]}],
            xlabel="training samples (batch 32, AdamW)",
            ylabel="B_simple (sequences)",
            reference=study["noise"]["needed"],
        )
    header = (
        "| optimizer | batch | lr @ 32 | scaling | warmup | β₂ | seed | samples to target | best accuracy |\n"
        "|---|---|---|---|---|---|---|---|---|"
    )
    record(
        args.record_as,
        f"2 ranks ZeRO 1, small BERT, seq {args.seq}, seeds {args.seeds}, {args.samples} samples per run, "
        f"target {args.target}, MLPerf-style schedule, LR scaled from batch {REFERENCE_BATCH}, grid {args.grid}",
        tables=[header + "\n" + "\n".join(TABLE)] if TABLE else [],
        study=study,
    )


# Full: batch 32 vs 1,024; 24 optimizer steps at 1,024 (768 at 32). LRs at batch 32: the shipped configs'.
FULL = {
    "samples": 24576,
    "eval_samples": 512,
    "target": 0.07,
    "factor": 32,
    "seeds": [1, 2],
    "grid": "compact",
    "noise_micro_batches": 32,
}
QUICK = {
    "samples": 2400,
    "eval_samples": 300,
    "target": 0.05,
    "factor": 8,
    "seeds": [1],
    "grid": "none",
    "noise_micro_batches": 0,
}

if __name__ == "__main__":
    main()
