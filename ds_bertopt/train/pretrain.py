"""BERT masked-LM pretraining through the real DeepSpeed engine.

``launch/pretrain.py`` parses arguments and calls :func:`main`. Order of work, so that bad input
fails before anything expensive or collective:

1. topology from the launcher's variables, config + CLI overrides, batch arithmetic, precision,
   corpus files — all checked on every rank, the error printed once;
2. process group (gloo on CPU, nccl on CUDA) with a finite timeout, topology cross-check;
3. data (local rank 0 of each node builds, the others read the cache), model, optimizer;
4. ``ds_bertopt.engine.initialize`` (DeepSpeed + our extensions), resume if asked;
5. the loop: ``grad_accum`` micro-batches per step from the plan sampler, dynamic padding,
   deterministic masking, periodic eval / logging / checkpoints; final eval, checkpoint, model.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from typing import Optional

import numpy as np
import torch

from ..config import RunConfig, describe, load_config
from ..dist import Topology, describe_dead_peers, init_distributed, is_comm_failure, set_cpu_thread_default, topology_from_env, verify_topology
from .. import faults
from ..errors import BertOptError
from ..data.collate import step_generator
from ..log import print0, print_all
from . import checkpoint

# CLI flag -> dotted key in the "bertopt" section
FLAG_KEYS = {
    "train_file": "data.train_files", "dataset": "data.dataset", "tokenizer": "data.tokenizer",
    "max_seq_length": "data.max_seq_length", "max_steps": "train.max_steps", "output_dir": "train.output_dir",
    "eval_every": "train.eval_every", "save_every": "train.save_every", "log_every": "train.log_every",
    "seed": "train.seed", "sampler": "sampler.strategy",
}


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="BERT pretraining with DeepSpeed (ds_bertopt).")
    p.add_argument("--deepspeed_config", required=True, help="DeepSpeed JSON with a \"bertopt\" section")
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    p.add_argument("--train_file", nargs="+", help="corpus files or globs (.txt, .jsonl, .gz)")
    p.add_argument("--dataset", help="a datasets name or save_to_disk directory instead of files")
    p.add_argument("--tokenizer", help="tokenizer directory or name (default: trained on the corpus)")
    p.add_argument("--max_seq_length", type=int)
    p.add_argument("--max_steps", type=int)
    p.add_argument("--output_dir")
    p.add_argument("--eval_every", type=int)
    p.add_argument("--save_every", type=int)
    p.add_argument("--log_every", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--sampler", help="batch planning strategy (see docs/data.md)")
    p.add_argument("--resume", nargs="?", const="auto", default=None, metavar="DIR",
                   help="continue from the newest complete checkpoint (of DIR, default: --output_dir)")
    p.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                   help="set any bertopt key (e.g. bucket_clip.enabled=true) or deepspeed.<key>")
    return p


def overrides_from_args(args: argparse.Namespace) -> list[str]:
    out = []
    for flag, key in FLAG_KEYS.items():
        value = getattr(args, flag)
        if value is not None:
            out.append(f"{key}={json.dumps(value)}")
    return out + list(args.override)


def prepare(args: argparse.Namespace, topo: Topology) -> RunConfig:
    """Load, override and validate everything that can be checked without other ranks."""
    from deepspeed.accelerator import get_accelerator

    from ..data.corpus import expand_train_files
    from ..engine import prepare_deepspeed_config, refuse_deepspeed_optimizer_blocks

    cfg = load_config(args.deepspeed_config, overrides_from_args(args))
    refuse_deepspeed_optimizer_blocks(cfg.deepspeed)
    ds = prepare_deepspeed_config(cfg, topo.world_size, get_accelerator().device_name())
    output_dir = os.path.abspath(os.path.expanduser(cfg.bertopt.train.output_dir))
    for monitor in ("csv_monitor", "tensorboard"):
        block = ds.get(monitor)
        if isinstance(block, dict) and block.get("enabled") and not block.get("output_path"):
            block["output_path"] = os.path.join(output_dir, "monitor")
    if cfg.bertopt.data.train_files:
        expand_train_files(cfg.bertopt.data.train_files, cfg.bertopt.data.text_field)
    if args.resume is not None:
        checkpoint.resolve_resume_dir(args.resume, output_dir)
    return cfg.with_deepspeed(ds, resolved_for=topo.world_size)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    torch.manual_seed(seed)


class Metrics:
    """Rank 0 appends JSON lines to ``output_dir/metrics.jsonl`` and feeds DeepSpeed's monitor."""

    def __init__(self, engine, output_dir: str, is_main: bool):
        self.engine = engine
        self.is_main = is_main
        self.path = os.path.join(output_dir, "metrics.jsonl")

    def write(self, record: dict, samples: int) -> None:
        if not self.is_main:
            return
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")
        monitor = getattr(self.engine, "monitor", None)
        if monitor is not None and getattr(monitor, "enabled", False):
            events = [(f"bertopt/{k}", float(v), samples) for k, v in record.items()
                      if k != "step" and isinstance(v, (int, float))]
            monitor.write_events(events)


