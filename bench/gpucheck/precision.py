"""Section ``precision``: bf16/fp16 pretraining with the bucket-clip hook at ZeRO 0/1/2 and LAMB at ZeRO 0/2."""

import math
import statistics

from bench._common import read_metrics

from .runner import Ctx, Result, losses_by_step, pretrain_job, run_jobs


def judge_losses(out, steps: int) -> tuple:
    """(problem or None, first-k mean, last-k mean, skipped steps) of a run's metrics."""
    losses = losses_by_step(out)
    skipped = sum(1 for r in read_metrics(out) if r.get("skipped") is True)
    if not losses:
        return "no loss in metrics.jsonl", math.nan, math.nan, skipped
    values = [losses[s] for s in sorted(losses)]
    if not all(math.isfinite(v) for v in values):
        bad = [s for s in sorted(losses) if not math.isfinite(losses[s])][:5]
        return f"non-finite loss at step(s) {bad}", math.nan, math.nan, skipped
    k = max(2, len(values) // 5)
    first, last = statistics.mean(values[:k]), statistics.mean(values[-k:])
    if len(values) < steps - skipped:
        return f"only {len(values)} of {steps} steps logged", first, last, skipped
    if not last < first:
        return f"loss does not fall ({first:.3f} -> {last:.3f})", first, last, skipped
    return None, first, last, skipped


def section_precision(ctx: Ctx) -> Result:
    steps = 8 if ctx.tiny else 25
    kinds = [("adamw+bucket_clip", stage, "bucket_clip.enabled=true") for stage in (0, 1, 2)]
    kinds += [("lamb", stage, 'optimizer.type="lamb"') for stage in (0, 2)]
    if ctx.tiny and not ctx.cuda:  # the smoke run: one of each kind
        kinds = [k for k in kinds if k[:2] in (("adamw+bucket_clip", 2), ("lamb", 0))]
    jobs, skipped_fp16 = [], 0 if ctx.cuda else len(kinds)
    for precision in ("bf16", "fp16") if ctx.cuda else ("bf16",):
        for kind, stage, extra in kinds:
            name = f"{precision} {kind} z{stage}"
            out = ctx.dir(name.replace(" ", "_").replace("+", "_"))
            overrides = [f'train.precision="{precision}"', f"deepspeed.zero_optimization.stage={stage}"]
            overrides += ["train.save_model=false", extra]
            flags = ["--log_every", "1", "--overwrite_output_dir"]
            jobs.append(pretrain_job(ctx, name, out, steps, overrides, flags=flags, timeout=240))
    run_jobs(ctx, jobs, parallel=ctx.jobs)
    failed, rows = [], []
    for job in jobs:
        if not job.started:
            ctx.detail(f"{job.name}: not run (time budget spent)")
            continue
        wrapper = job.line("non-finite gradients skip the step")
        optimizer = job.line("AdamW:") or job.line("LAMB (ds_bertopt)") or job.line("LAMB:")
        problem, first, last, skipped = judge_losses(job.out, steps) if job.ok else (None, math.nan, math.nan, 0)
        problem = problem if job.ok else f"{job.status()}: {job.tail()}"
        ctx.detail(
            f"{job.name}: {job.status()}; loss (mean of first/last {max(2, steps // 5)} steps) "
            f"{first:.3f} -> {last:.3f}; {skipped} steps skipped (non-finite/overflow)"
            + (f"; PROBLEM: {problem}" if problem else "")
        )
        said = [optimizer, (wrapper or "").replace("non-finite gradients skip the step ", "guard ") or None]
        if any(said):
            ctx.detail("    " + "; ".join(x for x in said if x))
        if problem:
            failed.append(job.name)
        else:
            rows.append(f"{job.name.replace('adamw+bucket_clip', 'clip')} {first:.2f}->{last:.2f}")
    not_run = sum(not j.started for j in jobs)
    figures = (
        f"{len(rows)}/{len(jobs)} runs exit 0 with finite, falling loss ({steps} steps)"
        + (f"; FAILED: {', '.join(failed)}" if failed else "")
        + (f"; {not_run} not run (time)" if not_run else "")
        + (f"; fp16: SKIPPED(no CUDA) x{skipped_fp16}" if skipped_fp16 else "")
    )
    if failed:
        return Result("FAIL", figures)
    if not rows:
        return Result("SKIPPED(time budget spent)", figures)
    return Result("PASS", figures + " [" + ", ".join(rows) + "]")
