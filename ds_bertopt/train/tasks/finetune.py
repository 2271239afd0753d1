"""Fine-tuning as a task of the shared loop (``launch/finetune.py``): ``finetune.task`` classification (one text or a
pair), regression, token classification or question answering (:mod:`.finetune_data` says what each reads, feeds
and scores). Labelled files are checked in the pre-flight and tokenised once; any Hugging Face BERT-family checkpoint
(default: the packaged MiniLM-L6) gets the task's transformers head and is prepared by
:func:`ds_bertopt.wtacrs.prepare_model` (LoRA → kit → WTA-CRS) *before* the engine is built, so ZeRO partitions the
swapped model. With ``model.unpadded`` the model runs on packed, padding-free micro-batches
(:class:`~ds_bertopt.model.heads.UnpaddedTaskModel`, the pretraining forward with the task's head); otherwise batches
are padded to their longest input. Losses: per example (question answering: per window) summed over the micro-batch
and divided by the nominal micro-batch; token classification per labelled token, divided by the step's labelled
tokens over all ranks (``global_loss_normalizer``). Evaluation is sharded by example over the ranks and scored by the
pure functions of :mod:`ds_bertopt.scores`.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from deepspeed.accelerator import get_accelerator
from transformers import AutoTokenizer
from transformers.utils import logging as hf_logging

from ...compat.deepspeed import zero3_numel
from ...compat.transformers import TORCH_MODULES
from ...config import RunConfig
from ...data.collate import collate_task_batch
from ...data.identity import DataFingerprint, array_digest, vocabulary_digest
from ...dist import Topology
from ...dsconfig import zero_stage
from ...errors import ConfigError
from ...log import print0
from ...model.bert import save_hf_model
from ...model.families import family_of_type
from ...model.heads import UnpaddedTaskModel, auto_model_class, task_losses
from ...model.local import resolve_model_dir
from ...model.pretrained import check_unpadded
from ...wtacrs import SampledLinear, prepare_model, run_from
from ...wtacrs.linear import EXAMPLE_IDS_KWARG, NUM_VALID_ROWS_KWARG, PACKED_INDEX_KWARG
from ...wtacrs.sizing import resolve_preset
from ..loop import main as run_task
from ..loop import to_device
from ..finetune_memory import task_variant
from ..metrics import all_reduce_sum, gather_objects
from .finetune_data import task_data

PACKED_KEYS = ("input_ids", "cu_seqlens", "token_type_ids", "position_ids", "max_seqlen", "seq_lengths")


class FinetuneTask:
    name = "finetune"
    title = "fine-tuning"
    description = (
        "BERT fine-tuning with DeepSpeed (ds_bertopt): classification of texts or text pairs, regression, token "
        "classification, extractive question answering."
    )
    reads = (
        "finetune",
        "train",
        "sampler",
        "bucket_clip",
        "optimizer",
        "schedule",
        "wtacrs",
        "data.max_skipped_fraction",
        "model.unpadded",
        "model.unpadded_attention",
        "model.compile",
    )
    unread_hints = {
        "model": (
            "the model is finetune.model_name_or_path's; fine-tuning reads model.unpadded, unpadded_attention and "
            "compile"
        ),
        "data": "its data settings are finetune.*, e.g. finetune.train_file, finetune.max_seq_length",
    }
    shortcuts = {
        **{key: f"finetune.{key}" for key in "model_name_or_path train_file validation_file text_column task".split()},
        **{key: f"finetune.{key}" for key in "text_pair_column label_column num_labels max_seq_length".split()},
        "epochs": "train.epochs",
    }
    global_loss_normalizer = False

    def preflight(self, cfg: RunConfig, topo: Topology, training: bool = True) -> None:  # noqa: ARG002
        b = cfg.bertopt
        f = b.finetune
        self.model_dir, model_config = resolve_model_dir(f.model_name_or_path, "finetune.model_name_or_path")
        positions = model_config.get("max_position_embeddings")
        if isinstance(positions, int) and f.max_seq_length > positions:
            raise ConfigError(
                f"finetune.max_seq_length: {f.max_seq_length} exceeds the model's max_position_embeddings {positions}"
            )
        self.family = family_of_type(model_config.get("model_type"), "finetune.model_name_or_path")
        self.unpadded = b.model.unpadded
        check_unpadded(self.family, self.unpadded)
        if not f.train_file:
            raise ConfigError("finetune.train_file: give --train_file (a .csv, .jsonl or datasets directory)")
        self.data = task_data(f, b.data.max_skipped_fraction)
        self.train_data = self.data.read(f.train_file, f.train_split)
        self.validation = self.data.read(f.validation_file, f.validation_split) if f.validation_file else None
        self.num_labels = self.data.prepare(self.train_data, self.validation)
        self.global_loss_normalizer = f.task == "token_classification"  # per labelled token, as run_ner's loss

    def build(self, cfg: RunConfig, topo: Topology) -> torch.nn.Module:
        b = cfg.bertopt
        f = b.finetune
        self.task = f.task
        if not topo.is_main:
            hf_logging.set_verbosity_error()
        self.train_data = self.train_data.subset(f.max_train_samples, b.train.seed, shuffle=True)
        self.tokenizer = _tokenizer(self.model_dir, f.task)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.samples, _ = self.data.samples(self.tokenizer, self.train_data, f.max_seq_length)
        self.lengths = np.asarray([len(s["input_ids"]) for s in self.samples], dtype=np.int64)
        line = f"data: {self.train_data.source}: {len(self.train_data)} training examples"
        if len(self.samples) != len(self.train_data):
            line += f" in {len(self.samples)} windows"
        line += f", {self.data.describe(self.num_labels)}"
        line += f" ({self.train_data.skipped}); " if self.train_data.skipped else "; "
        self.eval_samples = None
        if self.validation is not None:
            self.validation = self.validation.subset(f.max_eval_samples, b.train.seed, shuffle=False)
            self.eval_samples, example_of = self.data.samples(self.tokenizer, self.validation, f.max_seq_length)
            self.data.eval_samples = self.eval_samples
            self.windows_of = [[] for _ in range(len(self.validation))]
            for sample, example in enumerate(example_of):
                self.windows_of[example].append(sample)
            self.data.eval_windows = self.windows_of
            line += f"{self.validation.source}: {len(self.validation)} validation examples"
            line += f" ({self.validation.skipped})" if self.validation.skipped else ""
        print0(line if self.validation is not None else line + "no validation")
        arrays = [self.lengths, np.fromiter((t for s in self.samples for t in s["input_ids"]), dtype=np.int64)]
        arrays += self.data.fingerprint(self.samples)
        if self.eval_samples is not None:
            arrays += [np.fromiter((t for s in self.eval_samples for t in s["input_ids"]), dtype=np.int64)]
            arrays += self.data.fingerprint(self.eval_samples)
        self.fingerprint = DataFingerprint(
            vocabulary_digest(self.tokenizer),
            array_digest(arrays),
            f"model {self.model_dir}, finetune.task {f.task}, finetune.train_file {f.train_file}",
        )
        self.pad_multiple, self.eval_batch = (1 if self.unpadded else b.sampler.pad_multiple), f.eval_batch_size
        self.nominal_micro = cfg.deepspeed["train_micro_batch_size_per_gpu"]
        model = auto_model_class(f.task).from_pretrained(
            self.model_dir, **_head_arguments(f.task, self.num_labels, self.data), **TORCH_MODULES
        )
        seq = b.wtacrs.budget_seq_length or f.max_seq_length
        wtacrs, _, auto_lines = resolve_preset(  # the preset fallback; "auto": the fastest setup that fits the budget
            b.wtacrs,
            model,
            batch=self._budget_sequences(b, seq),
            seq=seq,
            precision=next((p for p in ("bf16", "fp16") if cfg.deepspeed.get(p, {}).get("enabled")), "fp32"),
            zero_stage=zero_stage(cfg.deepspeed),
            world=topo.world_size,
            model_dir=self.model_dir,
            device=get_accelerator().device_name(),
            num_labels=self.num_labels,
            threads=torch.get_num_threads(),
            task={"build": task_variant, "task": f.task, "packed": self.unpadded},
        )
        model, lines = prepare_model(model, wtacrs)
        for line in auto_lines + lines:
            print0(line)
        self.sampled = any(isinstance(m, SampledLinear) for m in model.modules())
        self.pass_example_ids = wtacrs.enabled and wtacrs.grad_norm_cache and self.sampled
        if self.unpadded:
            wrapper = UnpaddedTaskModel(model, attention=b.model.unpadded_attention, compile=b.model.compile)
            run_from(wrapper, model)  # its forward brackets what the prepared model's would (batch context, recompute)
            return wrapper
        return model

    def _budget_sequences(self, b, seq: int) -> int:
        """Sequences of ``seq`` tokens whose step the budget mode measures: the nominal micro-batch, or, packed under
        a token budget (``sampler.micro_batch_tokens``), as many as its tokens fill (the longest sequences: the most
        attention a packed row of that many tokens holds)."""
        tokens = b.sampler.micro_batch_tokens if self.unpadded and "packed" in b.sampler.strategy else None
        return -(-tokens // seq) if tokens else self.nominal_micro

    @staticmethod
    def skips_padding(cfg: RunConfig) -> bool:
        return cfg.bertopt.model.unpadded

    # --- the step -----------------------------------------------------------------------------------
    def _batch(self, samples: list[dict], indices: list[int]) -> dict:
        batch = collate_task_batch(
            [samples[i] for i in indices],
            self.task,
            packed=self.unpadded,
            pad_id=self.pad_id,
            pad_multiple=self.pad_multiple,
        )
        batch["example_ids"] = torch.as_tensor(indices, dtype=torch.long)
        return batch

    def collate(self, indices: list[int], *, epoch: int, step: int, micro: int) -> dict:  # noqa: ARG002
        return self._batch(self.samples, indices)

    def _forward(self, engine, batch: dict, example_ids: bool) -> tuple[dict, torch.Tensor]:
        """The model's outputs (logits at the labelled tokens; start/end ``[S, L]``, ``-inf`` beyond each sequence)
        and the per-target losses."""
        kwargs = {}
        if example_ids:
            kwargs[EXAMPLE_IDS_KWARG] = batch["example_ids"]
            if self.unpadded:  # the cache keys a packed token by its example and position in it
                kwargs[PACKED_INDEX_KWARG] = batch["pad_index"]
        if self.sampled:  # the budget k from a host count: no device read
            kwargs[NUM_VALID_ROWS_KWARG] = batch["num_tokens"]
        if self.unpadded:
            keys = PACKED_KEYS + {
                "token_classification": ("label_positions",),
                "question_answering": ("pad_index",),
            }.get(self.task, ())
            out = dict(engine(**{k: batch[k] for k in keys}, **kwargs))
        else:
            kwargs.update(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            if self.family.token_types:
                kwargs["token_type_ids"] = batch["token_type_ids"]
            out = dict(engine(**kwargs))
            if self.task == "token_classification":
                logits = out["logits"]
                out["logits"] = logits.reshape(-1, logits.shape[-1]).index_select(0, batch["label_positions"])
            elif self.task == "question_answering":
                pad = batch["attention_mask"] == 0
                out = {k: out[k].masked_fill(pad, float("-inf")) for k in ("start_logits", "end_logits")}
        targets = {k: batch[k] for k in ("labels", "start_positions", "end_positions") if k in batch}
        return out, task_losses(self.task, out, **targets)

    def loss(self, engine, batch: dict, normalizer) -> tuple[torch.Tensor, torch.Tensor]:
        _, losses = self._forward(engine, batch, self.pass_example_ids)
        divisor = normalizer if self.global_loss_normalizer else self.nominal_micro
        return losses.sum() / divisor, losses.mean()

    # --- evaluation and reporting -------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, engine, topo: Topology, seed: int) -> dict:  # noqa: ARG002
        """Loss and the task's scores over the validation set: examples dealt round-robin over the ranks (all windows
        of a question on one rank), every rank running equally many batches (ZeRO-3 gathers in step), the
        predictions gathered and scored on every rank."""
        if self.eval_samples is None:
            return {}
        world = topo.world_size
        per_rank = [sum(len(self.windows_of[e]) for e in range(r, len(self.windows_of), world)) for r in range(world)]
        mine = [w for e in range(topo.rank, len(self.windows_of), world) for w in self.windows_of[e]]
        batches = -(-max(per_rank) // self.eval_batch)
        engine.eval()
        loss_sum = torch.zeros((), dtype=torch.float64, device=engine.device)
        count, predicted = 0, {}
        for n in range(batches):
            chunk = mine[n * self.eval_batch : (n + 1) * self.eval_batch]
            batch = self._batch(self.eval_samples, chunk or [0])
            batch["sample_labels"] = [self.eval_samples[i].get("labels", ()) for i in chunk or [0]]
            batch["sample_lengths"] = [len(self.eval_samples[i]["input_ids"]) for i in chunk or [0]]
            out, losses = self._forward(engine, to_device(batch, engine.device), example_ids=False)
            if chunk:
                loss_sum += losses.double().sum()
                count += len(losses)
                predicted.update(zip(chunk, self.data.predict(out, batch)))
        engine.train()
        local = [
            (e, self.data.example_predictions(self.validation, e, [predicted[w] for w in self.windows_of[e]]))
            for e in range(topo.rank, len(self.windows_of), world)
        ]
        ordered = dict(item for part in gather_objects(local) for item in part)
        total, count = all_reduce_sum([loss_sum, count], engine.device)
        scores = self.data.scores(self.validation, [ordered[e] for e in range(len(self.windows_of))])
        return {"eval_loss": total / max(count, 1.0), **scores, "eval_examples": len(self.windows_of)}

    def eval_line(self, record: dict) -> str:
        if "eval_loss" not in record:
            return "no validation data"
        return f"epoch {record['epoch'] + 1}: eval loss {record['eval_loss']:.4f}, {self.data.line(record)}"

    @property
    def target_metric(self) -> str:
        """What ``train.target_eval_accuracy`` is compared with: the task's main score."""
        return self.data.main_score

    def describe_model(self, engine) -> str:
        # ZeRO-3 leaves partitioned params with numel 0; DeepSpeed keeps the full size in ds_numel
        trainable = sum(zero3_numel(p) for p in engine.module.parameters() if p.requires_grad)
        unpadded = f", unpadded ({engine.module.choose_attention()})" if self.unpadded else ""
        return f"model: {self.model_dir}: {trainable / 1e6:.2f}M trainable parameters{unpadded}"

    def save_final(self, engine, path: str, topo: Topology) -> None:
        """The fine-tuned model in Hugging Face format (LoRA: PEFT's adapter files)."""
        module = engine.module.model if self.unpadded else engine.module
        save_hf_model(module, path, is_main=topo.is_main, tokenizer=self.tokenizer)

    def done_line(self, history: dict) -> str:
        key = self.data.main_score
        values = ", ".join(f"{e[key]:.4f}" for e in history["eval"] if key in e)
        name = key.removeprefix("eval_").replace("_", " ")
        return f"done: {history['step']} steps" + (f"; {name} per evaluation: {values}" if values else "")


def _tokenizer(model_dir: str, task: str):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if task == "token_classification" and getattr(tokenizer, "add_prefix_space", None) is False:
        # byte-level BPE (RoBERTa, ModernBERT) takes pre-split words only with a prefix space
        tokenizer = AutoTokenizer.from_pretrained(model_dir, add_prefix_space=True)
    return tokenizer


def _head_arguments(task: str, num_labels: int, data) -> dict:
    """``from_pretrained`` keywords of the task's head."""
    # a checkpoint that carries a head for another label set (a model fine-tuned before) gets a new head, and
    # transformers' loading report names it
    out = {"ignore_mismatched_sizes": True}
    if task == "regression":
        return {**out, "num_labels": 1, "problem_type": "regression"}
    if task == "token_classification":
        names = data.label_names
        return {
            **out,
            "num_labels": num_labels,
            "id2label": dict(enumerate(names)),
            "label2id": {n: i for i, n in enumerate(names)},
        }
    return {**out, "num_labels": num_labels}


def main(argv: Optional[list[str]] = None) -> int:
    return run_task(FinetuneTask(), argv)
