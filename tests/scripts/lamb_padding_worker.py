"""One gloo rank of ``tests/test_lamb_world_sizes.py``: LAMB through ``ds_bertopt.engine.initialize`` at ZeRO 0, 1
and 2 on a model whose groups leave ranks with padding only at world 4 (DeepSpeed pads each group to a multiple of
2 × 4 = 8 elements: the 3 biases of the last layer fill one rank and a half, so ranks 2 and 3 hold padding only).

fp32, no clipping, the trust ratio on both groups (so that the no-decay group's per-layer sums are all-reduced):
ZeRO 1/2 must take ZeRO 0's steps exactly up to the summation order of the norms. ZeRO 2 runs LAMB's foreach path
(a GPU's), the others the fused CPU kernel.
"""

from __future__ import annotations

import torch

WORLD = 4
STEPS = 3


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 4, bias=False), torch.nn.Tanh(), torch.nn.Linear(4, 3))


def group_numels() -> list[list[int]]:
    """The element counts of the optimizer's groups (decay, no decay) in DeepSpeed's flattening order."""
    from ds_bertopt import optim

    return [[p.numel() for p in g["params"]] for g in optim.param_groups(tiny_model(), 0.01)]


def _engine(stage: int):
    from ds_bertopt import optim
    from ds_bertopt.config import BertOptConfig
    from ds_bertopt.configlib import load_section
    from ds_bertopt.engine import initialize

    bertopt = {
        "optimizer": {"type": "lamb", "lr": 0.05, "max_grad_norm": 0.0, "adapt_no_decay": True},
        "schedule": {"type": "constant", "warmup_fraction": 0.0},
        "train": {"max_steps": 8, "precision": "fp32"},
    }
    ds = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }
    model = tiny_model()
    cfg = load_section(BertOptConfig, bertopt, "bertopt")
    optimizer, scheduler = optim.build(model, cfg, global_batch=2 * WORLD, zero_stage=stage)
    if stage == 2:
        optimizer.kernel = "foreach"  # the path a GPU takes (ZeRO 0 and 1 take the fused CPU kernel)
    engine, *_ = initialize(config={**ds, "bertopt": bertopt}, model=model, optimizer=optimizer, lr_scheduler=scheduler)
    return engine, optimizer


def _train(stage: int, rank: int) -> dict:
    engine, lamb = _engine(stage)
    initial = torch.cat([p.detach().reshape(-1).clone() for p in engine.module.parameters()])
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(2, 5, generator=gen), torch.randn(2, 3, generator=gen)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
    params = torch.cat([p.detach().reshape(-1).clone() for p in engine.module.parameters()])
    result = {  # plain numbers: they cross a process boundary
        "params": params.tolist(),
        "moved": float((params - initial).abs().max()),
        "ratios": [r.tolist() for r in lamb.last_trust_ratios],
        "fragments": [len(layout.fragments) for layout in lamb._layouts.values()],
    }
    if stage > 0:
        result["alignment_factor"] = engine.optimizer.nccl_start_alignment_factor
    return result


def run(rank: int, world: int) -> dict:  # noqa: ARG001 - spawn_ranks' signature
    results = {f"stage{stage}": _train(stage, rank) for stage in (0, 1, 2)}
    results["alignment_factor"] = results["stage1"].pop("alignment_factor")
    results["stage2"].pop("alignment_factor")
    return results
