"""The one training loop. Pretraining and fine-tuning are tasks (:mod:`.tasks`) that bring data, a model,
a loss and their metrics; everything else is here, so both get every guarantee:

* engine set-up: the task's model, ``ds_bertopt.optim.build`` (LAMB/AdamW + schedule, spanning the real
  number of steps), ``ds_bertopt.engine.initialize`` (DeepSpeed + our extensions), the non-finite guard;
* the step: ``grad_accum`` micro-batches from the task's length-aware plan, collated (and masked) ahead
  of time by ``DataLoader`` workers into pinned memory on GPUs; losses stay on the device; with
  ``task.global_loss_normalizer`` the loss of every micro-batch is divided by the step's target count
  over all ranks and micro-batches (variable micro-batch sizes then give the big batch's gradient);
  a step with non-finite gradients is skipped (``max_consecutive_nonfinite`` in a row stop the job);
* evaluation every ``eval_every`` steps / each epoch, ``metrics.jsonl`` + DeepSpeed's monitor, tqdm on rank 0;
* atomic checkpoints with the run's identity, exact ``--resume`` (model, optimizer, scheduler, RNG, data
  position), preemption: SIGTERM/SIGUSR1 make every rank finish its step, checkpoint and exit
  with :data:`PREEMPTED_EXIT`;
* the entry point: generated CLI, pre-flight (nothing is built or written before it passes), process
  group, one-line errors, a dead peer named.

Host syncs per step, by design: reading ``engine.was_step_applied()`` (the non-finite verdict; DeepSpeed's
own overflow checks read it too) and the preemption flag of the step before (already reduced, no wait).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import random
import shutil
import signal
import sys
import uuid
from typing import Optional

import numpy as np
import torch

from .. import faults
from ..config import BertOptConfig, describe
from ..configlib import add_config_arguments, overrides_from_namespace
from ..dist import (
    Topology,
    barrier,
    describe_dead_peers,
    init_distributed,
    is_comm_failure,
    set_cpu_thread_default,
    topology_from_env,
    verify_topology,
)
from ..errors import BertOptError
from ..log import print0, print_all
from . import checkpoint
from .metrics import Metrics, Window, progress_bar
from .preflight import Plan, preflight, with_total_steps

PREEMPTED_EXIT = 75
"""Exit status after a preemption signal was honoured: a complete checkpoint was written; ``--resume``
continues exactly (EX_TEMPFAIL: "try again")."""
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(Exception):
    """Raised after the checkpoint that a preemption signal asked for is complete."""


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def step_loss_normalizer(local_targets: int, accum: int, world: int, device) -> torch.Tensor:
    """Collective: what each micro-batch divides its summed token losses by, so that the step's gradient is the
    mean over every target of the global batch however its samples were dealt. DeepSpeed's ``backward`` divides
    by the accumulation steps and its reduction averages over ranks, hence ``total / (accum × world)``."""
    total = torch.full((), float(local_targets), dtype=torch.float32, device=device)  # a fill: no blocking copy
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(total)
    return total / (accum * world)


class MicroBatches(torch.utils.data.Dataset):
    """Map-style view over micro-batch keys ``(epoch, step, micro, indices)``: collates in the workers."""

    def __init__(self, task):
        self.task = task

    def __getitem__(self, key):
        epoch, step, micro, indices = key
        return key, self.task.collate(list(indices), epoch=epoch, step=step, micro=micro)


class StepKeys(torch.utils.data.Sampler):
    """From a position on, the keys of every micro-batch of this rank, step after step (endless)."""

    def __init__(self, sampler, global_step: int):
        self.cursor, self.global_step = copy.copy(sampler), global_step  # its own position, the same plans

    def __iter__(self):
        step = self.global_step
        while True:
            step += 1
            micro_batches = self.cursor.next_step()
            for m, indices in enumerate(micro_batches):
                yield self.cursor.epoch, step, m, tuple(indices)


class Trainer:
    """One job on this rank: set-up in ``__init__``, the loop in :meth:`run`."""

    def __init__(self, plan: Plan, topo: Topology, task):
        from .. import optim
        from ..engine import initialize

        self.plan, self.topo, self.task = plan, topo, task
        b, ds = plan.cfg.bertopt, plan.cfg.deepspeed
        self.output_dir = plan.output_dir
        if b.train.deterministic:
            # torch's deterministic mode refuses cuBLAS GEMMs without a fixed workspace; set it before the first one
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        self.micro, self.accum, self.global_batch = (
            ds["train_micro_batch_size_per_gpu"],
            ds["gradient_accumulation_steps"],
            ds["train_batch_size"],
        )
        seed_everything(b.train.seed)  # identical init on every rank
        model = task.build(plan.cfg, topo)
        self.sampler = task.batch_sampler(topo, self.micro, self.accum)
        steps_per_epoch = self.sampler.steps_per_epoch
        epochs_steps = steps_per_epoch * b.train.epochs if b.train.epochs else None
        self.max_steps = min(s for s in (b.train.max_steps, epochs_steps) if s is not None)
        self.cfg = with_total_steps(plan.cfg, self.max_steps)
        self.b = self.cfg.bertopt
        self._start_run_directory()
        zero_stage = int(ds.get("zero_optimization", {}).get("stage", 0))
        optimizer, scheduler = optim.build(model, self.b, global_batch=self.global_batch, zero_stage=zero_stage)
        self.engine, _, _, _ = initialize(config=self.cfg, model=model, optimizer=optimizer, lr_scheduler=scheduler)
        seed_everything(b.train.seed + 7919 * (topo.rank + 1))  # distinct dropout (and sampling) per rank
        print0(
            f"{task.describe_model(self.engine)}; world {topo.world_size} ({topo.num_nodes} node(s) × "
            f"{topo.ranks_per_node}); global batch {self.global_batch} = {self.micro} × {self.accum} accumulation × "
            f"{topo.world_size} ranks; ZeRO {zero_stage}"
        )
        self.metrics = Metrics(self.engine, self.output_dir, topo.is_main)
        self.step = 0
        self.identity = checkpoint.identity(self.run_id, topo.world_size, describe(plan.cfg))
        if plan.resume_root is not None:
            self._resume(plan.resume_root)
        print0(
            f"plan: {steps_per_epoch} steps per epoch ({b.sampler.strategy}), {self.max_steps} steps; "
            f"{self.sampler.plan().dropped} samples left out of each epoch's last partial global batch; "
            f"{b.train.max_consecutive_nonfinite} steps in a row with non-finite gradients stop the job"
        )
        self.history: dict = {"eval": [], "train": []}
        self.skipped_in_a_row = 0
        self.stop_requested = False
        workers = b.train.dataloader_workers
        on_gpu = self.engine.device.type != "cpu"
        self.workers = workers if workers is not None else (2 if on_gpu else 0)
        self.pin_memory = on_gpu

    # --- run directory and resume ------------------------------------------------------------------
    def _start_run_directory(self) -> None:
        """The first write of the run: only now, after the pre-flight and the data and model checks passed."""
        self.run_id = self.plan.run_id
        if self.topo.is_main:
            if self.plan.resume_root is None:
                if self.b.train.overwrite_output_dir and os.path.isdir(self.output_dir):
                    shutil.rmtree(self.output_dir)
                    print0(f"overwrite_output_dir: removed the earlier run in {self.output_dir}")
                self.run_id = uuid.uuid4().hex[:12]
                checkpoint.write_run_id(self.output_dir, self.run_id)
                with open(os.path.join(self.output_dir, "config.json"), "w", encoding="utf-8") as fh:
                    json.dump(describe(self.cfg), fh, indent=2)
        holder = [self.run_id]
        if torch.distributed.is_initialized():
            torch.distributed.broadcast_object_list(holder, src=0)
        self.run_id = holder[0]
        barrier()  # no rank writes into output_dir before it exists

    def _resume(self, root: str) -> None:
        client = checkpoint.load(self.engine, root, rank=self.topo.rank, run_id=self.run_id)
        self.step = int(client["step"])
        self.sampler.load_state_dict(client["sampler"])
        if client.get("max_steps") not in (None, self.max_steps):
            print0(
                f"the run was planned for {client['max_steps']} steps and now for {self.max_steps}: the learning-rate "
                f"schedule spans {self.max_steps} steps from here on"
            )
        print0(
            f"resumed from {client['tag']}: step {self.step}, epoch {self.sampler.epoch}, "
            f"step {self.sampler.step} of {self.sampler.steps_per_epoch} in the epoch"
        )

    def client_state(self) -> dict:
        return {
            "step": self.step,
            "sampler": self.sampler.state_dict(),
            "world_size": self.topo.world_size,
            "global_batch": self.global_batch,
            "max_steps": self.max_steps,
            "identity": self.identity,
        }

    # --- the step -----------------------------------------------------------------------------------
    def _loader(self):
        # Its own generator: creating the iterator draws a seed, which must not shift the global RNG that
        # dropout uses (a resumed run creates its iterator at another point of the stream). Collation is
        # seeded per micro-batch anyway.
        loader = torch.utils.data.DataLoader(
            MicroBatches(self.task),
            batch_size=None,
            sampler=StepKeys(self.sampler, self.step),
            num_workers=self.workers,
            pin_memory=self.pin_memory,
            generator=torch.Generator().manual_seed(0),
            prefetch_factor=2 * self.accum if self.workers else None,
        )
        return iter(loader)

    def train_step(self, batches, sample_log, window: Window) -> None:
        """One optimizer step over this rank's ``grad_accum`` collated micro-batches."""
        engine, topo, device = self.engine, self.topo, self.engine.device
        epoch = batches[0][0][0]
        self.sampler.next_step()  # the consumed position, for checkpoints (the loader runs ahead on a copy)
        if sample_log is not None:
            sample_log.write(
                json.dumps(
                    {
                        "step": self.step + 1,
                        "epoch": epoch,
                        "rank": topo.rank,
                        "node": topo.node_rank,
                        "indices": [list(k[3]) for k, _ in batches],
                    }
                )
                + "\n"
            )
        normalizer = None
        if self.task.global_loss_normalizer:
            normalizer = step_loss_normalizer(
                sum(self.task.targets(batch) for _, batch in batches), self.accum, topo.world_size, device
            )
        losses, tokens = [], 0
        for _, batch in batches:
            tokens += self.task.tokens(batch)
            moved = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
            loss, mean_loss = self.task.loss(engine, moved, normalizer)  # to backpropagate, to report
            loss = faults.inject("loss", topo.rank, self.step + 1, loss)
            faults.inject("forward", topo.rank, self.step + 1)
            engine.backward(loss)
            engine.step()
            losses.append(faults.inject("loss", topo.rank, self.step + 1, mean_loss.detach()))
        self.step += 1
        if engine.was_step_applied():
            self.skipped_in_a_row = 0
            window.add_step(losses, tokens)
            return
        loss = float(torch.stack(losses).mean())
        if engine.fp16_enabled() and math.isfinite(loss):  # the dynamic loss scaler at work, not a broken run
            window.skipped += 1
            print0(
                f"step {self.step}: skipped by the fp16 loss scaler (gradient overflow), loss scale now "
                f"{getattr(engine.optimizer, 'loss_scale', '?')}"
            )
            return
        self._skipped(window, loss)

    def _skipped(self, window: Window, loss: float) -> None:
        self.skipped_in_a_row += 1
        window.skipped += 1
        self.metrics.write({"step": self.step, "skipped": True, "step_loss": loss}, self.step * self.global_batch)
        print0(f"step {self.step}: skipped, gradients not finite (loss {loss:.4g}); {self.skipped_in_a_row} in a row")
        if self.skipped_in_a_row >= self.b.train.max_consecutive_nonfinite:
            first = self.step - self.skipped_in_a_row + 1
            raise BertOptError(
                f"{self.skipped_in_a_row} consecutive steps had non-finite gradients (steps "
                f"{first}-{self.step}); stopping. Lower the learning rate, check the data, "
                "or resume from the last checkpoint"
            )

    # --- evaluation, checkpoints, preemption --------------------------------------------------------
    def evaluate(self) -> None:
        record = {
            "step": self.step,
            "epoch": self.sampler.epoch,
            **self.task.evaluate(self.engine, self.topo, self.b.train.seed),
        }
        self.history["eval"].append(record)
        self.metrics.write(record, self.step * self.global_batch)
        print0(f"step {self.step}: {self.task.eval_line(record)}")

    def save(self) -> None:
        path = checkpoint.save(
            self.engine,
            self.output_dir,
            self.step,
            self.client_state(),
            rank=self.topo.rank,
            local_rank=self.topo.local_rank,
            keep_last=self.b.train.keep_last,
        )
        print0(f"checkpoint saved: {path}")

    def _on_signal(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        self.stop_requested = True

    def _agreed_stop(self, pending):
        """Launch this step's reduction of the stop flag; return (the verdict of the step before, the new handle).

        Ranks may receive the signal in different steps; the MAX over ranks, read one step later (by then
        it is complete, so reading it does not wait), makes every rank stop after the same step."""
        flag = torch.full((1,), 1.0 if self.stop_requested else 0.0, device=self.engine.device)
        handle = None
        if torch.distributed.is_initialized():
            handle = torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, async_op=True)
        verdict = False
        if pending is not None:
            previous_flag, previous_handle = pending
            if previous_handle is not None:
                previous_handle.wait()
            verdict = bool(previous_flag.item() > 0)
        return verdict, (flag, handle)

    # --- the loop -----------------------------------------------------------------------------------
    def run(self) -> dict:
        t = self.b.train
        evaluates = t.eval_every > 0 or t.eval_each_epoch
        if self.step == 0 and t.eval_every:
            self.evaluate()
        sample_log = None
        if t.log_samples:
            os.makedirs(os.path.join(self.output_dir, "samples"), exist_ok=True)
            sample_log = open(
                os.path.join(self.output_dir, "samples", f"rank{self.topo.rank}.jsonl"),
                "a",
                encoding="utf-8",
                buffering=1,
            )
        previous = {s: signal.signal(s, self._on_signal) for s in PREEMPTION_SIGNALS}
        bar = progress_bar(self.max_steps, self.step, self.task.name, self.topo.is_main)
        window, pending, evaluated_at = Window(self.engine.device), None, -1
        batches_iter = self._loader()
        try:
            while self.step < self.max_steps:
                batches = [next(batches_iter) for _ in range(self.accum)]
                self.train_step(batches, sample_log, window)
                bar.update(1)
                last = self.step == self.max_steps
                epoch_end = self.sampler.step == self.sampler.steps_per_epoch
                if self.step % t.log_every == 0 or last:
                    record = window.close(self.step, self.engine.get_lr()[0], self.sampler.epoch, self.max_steps, bar)
                    self.history["train"].append(record)
                    self.metrics.write(record, self.step * self.global_batch)
                if (
                    (t.eval_every and self.step % t.eval_every == 0)
                    or (t.eval_each_epoch and epoch_end)
                    or (last and evaluates)
                ):
                    if evaluated_at != self.step:
                        self.evaluate()
                        evaluated_at = self.step
                stop, pending = self._agreed_stop(pending)
                if (t.save_every and self.step % t.save_every == 0) or last or stop:
                    self.save()
                if stop and not last:
                    raise Preempted(
                        f"preempted: stopped after step {self.step} of {self.max_steps}; the checkpoint "
                        f"is complete, continue with --resume (exit status {PREEMPTED_EXIT})"
                    )
        finally:
            if pending is not None and pending[1] is not None:
                pending[1].wait()
            for s, handler in previous.items():
                signal.signal(s, handler)
            bar.close()
            if sample_log is not None:
                sample_log.close()
            del batches_iter  # stops the loader's workers
        if t.save_model:
            self.task.save_final(self.engine, os.path.join(self.output_dir, "final"), self.topo)
        return {**self.history, "step": self.step}


