"""Masked-LM pretraining (from scratch, or continued from a checkpoint of any family in ``ds_bertopt.model.families``)
as a task of the shared loop (``launch/pretrain.py``): the corpus built into BERT
sequences (``ds_bertopt.data.pipeline``), micro-batches padded or packed (``model.unpadded``) and masked with a
generator seeded by (seed, epoch, step, micro-batch, rank), so a resumed run sees the same masks; the MLM head
run only at masked positions; the loss divided by the step's masked-token count over all ranks
(``global_loss_normalizer``); held-out MLM loss and accuracy with fixed masks.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import torch

from ...config import RunConfig
from ...data.collate import IGNORE_INDEX, MLMCollator, PackedMLMCollator, step_generator
from ...data.corpus import check_cache_dir, check_dataset_dir, expand_train_files
from ...data.pipeline import build_pretrain_data, length_warnings
from ...data.sequences import special_token_count
from ...data.tokenizer import check_tokenizer_location
from ...dist import Topology
from ...log import print0
from ...model import SparseMLMHead, build_pretraining_model
from ...model.bert import save_hf_model
from ...model.local import check_model_dir
from ...model.pretrained import resolve_checkpoint
from ...model.unpadded import UnpaddedMLM
from ..loop import main as run_task
from ..loop import to_device
from ..metrics import sharded_evaluation


def _samples(dataset, indices: list[int], nsp: bool) -> list[dict]:
    cols = dataset[indices]
    keys = ["input_ids", "token_type_ids"] + (["next_sentence_label"] if nsp else [])
    return [{k: cols[k][i] for k in keys} for i in range(len(indices))]


FORWARD_KEYS = ("input_ids", "attention_mask", "token_type_ids", "labels", "next_sentence_label", "masked_positions")
UNPADDED_KEYS = (
    *(k for k in FORWARD_KEYS if k != "attention_mask"),
    *("position_ids", "cu_seqlens", "max_seqlen", "seq_lengths"),
)
"""The unpadded step drops the mask: each sequence's extent comes from ``cu_seqlens`` / ``seq_lengths``."""


