"""Section ``nccl`` (>= 2 GPUs): 2-rank start-up, resume, ZeRO-2 LAMB and bucket-clip timing."""

import json
import statistics

from .lamb_equal import run_lamb_checks
from .resume import resume_check
from .runner import Ctx, Result, Skip, judged, pretrain_args, run_jobs, worker_job


def startup_check(ctx: Ctx, problems: list, figures: list) -> None:
    """A 2-rank pretraining start-up through the launcher at ZeRO 2 with the bucket clip: each rank on its device."""
    probe, out = ctx.dir("probe"), ctx.dir("startup")
    overrides = ("deepspeed.zero_optimization.stage=2", "bucket_clip.enabled=true", "train.save_model=false")
    argv = [*pretrain_args(ctx, 4, *overrides), "--log_every", "1", "--overwrite_output_dir", "--output_dir", out]
    env = dict(GPU_CHECK_TASK="pretrain", GPU_CHECK_PROBE=str(probe))
    job = worker_job(ctx, "2-rank start-up", "loop", argv, out.parent / "startup.log", ranks=2, **env)
    run_jobs(ctx, [job])
    facts = [json.loads(p.read_text()) for p in sorted(probe.glob("rank*.json"))]
    for f in facts:
        ctx.detail(
            f"start-up rank {f['rank']}: local rank {f['local_rank']}, engine on {f['engine_device']}, "
            f"current device {f.get('current_device')}, {f.get('name', '')} {f.get('pci_bus_id', '')} "
            f"{f.get('uuid', '')[:13]}"
        )
    distinct = len({f.get("uuid") or f.get("current_device") for f in facts}) == 2
    own_devices = distinct and all(f.get("current_device") == f["local_rank"] for f in facts)
    if not job.ok or len(facts) != 2:
        problems.append(f"2-rank start-up: {job.status()}, {len(facts)} probes: {job.tail(3)}")
    elif ctx.cuda and not own_devices:
        problems.append("2-rank start-up: the ranks do not each use their own device")
    else:
        figures.append(f"start-up ok ({job.seconds:.0f} s)")


def clip_timing(ctx: Ctx, problems: list, figures: list) -> None:
    """The bucket-clip hook vs DeepSpeed's ``gradient_clipping`` on 2 ranks, interleaved (reported, not judged)."""
    result = ctx.dir("clip_timing.json")
    result.unlink(missing_ok=True)
    args = ["--out", result, "--rounds", "3", *(["--tiny"] if ctx.tiny else [])]
    job = worker_job(ctx, "clip timing", "clip", args, ctx.dir("clip_timing.log"), ranks=2, timeout=240)
    run_jobs(ctx, [job])
    if not (job.ok and result.exists()):
        problems.append(f"clip timing: {job.status()}: {job.tail(3)}")
        return
    data = json.loads(result.read_text())
    ours, theirs = (statistics.median(data["times"][k]) for k in ("bucket_clip", "deepspeed_clip"))
    ctx.detail(
        f"bucket-clip hook vs DeepSpeed gradient_clipping, {data['world']} ranks {'NCCL' if ctx.cuda else 'gloo'}, "
        f"{data['precision']}, ZeRO {data['stage']}, micro {data['micro']} x {data['seq']}: median step "
        f"{ours * 1e3:.1f} vs {theirs * 1e3:.1f} ms (rounds {data['times']})"
    )
    figures.append(f"clip hook step time {ours / theirs:.2f}x DeepSpeed's")


def section_nccl(ctx: Ctx) -> Result:
    if ctx.gpus < 2:
        raise Skip(f"{ctx.gpus} GPU{'s' if ctx.gpus != 1 else ''}: needs 2" if ctx.cuda else "no CUDA")
    problems, figures = [], []
    startup_check(ctx, problems, figures)
    if ctx.left() > 90:
        resume_problems, resume_figures = resume_check(ctx, "x2", 2, 1, 8, 6)
        problems += [f"2-rank resume: {p}" for p in resume_problems]
        figures.append(f"resume x2 {'bit-exact' if not resume_problems else 'FAILED'}")
        if resume_figures:
            ctx.detail(f"2-rank resume: {resume_figures}")
    else:
        figures.append("resume x2 not run (time)")
    if ctx.left() > 60:  # ZeRO-2 LAMB = ZeRO-0 LAMB on 2 ranks
        failures, count, _ = run_lamb_checks(ctx, 2, ("stages", "per_shard"), "2 ranks")
        problems += [f"LAMB x2: {f}" for f in failures]
        figures.append(f"LAMB x2 {count - len(failures)}/{count}")
    else:
        figures.append("LAMB x2 not run (time)")
    if ctx.left() > 60:
        clip_timing(ctx, problems, figures)
    else:
        figures.append("clip timing not run (time)")
    backend = "NCCL" if ctx.cuda else "gloo"
    return judged(problems, ", ".join(figures), f"{backend}: " + ", ".join(figures))