# --- the entry point ---------------------------------------------------------------------------------
def build_arg_parser(task) -> argparse.ArgumentParser:
    """The CLI of a task: generic flags, the task's shortcuts, and ``--<section>.<field>`` for every config field."""
    p = argparse.ArgumentParser(
        description=task.description,
        usage="%(prog)s --deepspeed_config FILE [options]",
        allow_abbrev=False,  # --max_step must not silently mean --max_steps
        epilog="Every config field is also a flag (--section.field), documented below; "
        "-o key=value sets any bertopt key and -o deepspeed.key=value DeepSpeed's.",
    )
    p.add_argument("--deepspeed_config", required=True, help='DeepSpeed JSON with a "bertopt" section')
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    p.add_argument(
        "--resume",
        nargs="?",
        const="auto",
        default=None,
        metavar="DIR",
        help="continue this run from its newest complete checkpoint (of DIR, default: the output dir)",
    )
    p.add_argument(
        "-o",
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set any bertopt key (e.g. bucket_clip.enabled=true) or deepspeed.<key>",
    )
    add_config_arguments(p, BertOptConfig, "bertopt", task.shortcuts)
    return p


def overrides_of(args: argparse.Namespace) -> list[str]:
    return overrides_from_namespace(args) + list(args.override)


def main(task, argv: Optional[list[str]] = None) -> int:
    """Run ``task`` from the command line; returns the exit status (2: bad input, 1: a dead peer,
    :data:`PREEMPTED_EXIT`: checkpointed after a preemption signal)."""
    from deepspeed.accelerator import get_accelerator

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local checkpoints only: never reach for the hub mid-run
    args = build_arg_parser(task).parse_args(argv)
    started = False
    try:
        topo = topology_from_env(local_rank_arg=args.local_rank)
        set_cpu_thread_default(topo)
        plan = preflight(
            task, args.deepspeed_config, overrides_of(args), topo, get_accelerator().device_name(), resume=args.resume
        )
        started = True
        train = plan.cfg.bertopt.train
        init_distributed(topo, timeout_s=train.dist_timeout_s, init_timeout_s=train.dist_init_timeout_s)
        verify_topology(topo)
        history = Trainer(plan, topo, task).run()
    except Preempted as exc:
        print0(str(exc))
        return PREEMPTED_EXIT
    except BertOptError as exc:
        if started:  # may be specific to this rank: every rank that hits it says so
            print_all(f"error: {exc}", file=sys.stderr)
        else:
            print0(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - a dead peer: say who, then fail
        if not started or not is_comm_failure(exc):
            raise
        print_all(
            f"error: lost contact with the other ranks: {describe_dead_peers(topo.rank)} "
            f"({type(exc).__name__}: {str(exc).splitlines()[0][:160]})",
            file=sys.stderr,
        )
        return 1
    print0(task.done_line(history))
    return 0
