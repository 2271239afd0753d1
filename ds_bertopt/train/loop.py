"""The one training loop; pretraining and fine-tuning are tasks (:mod:`.tasks`) bringing data, a model, a loss
and metrics. Here: engine set-up; the step (micro-batches of the length-aware plan collated ahead by ``DataLoader``
workers, the global loss normalizer, non-finite steps skipped, too many in a row stop the job); evaluation and
``metrics.jsonl``; atomic checkpoints and exact ``--resume``; preemption (SIGTERM/SIGUSR1, and SIGINT (Ctrl-C) alike:
every rank finishes its step, checkpoints, exits :data:`PREEMPTED_EXIT`); the entry point (pre-flight, one-line
errors, dead peers named, a full disk named).
Host syncs per step, by design: ``engine.was_step_applied()`` (the non-finite verdict; DeepSpeed's own overflow
checks read it too). The preemption vote of the step before is read from pinned host memory behind its own event
(:class:`StopVote`), which waits for nothing queued since.
"""

from __future__ import annotations

import argparse
import copy
import errno
import json
import math
import os
import random
import signal
import sys
from typing import Optional

import numpy as np
import torch
from deepspeed.accelerator import get_accelerator

from .. import dist, dsconfig, faults, optim
from ..compat.deepspeed import loss_scale
from ..config import describe, run_arg_parser, run_overrides
from ..data.sampler import PlanBatchSampler
from ..engine import initialize
from ..data.identity import check_same_data
from ..errors import BertOptError, JobError
from ..log import print0, print_all
from ..mounts import device_of
from . import checkpoint, rundir
from .metrics import Metrics, Window, progress_bar
from .preflight import Plan, preflight, with_total_steps

PREEMPTED_EXIT = 75
"""Exit status after a preemption signal was honoured: a complete checkpoint was written; ``--resume``
continues exactly (EX_TEMPFAIL: "try again")."""
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
"""Each asks for a checkpoint and a clean stop after the current step; a second SIGINT stops at once."""
COMMON_SHORTCUTS = {
    k: f"train.{k}" for k in "max_steps output_dir overwrite_output_dir seed log_every save_every".split()
}
"""CLI aliases every task has (``--max_steps`` for ``--train.max_steps``); tasks add their own."""


def ignore_preemption_signals(worker_id: int) -> None:  # noqa: ARG001 - DataLoader's worker_init_fn signature
    """In a DataLoader worker: leave preemption signals to the rank. Ctrl-C and a scheduler's SIGTERM reach the
    whole process group; a worker that died of them would fail the step the rank is finishing to checkpoint.
    The rank ends its workers itself (and they exit when it dies, through torch's watchdog)."""
    for signum in PREEMPTION_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


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


def to_device(batch: dict, device, keys=None) -> dict:
    """The batch's tensors on ``device`` (non-blocking: pinned host memory on GPUs), other values as they are."""
    return {
        k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v
        for k, v in batch.items()
        if keys is None or k in keys
    }


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


class StopVote:
    """This rank's wish to stop, MAX-reduced over the ranks, read one step later without a host sync in the step.

    On an accelerator the reduction's result is copied to pinned host memory behind an event as soon as it is
    launched (``handle.wait()`` on NCCL only makes the current stream wait), so reading it a step later waits for
    that event alone, not for the step queued since (``.item()`` would). On CPU (gloo) the wait is deferred to the
    read, when the reduction is long complete."""

    def __init__(self, wish: bool, device: torch.device):
        self.flag = torch.full((1,), 1.0 if wish else 0.0, device=device)  # a fill: no copy from the host
        self.handle, self.event, self.host = None, None, self.flag
        if torch.distributed.is_initialized():
            self.handle = torch.distributed.all_reduce(self.flag, op=torch.distributed.ReduceOp.MAX, async_op=True)
        if device.type != "cpu":
            accelerator = get_accelerator()
            if self.handle is not None:
                self.handle.wait()
                self.handle = None
            self.host = accelerator.pin_memory(torch.empty((1,), dtype=self.flag.dtype))
            self.host.copy_(self.flag, non_blocking=True)
            self.event = accelerator.Event()
            self.event.record()

    def result(self) -> bool:
        """Whether any rank wished to stop (host memory only; waits for this vote's reduction alone)."""
        if self.handle is not None:
            self.handle.wait()
            self.handle = None
        if self.event is not None:
            self.event.synchronize()
        return bool(self.host[0] > 0)


