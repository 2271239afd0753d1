"""Section ``lamb_equal``: ZeRO-1/2 LAMB takes ZeRO-0's steps on the accelerator."""

from .apex_lamb import apex_checks
from .runner import Ctx, Result, rank0_env, run_jobs, test_script, worker_job
from .workers import LAMB_STEPS


def run_lamb_checks(ctx: Ctx, world: int, checks: tuple, label: str) -> tuple:
    """(failures, checks run, seconds) of one optimizer-check job (``optim_zero_check`` on ``world`` ranks)."""
    import torch

    out = ctx.dir(f"lamb_x{world}")  # run_jobs makes it (the worker's log is in it)
    ranks, env = (world, {}) if world > 1 else (0, rank0_env())
    name, args = f"optim_zero_check x{world}", ["--out", out, "--checks", *checks]
    job = run_jobs(ctx, [worker_job(ctx, name, "lamb", args, out / "worker.log", ranks=ranks, timeout=240, **env)])[0]
    if not job.ok:
        ctx.detail(f"{label}: worker {job.status()}: {job.tail()}")
        return (["worker " + job.status()] if job.started else ["not run (time)"]), 0, job.seconds
    results = torch.load(out / "optim_zero_check.pt", map_location="cpu", weights_only=False)
    verdict = test_script("optim_zero_check").judge(results, world, LAMB_STEPS)  # tests/test_optim_zero.py's checks
    return ctx.verdicts(label, verdict), len(verdict), job.seconds


def section_lamb_equal(ctx: Ctx) -> Result:
    world = 2 if ctx.cuda and ctx.gpus >= 2 else 1
    ranks = f"{world} rank{'s' if world > 1 else ''}"
    failures, count, seconds = run_lamb_checks(ctx, world, ("stages", "per_shard", "resume", "bf16"), ranks)
    apex = apex_checks(ctx)
    failures += ctx.verdicts("apex", apex)
    where = f"{'NCCL' if ctx.cuda else 'gloo'}, {ranks}"
    if failures:
        return Result("FAIL", f"{len(failures)} of {count + len(apex)} checks failed ({where}): {'; '.join(failures)}")
    return Result(
        "PASS",
        f"{count} checks of tests/test_optim_zero.py hold on {ctx.device} ({where}, "
        f"{seconds:.0f} s): ZeRO-1/2 LAMB = ZeRO-0, resume bit-exact, bf16 wrappers agree"
        + (f"; apex FusedLAMB = ours ({len(apex)} checks)" if apex and ctx.cuda else ""),
    )
