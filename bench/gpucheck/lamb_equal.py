"""Section ``lamb_equal``: ZeRO-1/2 LAMB takes ZeRO-0's steps on the accelerator."""

from __future__ import annotations

import math
import sys
from pathlib import Path

from .apex_lamb import apex_checks
from .runner import ENTRY, ROOT, Ctx, Job, Result, free_port, launcher, run_jobs


def lamb_job(ctx: Ctx, out: Path, world: int, checks: tuple, timeout: float = 240) -> Job:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        *(launcher(world) if world > 1 else [sys.executable, "-u"]),
        str(ENTRY),
        "--out",
        str(out),
        "--checks",
        *checks,
    ]
    env = ctx.env(GPU_CHECK_WORKER="lamb")
    if world == 1:
        env.update(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            LOCAL_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
        )
    return Job(f"optim_zero_check x{world}", cmd, env, out / "worker.log", timeout)


def _approx(a: float, b: float, rel: float) -> bool:
    return abs(float(a) - float(b)) <= rel * abs(float(b)) + 1e-12


def judge_lamb(results: dict, world: int, steps: int) -> list:
    """The assertions of ``tests/test_optim_zero.py`` with its tolerances, as (name, ok, detail)."""
    import torch

    sys.path.insert(0, str(ROOT / "tests" / "scripts"))
    import optim_zero_check as ozc

    initial = torch.cat([p.detach().reshape(-1) for p in ozc.tiny_bert().parameters()])
    out = []
    if "stage0" in results:
        zero0 = results["stage0"]
        moved = float((zero0["params"] - initial).abs().max())
        out.append(("zero0 moved the weights (> 1e-2)", moved > 1e-2, f"max move {moved:.3g}"))
        scales0 = [float(s) for s in zero0["grad_scales"]]
        out.append(("LAMB clipping active at ZeRO 0", all(s < 1.0 for s in scales0), f"scales {scales0}"))
        for stage in (1, 2):
            zn = results.get(f"stage{stage}")
            if zn is None:
                continue
            diff = (zn["params"] - zero0["params"]).abs()
            bound = 1e-6 + 1e-5 * zero0["params"].abs()
            out.append(
                (
                    f"ZeRO {stage} params = ZeRO 0 (rtol 1e-5, atol 1e-6)",
                    bool((diff <= bound).all()),
                    f"max diff {float(diff.max()):.3g}",
                )
            )
            scales = [float(s) for s in zn["grad_scales"]]
            out.append(
                (
                    f"ZeRO {stage} clip factors = ZeRO 0 (rel 1e-5)",
                    len(scales) == len(scales0) and all(_approx(a, b, 1e-5) for a, b in zip(scales, scales0)),
                    f"{scales} vs {scales0}",
                )
            )
            out.append(
                (f"ZeRO {stage} lr = ZeRO 0", _approx(zn["lr"], zero0["lr"], 1e-6), f"{zn['lr']} vs {zero0['lr']}")
            )
            out.append(
                (
                    f"ZeRO {stage} layouts attached (ZeRO 0 none)",
                    bool(zn["attached"]) and zero0["attached"] == [],
                    f"{zn['attached']} / {zero0['attached']}",
                )
            )
        if "per_shard" in results:
            gap = float((results["per_shard"]["params"] - zero0["params"]).abs().max())
            out.append(("per-shard trust ratio control differs (> 1e-3)", gap > 1e-3, f"gap {gap:.3g}"))
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
        gap = float((straight["params"] - resumed["params"]).abs().max())
        detail = "" if same_params else f"max param diff {gap:.3g}"
        out.append(
            (
                f"ZeRO {stage} checkpoint resume bit-exact",
                same_params and states_ok and sched_ok,
                detail or f"params, {len(resumed['state'])} optimizer shards, lr and schedule equal",
            )
        )
    if "bf16_stage0" in results:
        zero0 = results["bf16_stage0"]
        out.append(
            (
                "bf16 ZeRO 0 runs FP16_UnfusedOptimizer, no fragments",
                zero0["wrapper"] == "FP16_UnfusedOptimizer" and zero0["fragments"] == 0,
                f"{zero0['wrapper']}, {zero0['fragments']} fragments",
            )
        )
        moved = float((zero0["masters"] - initial).abs().max())
        out.append(("bf16 ZeRO 0 moved the masters (> 1e-2)", moved > 1e-2, f"max move {moved:.3g}"))
        out.append(
            (
                "bf16 ZeRO 0 params are the rounded masters",
                torch.equal(zero0["params"], zero0["masters"].to(torch.bfloat16).float()),
                "",
            )
        )
        control = (
            float((results["bf16_per_shard"]["masters"] - zero0["masters"]).abs().max())
            if "bf16_per_shard" in results
            else math.inf
        )
        for stage in (1, 2):
            zn = results.get(f"bf16_stage{stage}")
            if zn is None:
                continue
            gap = float((zn["masters"] - zero0["masters"]).abs().max())
            out.append(
                (
                    f"bf16 ZeRO {stage}: DeepSpeedZeroOptimizer with fragments, {steps} LAMB steps",
                    zn["wrapper"] == "DeepSpeedZeroOptimizer"
                    and zn["fragments"] > 0
                    and zero0["steps"] == zn["steps"] == [steps],
                    f"{zn['wrapper']}, {zn['fragments']} fragments, steps {zn['steps']} / {zero0['steps']}",
                )
            )
            out.append(
                (
                    f"bf16 ZeRO {stage} masters = ZeRO 0 (gap < 1e-4 < control)",
                    gap < 1e-4 < control,
                    f"gap {gap:.3g}, per-shard control {control:.3g}",
                )
            )
            s0 = [float(s) for s in zero0["grad_scales"]]
            sn = [float(s) for s in zn["grad_scales"]]
            out.append(
                (
                    f"bf16 ZeRO {stage} clip factors (rel 1e-3)",
                    len(s0) == len(sn) and all(_approx(a, b, 1e-3) for a, b in zip(sn, s0)),
                    f"{sn} vs {s0}",
                )
            )
    return out


