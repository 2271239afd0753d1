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

import copy
import json
import os
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Optional

from .comm.config import BucketClipConfig
from .configlib import load_section, parse_override, set_dotted, to_dict
from .data.config import DataConfig, SamplerConfig
from .model.config import ModelConfig
from .errors import ConfigError, check
from .optim.config import OptimizerConfig, ScheduleConfig
from .train.finetune_config import FinetuneConfig
from .wtacrs.config import WtaCrsConfig


@dataclass(frozen=True)
class TrainConfig:
    max_steps: int = 300
    """Optimizer steps to train for."""
    output_dir: str = "runs/bert"
    """Checkpoints, monitor logs and the final model go here."""
    eval_every: int = 100
    """Evaluate every this many steps (and at step 0 and the end); 0 disables periodic eval."""
    log_every: int = 10
    """Print a log line every this many steps."""
    save_every: int = 0
    """Checkpoint every this many steps (and at the end); 0 saves only at the end."""
    keep_last: int = 3
    """Keep this many most recent checkpoints."""
    seed: int = 42
    """Seed for model init, masking and data order."""
    save_model: bool = True
    """Also write the final model in Hugging Face format to ``output_dir/final``."""
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
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """Used only when the DeepSpeed part has no ``fp16``/``bf16`` block. ``auto``: bf16 on GPUs that
    support it (else fp16), and on CPUs with native bf16 (AVX512-BF16/AMX); fp32 on other CPUs, where
    bf16 matmuls are emulated and measured 15× slower than fp32 (AVX2 EPYC, torch 2.13)."""

    def __post_init__(self) -> None:
        check(self.max_steps > 0, f"max_steps: must be positive, got {self.max_steps}")
        for name in ("eval_every", "save_every"):
            check(getattr(self, name) >= 0, f"{name}: must be >= 0, got {getattr(self, name)}")
        check(self.log_every > 0, f"log_every: must be positive, got {self.log_every}")
        check(self.keep_last >= 1, f"keep_last: must be at least 1, got {self.keep_last}")
        check(self.dist_timeout_s >= 10, f"dist_timeout_s: must be at least 10, got {self.dist_timeout_s}")
        check(self.dist_init_timeout_s >= 5,
              f"dist_init_timeout_s: must be at least 5, got {self.dist_init_timeout_s}")
        check(self.max_consecutive_nonfinite >= 1,
              f"max_consecutive_nonfinite: must be at least 1, got {self.max_consecutive_nonfinite}")


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
    """Sequence-classification fine-tuning (``launch/finetune.py``)."""

    def __post_init__(self) -> None:
        check(self.data.max_seq_length <= self.model.max_position_embeddings,
              f"data.max_seq_length: {self.data.max_seq_length} exceeds the model's "
              f"max_position_embeddings {self.model.max_position_embeddings}")


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

    def with_deepspeed(self, ds: dict, resolved_for: Optional[int] = None) -> "RunConfig":
        return replace(self, deepspeed=ds, resolved_for=resolved_for)


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
        raise ConfigError(f"config file {path} is not valid JSON: {exc.msg} at line {exc.lineno} "
                          f"column {exc.colno}") from None
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
            set_dotted(raw, key[len("deepspeed."):], value)
        else:
            set_dotted(ours, key[len("bertopt."):] if key.startswith("bertopt.") else key, value)
    bertopt = load_section(BertOptConfig, ours, "bertopt")
    return RunConfig(path=path, deepspeed=raw, bertopt=bertopt)