def _all_reduce_sum(values: list[float], device) -> list[float]:
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


def _to_device(batch: dict, device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def _samples(dataset, indices: list[int], nsp: bool = False) -> list[dict]:
    cols = dataset[indices]
    keys = ["input_ids", "token_type_ids"] + (["next_sentence_label"] if nsp else [])
    return [{k: cols[k][i] for k in keys} for i in range(len(indices))]


@torch.no_grad()
def evaluate(engine, data, collator, micro_batch: int, topo: Topology, seed: int, nsp: bool) -> dict:
    """MLM loss and accuracy on the held-out set with fixed masks; every rank runs equally many batches."""
    engine.eval()
    n = len(data.eval)
    batches = math.ceil(math.ceil(n / topo.world_size) / micro_batch)
    mine = list(range(topo.rank, n, topo.world_size))
    loss_sum = correct = count = 0.0
    for b in range(batches):
        chunk = mine[b * micro_batch:(b + 1) * micro_batch]
        weight = 1.0 if chunk else 0.0
        chunk = chunk or [0]  # keep collectives (ZeRO-3 gathers) in step with the other ranks
        batch = collator(_samples(data.eval, chunk, nsp), eval_generator(seed, chunk[0]))
        out = engine(**_to_device(batch, engine.device))
        logits, target = out.mlm_logits.float(), out.mlm_labels
        loss_sum += weight * torch.nn.functional.cross_entropy(logits, target, reduction="sum").item()
        correct += weight * (logits.argmax(-1) == target).sum().item()
        count += weight * target.numel()
    engine.train()
    loss_sum, correct, count = _all_reduce_sum([loss_sum, correct, count], engine.device)
    return {"eval_loss": loss_sum / max(count, 1.0), "eval_accuracy": correct / max(count, 1.0),
            "eval_tokens": int(count)}


def eval_generator(seed: int, key: int) -> torch.Generator:
    """Eval masks depend only on (seed, sample), so every evaluation scores the same masked tokens."""
    return step_generator(seed, 10 ** 9, key)


class Pretrainer:
    """One pretraining job on this rank: set-up in ``__init__``, the loop in :meth:`run`."""

    def __init__(self, cfg: RunConfig, topo: Topology, resume: Optional[str]):
        from .. import optim
        from ..data.collate import MLMCollator
        from ..data.pipeline import build_pretrain_data
        from ..data.sampler import PlanBatchSampler
        from ..engine import initialize
        from ..model import SparseMLMHead, build_pretraining_model
        from .nonfinite import install_nonfinite_guard

        self.cfg, self.topo, self.b = cfg, topo, cfg.bertopt
        b, ds = self.b, cfg.deepspeed
        self.output_dir = os.path.abspath(os.path.expanduser(b.train.output_dir))
        if b.train.deterministic:
            torch.use_deterministic_algorithms(True)

        self.data = build_pretrain_data(b, local_rank=topo.local_rank, distributed=topo.world_size > 1)
        self.micro, accum = ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]
        self.global_batch = ds["train_batch_size"]
        lengths = self.data.lengths
        print0(f"corpus: {self.data.source}: {len(self.data.train)} training sequences (mean length "
               f"{lengths.mean():.1f}, max {lengths.max()}), {len(self.data.eval)} held out; "
               f"vocabulary {len(self.data.tokenizer)}")

        seed_everything(b.train.seed)  # identical init on every rank
        model = SparseMLMHead(build_pretraining_model(b.model, self.data.tokenizer, b.data.max_seq_length))
        if topo.is_main:  # only once the data and the model passed their checks: bad input writes nothing
            os.makedirs(self.output_dir, exist_ok=True)
            with open(os.path.join(self.output_dir, "config.json"), "w", encoding="utf-8") as fh:
                json.dump(describe(cfg), fh, indent=2)
        zero_stage = int(ds.get("zero_optimization", {}).get("stage", 0))
        optimizer, scheduler = optim.build(model, b, global_batch=self.global_batch, zero_stage=zero_stage)
        self.engine, _, _, _ = initialize(config=cfg, model=model, optimizer=optimizer, lr_scheduler=scheduler)
        print0(f"non-finite gradients skip the step ({install_nonfinite_guard(self.engine)}); "
               f"{b.train.max_consecutive_nonfinite} in a row stop the job")
        seed_everything(b.train.seed + 7919 * (topo.rank + 1))  # distinct dropout per rank
        print0(f"model: {type(model.model).__name__} {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
               f"parameters; world {topo.world_size} ({topo.num_nodes} node(s) × {topo.ranks_per_node}); global "
               f"batch {self.global_batch} = {self.micro} × {accum} accumulation × {topo.world_size} ranks; "
               f"ZeRO {zero_stage}")

        self.sampler = PlanBatchSampler(lengths, rank=topo.rank, world_size=topo.world_size,
                                        ranks_per_node=topo.ranks_per_node, micro_batch=self.micro,
                                        grad_accum=accum, cfg=b.sampler, seed=b.train.seed)
        self.collator = MLMCollator(self.data.tokenizer, mlm_probability=b.data.mlm_probability,
                                    pad_multiple=b.sampler.pad_multiple, max_length=b.model.max_position_embeddings)
        self.metrics = Metrics(self.engine, self.output_dir, topo.is_main)
        self.nsp = b.model.objective == "mlm_nsp"
        self.step = 0
        if resume is not None:
            self._resume(resume)
        print0(f"plan: {self.sampler.steps_per_epoch} steps per epoch ({b.sampler.strategy}); "
               f"{self.sampler.plan().dropped} sequences left out of each epoch's last partial global batch")
        self.history: dict = {"eval": []}
        self.skipped_in_a_row = 0
        self._reset_window()

    def _resume(self, resume: str) -> None:
        root = checkpoint.resolve_resume_dir(resume, self.output_dir)
        client = checkpoint.load(self.engine, root, rank=self.topo.rank)
        _check_resumable(client, self.sampler)
        self.step = int(client["step"])
        self.sampler.load_state_dict(client["sampler"])
        print0(f"resumed from {client['tag']}: step {self.step}, epoch {self.sampler.epoch}, "
               f"step {self.sampler.step} of {self.sampler.steps_per_epoch} in the epoch")

    def client_state(self) -> dict:
        return {"step": self.step, "sampler": self.sampler.state_dict(), "world_size": self.topo.world_size,
                "global_batch": self.global_batch}

    def _reset_window(self) -> None:
        self.window = {"loss": 0.0, "micro": 0, "tokens": 0, "skipped": 0, "t0": time.perf_counter()}

    def train_step(self, sample_log) -> None:
        """One optimizer step: ``grad_accum`` micro-batches, then DeepSpeed's boundary step."""
        engine, topo, seed = self.engine, self.topo, self.b.train.seed
        micro_batches = self.sampler.next_step()
        epoch = self.sampler.epoch  # next_step() may have started a new epoch
        if sample_log is not None:
            sample_log.write(json.dumps({"step": self.step + 1, "epoch": epoch, "rank": topo.rank,
                                         "node": topo.node_rank, "indices": micro_batches}) + "\n")
        step_loss = 0.0
        for m, indices in enumerate(micro_batches):
            batch = self.collator(_samples(self.data.train, indices, self.nsp),
                                  step_generator(seed, epoch, self.step, m, topo.rank))
            self.window["tokens"] += int(batch["attention_mask"].sum())
            out = engine(**_to_device(batch, engine.device))
            loss = faults.inject("loss", topo.rank, self.step + 1, out.loss)
            faults.inject("forward", topo.rank, self.step + 1)
            engine.backward(loss)
            engine.step()
            step_loss += loss.item()
        self.step += 1
        if engine.was_step_applied():
            self.skipped_in_a_row = 0
            self.window["loss"] += step_loss
            self.window["micro"] += len(micro_batches)
        else:
            self._skipped(step_loss / len(micro_batches))

    def _skipped(self, loss: float) -> None:
        self.skipped_in_a_row += 1
        self.window["skipped"] += 1
        self.metrics.write({"step": self.step, "skipped": True, "step_loss": loss}, self.step * self.global_batch)
        print0(f"step {self.step}: skipped, gradients not finite (loss {loss:.4g}); {self.skipped_in_a_row} in a row")
        if self.skipped_in_a_row >= self.b.train.max_consecutive_nonfinite:
            first = self.step - self.skipped_in_a_row + 1
            raise BertOptError(f"{self.skipped_in_a_row} consecutive steps had non-finite gradients (steps "
                               f"{first}-{self.step}); stopping. Lower the learning rate, check the data, "
                               "or resume from the last checkpoint")

    def log_progress(self, bar) -> None:
        window = self.window
        loss_sum, micro_count, tokens = _all_reduce_sum([window["loss"], window["micro"], window["tokens"]],
                                                        self.engine.device)
        elapsed = time.perf_counter() - window["t0"]
        record = {"step": self.step, "lr": self.engine.get_lr()[0], "tokens_per_s": tokens / max(elapsed, 1e-9),
                  "epoch": self.sampler.epoch, "skipped": window["skipped"]}
        if micro_count:  # every step of the window may have been skipped
            record["loss"] = loss_sum / micro_count
        self.metrics.write(record, self.step * self.global_batch)
        loss_text = f"loss {record['loss']:.4f}" if "loss" in record else "all steps skipped"
        bar.set_postfix_str(f"{loss_text}, lr {record['lr']:.2e}, {record['tokens_per_s']:.0f} tok/s")
        if bar.disable:  # no terminal: a plain line instead of the bar
            print0(f"step {self.step}/{self.b.train.max_steps}: {loss_text}, lr {record['lr']:.3e}, "
                   f"{record['tokens_per_s']:.0f} tokens/s")
        self._reset_window()

    def evaluate(self) -> None:
        record = {"step": self.step, **evaluate(self.engine, self.data, self.collator, self.micro, self.topo,
                                                self.b.train.seed, self.nsp)}
        self.history["eval"].append(record)
        self.metrics.write(record, self.step * self.global_batch)
        print0(f"step {self.step}: eval loss {record['eval_loss']:.4f}, MLM accuracy {record['eval_accuracy']:.4f}")

    def save(self) -> None:
        path = checkpoint.save(self.engine, self.output_dir, self.step, self.client_state(), rank=self.topo.rank,
                               local_rank=self.topo.local_rank, keep_last=self.b.train.keep_last)
        print0(f"checkpoint saved: {path}")

    def run(self) -> dict:
        from tqdm.auto import tqdm

        t = self.b.train
        if self.step == 0 and t.eval_every:
            self.evaluate()
        sample_log = None
        if t.log_samples:
            os.makedirs(os.path.join(self.output_dir, "samples"), exist_ok=True)
            sample_log = open(os.path.join(self.output_dir, "samples", f"rank{self.topo.rank}.jsonl"), "a",
                              encoding="utf-8", buffering=1)
        bar = tqdm(total=t.max_steps, initial=self.step, desc="pretrain", dynamic_ncols=True,
                   disable=not self.topo.is_main or not sys.stderr.isatty())
        self._reset_window()
        try:
            while self.step < t.max_steps:
                self.train_step(sample_log)
                bar.update(1)
                last = self.step == t.max_steps
                if self.step % t.log_every == 0 or last:
                    self.log_progress(bar)
                if t.eval_every and (self.step % t.eval_every == 0 or last):
                    self.evaluate()
                if (t.save_every and self.step % t.save_every == 0) or last:
                    self.save()
        finally:
            bar.close()
            if sample_log is not None:
                sample_log.close()
        if t.save_model:
            _save_final_model(self.engine, self.data.tokenizer, os.path.join(self.output_dir, "final"), self.topo)
        return {**self.history, "step": self.step}