def run_lamb_checks(ctx: Ctx, world: int, checks: tuple, label: str) -> tuple:
    """(failures, checks run, seconds) of one optimizer-check job; details printed."""
    import torch

    out = ctx.dir(f"lamb_x{world}")
    job = run_jobs(ctx, [lamb_job(ctx, out, world, checks)])[0]
    if not job.ok:
        ctx.detail(f"{label}: worker {job.status()}: {job.tail()}")
        return (["worker " + job.status()] if job.started else ["not run (time)"]), 0, job.seconds
    results = torch.load(out / "optim_zero_check.pt", map_location="cpu", weights_only=False)
    verdicts = judge_lamb(results, world, 4)
    for name, ok, detail in verdicts:
        ctx.detail(f"{label}: {'ok  ' if ok else 'FAIL'} {name}" + (f" ({detail})" if detail else ""))
    return [name for name, ok, _ in verdicts if not ok], len(verdicts), job.seconds


def section_lamb_equal(ctx: Ctx) -> Result:
    world = 2 if ctx.cuda and ctx.gpus >= 2 else 1
    checks = ("stages", "per_shard", "resume", "bf16")
    failures, count, seconds = run_lamb_checks(ctx, world, checks, f"{world} rank{'s' if world > 1 else ''}")
    apex = apex_checks(ctx)
    for name, ok, detail in apex:
        ctx.detail(f"apex: {'ok  ' if ok else 'FAIL'} {name}" + (f" ({detail})" if detail else ""))
    failures += [name for name, ok, _ in apex if not ok]
    where = f"{'NCCL' if ctx.cuda else 'gloo'}, {world} rank{'s' if world > 1 else ''}"
    if failures:
        return Result("FAIL", f"{len(failures)} of {count + len(apex)} checks failed ({where}): {'; '.join(failures)}")
    return Result(
        "PASS",
        f"{count} checks of tests/test_optim_zero.py hold on {ctx.device} ({where}, "
        f"{seconds:.0f} s): ZeRO-1/2 LAMB = ZeRO-0, resume bit-exact, bf16 wrappers agree"
        + (f"; apex FusedLAMB = ours ({len(apex)} checks)" if apex and ctx.cuda else ""),
    )
