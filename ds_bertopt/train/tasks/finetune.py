"""Sequence-classification fine-tuning as a task of the shared loop (``launch/finetune.py``): labelled files
(``ds_bertopt.data.labelled``) checked in the pre-flight and tokenised once; any Hugging Face BERT-family
checkpoint (default: the packaged MiniLM-L6) prepared by :func:`ds_bertopt.wtacrs.prepare_model` (LoRA → kit →
WTA-CRS) *before* the engine is built, so ZeRO partitions the swapped model; cross-entropy summed over the
micro-batch and divided by the nominal micro-batch; validation loss and accuracy.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from deepspeed.accelerator import get_accelerator
from transformers import AutoModelForSequenceClassification, AutoTokenizer
from transformers.utils import logging as hf_logging

from ...compat.deepspeed import zero3_numel
from ...compat.transformers import TORCH_MODULES
from ...config import RunConfig
from ...data.collate import pad_classification_batch
from ...data.identity import DataFingerprint, array_digest, vocabulary_digest
from ...data.labelled import check_labels, load_labelled
from ...dist import Topology
from ...errors import ConfigError
from ...log import print0
from ...model.bert import save_hf_model
from ...model.local import resolve_model_dir
from ...wtacrs import SampledLinear, prepare_model
from ...wtacrs.sizing import resolve_auto
from ...wtacrs.linear import EXAMPLE_IDS_KWARG, NUM_VALID_ROWS_KWARG
from ..loop import main as run_task
from ..loop import to_device
from ..metrics import sharded_evaluation


class FinetuneTask:
    name = "finetune"
    title = "fine-tuning"
    description = "BERT sequence-classification fine-tuning with DeepSpeed (ds_bertopt)."
    reads = (
        "finetune",
        "train",
        "sampler",
        "bucket_clip",
        "optimizer",
        "schedule",
        "wtacrs",
        "data.max_skipped_fraction",
    )
    unread_hints = {
        "model": "the model is finetune.model_name_or_path's",
        "data": "its data settings are finetune.*, e.g. finetune.train_file, finetune.max_seq_length",
    }
    shortcuts = {
        **{key: f"finetune.{key}" for key in "model_name_or_path train_file validation_file text_column".split()},
        **{key: f"finetune.{key}" for key in "label_column num_labels max_seq_length".split()},
        "epochs": "train.epochs",
    }
    global_loss_normalizer = False

    def preflight(self, cfg: RunConfig, topo: Topology, training: bool = True) -> None:  # noqa: ARG002
        f = cfg.bertopt.finetune
        self.model_dir, model_config = resolve_model_dir(f.model_name_or_path, "finetune.model_name_or_path")
        positions = model_config.get("max_position_embeddings")
        if isinstance(positions, int) and f.max_seq_length > positions:
            raise ConfigError(
                f"finetune.max_seq_length: {f.max_seq_length} exceeds the model's max_position_embeddings {positions}"
            )
        if not f.train_file:
            raise ConfigError("finetune.train_file: give --train_file (a .csv, .jsonl or datasets directory)")
        cap = cfg.bertopt.data.max_skipped_fraction
        self.train_data = load_labelled(f.train_file, f.text_column, f.label_column, f.train_split, f.label_names, cap)
        self.validation = None
        if f.validation_file:
            self.validation = load_labelled(
                f.validation_file, f.text_column, f.label_column, f.validation_split, f.label_names, cap
            )
        given = f.num_labels or (len(f.label_names) or None)
        self.num_labels = check_labels(self.train_data, self.validation, given, f.label_column)

    def build(self, cfg: RunConfig, topo: Topology) -> torch.nn.Module:
        b = cfg.bertopt
        f = b.finetune
        if not topo.is_main:
            hf_logging.set_verbosity_error()
        self.train_data = self.train_data.subset(f.max_train_samples, b.train.seed, shuffle=True)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.train_ids = self._tokenize(self.train_data.texts, f.max_seq_length)
        self.lengths = np.asarray([len(x) for x in self.train_ids], dtype=np.int64)
        line = f"data: {self.train_data.source}: {len(self.train_ids)} training examples, {self.num_labels} classes"
        line += f" ({self.train_data.skipped}); " if self.train_data.skipped else "; "
        self.eval_ids = None
        if self.validation is not None:
            self.validation = self.validation.subset(f.max_eval_samples, b.train.seed, shuffle=False)
            self.eval_ids = self._tokenize(self.validation.texts, f.max_seq_length)
            line += f"{self.validation.source}: {len(self.eval_ids)} validation examples"
            line += f" ({self.validation.skipped})" if self.validation.skipped else ""
        print0(line if self.validation is not None else line + "no validation")
        self.fingerprint = DataFingerprint(
            vocabulary_digest(self.tokenizer),
            array_digest(
                _examples(self.train_ids, self.train_data.labels)
                + _examples(self.eval_ids, self.validation.labels if self.validation is not None else ())
            ),
            f"model {self.model_dir}, finetune.train_file {f.train_file}",
        )
        self.pad_multiple, self.eval_batch = b.sampler.pad_multiple, f.eval_batch_size
        self.nominal_micro = cfg.deepspeed["train_micro_batch_size_per_gpu"]
        model = AutoModelForSequenceClassification.from_pretrained(
            self.model_dir, num_labels=self.num_labels, **TORCH_MODULES
        )
        wtacrs, _, auto_lines = resolve_auto(  # wtacrs.preset "auto": the fastest setup that fits memory_budget
            b.wtacrs,
            model_dir=self.model_dir,
            batch=self.nominal_micro,
            seq=b.wtacrs.budget_seq_length or f.max_seq_length,
            precision=next((p for p in ("bf16", "fp16") if cfg.deepspeed.get(p, {}).get("enabled")), "fp32"),
            device=get_accelerator().device_name(),
            num_labels=self.num_labels,
            threads=torch.get_num_threads(),
        )
        model, lines = prepare_model(model, wtacrs)
        for line in auto_lines + lines:
            print0(line)
        self.sampled = any(isinstance(m, SampledLinear) for m in model.modules())
        self.pass_example_ids = wtacrs.enabled and wtacrs.grad_norm_cache and self.sampled
        return model

    @staticmethod
    def skips_padding(cfg: RunConfig) -> bool:  # noqa: ARG004 - Hugging Face models compute on padding
        return False

    def _tokenize(self, texts, max_length: int) -> list[list[int]]:
        return self.tokenizer(list(texts), truncation=True, max_length=max_length)["input_ids"]

    def _batch(self, ids, labels, indices: list[int]) -> dict:
        batch = pad_classification_batch(
            [ids[i] for i in indices], [labels[i] for i in indices], indices, self.pad_id, self.pad_multiple
        )
        return {**batch, "num_tokens": int(batch["attention_mask"].sum()), "num_targets": len(indices)}

    # --- the step -----------------------------------------------------------------------------------
    def collate(self, indices: list[int], *, epoch: int, step: int, micro: int) -> dict:  # noqa: ARG002
        return self._batch(self.train_ids, self.train_data.labels, indices)

    def _forward(self, engine, batch: dict, example_ids: bool):
        kwargs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        if example_ids:
            kwargs[EXAMPLE_IDS_KWARG] = batch["example_ids"]
        if self.sampled:  # the budget k from a host count: no device read
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

        def score(chunk: list[int]):
            batch = self._batch(self.eval_ids, self.validation.labels, chunk)
            batch = to_device(batch, engine.device)
            logits = self._forward(engine, batch, example_ids=False)
            labels = batch["labels"]
            loss = torch.nn.functional.cross_entropy(logits, labels, reduction="sum")
            return loss, (logits.argmax(-1) == labels).sum(), len(chunk)

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
        trainable = sum(zero3_numel(p) for p in engine.module.parameters() if p.requires_grad)
        return f"model: {self.model_dir}: {trainable / 1e6:.2f}M trainable parameters"

    def save_final(self, engine, path: str, topo: Topology) -> None:
        """The fine-tuned model in Hugging Face format (LoRA: PEFT's adapter files)."""
        save_hf_model(engine.module, path, is_main=topo.is_main, tokenizer=self.tokenizer)

    @staticmethod
    def done_line(history: dict) -> str:
        accuracies = ", ".join(f"{e['eval_accuracy']:.4f}" for e in history["eval"] if "eval_accuracy" in e)
        return f"done: {history['step']} steps" + (f"; accuracy per evaluation: {accuracies}" if accuracies else "")


def _examples(ids, labels) -> list[np.ndarray]:
    """Token ids (with their lengths) and labels as arrays, for the data fingerprint; ``[]`` without data."""
    if ids is None:
        return []
    flat = np.fromiter((t for row in ids for t in row), dtype=np.int64)
    return [np.asarray([len(row) for row in ids], dtype=np.int64), flat, np.asarray(labels, dtype=np.int64)]


def main(argv: Optional[list[str]] = None) -> int:
    return run_task(FinetuneTask(), argv)
