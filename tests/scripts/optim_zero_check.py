"""LAMB under real DeepSpeed engines on gloo ranks: ZeRO 0/1/2 trajectories and checkpoint resume.

Two ways in, same work (:func:`run_checks`), results written as ``.pt`` files by rank 0:

* ``tests/test_optim_zero.py`` spawns ranks with torch.multiprocessing (:func:`spawn_worker`);
* the real launcher: ``deepspeed --num_gpus 2 tests/scripts/optim_zero_check.py --out DIR [--checks ...]``.

Model: a tiny BERT masked LM, dropout off so every stage sees the same function. Precision is pinned
(``train.precision``), never ``auto``: fp32 for the ZeRO-0 vs ZeRO-1/2 comparison (exact up to the
summation order of the per-layer norms), and bf16 on purpose for the same comparison through
DeepSpeed's bf16 wrappers (``FP16_UnfusedOptimizer`` at ZeRO 0, ``DeepSpeedZeroOptimizer`` at 1/2).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

VOCAB, SEQ, MICRO = 97, 12, 2
ALL_CHECKS = ("stages", "per_shard", "resume", "bf16")
BF16_STAGES = (0, 1, 2)


def tiny_bert():
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    return BertForMaskedLM(
        BertConfig(
            vocab_size=VOCAB,
            hidden_size=24,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=40,
            max_position_embeddings=SEQ,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
    )


def batch(step: int, rank: int) -> dict:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(5, VOCAB, (MICRO, SEQ), generator=gen)
    labels = torch.where(torch.rand(MICRO, SEQ, generator=gen) < 0.3, ids, torch.full_like(ids, -100))
    masked = torch.where(labels != -100, torch.full_like(ids, 4), ids)
    return {"input_ids": masked, "attention_mask": torch.ones_like(ids), "labels": labels}


def engine_for(stage: int, *, max_grad_norm: float, bf16: bool = False, max_steps: int = 8, kernel: str = "auto"):
    from ds_bertopt import optim
    from ds_bertopt.config import BertOptConfig
    from ds_bertopt.configlib import load_section
    from ds_bertopt.engine import initialize

    bertopt = {
        "optimizer": {"type": "lamb", "lr": 0.02, "weight_decay": 0.01, "max_grad_norm": max_grad_norm},
        "schedule": {"type": "poly", "warmup_steps": 2},
        "train": {"max_steps": max_steps, "precision": "bf16" if bf16 else "fp32"},
    }
    ds = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    model = tiny_bert()
    if bf16:
        model = model.to(torch.bfloat16)
    optimizer, scheduler = optim.build(
        model,
        load_section(BertOptConfig, bertopt, "bertopt"),
        global_batch=MICRO * torch.distributed.get_world_size(),
        zero_stage=stage,
    )
    optimizer.kernel = kernel
    engine, _, _, _ = initialize(
        config={**ds, "bertopt": bertopt}, model=model, optimizer=optimizer, lr_scheduler=scheduler
    )
    return engine, optimizer


def train_steps(engine, lamb, first: int, last: int) -> list[float]:
    """Steps ``first … last − 1``; returns LAMB's clipping factor of each."""
    scales = []
    for step in range(first, last):
        out = engine(**batch(step, torch.distributed.get_rank()))
        engine.backward(out.loss)
        engine.step()
        scales.append(float(lamb.last_grad_scale))  # a device tensor: read here, never in the step
    return scales


def flat_params(engine) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in engine.module.parameters()])


def fp32_masters(engine) -> torch.Tensor:
    """The fp32 master weights DeepSpeed keeps behind bf16 parameters, whole (gathered across ranks)."""
    from deepspeed.utils import safe_get_full_fp32_param

    wrapper = engine.optimizer
    copies = {}  # ZeRO 0: FP16_UnfusedOptimizer keeps one fp32 copy per parameter, group by group
    for low, high in zip(getattr(wrapper, "fp16_groups", ()), getattr(wrapper, "fp32_groups", ())):
        copies.update({id(p): c for p, c in zip(low, high)})
    return torch.cat(
        [
            (copies[id(p)] if id(p) in copies else safe_get_full_fp32_param(p)).detach().float().reshape(-1)
            for p in engine.module.parameters()
        ]
    )