def train(cfg: RunConfig, topo: Topology, resume: Optional[str]) -> dict:
    return Pretrainer(cfg, topo, resume).run()


def _check_resumable(client: dict, sampler) -> None:
    saved = client.get("sampler", {})
    mine = sampler.state_dict()
    for key in ("num_samples", "world_size", "seed", "strategy"):
        if key in saved and saved[key] != mine[key]:
            raise BertOptError(f"cannot resume {client.get('tag')}: it was written with sampler {key}={saved[key]!r}, "
                               f"this run has {mine[key]!r}; resume with the same data, world size and sampler, "
                               "or start a new output_dir")
    if client.get("global_batch") not in (None, sampler.world_size * sampler.grad_accum * sampler.micro_batch):
        raise BertOptError(f"cannot resume {client.get('tag')}: it was written with global batch "
                           f"{client['global_batch']}, this run has "
                           f"{sampler.world_size * sampler.grad_accum * sampler.micro_batch}")


def _save_final_model(engine, tokenizer, path: str, topo: Topology) -> None:
    """Hugging Face format (``from_pretrained``-loadable), gathered under ZeRO-3."""
    import deepspeed

    module = engine.module.model  # the Hugging Face model inside SparseMLMHead
    params = list(module.parameters())
    zero3 = any(hasattr(p, "ds_id") for p in params)
    if zero3:
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            if topo.is_main:
                module.save_pretrained(path, state_dict={k: v.detach().float().cpu().clone()
                                                         for k, v in module.state_dict().items()})
    elif topo.is_main:
        module.save_pretrained(path, state_dict={k: v.detach().float().cpu() for k, v in module.state_dict().items()})
    if topo.is_main:
        tokenizer.save_pretrained(path)
        print0(f"final model written to {path}")


