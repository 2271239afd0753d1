"""Section ``resume``: a reference run vs a run killed mid-way and resumed, bit-exact."""

import json
import math
import os
import sys

from .runner import Ctx, Job, Result, judged, losses_by_step, pretrain_job, run_jobs

DETERMINISTIC_CUBLAS = ":4096:8"  # what torch's deterministic mode demands of cuBLAS (CUBLAS_WORKSPACE_CONFIG)


def cublas_probe_job(ctx: Ctx) -> Job:
    code = "import torch; torch.use_deterministic_algorithms(True); a = torch.randn(64, 64, device='cuda'); "
    env = {k: v for k, v in ctx.env().items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    cmd = [sys.executable, "-c", code + "print('GEMM ok', float((a @ a).sum()))"]
    return Job("deterministic GEMM without CUBLAS_WORKSPACE_CONFIG", cmd, env, ctx.dir("cublas_probe.log"), 60)


def samples_by_step(out, rank: int) -> dict:
    path = out / "samples" / f"rank{rank}.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    return {row["step"]: row["indices"] for row in rows}


def resume_check(ctx: Ctx, label: str, world: int, kill_rank: int, steps: int, kill_step: int) -> tuple:
    """Reference vs killed + resumed: (problems, figures). Both runs deterministic, checkpoints every 2 steps."""
    from safetensors.torch import load_file

    common = ["train.deterministic=true", "train.log_samples=true"]
    flags = ["--save_every", "2", "--log_every", "1"]
    env = ctx.env(CUBLAS_WORKSPACE_CONFIG=os.environ.get("CUBLAS_WORKSPACE_CONFIG", DETERMINISTIC_CUBLAS))
    ref_dir, cut_dir = ctx.dir(f"{label}_reference"), ctx.dir(f"{label}_interrupted")
    # the killed run goes through the deepspeed launcher (a rank dying under it); on one rank the others start
    # without it (its runner and launch processes each import deepspeed again: seconds of start-up per run)
    multi = world > 1

    def run(name: str, out, flag: str, launched: bool, **extra) -> Job:
        ranks = world if launched else 0
        return pretrain_job(ctx, name, out, steps, common, flags=[*flags, flag], ranks=ranks, env={**env, **extra})

    ref = run("reference", ref_dir, "--overwrite_output_dir", multi)
    fault = f"kill@forward:rank={kill_rank}:step={kill_step}"
    cut = run("killed", cut_dir, "--overwrite_output_dir", multi or ctx.cuda, DS_BERTOPT_FAULT=fault)
    extra = [cublas_probe_job(ctx)] if ctx.cuda and world == 1 else []
    run_jobs(ctx, [ref, cut, *extra], parallel=3)
    for job in (job for job in extra if job.started):  # does torch demand CUBLAS_WORKSPACE_CONFIG here?
        fails = (
            f"fails ({job.tail(2)}); these runs set CUBLAS_WORKSPACE_CONFIG={DETERMINISTIC_CUBLAS}, the loop does not"
        )
        note, verdict = ("", "runs (torch does not demand it here)") if job.ok else ("NOTE ", fails)
        ctx.detail(f"{note}train.deterministic=true without CUBLAS_WORKSPACE_CONFIG: a CUDA GEMM {verdict}")
    if not ref.ok:
        return [f"reference run {ref.status()}: {ref.tail()}"], ""
    expected_tag = f"step{(kill_step - 1) // 2 * 2:08d}"
    latest = cut_dir / "checkpoints" / "latest"
    latest_tag = latest.read_text().strip() if latest.exists() else None
    ctx.detail(
        f"{label}: reference {ref.status()}; killed run {cut.status()} (fault kill@forward rank {kill_rank} "
        f"step {kill_step}), latest checkpoint {latest_tag}"
    )
    if not cut.started or cut.timed_out or cut.rc == 0:
        return [f"the killed run did not die as injected ({cut.status()})"], ""
    if latest_tag != expected_tag:
        return [f"latest checkpoint after the kill is {latest_tag}, expected {expected_tag}"], ""
    resume = run("resumed", cut_dir, "--resume", multi)
    resume.log = cut_dir.parent / f"{cut_dir.name}_resume.log"
    run_jobs(ctx, [resume])
    if not resume.ok:
        return [f"resumed run {resume.status()}: {resume.tail()}"], ""
    resumed_from = resume.line("resumed from")
    ctx.detail(f"{label}: resumed run {resume.status()}: {resumed_from}")
    a, b = load_file(ref_dir / "final" / "model.safetensors"), load_file(cut_dir / "final" / "model.safetensors")
    problems = [] if a.keys() == b.keys() else [f"final weights have different keys ({sorted(set(a) ^ set(b))[:4]})"]
    differing = {k: float((a[k].double() - b[k].double()).abs().max()) for k in a if k in b and not a[k].equal(b[k])}
    ref_loss, cut_loss = losses_by_step(ref_dir), losses_by_step(cut_dir)
    loss_diff = [abs(ref_loss[s] - cut_loss.get(s, math.inf)) for s in sorted(ref_loss)]
    samples = [(samples_by_step(ref_dir, rank), samples_by_step(cut_dir, rank)) for rank in range(world)]
    samples_equal = all(ref_samples == cut_samples and bool(ref_samples) for ref_samples, cut_samples in samples)
    if differing:
        worst = max(differing, key=differing.get)
        problems.append(
            f"final weights differ in {len(differing)}/{len(a)} tensors (max |diff| {differing[worst]:.3g} in {worst})"
        )
    worst_loss = max(loss_diff, default=math.nan)
    if not loss_diff or sorted(cut_loss) != sorted(ref_loss) or worst_loss != 0:
        problems.append(
            f"per-step losses differ (max |diff| {worst_loss:.3g}; steps {sorted(ref_loss)} vs {sorted(cut_loss)})"
        )
    if not samples_equal:
        problems.append("the samples of some steps differ (samples/rank*.jsonl)")
    figures = (
        f"{'bit-exact' if not problems else 'NOT bit-exact'}: {len(a)} weight tensors "
        f"{'equal' if not differing else f'({len(differing)} differ)'}, {len(ref_loss)} step losses "
        f"{'equal' if worst_loss == 0 else f'max |diff| {worst_loss:.3g}'}, samples "
        f"{'equal' if samples_equal else 'differ'} ({world} rank{'s' if world > 1 else ''}, {resumed_from})"
    )
    return problems, figures


def section_resume(ctx: Ctx) -> Result:
    steps, kill_step = (8, 6) if ctx.tiny else (10, 6)
    problems, figures = resume_check(ctx, "x1", 1, 0, steps, kill_step)
    return judged(problems, figures) if figures else Result("FAIL", "; ".join(problems))