class Trainer:
    """One job on this rank: set-up in ``__init__``, the loop in :meth:`run`."""

    def __init__(self, plan: Plan, topo: dist.Topology, task):
        self.plan, self.topo, self.task = plan, topo, task
        b, ds = plan.cfg.bertopt, plan.cfg.deepspeed
        self.output_dir = plan.output_dir
        if b.train.deterministic:
            # torch's deterministic mode refuses cuBLAS GEMMs without a fixed workspace; set it before the first one
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        batch_keys = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
        self.micro, self.accum, self.global_batch = (ds[key] for key in batch_keys)
        seed_everything(b.train.seed)  # identical init on every rank
        model = task.build(plan.cfg, topo)
        check_same_data(task.fingerprint, topo)  # nodes with their own caches must have built the same data
        if plan.resume_root is not None:  # the pre-flight compared the config; now the vocabulary and samples too
            data = task.fingerprint.identity()
            current = checkpoint.identity(plan.run_id, topo.world_size, describe(plan.cfg), task.name, data)
            checkpoint.check_resumable(plan.resume_root, plan.run_id, current)
        self.sampler = PlanBatchSampler(
            task.lengths,
            rank=topo.rank,
            world_size=topo.world_size,
            ranks_per_node=topo.ranks_per_node,
            micro_batch=self.micro,
            grad_accum=self.accum,
            cfg=b.sampler,
            seed=b.train.seed,
        )
        steps_per_epoch = self.sampler.steps_per_epoch
        epochs_steps = steps_per_epoch * b.train.epochs if b.train.epochs else None
        self.max_steps = min(s for s in (b.train.max_steps, epochs_steps) if s is not None)
        self.cfg = with_total_steps(plan.cfg, self.max_steps)
        self.b = self.cfg.bertopt
        self._start_run_directory()
        zero_stage = dsconfig.zero_stage(ds)
        optimizer, scheduler = optim.build(
            model,
            self.b,
            global_batch=self.global_batch,
            zero_stage=zero_stage,
            offload=dsconfig.optimizer_offload(ds) is not None,
        )
        self.engine, _, _, _ = initialize(config=self.cfg, model=model, optimizer=optimizer, lr_scheduler=scheduler)
        seed_everything(b.train.seed + 7919 * (topo.rank + 1))  # distinct dropout (and sampling) per rank
        print0(
            f"{task.describe_model(self.engine)}; world {topo.world_size} ({topo.num_nodes} node(s) × "
            f"{topo.ranks_per_node}); global batch {self.global_batch} = {self.micro} × {self.accum} accumulation × "
            f"{topo.world_size} ranks; ZeRO {zero_stage}"
        )
        self.metrics = Metrics(self.engine, self.output_dir, topo.is_main)
        self.step = 0
        self.identity = checkpoint.identity(
            self.run_id, topo.world_size, describe(plan.cfg), task.name, task.fingerprint.identity()
        )
        if plan.resume_root is not None:
            self._resume(plan.resume_root)
        print0(
            f"plan: {steps_per_epoch} steps per epoch ({b.sampler.strategy}), {self.max_steps} steps; "
            f"{self.sampler.dropped} samples left out of each epoch's last partial global batch; "
            f"{b.train.max_consecutive_nonfinite} steps in a row with non-finite gradients stop the job"
        )
        self.history: dict = {"eval": [], "train": []}
        self.skipped_in_a_row = 0
        self.stop_requested = False
        self.pin_memory = self.engine.device.type != "cpu"
        workers = b.train.dataloader_workers
        self.workers = workers if workers is not None else (2 if self.pin_memory else 0)

    # --- run directory and resume ------------------------------------------------------------------
    def _start_run_directory(self) -> None:
        """The first write of the run: only now, after the pre-flight and the data and model checks passed. Rank 0
        first takes the directory's lock for the run's lifetime (:class:`~.rundir.RunLock`: a second run with
        the same ``output_dir`` is refused, a killed run's lock is gone with its process); its verdict is
        broadcast, so every rank stops with the same line."""
        self.run_id, refused = self.plan.run_id, None
        if self.topo.is_main:
            try:
                self.lock = rundir.RunLock(self.output_dir)
                if self.plan.resume_root is None:
                    overwrite, described = self.b.train.overwrite_output_dir, describe(self.cfg)
                    self.run_id = rundir.start_fresh(self.output_dir, overwrite, described, self.plan.writes)
                elif self.run_id is not None:  # what this continuation may write beside the run's earlier entries
                    rundir.write_run(self.output_dir, self.run_id, self.plan.writes)
            except BertOptError as exc:
                refused = str(exc)
        holder = [self.run_id, refused]
        if torch.distributed.is_initialized():
            torch.distributed.broadcast_object_list(holder, src=0)
        self.run_id, refused = holder
        if refused:
            raise JobError(refused)
        dist.barrier()  # no rank writes into output_dir before it exists

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
        sizes = {"world_size": self.topo.world_size, "global_batch": self.global_batch, "max_steps": self.max_steps}
        return {"step": self.step, "sampler": self.sampler.state_dict(), **sizes, "identity": self.identity}

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
            worker_init_fn=ignore_preemption_signals,
        )
        return iter(loader)

    def train_step(self, batches, sample_log, window: Window) -> None:
        """One optimizer step over this rank's ``grad_accum`` collated micro-batches."""
        engine, topo, device = self.engine, self.topo, self.engine.device
        epoch = batches[0][0][0]
        self.sampler.advance()  # the consumed position, for checkpoints (the loader's copy plans and runs ahead)
        if sample_log is not None:
            indices = [list(key[3]) for key, _ in batches]
            record = {"step": self.step + 1, "epoch": epoch, "rank": topo.rank, "node": topo.node_rank}
            sample_log.write(json.dumps({**record, "indices": indices}) + "\n")
        normalizer = None
        if self.task.global_loss_normalizer:
            targets = sum(batch["num_targets"] for _, batch in batches)
            normalizer = step_loss_normalizer(targets, self.accum, topo.world_size, device)
        losses, tokens = [], 0
        for _, batch in batches:
            tokens += batch["num_tokens"]
            # the loss to backpropagate, and the mean loss to report
            loss, mean_loss = self.task.loss(engine, to_device(batch, device), normalizer)
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
            scale = loss_scale(engine.optimizer, "?")
            print0(f"step {self.step}: skipped by the fp16 loss scaler (gradient overflow), loss scale now {scale}")
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
    def evaluate(self) -> bool:
        """Collective: evaluate, log; returns whether ``train.target_eval_accuracy`` is reached (the score is
        all-reduced, so every rank agrees)."""
        scores = self.task.evaluate(self.engine, self.topo, self.b.train.seed)
        record = {"step": self.step, "epoch": self.sampler.epoch, **scores}
        self.history["eval"].append(record)
        self.metrics.write(record, self.step * self.global_batch)
        print0(f"step {self.step}: {self.task.eval_line(record)}")
        target = self.b.train.target_eval_accuracy
        score = getattr(self.task, "target_metric", "eval_accuracy")  # the task's main score (fine-tuning: per task)
        reached = target is not None and self.step > 0 and record[score] >= target
        if reached:
            print0(f"step {self.step}: the target accuracy {target:g} is reached; stopping")
            self.history["target_reached_at"] = self.step
        return reached

    def save(self) -> None:
        path = checkpoint.save(
            self.engine, self.output_dir, self.step, self.client_state(), self.topo, self.b.train.keep_last
        )
        print0(f"checkpoint saved: {path}")

    def _on_signal(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        if signum == signal.SIGINT and self.stop_requested == "SIGINT":
            raise KeyboardInterrupt  # a second Ctrl-C: stop now (main says what is left)
        self.stop_requested = self.stop_requested or signal.Signals(signum).name

    def _agreed_stop(self, pending: Optional["StopVote"]) -> tuple[bool, "StopVote"]:
        """Cast this step's stop vote; return (the verdict of the step before, the new vote).

        Ranks may receive the signal in different steps; the MAX over ranks, read one step later, makes every
        rank stop after the same step."""
        verdict = pending.result() if pending is not None else False
        return verdict, StopVote(bool(self.stop_requested), self.engine.device)

    # --- the loop -----------------------------------------------------------------------------------
    def run(self) -> dict:
        t = self.b.train
        evaluates = t.eval_every > 0 or t.eval_each_epoch
        if self.step == 0 and t.eval_every:
            self.evaluate()
        sample_log = None
        if t.log_samples:
            os.makedirs(os.path.join(self.output_dir, rundir.SAMPLES_DIR), exist_ok=True)
            path = os.path.join(self.output_dir, rundir.SAMPLES_DIR, f"rank{self.topo.rank}.jsonl")
            sample_log = open(path, "a", encoding="utf-8", buffering=1)  # closed in the finally
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
                epoch_end = t.eval_each_epoch and self.sampler.step == self.sampler.steps_per_epoch
                if self.step % t.log_every == 0 or last:
                    record = window.close(self.step, self.engine.get_lr()[0], self.sampler.epoch, self.max_steps, bar)
                    self.history["train"].append(record)
                    self.metrics.write(record, self.step * self.global_batch)
                due = (t.eval_every and self.step % t.eval_every == 0) or epoch_end or (last and evaluates)
                if due and evaluated_at != self.step:
                    last = self.evaluate() or last  # the quality target ends the run as its last step would
                    evaluated_at = self.step
                stop, pending = self._agreed_stop(pending)
                if (t.save_every and self.step % t.save_every == 0) or last or stop:
                    self.save()
                if last:
                    break
                if stop:
                    cause = self.stop_requested or "a signal on another rank"
                    raise Preempted(
                        f"preempted ({cause}): stopped after step {self.step} of {self.max_steps}; checkpoint "
                        f"{checkpoint.checkpoint_root(self.output_dir)}/{checkpoint.tag_for(self.step)} is complete, "
                        f"continue with --resume (exit status {PREEMPTED_EXIT})"
                    )
        finally:
            if pending is not None:
                pending.result()  # no collective left in flight
            for s, handler in previous.items():
                signal.signal(s, handler)
            bar.close()
            if sample_log is not None:
                sample_log.close()
            del batches_iter  # stops the loader's workers
        if t.save_model:
            self.task.save_final(self.engine, os.path.join(self.output_dir, rundir.FINAL_DIR), self.topo)
        return {**self.history, "step": self.step}


# --- the entry point ---------------------------------------------------------------------------------
def build_arg_parser(task) -> argparse.ArgumentParser:
    """The CLI of a task: :func:`ds_bertopt.config.run_arg_parser` with the common aliases and the task's."""
    return run_arg_parser(task.description, {**COMMON_SHORTCUTS, **task.shortcuts})


def main(task, argv: Optional[list[str]] = None) -> int:
    """Run ``task`` from the command line; returns the exit status (2: bad input, 1: a dead peer,
    :data:`PREEMPTED_EXIT`: checkpointed after a preemption signal)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local checkpoints only: never reach for the hub mid-run
    args = build_arg_parser(task).parse_args(argv)
    started = False
    try:
        topo = dist.topology_from_env(local_rank_arg=args.local_rank)
        dist.set_cpu_thread_default(topo)
        # this rank's GPU before anything touches CUDA: the pre-flight's precision check queries the current device
        dist.bind_device(topo, get_accelerator())
        plan = preflight(
            task, args.deepspeed_config, run_overrides(args), topo, get_accelerator().device_name(), resume=args.resume
        )
        started = True
        train = plan.cfg.bertopt.train
        dist.init_distributed(topo, timeout_s=train.dist_timeout_s, init_timeout_s=train.dist_init_timeout_s)
        dist.verify_topology(topo)
        history = Trainer(plan, topo, task).run()
        print0(task.done_line(history))  # before the group goes: without a launcher's RANK, rank comes from it
        dist.shutdown()
    except Preempted as exc:  # every rank checkpointed together: their collectives are over
        print0(str(exc))
        dist.shutdown()
        return PREEMPTED_EXIT
    except BertOptError as exc:
        # after the pre-flight an error may be specific to this rank: every rank that hits it says so (a verdict
        # the ranks reached together, a JobError, is the same line everywhere: said once)
        (print_all if started and not isinstance(exc, JobError) else print0)(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a second Ctrl-C, or one before training started
        good = checkpoint.complete_tags(checkpoint.checkpoint_root(plan.output_dir)) if started else []
        resume = f"the last complete checkpoint is {good[0]}, continue with --resume" if good else "nothing to resume"
        print0(f"interrupted: stopped at once, without a checkpoint of this step; {resume}", file=sys.stderr)
        return 130
    except OSError as exc:  # a full disk outside a checkpoint (metrics, the final model): one line, not a traceback
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        print_all(
            f"error: no space left on {device_of(exc.filename or '.')} while writing "
            f"{exc.filename or 'the run directory'}",
            file=sys.stderr,
        )
        return 1
    except Exception as exc:  # noqa: BLE001 - a dead peer: say who, then fail
        if not started or not dist.is_comm_failure(exc):
            raise
        print_all(
            f"error: lost contact with the other ranks: {dist.describe_dead_peers(topo.rank)} "
            f"({type(exc).__name__}: {str(exc).splitlines()[0][:160]})",
            file=sys.stderr,
        )
        return 1
    return 0