def main(argv: Optional[list[str]] = None) -> int:
    args = build_arg_parser().parse_args(argv)
    started = False
    try:
        topo = topology_from_env(local_rank_arg=args.local_rank)
        set_cpu_thread_default(topo)
        cfg = prepare(args, topo)  # identical on every rank: its errors are printed once
        started = True
        init_distributed(topo, timeout_s=cfg.bertopt.train.dist_timeout_s,
                         init_timeout_s=cfg.bertopt.train.dist_init_timeout_s)
        verify_topology(topo)
        history = train(cfg, topo, args.resume)
    except BertOptError as exc:
        if started:  # may be specific to this rank: every rank that hits it says so
            print_all(f"error: {exc}", file=sys.stderr)
        else:
            print0(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - a dead peer: say who, then fail
        if not started or not is_comm_failure(exc):
            raise
        print_all(f"error: lost contact with the other ranks: {describe_dead_peers(topo.rank)} "
                  f"({type(exc).__name__}: {str(exc).splitlines()[0][:160]})", file=sys.stderr)
        return 1
    evals = history["eval"]
    if evals:
        print0(f"done: {history['step']} steps; MLM accuracy {evals[0]['eval_accuracy']:.4f} -> "
               f"{evals[-1]['eval_accuracy']:.4f}, eval loss {evals[0]['eval_loss']:.4f} -> {evals[-1]['eval_loss']:.4f}")
    return 0
