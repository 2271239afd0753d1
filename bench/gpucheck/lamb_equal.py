"""Section ``lamb_equal``: ZeRO-1/2 LAMB takes ZeRO-0's steps on the accelerator."""

import math

from .apex_lamb import apex_checks
from .runner import Ctx, Result, rank0_env, run_jobs, test_script, worker_job


def _approx(a: float, b: float, rel: float) -> bool:
    return abs(float(a) - float(b)) <= rel * abs(float(b)) + 1e-12


def _same_scales(ours: list, theirs: list, rel: float) -> bool:
    return len(ours) == len(theirs) and all(_approx(a, b, rel) for a, b in zip(ours, theirs))


def judge_lamb(results: dict, world: int, steps: int) -> list:
    """The assertions of ``tests/test_optim_zero.py`` with its tolerances, as (name, ok, detail)."""
    import torch

    initial = torch.cat([p.detach().reshape(-1) for p in test_script("optim_zero_check").tiny_bert().parameters()])
    out = []
    check = lambda name, ok, detail="": out.append((name, ok, detail))
    max_gap = lambda a, b: float((a - b).abs().max())
    if "stage0" in results:
        zero0 = results["stage0"]
        moved = max_gap(zero0["params"], initial)
        check("zero0 moved the weights (> 1e-2)", moved > 1e-2, f"max move {moved:.3g}")
        scales0 = [float(s) for s in zero0["grad_scales"]]
        check("LAMB clipping active at ZeRO 0", all(s < 1.0 for s in scales0), f"scales {scales0}")
        for stage in (1, 2):
            zn = results.get(f"stage{stage}")
            if zn is None:
                continue
            diff = (zn["params"] - zero0["params"]).abs()
            bound = 1e-6 + 1e-5 * zero0["params"].abs()
            ok = bool((diff <= bound).all())
            check(f"ZeRO {stage} params = ZeRO 0 (rtol 1e-5, atol 1e-6)", ok, f"max diff {float(diff.max()):.3g}")
            scales = [float(s) for s in zn["grad_scales"]]
            ok = _same_scales(scales, scales0, 1e-5)
            check(f"ZeRO {stage} clip factors = ZeRO 0 (rel 1e-5)", ok, f"{scales} vs {scales0}")
            ok = _approx(zn["lr"], zero0["lr"], 1e-6)
            check(f"ZeRO {stage} lr = ZeRO 0", ok, f"{zn['lr']} vs {zero0['lr']}")
            ok = bool(zn["attached"]) and zero0["attached"] == []
            check(f"ZeRO {stage} layouts attached (ZeRO 0 none)", ok, f"{zn['attached']} / {zero0['attached']}")
        if "per_shard" in results:
            gap = max_gap(results["per_shard"]["params"], zero0["params"])
            check("per-shard trust ratio control differs (> 1e-3)", gap > 1e-3, f"gap {gap:.3g}")
    for stage in (0, 2):
        entry = results.get(f"resume{stage}")
        if entry is None:
            continue
        straight, resumed = entry["straight"], entry["resumed"]
        same_params = torch.equal(straight["params"], resumed["params"])
        states_ok = len(straight["state"]) == len(resumed["state"]) == world and all(
            torch.equal(a, b) for a, b in zip(straight["state"], resumed["state"])
        )
        sched_ok = straight["lr"] == resumed["lr"] and straight["sched"] == resumed["sched"] == steps
        detail = "" if same_params else f"max param diff {max_gap(straight['params'], resumed['params']):.3g}"
        detail = detail or f"params, {len(resumed['state'])} optimizer shards, lr and schedule equal"
        check(f"ZeRO {stage} checkpoint resume bit-exact", same_params and states_ok and sched_ok, detail)
    if "bf16_stage0" in results:
        zero0 = results["bf16_stage0"]
        ok = zero0["wrapper"] == "FP16_UnfusedOptimizer" and zero0["fragments"] == 0
        check(
            "bf16 ZeRO 0 runs FP16_UnfusedOptimizer, no fragments",
            ok,
            f"{zero0['wrapper']}, {zero0['fragments']} fragments",
        )
        moved = max_gap(zero0["masters"], initial)
        check("bf16 ZeRO 0 moved the masters (> 1e-2)", moved > 1e-2, f"max move {moved:.3g}")
        ok = torch.equal(zero0["params"], zero0["masters"].to(torch.bfloat16).float())
        check("bf16 ZeRO 0 params are the rounded masters", ok)
        per_shard = results.get("bf16_per_shard")
        control = max_gap(per_shard["masters"], zero0["masters"]) if per_shard is not None else math.inf
        for stage in (1, 2):
            zn = results.get(f"bf16_stage{stage}")
            if zn is None:
                continue
            gap = max_gap(zn["masters"], zero0["masters"])
            ok = (
                zn["wrapper"] == "DeepSpeedZeroOptimizer"
                and zn["fragments"] > 0
                and zero0["steps"] == zn["steps"] == [steps]
            )
            detail = f"{zn['wrapper']}, {zn['fragments']} fragments, steps {zn['steps']} / {zero0['steps']}"
            check(f"bf16 ZeRO {stage}: DeepSpeedZeroOptimizer with fragments, {steps} LAMB steps", ok, detail)
            detail = f"gap {gap:.3g}, per-shard control {control:.3g}"
            check(f"bf16 ZeRO {stage} masters = ZeRO 0 (gap < 1e-4 < control)", gap < 1e-4 < control, detail)
            s0, sn = ([float(s) for s in z["grad_scales"]] for z in (zero0, zn))
            check(f"bf16 ZeRO {stage} clip factors (rel 1e-3)", _same_scales(sn, s0, 1e-3), f"{sn} vs {s0}")
    return out


def run_lamb_checks(ctx: Ctx, world: int, checks: tuple, label: str) -> tuple:
    """(failures, checks run, seconds) of one optimizer-check job (``optim_zero_check`` on ``world`` ranks)."""
    import torch

    out = ctx.dir(f"lamb_x{world}")
    out.mkdir(parents=True, exist_ok=True)
    ranks, env = (world, {}) if world > 1 else (0, rank0_env())
    job = worker_job(
        ctx,
        f"optim_zero_check x{world}",
        "lamb",
        ["--out", out, "--checks", *checks],
        out / "worker.log",
        ranks=ranks,
        timeout=240,
        **env,
    )
    job = run_jobs(ctx, [job])[0]
    if not job.ok:
        ctx.detail(f"{label}: worker {job.status()}: {job.tail()}")
        return (["worker " + job.status()] if job.started else ["not run (time)"]), 0, job.seconds
    results = torch.load(out / "optim_zero_check.pt", map_location="cpu", weights_only=False)
    verdict = judge_lamb(results, world, 4)
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
