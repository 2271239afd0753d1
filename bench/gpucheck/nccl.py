"""Section ``nccl`` (>= 2 GPUs): 2-rank start-up, resume, ZeRO-2 LAMB and bucket-clip timing."""

from __future__ import annotations

import json
import statistics

from .lamb_equal import run_lamb_checks
from .resume import resume_check
from .runner import ENTRY, Ctx, Job, Result, Skip, launcher, run_jobs, tiny_flags
from .syncs import loop_worker_job


def section_nccl(ctx: Ctx) -> Result:
    if ctx.gpus < 2:
        raise Skip(f"{ctx.gpus} GPU{'s' if ctx.gpus != 1 else ''}: needs 2" if ctx.cuda else "no CUDA")
    problems, figures = [], []
    backend = "NCCL" if ctx.cuda else "gloo"
    # start-up: each rank on its own device, through the launcher
    probe = ctx.dir("probe")
    out = ctx.dir("startup")
    argv = [
        "--deepspeed_config",
        "ds_configs/bert.json",
        "--max_steps",
        "4",
        "--log_every",
        "1",
        "--eval_every",
        "0",
        "--overwrite_output_dir",
        "--output_dir",
        str(out),
        "-o",
        "data.max_documents=300",
        "-o",
        f"data.cache_dir={ctx.cache_dir}",
        "-o",
        "deepspeed.zero_optimization.stage=2",
        "-o",
        "bucket_clip.enabled=true",
        "-o",
        "train.save_model=false",
        *tiny_flags(ctx),
    ]
    job = run_jobs(
        ctx,
        [
            loop_worker_job(
                ctx,
                "2-rank start-up",
                "pretrain",
                argv,
                {"GPU_CHECK_PROBE": str(probe)},
                out.parent / "startup.log",
                gpus=2,
                use_launcher=True,
            )
        ],
    )[0]
    facts = [json.loads(p.read_text()) for p in sorted(probe.glob("rank*.json"))]
    for f in facts:
        ctx.detail(
            f"start-up rank {f['rank']}: local rank {f['local_rank']}, engine on {f['engine_device']}, "
            f"current device {f.get('current_device')}, {f.get('name', '')} {f.get('pci_bus_id', '')} "
            f"{f.get('uuid', '')[:13]}"
        )
    if not job.ok or len(facts) != 2:
        problems.append(f"2-rank start-up: {job.status()}, {len(facts)} probes: {job.tail(3)}")
    elif ctx.cuda and (
        len({f.get("uuid") or f.get("current_device") for f in facts}) != 2
        or any(f.get("current_device") != f["local_rank"] for f in facts)
    ):
        problems.append("2-rank start-up: the ranks do not each use their own device")
    else:
        figures.append(f"start-up ok ({job.seconds:.0f} s)")
    # resume across 2 ranks
    if ctx.left() > 90:
        resume_problems, resume_figures = resume_check(ctx, "x2", 2, 1, 8, 6)
        problems += [f"2-rank resume: {p}" for p in resume_problems]
        figures.append(f"resume x2 {'bit-exact' if not resume_problems else 'FAILED'}")
        if resume_figures:
            ctx.detail(f"2-rank resume: {resume_figures}")
    else:
        figures.append("resume x2 not run (time)")
    # ZeRO-2 LAMB = ZeRO-0 LAMB on 2 ranks
    if ctx.left() > 60:
        failures, count, _ = run_lamb_checks(ctx, 2, ("stages", "per_shard"), "2 ranks")
        problems += [f"LAMB x2: {f}" for f in failures]
        figures.append(f"LAMB x2 {count - len(failures)}/{count}")
    else:
        figures.append("LAMB x2 not run (time)")
    # bucket-clip overlap timing
    if ctx.left() > 60:
        result = ctx.dir("clip_timing.json")
        result.unlink(missing_ok=True)
        cmd = [*launcher(2), str(ENTRY), "--out", str(result), "--rounds", "3", *(["--tiny"] if ctx.tiny else [])]
        job = run_jobs(
            ctx, [Job("clip timing", cmd, ctx.env(GPU_CHECK_WORKER="clip"), ctx.dir("clip_timing.log"), 240)]
        )[0]
        if job.ok and result.exists():
            data = json.loads(result.read_text())
            ours, theirs = (statistics.median(data["times"][k]) for k in ("bucket_clip", "deepspeed_clip"))
            ctx.detail(
                f"bucket-clip hook vs DeepSpeed gradient_clipping, {data['world']} ranks {backend}, "
                f"{data['precision']}, ZeRO {data['stage']}, micro {data['micro']} x {data['seq']}: median step "
                f"{ours * 1e3:.1f} vs {theirs * 1e3:.1f} ms (rounds {data['times']})"
            )
            figures.append(f"clip hook step time {ours / theirs:.2f}x DeepSpeed's")
        else:
            problems.append(f"clip timing: {job.status()}: {job.tail(3)}")
    else:
        figures.append("clip timing not run (time)")
    if problems:
        return Result("FAIL", "; ".join(problems) + f" [{', '.join(figures)}]")
    return Result("PASS", f"{backend}: " + ", ".join(figures))
