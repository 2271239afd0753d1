"""One rank of the GPU conformance matrix (``tests/test_gpu_conformance.py``, ``bench/gpu_check.py``).

For each row, through the real ``ds_bertopt.engine.initialize`` with what a CUDA run builds
(``ds_bertopt.testing.gpu_paths.cuda_optimizer_choice``): the classes DeepSpeed picked, two steps with bucket clip
(one bucket, active) and LAMB's ZeRO attachment, a step with NaN gradients that must be skipped and a good one after
it, and checkpoint + resume: a fresh engine loads the step-1 checkpoint and must take the same step 2.
"""

from __future__ import annotations

import contextlib
import os
import deepspeed
import torch
import torch.distributed as dist
from transformers import BertConfig, BertForMaskedLM

from ds_bertopt import optim
from ds_bertopt.config import BertOptConfig, RunConfig
from ds_bertopt.configlib import load_section
from ds_bertopt.dist import Topology
from ds_bertopt.dsconfig import optimizer_offload
from ds_bertopt.engine import initialize, prepare_deepspeed_config
from ds_bertopt.testing.gpu_paths import Row, cuda_optimizer_choice, gradient_part
from ds_bertopt.train import checkpoint

VOCAB, SEQ, MICRO = 64, 12, 2


def row_config(row: Row, device_type: str, world: int) -> RunConfig:
    ds = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "steps_per_print": 10**9}
    ds.update(row.deepspeed_part())
    ours = {
        "optimizer": {"type": row.optimizer, "lr": 1e-2},
        "schedule": {"type": "constant", "warmup_fraction": 0.0},
        # one bucket holding every gradient: the clip is then the same quantity at every stage (comparable rows)
        "bucket_clip": {"enabled": row.stage < 3, "max_norm": 0.05, "bucket_size": 10**7},
        "train": {"max_steps": 8, "precision": row.precision},
    }
    run = RunConfig(path="<conformance>", deepspeed=ds, bertopt=load_section(BertOptConfig, ours, "bertopt"))
    return run.with_deepspeed(prepare_deepspeed_config(run, world, device_type), resolved_for=world)


def tiny_bert() -> torch.nn.Module:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=SEQ,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForMaskedLM(config)


def batch(rank: int, step: int, device) -> dict:
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(4, VOCAB, (MICRO, SEQ), generator=g)
    labels = torch.where(torch.rand(MICRO, SEQ, generator=g) < 0.3, ids, torch.full_like(ids, -100))
    return {"input_ids": ids.to(device), "labels": labels.to(device)}


def build(row: Row, world: int, device_type: str):
    run = row_config(row, device_type, world)
    model = tiny_bert()
    # on a CUDA host ds_bertopt.optim chooses by itself; on the CPU it is made to choose as there
    with cuda_optimizer_choice(apex=row.apex) if device_type == "cpu" else contextlib.nullcontext():
        optimizer, scheduler = optim.build(
            model,
            run.bertopt,
            global_batch=MICRO * world,
            zero_stage=row.stage,
            offload=optimizer_offload(run.deepspeed) is not None,
        )
    engine, *_ = initialize(config=run, model=model, optimizer=optimizer, lr_scheduler=scheduler)
    return engine


def train_step(engine, rank: int, step: int, poison: bool = False) -> bool:
    loss = engine(**batch(rank, step, engine.device)).loss
    if poison:
        loss = loss * float("nan")
    engine.backward(loss)
    engine.step()
    return bool(engine.was_step_applied())


def full_params(engine) -> dict:
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        return {n: p.detach().float().cpu().clone() for n, p in engine.module.named_parameters()}


def max_difference(a: dict, b: dict) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def run_row(rank: int, world: int, row: Row, workdir: str, device_type: str = "cpu") -> dict:
    """The figures of one row on this rank (plain numbers: they cross a process boundary)."""
    topo = Topology(rank=rank, world_size=world, local_rank=rank, ranks_per_node=world, node_rank=0)
    out = os.path.join(workdir, row.id)
    engine = build(row, world, device_type)
    result = {"optimizer": type(engine.basic_optimizer).__name__, "wrapper": type(engine.optimizer).__name__}
    initial = full_params(engine)
    result["step1_applied"] = train_step(engine, rank, 1)
    clip = getattr(engine, "bucket_clip", None)
    if clip is not None:
        result["clip_coefficients"] = [float(c) for c in clip.last_coefficients if c is not None]
    lamb = engine.basic_optimizer
    if row.optimizer == "lamb" and hasattr(lamb, "last_trust_ratios"):  # ours (apex's FusedLAMB keeps neither)
        result["lamb_layouts"] = len(lamb._layouts)
        result["lamb_ratios"] = [float(x) for r in lamb.last_trust_ratios for x in r.flatten()]
    checkpoint.save(engine, out, 1, {"step": 1, "world_size": world}, topo, keep_last=2)
    result["step2_applied"] = train_step(engine, rank, 2)
    after_step2 = full_params(engine)
    result["moved"] = max_difference(after_step2, initial)
    result["moved_by_gradients"] = gradient_part(initial, after_step2)
    result["nan_applied"] = train_step(engine, rank, 3, poison=True)
    result["changed_by_nan_step"] = max_difference(full_params(engine), after_step2)
    result["recovered_applied"] = train_step(engine, rank, 4)
    result["recovered_finite"] = all(bool(torch.isfinite(p).all()) for p in full_params(engine).values())
    del engine
    resumed = build(row, world, device_type)
    loaded = checkpoint.load(resumed, checkpoint.checkpoint_root(out), rank=rank)
    result["resumed_step"] = int(loaded["step"])
    result["resumed_step2_applied"] = train_step(resumed, rank, 2)
    result["resume_difference"] = max_difference(full_params(resumed), after_step2)
    if rank == 0:  # for the comparison across rows (the same steps at every ZeRO stage)
        torch.save({"initial": initial, "after_step2": after_step2}, os.path.join(workdir, f"{row.id}.params.pt"))
    dist.barrier()
    return result


def run_rows(rank: int, world: int, rows: list, workdir: str, device_type: str = "cpu") -> dict:
    """Every row in turn on this rank; a row that raises is reported with its error (the others still run)."""
    results = {}
    for row in rows:
        try:
            results[row.id] = run_row(rank, world, row, workdir, device_type)
        except Exception as exc:  # noqa: BLE001 - reported per row by the test
            results[row.id] = {"error": f"{type(exc).__name__}: {exc}"}
            dist.barrier()
    return results
