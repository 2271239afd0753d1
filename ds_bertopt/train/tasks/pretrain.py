"""BERT masked-LM pretraining as a task of the shared loop (``launch/pretrain.py``).

Data: the corpus built into BERT sequences with recorded lengths (``ds_bertopt.data.pipeline``; local
rank 0 of each node builds, the others read the cache), planned by ``PlanBatchSampler``; each
micro-batch padded to its longest sample (rounded to ``sampler.pad_multiple``) and masked with a
generator seeded by (seed, epoch, step, micro-batch, rank), so a resumed run sees the same masks.
Model: Hugging Face ``BertForMaskedLM``/``BertForPreTraining`` with the MLM head run only at masked
positions (``ds_bertopt.model``). Loss: summed over masked tokens, divided by the step's masked-token
count over all ranks (the loop's ``global_loss_normalizer``). Metrics: held-out MLM loss and accuracy
with fixed masks.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...config import RunConfig
from ...data.collate import MLMCollator, PackedMLMCollator, step_generator
from ...data.sampler import PlanBatchSampler
from ...dist import Topology
from ...log import print0
from ...model.bert import save_hf_model
from ..metrics import sharded_evaluation


def _samples(dataset, indices: list[int], nsp: bool) -> list[dict]:
    cols = dataset[indices]
    keys = ["input_ids", "token_type_ids"] + (["next_sentence_label"] if nsp else [])
    return [{k: cols[k][i] for k in keys} for i in range(len(indices))]


def eval_generator(seed: int, key: int) -> torch.Generator:
    """Eval masks depend only on (seed, sample), so every evaluation scores the same masked tokens."""
    return step_generator(seed, 10**9, key)


FORWARD_KEYS = ("input_ids", "attention_mask", "token_type_ids", "labels", "next_sentence_label", "masked_positions")
UNPADDED_KEYS = (
    "input_ids",
    "token_type_ids",
    "position_ids",
    "cu_seqlens",
    "labels",
    "max_seqlen",
    "next_sentence_label",
    "seq_lengths",
    "masked_positions",
)


class PretrainTask:
    name = "pretrain"
    description = "BERT pretraining with DeepSpeed (ds_bertopt)."
    shortcuts = {
        "train_file": "data.train_files",
        "dataset": "data.dataset",
        "tokenizer": "data.tokenizer",
        "max_seq_length": "data.max_seq_length",
        "max_steps": "train.max_steps",
        "output_dir": "train.output_dir",
        "overwrite_output_dir": "train.overwrite_output_dir",
        "eval_every": "train.eval_every",
        "save_every": "train.save_every",
        "log_every": "train.log_every",
        "seed": "train.seed",
        "sampler": "sampler.strategy",
    }
    global_loss_normalizer = True

    def preflight(self, cfg: RunConfig, topo: Topology) -> None:
        from ...data.corpus import expand_train_files

        data = cfg.bertopt.data
        if data.train_files:
            expand_train_files(data.train_files, data.text_field)

    def build(self, cfg: RunConfig, topo: Topology) -> torch.nn.Module:
        from ...data.pipeline import build_pretrain_data
        from ...model import SparseMLMHead, build_pretraining_model
        from ...model.unpadded import UnpaddedBert

        b = self.b = cfg.bertopt
        self.data = build_pretrain_data(b, local_rank=topo.local_rank, distributed=topo.world_size > 1)
        self.rank, self.seed, self.nsp = topo.rank, b.train.seed, b.model.objective == "mlm_nsp"
        self.micro = cfg.deepspeed["train_micro_batch_size_per_gpu"]
        lengths = self.data.lengths
        print0(
            f"corpus: {self.data.source}: {len(self.data.train)} training sequences (mean length "
            f"{lengths.mean():.1f}, max {lengths.max()}), {len(self.data.eval)} held out; "
            f"vocabulary {len(self.data.tokenizer)}"
        )
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
            return UnpaddedBert(model, attention=b.model.unpadded_attention)
        return SparseMLMHead(model)

    def batch_sampler(self, topo: Topology, micro: int, accum: int) -> PlanBatchSampler:
        return PlanBatchSampler(
            self.data.lengths,
            rank=topo.rank,
            world_size=topo.world_size,
            ranks_per_node=topo.ranks_per_node,
            micro_batch=micro,
            grad_accum=accum,
            cfg=self.b.sampler,
            seed=self.b.train.seed,
        )

    # --- the step -----------------------------------------------------------------------------------
    def collate(self, indices: list[int], *, epoch: int, step: int, micro: int) -> dict:
        batch = self.collator(
            _samples(self.data.train, indices, self.nsp), step_generator(self.seed, epoch, step - 1, micro, self.rank)
        )
        batch["num_targets"] = int((batch["labels"] != -100).sum())
        batch["num_tokens"] = int(
            batch["input_ids"].numel() if "cu_seqlens" in batch else batch["attention_mask"].sum()
        )
        return batch

    @staticmethod
    def tokens(batch: dict) -> int:
        return batch["num_tokens"]

    @staticmethod
    def targets(batch: dict) -> int:
        return batch["num_targets"]

    def loss(self, engine, batch: dict, normalizer) -> tuple[torch.Tensor, torch.Tensor]:
        out = engine(**{k: batch[k] for k in self.forward_keys if k in batch}, loss_normalizer=normalizer)
        return out.loss, out.mean_loss

    # --- evaluation and reporting -------------------------------------------------------------------
    def evaluate(self, engine, topo: Topology, seed: int) -> dict:
        """MLM loss and accuracy on the held-out set with fixed masks."""

        def score(chunk: list[int]):
            batch = self.collator(_samples(self.data.eval, chunk, self.nsp), eval_generator(seed, chunk[0]))
            out = engine(
                **{
                    k: v.to(engine.device) if torch.is_tensor(v) else v
                    for k, v in batch.items()
                    if k in self.forward_keys
                }
            )
            logits, target = out.mlm_logits.float(), out.mlm_labels
            return (
                torch.nn.functional.cross_entropy(logits, target, reduction="sum"),
                (logits.argmax(-1) == target).sum(),
                int((batch["labels"] != -100).sum()),
            )

        return sharded_evaluation(engine, topo, len(self.data.eval), self.micro, score, counted="tokens")

    @staticmethod
    def eval_line(record: dict) -> str:
        return f"eval loss {record['eval_loss']:.4f}, MLM accuracy {record['eval_accuracy']:.4f}"

    @staticmethod
    def describe_model(engine) -> str:
        model = engine.module.model
        unpadded = ", unpadded" if type(engine.module).__name__ == "UnpaddedBert" else ""
        return (
            f"model: {type(model).__name__}{unpadded} {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
            "parameters"
        )

    def save_final(self, engine, path: str, topo: Topology) -> None:
        save_hf_model(engine.module.model, path, is_main=topo.is_main, tokenizer=self.data.tokenizer)

    @staticmethod
    def done_line(history: dict) -> str:
        evals = history["eval"]
        if not evals:
            return f"done: {history['step']} steps"
        return (
            f"done: {history['step']} steps; MLM accuracy {evals[0]['eval_accuracy']:.4f} -> "
            f"{evals[-1]['eval_accuracy']:.4f}, eval loss {evals[0]['eval_loss']:.4f} -> {evals[-1]['eval_loss']:.4f}"
        )


def main(argv: Optional[list[str]] = None) -> int:
    from ..loop import main as run

    return run(PretrainTask(), argv)