def optimizer_state(lamb) -> torch.Tensor:
    """This rank's LAMB moments, flattened (the shard under ZeRO 1/2)."""
    tensors = [
        lamb.state[p][k].reshape(-1) for g in lamb.param_groups for p in g["params"] for k in ("exp_avg", "exp_avg_sq")
    ]
    return torch.cat(tensors)


def gather_state(tensor: torch.Tensor) -> list[torch.Tensor]:
    parts = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, tensor)
    return parts


def run_checks(out_dir: str, checks=ALL_CHECKS, steps: int = 4) -> None:
    from ds_bertopt.optim.lamb import Layout

    from ds_bertopt.optim import lamb_kernel

    rank = torch.distributed.get_rank()
    results: dict = {}
    fused_steps = [0]
    built = lamb_kernel.Step.__init__

    def counted(self, *args, **kwargs):
        fused_steps[0] += 1
        built(self, *args, **kwargs)

    lamb_kernel.Step.__init__ = counted  # which path each run took
    if "stages" in checks:
        # auto: the fused CPU kernel where it applies (these fp32 CPU runs), foreach on an accelerator; "foreach":
        # the torch._foreach_* path, the step as it was before the fused kernel.
        for stage, kernel in ((0, "auto"), (1, "auto"), (2, "auto"), (0, "foreach"), (2, "foreach")):
            fused_steps[0] = 0
            engine, lamb = engine_for(stage, max_grad_norm=0.05, kernel=kernel)
            scales = train_steps(engine, lamb, 0, steps)
            results[f"stage{stage}" + ("_foreach" if kernel == "foreach" else "")] = {
                "params": flat_params(engine),
                "grad_scales": scales,
                "lr": engine.get_lr()[0],
                "clip": lamb.max_grad_norm,
                "attached": sorted(len(layout.fragments) for layout in lamb._layouts.values()),
                "fused_steps": fused_steps[0],
            }
    if "per_shard" in checks:
        # What a client LAMB does under ZeRO without our layouts: one "layer" per flat shard.
        engine, lamb = engine_for(1, max_grad_norm=0.05)
        for group in lamb.param_groups:
            shard = group["params"][0]
            lamb.set_layout(shard, Layout.whole([shard]))
        train_steps(engine, lamb, 0, steps)
        results["per_shard"] = {"params": flat_params(engine)}
    if "resume" in checks:
        holder = [os.path.join(out_dir, "resume_checkpoints")]  # the caller's directory: nothing left in /tmp
        for stage in (0, 2):
            engine, lamb = engine_for(stage, max_grad_norm=0.05)
            train_steps(engine, lamb, 0, steps)
            straight = {
                "params": flat_params(engine),
                "state": gather_state(optimizer_state(lamb)),
                "lr": engine.get_lr()[0],
                "sched": engine.lr_scheduler.state_dict()["last_epoch"],
            }
            engine, lamb = engine_for(stage, max_grad_norm=0.05)
            train_steps(engine, lamb, 0, steps // 2)
            engine.save_checkpoint(holder[0], tag=f"stage{stage}")
            engine, lamb = engine_for(stage, max_grad_norm=0.05)
            engine.load_checkpoint(holder[0], tag=f"stage{stage}")
            train_steps(engine, lamb, steps // 2, steps)
            resumed = {
                "params": flat_params(engine),
                "state": gather_state(optimizer_state(lamb)),
                "lr": engine.get_lr()[0],
                "sched": engine.lr_scheduler.state_dict()["last_epoch"],
            }
            results[f"resume{stage}"] = {"straight": straight, "resumed": resumed}
    if "bf16" in checks:
        from ds_bertopt.compat.deepspeed import DeepSpeedIncompatible

        for stage in BF16_STAGES:
            try:
                engine, lamb = engine_for(stage, max_grad_norm=0.05, bf16=True)
            except DeepSpeedIncompatible as exc:  # bf16 at ZeRO 0 before DeepSpeed 0.18
                results[f"bf16_stage{stage}"] = {"refused": str(exc)}
                continue
            scales = train_steps(engine, lamb, 0, steps)
            results[f"bf16_stage{stage}"] = {
                "params": flat_params(engine),
                "masters": fp32_masters(engine),
                "grad_scales": scales,
                "wrapper": type(engine.optimizer).__name__,
                "steps": sorted({lamb.state[p]["step"] for g in lamb.param_groups for p in g["params"]}),
                "fragments": sum(len(layout.fragments) for layout in lamb._layouts.values()),
            }
        engine, lamb = engine_for(1, max_grad_norm=0.05, bf16=True)  # the per-shard control, in bf16
        for group in lamb.param_groups:
            lamb.set_layout(group["params"][0], Layout.whole([group["params"][0]]))
        train_steps(engine, lamb, 0, steps)
        results["bf16_per_shard"] = {"masters": fp32_masters(engine)}
    lamb_kernel.Step.__init__ = built
    if rank == 0:
        torch.save(results, os.path.join(out_dir, "optim_zero_check.pt"))
    torch.distributed.barrier()


def judge(results: dict, world: int, steps: int) -> list[tuple[str, bool, str]]:
    """The checks of ``tests/test_optim_zero.py`` (and of ``bench/gpu_check.sh``'s ``lamb_equal``) with their
    tolerances, as ``(name, ok, detail)``, on the runs present in ``results`` (:func:`run_checks` on ``world`` ranks,
    ``steps`` steps)."""
    import math

    from ds_bertopt.compat import deepspeed as ds_compat

    initial = torch.cat([p.detach().reshape(-1) for p in tiny_bert().parameters()])
    gap = lambda a, b: float((a - b).abs().max())
    scales = lambda entry: [float(s) for s in entry["grad_scales"]]
    same = lambda ours, theirs, rel: (  # pytest.approx (its default abs 1e-12 too) on lists of equal length
        len(ours) == len(theirs) and all(abs(a - b) <= rel * abs(b) + 1e-12 for a, b in zip(ours, theirs))
    )
    present = lambda key, stages: [(s, results[key % s]) for s in stages if results.get(key % s) is not None]
    out = []
    zero0 = results.get("stage0")
    if zero0 is not None:
        moved, scales0 = gap(zero0["params"], initial), scales(zero0)
        out.append(("zero0 moved the weights (> 1e-2)", moved > 1e-2, f"max move {moved:.3g}"))
        out.append(("LAMB clipping active at ZeRO 0", all(s < 1.0 for s in scales0), f"scales {scales0}"))
    # the same per-layer ratio on every stage: equal up to the summation order of the layer norms; DeepSpeed's global
    # norm feeds LAMB's clipping the same factor as ZeRO-0's; layouts only where DeepSpeed flattened
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
    if zero0 is not None and "per_shard" in results:  # the control: one trust ratio per flat shard
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
    if not ds_compat.available("engine.bf16_zero0"):  # DeepSpeed < 0.18: bf16 at ZeRO 0 is refused in one line
        refused = zero0.get("refused", "")
        ok = "hook engine.bf16_zero0 " in refused and "\n" not in refused
        out.append(("bf16 ZeRO 0 refused in one line", ok, refused))
        for stage, zn in present("bf16_stage%d", (1, 2)):
            ok, detail = zn["wrapper"] == "DeepSpeedZeroOptimizer" and zn["fragments"] > 0, zn.get("fragments")
            out.append((f"bf16 ZeRO {stage}: DeepSpeedZeroOptimizer with fragments", ok, f"{zn['wrapper']}, {detail}"))
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
    # DeepSpeed's zero-gradient state-initialisation step does not count as a step
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


def spawn_worker(rank: int, world: int, port: int, out_dir: str, checks, steps: int) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        DS_ACCELERATOR="cpu",
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    run_checks(out_dir, checks, steps)
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--checks", nargs="+", default=list(ALL_CHECKS), choices=ALL_CHECKS)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    deepspeed.init_distributed(verbose=False)
    run_checks(args.out, tuple(args.checks), args.steps)


if __name__ == "__main__":
    main()
