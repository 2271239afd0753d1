"""One gloo rank of the ZeRO fine-tuning test: tiny BERT + kit + WTA-CRS through ds_bertopt.engine.initialize.

Writes ``<out>/rank<R>.json`` with the per-step losses; the test asserts on them.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from wtacrs_common import tiny_bert  # noqa: E402


def learnable_batch(step: int, rank: int, batch: int = 8, seq: int = 16, vocab: int = 200):
    """Label 0: tokens from the lower half of the vocabulary, label 1: the upper half; some rows padded."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    labels = torch.randint(0, 2, (batch,), generator=gen)
    ids = torch.randint(5, vocab // 2, (batch, seq), generator=gen) + labels.unsqueeze(1) * (vocab // 2 - 5)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[batch // 2 :, seq - 5 :] = 0
    ids[mask == 0] = 0
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "labels": labels,
        "wtacrs_example_ids": torch.arange(batch) + batch * (rank + 2 * step),
        "wtacrs_num_valid_rows": int(mask.sum()),
    }  # the host count: k = ratio · N' without a device read


def run(rank: int, world: int, port: int, stage: int, out_dir: str, steps: int, wtacrs: dict) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_SIZE=str(world),
        DS_ACCELERATOR="cpu",
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    from ds_bertopt import engine as bertopt_engine
    from ds_bertopt import optim
    from ds_bertopt.config import BertOptConfig
    from ds_bertopt.configlib import load_section
    from ds_bertopt.wtacrs import SampledLinear, prepare_model

    bertopt_raw = {
        "wtacrs": wtacrs,
        "optimizer": {"lr": 2e-3},
        "schedule": {"type": "constant", "warmup_steps": 0},
        "train": {"max_steps": steps},
    }
    bertopt = load_section(BertOptConfig, bertopt_raw, "bertopt")
    model, lines = prepare_model(tiny_bert(seed=0), bertopt.wtacrs)
    sampled = sum(isinstance(m, SampledLinear) for m in model.modules())
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**6,
        "bertopt": bertopt_raw,
    }
    optimizer, scheduler = optim.build(model, bertopt, global_batch=8 * world, zero_stage=stage)
    engine, _, _, _ = bertopt_engine.initialize(config=config, model=model, optimizer=optimizer, lr_scheduler=scheduler)
    losses = []
    for step in range(steps):
        batch = learnable_batch(step, rank)
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach().float()))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"losses": losses, "sampled": sampled, "lines": lines}))
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
