"""One gloo rank of ``tests/test_first_step.py``: every optimizer × DeepSpeed wrapper a run can get, through
``ds_bertopt.engine.initialize``; what the state-creating step left behind.

DeepSpeed's fp16/bf16 wrappers at ZeRO 0 step the optimizer once on zero gradients in their ``__init__``
(``initialize_optimizer_states``). For each combination: the step counters right after ``initialize``, and the
weights after one real step at learning rate 0 (which moves nothing by itself, and copies the fp32 masters into the
model): equal to the weights before it exactly, unless the state-creating step moved the masters. Weight decay is
large (lr 0.5 × λ 0.2) so that a shrink shows even through bf16 rounding.
"""

from __future__ import annotations

import contextlib


from ds_bertopt import optim
from ds_bertopt.config import BertOptConfig, RunConfig
from ds_bertopt.configlib import load_section
from ds_bertopt.engine import initialize, prepare_deepspeed_config
from ds_bertopt.testing.gpu_paths import cuda_optimizer_choice

from conformance_worker import batch, full_params, tiny_bert

OPTIMIZERS = {  # name: (optimizer.type, implementation, what ds_bertopt.optim builds it as)
    "FusedAdam": ("adamw", "auto", "cuda"),  # DeepSpeed's FusedAdam (its kernel in torch): the fused FP16_Optimizer
    "AdamW": ("adamw", "torch", "cpu"),  # torch's fused AdamW
    "Lamb": ("lamb", "ours", "cpu"),
    "FusedLAMB": ("lamb", "apex", "apex"),  # apex's FusedLAMB, its kernel on the CPU (ds_bertopt.testing.apex_lamb)
}
WRAPPERS = {  # name: (precision, ZeRO stage, bf16 gradient accumulation in fp32 -> BF16_Optimizer)
    "none": ("fp32", 0, False),
    "fp16 wrapper": ("bf16", 0, False),  # FP16_Optimizer for FusedAdam, FP16_UnfusedOptimizer otherwise
    "BF16_Optimizer": ("bf16", 1, True),
    "ZeRO 1": ("bf16", 1, False),
    "ZeRO 2": ("fp32", 2, False),
}


def combinations() -> list[tuple[str, str]]:
    """apex's FusedLAMB runs at ZeRO 0 only (``ds_bertopt.optim`` refuses it elsewhere)."""
    return [
        (opt, wrapper)
        for opt in OPTIMIZERS
        for wrapper, (_, stage, _) in WRAPPERS.items()
        if not (opt == "FusedLAMB" and stage > 0)
    ]


def _engine(opt: str, wrapper: str):
    kind, implementation, host = OPTIMIZERS[opt]
    precision, stage, fp32_accumulation = WRAPPERS[wrapper]
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**9}
    ds["zero_optimization"] = {"stage": stage}
    if fp32_accumulation:
        ds["data_types"] = {"grad_accum_dtype": "fp32"}
    ours = {
        "optimizer": {"type": kind, "lr": 0.5, "weight_decay": 0.2, "implementation": implementation},
        "schedule": {"type": "constant", "warmup_fraction": 0.0},
        "train": {"max_steps": 8, "precision": precision},
    }
    run = RunConfig(path="<first step>", deepspeed=ds, bertopt=load_section(BertOptConfig, ours, "bertopt"))
    run = run.with_deepspeed(prepare_deepspeed_config(run, 1, "cpu"), resolved_for=1)
    model = tiny_bert()
    choice = cuda_optimizer_choice(apex=host == "apex") if host != "cpu" else contextlib.nullcontext()
    with choice:
        optimizer, scheduler = optim.build(model, run.bertopt, global_batch=2, zero_stage=stage)
    engine, *_ = initialize(config=run, model=model, optimizer=optimizer, lr_scheduler=scheduler)
    return engine


def _steps_counted(optimizer) -> list[int]:
    counts = [int(group.get("step", 0)) for group in optimizer.param_groups]
    counts += [int(state["step"]) for state in optimizer.state.values() if "step" in state]
    return counts


def run(rank: int, world: int) -> dict:  # noqa: ARG001 - spawn_ranks' signature
    results = {}
    for opt, wrapper in combinations():
        engine = _engine(opt, wrapper)
        found = {"optimizer": type(engine.basic_optimizer).__name__, "wrapper": type(engine.optimizer).__name__}
        found["steps_counted"] = _steps_counted(engine.basic_optimizer)
        before = full_params(engine)
        for group in engine.basic_optimizer.param_groups:
            group["lr"] = 0.0
        engine.backward(engine(**batch(rank, 1, engine.device)).loss)
        engine.step()
        after = full_params(engine)
        found["applied"] = bool(engine.was_step_applied())
        found["moved"] = max(float((after[n] - before[n]).abs().max()) for n in before)
        results[f"{opt} / {wrapper}"] = found
    return results
