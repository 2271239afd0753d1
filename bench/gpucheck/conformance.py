"""Section ``conformance``: the matrix of docs/gpu_matrix.md with the classes a CUDA run really gets."""

import json

from .runner import Ctx, Result, rank0_env, run_jobs, worker_job


def section_conformance(ctx: Ctx) -> Result:
    """Every row the pre-flight accepts (fp16 included on CUDA) with the real FusedAdam: two steps with the bucket
    clip and LAMB's ZeRO attachment, a NaN step skipped, checkpoint + resume exact (``conformance_problems``)."""
    from ds_bertopt import optim
    from ds_bertopt.testing.gpu_paths import REPRESENTATIVE, all_rows, conformance_problems, cpu_rows, cuda_choice

    accepted = [row for row in all_rows() if cuda_choice(row).refusal is None]
    rows = accepted if ctx.cuda else (list(REPRESENTATIVE) if ctx.tiny else cpu_rows())
    out = ctx.dir("matrix")  # run_jobs makes it (the worker's log is in it)
    args = ["--out", out, "--rows", *(row.id for row in rows)]
    job = worker_job(ctx, "conformance", "conformance", args, out / "worker.log", timeout=400, **rank0_env())
    job = run_jobs(ctx, [job])[0]
    if not job.ok or not (out / "results.json").exists():
        return Result("FAIL", f"worker {job.status()}: {job.tail()}")
    results = json.loads((out / "results.json").read_text())
    apex = ctx.cuda and optim.apex_fused_lamb() is not None  # apex absent: LAMB is ours
    failed = []
    for row in rows:
        problems = conformance_problems(row, results.get(row.id, {"error": "no result"}), apex)
        ctx.detail(
            f"{'ok  ' if not problems else 'FAIL'} {row.id}: {results.get(row.id, {}).get('wrapper', '?')}"
            + (f": {'; '.join(problems)}" if problems else "")
        )
        if problems:
            failed.append(f"{row.id}: {problems[0]}")
    where = f"{ctx.device}, 1 rank, {job.seconds:.0f} s"
    if failed:
        return Result("FAIL", f"{len(failed)} of {len(rows)} rows ({where}): {'; '.join(failed)}")
    return Result("PASS", f"{len(rows)} rows of docs/gpu_matrix.md conform ({where}): classes, clip, LAMB, NaN, resume")
