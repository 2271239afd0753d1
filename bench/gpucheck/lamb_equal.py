"""Section ``lamb_equal``: ZeRO-1/2 LAMB takes ZeRO-0's steps on the accelerator."""

import math

from .apex_lamb import apex_checks
from .runner import Ctx, Result, rank0_env, run_jobs, test_script, worker_job
from .workers import LAMB_STEPS


def judge_lamb(results: dict, world: int, steps: int) -> list:
    """The assertions of ``tests/test_optim_zero.py`` with its tolerances, as (name, ok, detail)."""
    import torch

    initial = torch.cat([p.detach().reshape(-1) for p in test_script("optim_zero_check").tiny_bert().parameters()])
    gap = lambda a, b: float((a - b).abs().max())
    scales = lambda entry: [float(s) for s in entry["grad_scales"]]
    same = lambda ours, theirs, rel: (
        len(ours) == len(theirs) and all(abs(a - b) <= rel * abs(b) + 1e-12 for a, b in zip(ours, theirs))
    )
    present = lambda key, stages: [(s, results[key % s]) for s in stages if results.get(key % s) is not None]
    out = []
    zero0 = results.get("stage0")
    if zero0 is not None:
        moved, scales0 = gap(zero0["params"], initial), scales(zero0)
        out.append(("zero0 moved the weights (> 1e-2)", moved > 1e-2, f"max move {moved:.3g}"))
        out.append(("LAMB clipping active at ZeRO 0", all(s < 1.0 for s in scales0), f"scales {scales0}"))
    for stage, zn in present("stage%d", (1, 2) if zero0 is not None else ()):
        diff = (zn["params"] - zero0["params"]).abs()
        ok = bool((diff <= 1e-6 + 1e-5 * zero0["params"].abs()).all())
        out.append((f"ZeRO {stage} params = ZeRO 0 (rtol 1e-5, atol 1e-6)", ok, f"max diff {float(diff.max()):.3g}"))
        ok, detail = same(scales(zn), scales0, 1e-5), f"{scales(zn)} vs {scales0}"
        out.append((f"ZeRO {stage} clip factors = ZeRO 0 (rel 1e-5)", ok, detail))
        ok = same([zn["lr"]], [zero0["lr"]], 1e-6)
        out.append((f"ZeRO {stage} lr = ZeRO 0", ok, f"{zn['lr']} vs {zero0['lr']}"))
        ok, detail = bool(zn["attached"]) and zero0["attached"] == [], f"{zn['attached']} / {zero0['attached']}"
        out.append((f"ZeRO {stage} layouts attached (ZeRO 0 none)", ok, detail))
    if zero0 is not None and "per_shard" in results:
        control = gap(results["per_shard"]["params"], zero0["params"])
        out.append(("per-shard trust ratio control differs (> 1e-3)", control > 1e-3, f"gap {control:.3g}"))
    for stage, entry in present("resume%d", (0, 2)):
        straight, resumed = entry["straight"], entry["resumed"]
        same_params = torch.equal(straight["params"], resumed["params"])
        states_ok = len(straight["state"]) == len(resumed["state"]) == world and all(
            torch.equal(a, b) for a, b in zip(straight["state"], resumed["state"])
        )
        sched_ok = straight["lr"] == resumed["lr"] and straight["sched"] == resumed["sched"] == steps
        detail = "" if same_params else f"max param diff {gap(straight['params'], resumed['params']):.3g}"
        detail = detail or f"params, {len(resumed['state'])} optimizer shards, lr and schedule equal"
        out.append((f"ZeRO {stage} checkpoint resume bit-exact", same_params and states_ok and sched_ok, detail))
    zero0 = results.get("bf16_stage0")
    if zero0 is None:
        return out
    ok = zero0["wrapper"] == "FP16_UnfusedOptimizer" and zero0["fragments"] == 0
    detail = f"{zero0['wrapper']}, {zero0['fragments']} fragments"
    out.append(("bf16 ZeRO 0 runs FP16_UnfusedOptimizer, no fragments", ok, detail))
    moved = gap(zero0["masters"], initial)
    out.append(("bf16 ZeRO 0 moved the masters (> 1e-2)", moved > 1e-2, f"max move {moved:.3g}"))
    ok = torch.equal(zero0["params"], zero0["masters"].to(torch.bfloat16).float())
    out.append(("bf16 ZeRO 0 params are the rounded masters", ok, ""))
    per_shard = results.get("bf16_per_shard")
    control = gap(per_shard["masters"], zero0["masters"]) if per_shard is not None else math.inf
    for stage, zn in present("bf16_stage%d", (1, 2)):
        ok = zn["wrapper"] == "DeepSpeedZeroOptimizer" and zn["fragments"] > 0
        ok = ok and zero0["steps"] == zn["steps"] == [steps]
        detail = f"{zn['wrapper']}, {zn['fragments']} fragments, steps {zn['steps']} / {zero0['steps']}"
        out.append((f"bf16 ZeRO {stage}: DeepSpeedZeroOptimizer with fragments, {steps} LAMB steps", ok, detail))
        masters_gap = gap(zn["masters"], zero0["masters"])
        detail = f"gap {masters_gap:.3g}, per-shard control {control:.3g}"
        out.append((f"bf16 ZeRO {stage} masters = ZeRO 0 (gap < 1e-4 < control)", masters_gap < 1e-4 < control, detail))
        s0, sn = scales(zero0), scales(zn)
        out.append((f"bf16 ZeRO {stage} clip factors (rel 1e-3)", same(sn, s0, 1e-3), f"{sn} vs {s0}"))
    return out


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
    verdict = judge_lamb(results, world, LAMB_STEPS)
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
