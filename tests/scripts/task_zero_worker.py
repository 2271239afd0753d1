"""One gloo rank of the every-task × every-ZeRO-stage check: for each fine-tuning task a tiny BERT task model on packed
rows (``ds_bertopt.model.heads.UnpaddedTaskWithLoss``: the unpadded heads and the stock loss), through
``ds_bertopt.engine.initialize`` at ZeRO 0, 1, 2 and 3, two AdamW steps on the same batches (fp32).

Writes ``<out>/rank<R>.json``: ``{task: {stage: {"losses": [...], "updates": {parameter: |after - before|}}}}`` (the
parameters gathered under ZeRO 3)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import torch

TASKS = ("classification", "regression", "token_classification", "question_answering")


def tiny(task: str):
    import transformers

    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        num_labels={"regression": 1, "token_classification": 5, "question_answering": 2}.get(task, 3),
    )  # fmt: skip
    cls = {"token_classification": "ForTokenClassification", "question_answering": "ForQuestionAnswering"}
    return getattr(transformers, "Bert" + cls.get(task, "ForSequenceClassification"))(config)


def features(task: str, step: int, rank: int) -> list[dict]:
    rng = random.Random(1000 * step + rank)
    out = []
    for _ in range(4):
        n = rng.randrange(5, 30)
        feature = {"input_ids": [rng.randrange(3, 120) for _ in range(n)], "token_type_ids": [0] * n}
        if task == "classification":
            feature["labels"] = rng.randrange(3)
        elif task == "regression":
            feature["labels"] = rng.uniform(0, 5)
        elif task == "token_classification":
            feature["labels"] = [rng.randrange(5) if rng.random() < 0.7 else -100 for _ in range(n)]
        else:
            feature["start_positions"] = rng.randrange(n)
            feature["end_positions"] = rng.randrange(feature["start_positions"], n)
        out.append(feature)
    return out


def run(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_SIZE=str(world), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
    )  # fmt: skip
    torch.set_num_threads(1)
    from deepspeed.utils import safe_get_full_fp32_param

    from ds_bertopt import engine as bertopt_engine
    from ds_bertopt import optim
    from ds_bertopt.config import BertOptConfig
    from ds_bertopt.configlib import load_section
    from ds_bertopt.data.collate import PackedTaskFeatures
    from ds_bertopt.model.heads import TASK_MODEL_CLASSES

    # fp32 pinned: "auto" picks bf16 on a native-bf16 CPU, whose rounding the 1e-5 loss tolerance is not for
    train = {"max_steps": 2, "precision": "fp32"}
    raw = {"optimizer": {"lr": 1e-3}, "schedule": {"type": "constant", "warmup_steps": 0}, "train": train}
    bertopt = load_section(BertOptConfig, raw, "bertopt")
    results: dict = {}
    for task in TASKS:
        collate = PackedTaskFeatures(task)
        for stage in (0, 1, 2, 3):
            model = TASK_MODEL_CLASSES[task](tiny(task), attention="sdpa_loop")
            config = {
                "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
                "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
                "steps_per_print": 10**6, "bertopt": raw,
            }  # fmt: skip
            optimizer, scheduler = optim.build(model, bertopt, global_batch=4 * world, zero_stage=stage)
            engine, *_ = bertopt_engine.initialize(
                config=config, model=model, optimizer=optimizer, lr_scheduler=scheduler
            )
            losses = []
            for step in range(2):
                batch = collate(features(task, step, rank))
                loss = engine(**batch).loss
                engine.backward(loss)
                engine.step()
                losses.append(float(loss.detach()))
            start = dict(tiny(task).named_parameters())
            updates = {}
            for name, param in engine.module.named_parameters():
                after = safe_get_full_fp32_param(param) if stage == 3 else param.detach()
                updates[name] = float((after - start[name.removeprefix("model.")]).norm())
            results.setdefault(task, {})[str(stage)] = {"losses": losses, "updates": updates}
            engine.destroy()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