def resolve_batch(ds: dict, world_size: int) -> dict:
    """Fill in and check DeepSpeed's batch triple for ``world_size`` data-parallel ranks.

    ``train_batch_size = train_micro_batch_size_per_gpu × gradient_accumulation_steps × world``.
    Any two determine the third; all three must agree. Returns a new dict.
    """
    ds = copy.deepcopy(ds)
    tbs = ds.get("train_batch_size")
    mbs = ds.get("train_micro_batch_size_per_gpu")
    gas = ds.get("gradient_accumulation_steps")
    for name, value in (("train_batch_size", tbs), ("train_micro_batch_size_per_gpu", mbs),
                        ("gradient_accumulation_steps", gas)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ConfigError(f"{name}: must be a positive integer, got {json.dumps(value)}")
    if mbs is None and tbs is None:
        raise ConfigError("train_micro_batch_size_per_gpu: give it (or train_batch_size)")
    if mbs is not None and gas is None and tbs is None:
        gas = 1
    if tbs is not None and mbs is not None and gas is None:
        if tbs % (mbs * world_size):
            raise ConfigError(f"train_batch_size {tbs} is not divisible by "
                              f"train_micro_batch_size_per_gpu {mbs} × world size {world_size}")
        gas = tbs // (mbs * world_size)
    if tbs is not None and mbs is None:
        gas = gas or 1
        if tbs % (gas * world_size):
            raise ConfigError(f"train_batch_size {tbs} is not divisible by "
                              f"gradient_accumulation_steps {gas} × world size {world_size}")
        mbs = tbs // (gas * world_size)
    if tbs is None:
        tbs = mbs * gas * world_size
    if tbs != mbs * gas * world_size:
        raise ConfigError(f"train_batch_size {tbs} != train_micro_batch_size_per_gpu {mbs} × "
                          f"gradient_accumulation_steps {gas} × world size {world_size} "
                          f"(= {mbs * gas * world_size}); drop train_batch_size to let it follow")
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


def auto_precision(device_type: str) -> tuple[str, str]:
    """What ``precision: "auto"`` picks on ``device_type``, and why (one phrase for the log)."""
    if device_type == "cuda":
        import torch

        if torch.cuda.is_bf16_supported():
            return "bf16", "this GPU supports bf16"
        return "fp16", "this GPU has no bf16"
    if device_type != "cpu":
        return "fp32", f"no automatic choice for accelerator {device_type!r}"
    forced = os.environ.get(CPU_BF16_ENV, "").strip() in ("0", "1")
    if cpu_has_native_bf16():
        return "bf16", f"{CPU_BF16_ENV}=1" if forced else "this CPU has native bf16 (AVX512-BF16/AMX)"
    return "fp32", (f"{CPU_BF16_ENV}=0" if forced else
                    "this CPU has no native bf16, where bf16 matmuls are emulated and ~15x slower")


def apply_precision(ds: dict, precision: str, device_type: str) -> tuple[str, str]:
    """Fill DeepSpeed's ``bf16``/``fp16`` block from ``train.precision`` unless the user wrote one.

    Returns ``(precision in use, why)``, the reason being one phrase for the log line."""
    if "fp16" in ds or "bf16" in ds:
        return check_precision(ds, device_type), "set by the DeepSpeed fp16/bf16 block"
    why = "set by train.precision"
    if precision == "auto":
        precision, reason = auto_precision(device_type)
        why = f"train.precision auto: {reason}"
    if precision in ("bf16", "fp16"):
        ds[precision] = {"enabled": True}
    return check_precision(ds, device_type), why


def check_precision(ds: dict, device_type: str) -> str:
    """Return ``"fp16"``, ``"bf16"`` or ``"fp32"``; refuse fp16 where DeepSpeed cannot run it."""
    blocks = {}
    for name in ("fp16", "bf16"):
        block = ds.get(name, {})
        if not isinstance(block, dict):
            raise ConfigError(f"deepspeed.{name}: expected an object such as {{\"enabled\": true}}, "
                              f"got {json.dumps(block)}")
        blocks[name] = bool(block.get("enabled", False))
    fp16, bf16 = blocks["fp16"], blocks["bf16"]
    check(not (fp16 and bf16), "fp16 and bf16 are both enabled; enable one")
    if fp16 and device_type == "cpu":
        raise ConfigError("fp16 is not supported on CPU by DeepSpeed; set \"bf16\": {\"enabled\": true} "
                          "and \"fp16\": {\"enabled\": false}")
    return "fp16" if fp16 else "bf16" if bf16 else "fp32"


def describe(cfg: RunConfig) -> dict:
    """A JSON-able view of the resolved config, for logs and checkpoints."""
    return {"deepspeed": cfg.deepspeed, "bertopt": to_dict(cfg.bertopt)}