class PretrainTask:
    name = "pretrain"
    title = "pretraining"
    description = "BERT pretraining with DeepSpeed (ds_bertopt)."
    reads = ("model", "data", "train", "sampler", "bucket_clip", "optimizer", "schedule")
    unread_hints = {
        "wtacrs": "WTA-CRS and the memory kit are for fine-tuning, launch/finetune.py",
        "finetune": "the section configures launch/finetune.py",
    }
    shortcuts = {
        "train_file": "data.train_files",
        "model_name_or_path": "model.init_checkpoint",
        **{key: f"data.{key}" for key in ("dataset", "tokenizer", "max_seq_length")},
        "eval_every": "train.eval_every",
        "sampler": "sampler.strategy",
    }
    global_loss_normalizer = True

    def preflight(self, cfg: RunConfig, topo: Topology, training: bool = True) -> None:  # noqa: ARG002
        data, model = cfg.bertopt.data, cfg.bertopt.model
        if data.train_files:
            expand_train_files(data.train_files, data.text_field)
        check_cache_dir(data.cache_dir, "data.cache_dir")
        if data.dataset and (os.sep in data.dataset or data.dataset.startswith((".", "~"))):
            check_dataset_dir(data.dataset)
        if not training:  # a phase-2 config names phase 1's output, which `ds-bertopt config` may check first
            return
        if data.tokenizer:
            check_tokenizer_location(data.tokenizer)
        if model.init_checkpoint:
            check_model_dir(os.path.expanduser(model.init_checkpoint), "model.init_checkpoint")

    @staticmethod
    def skips_padding(cfg: RunConfig) -> bool:
        return cfg.bertopt.model.unpadded

    def build(self, cfg: RunConfig, topo: Topology) -> torch.nn.Module:
        b = cfg.bertopt
        # a checkpoint's architecture and tokenizer, settled (and refused in one line) before the data is built
        model_cfg, data_cfg, _, lines = resolve_checkpoint(b.model, b.data)
        for line in lines:
            print0(line)
        b = self.b = dataclasses.replace(b, model=model_cfg, data=data_cfg)
        self.data = build_pretrain_data(b, topo)  # collective, with no timeout on the build (ds_bertopt.handoff)
        self.rank, self.seed, self.nsp = topo.rank, b.train.seed, b.model.objective == "mlm_nsp"
        self.micro = cfg.deepspeed["train_micro_batch_size_per_gpu"]
        lengths = self.lengths = self.data.lengths
        self.fingerprint = self.data.fingerprint
        skipped = f"; {self.data.skipped.line()}" if self.data.skipped.count else ""
        print0(f"data: {self.data.opened}")
        print0(
            f"corpus: {self.data.source}: {len(self.data.train)} training sequences (mean length "
            f"{lengths.mean():.1f}, max {lengths.max()}), {len(self.data.eval)} held out; "
            f"vocabulary {len(self.data.tokenizer)}{skipped}"
        )
        specials = special_token_count(self.nsp)
        eval_lengths = self.data.eval_lengths
        for line in length_warnings(lengths, eval_lengths, b.data.max_seq_length, b.data.mlm_probability, specials):
            print0(line)
        collator = PackedMLMCollator if b.model.unpadded else MLMCollator
        self.collator = collator(
            self.data.tokenizer,
            mlm_probability=b.data.mlm_probability,
            pad_multiple=b.sampler.pad_multiple,
            max_length=b.model.max_position_embeddings,
        )
        self.forward_keys = UNPADDED_KEYS if b.model.unpadded else FORWARD_KEYS
        model = build_pretraining_model(b.model, self.data.tokenizer, b.data.max_seq_length)
        if b.model.unpadded:
            options = {"fused_dropout": b.model.fused_dropout, "compile": b.model.compile}
            return UnpaddedMLM(model, attention=b.model.unpadded_attention, **options)
        return SparseMLMHead(model)

    # --- the step -----------------------------------------------------------------------------------
    def collate(self, indices: list[int], *, epoch: int, step: int, micro: int) -> dict:
        batch = self.collator(
            _samples(self.data.train, indices, self.nsp), step_generator(self.seed, epoch, step - 1, micro, self.rank)
        )
        batch["num_targets"] = int((batch["labels"] != IGNORE_INDEX).sum())
        batch["num_tokens"] = int(
            batch["input_ids"].numel() if "cu_seqlens" in batch else batch["attention_mask"].sum()
        )
        return batch

    def loss(self, engine, batch: dict, normalizer) -> tuple[torch.Tensor, torch.Tensor]:
        out = engine(**{k: batch[k] for k in self.forward_keys if k in batch}, loss_normalizer=normalizer)
        return out.loss, out.mean_loss

    # --- evaluation and reporting -------------------------------------------------------------------
    def evaluate(self, engine, topo: Topology, seed: int) -> dict:
        """MLM loss and accuracy on the held-out set with fixed masks."""

        def score(chunk: list[int]):
            # masks depend only on (seed, sample): every evaluation scores the same masked tokens
            batch = self.collator(_samples(self.data.eval, chunk, self.nsp), step_generator(seed, 10**9, chunk[0]))
            out = engine(**to_device(batch, engine.device, self.forward_keys))
            logits, target = out.mlm_logits.float(), out.mlm_labels
            return (
                torch.nn.functional.cross_entropy(logits, target, reduction="sum"),
                (logits.argmax(-1) == target).sum(),
                int((batch["labels"] != IGNORE_INDEX).sum()),
            )

        return sharded_evaluation(engine, topo, len(self.data.eval), self.micro, score, counted="tokens")

    @staticmethod
    def eval_line(record: dict) -> str:
        return f"eval loss {record['eval_loss']:.4f}, MLM accuracy {record['eval_accuracy']:.4f}"

    @staticmethod
    def describe_model(engine) -> str:
        model = engine.module.model
        # every rank decides its attention kernel here, once its engine placed the model (probing flash varlen eagerly)
        unpadded = f", {engine.module.choose_attention()}" if isinstance(engine.module, UnpaddedMLM) else ""
        millions = sum(p.numel() for p in model.parameters()) / 1e6
        tied = f"; {engine.module.tied}" if engine.module.tied else ""
        return f"model: {type(model).__name__}{unpadded} {millions:.1f}M parameters{tied}"

    def save_final(self, engine, path: str, topo: Topology) -> None:
        save_hf_model(engine.module.model, path, is_main=topo.is_main, tokenizer=self.data.tokenizer)

    @staticmethod
    def done_line(history: dict) -> str:
        evals = history["eval"]
        if not evals:
            return f"done: {history['step']} steps"
        first, last = evals[0], evals[-1]
        return (
            f"done: {history['step']} steps; MLM accuracy {first['eval_accuracy']:.4f} -> {last['eval_accuracy']:.4f}, "
            f"eval loss {first['eval_loss']:.4f} -> {last['eval_loss']:.4f}"
        )


def main(argv: Optional[list[str]] = None) -> int:
    return run_task(PretrainTask(), argv)
