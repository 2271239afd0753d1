"""What a run reports: ``metrics.jsonl`` and DeepSpeed's monitor (rank 0), and the per-window log line.

Training losses are summed on the device during a window (no host sync per micro-batch) and read once
when the window is logged, all-reduced together with the token and micro-batch counts.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import torch
from tqdm.auto import tqdm

from ..log import print0
from .rundir import METRICS_FILE


class Metrics:
    """Rank 0 appends JSON lines to ``output_dir/metrics.jsonl`` and feeds DeepSpeed's monitor."""

    def __init__(self, engine, output_dir: str, is_main: bool):
        self.engine, self.is_main, self.path = engine, is_main, os.path.join(output_dir, METRICS_FILE)

    def write(self, record: dict, samples: int) -> None:
        if not self.is_main:
            return
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")
        monitor = getattr(self.engine, "monitor", None)
        if monitor is not None and getattr(monitor, "enabled", False):
            events = [
                (f"bertopt/{k}", float(v), samples)
                for k, v in record.items()
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
            ]
            monitor.write_events(events)


def all_reduce_sum(values: list, device) -> list[float]:
    """Sum python numbers and 0-d tensors over ranks, in one float64 all-reduce on ``device``."""
    t = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device).reshape(()) for v in values])
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(t)
    return t.tolist()


class Window:
    """Loss, tokens and micro-batches of the applied steps since the last log line."""

    def __init__(self, device):
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.loss = torch.zeros((), dtype=torch.float64, device=self.device)
        self.micro = self.tokens = self.skipped = 0
        self.started = time.perf_counter()

    def add_step(self, losses: list[torch.Tensor], tokens: int) -> None:
        self.loss += torch.stack([loss.detach().double() for loss in losses]).sum()
        self.micro += len(losses)
        self.tokens += tokens

    def close(self, step: int, lr: float, epoch: int, max_steps: int, bar) -> dict:
        """Collective: the record of this window (all ranks), logged on rank 0; then a fresh window."""
        loss_sum, micro, tokens = all_reduce_sum([self.loss, self.micro, self.tokens], self.device)
        elapsed = time.perf_counter() - self.started
        record = {"step": step, "lr": lr, "tokens_per_s": tokens / max(elapsed, 1e-9), "epoch": epoch}
        record["skipped"] = self.skipped
        if micro:  # every step of the window may have been skipped
            record["loss"] = loss_sum / micro
        text = f"loss {record['loss']:.4f}" if "loss" in record else "all steps skipped"
        bar.set_postfix_str(f"{text}, lr {lr:.2e}, {record['tokens_per_s']:.0f} tok/s")
        if bar.disable:  # no terminal: a plain line instead of the bar
            print0(f"step {step}/{max_steps}: {text}, lr {lr:.3e}, {record['tokens_per_s']:.0f} tokens/s")
        self.reset()
        return record


@torch.no_grad()
def sharded_evaluation(engine, topo, num_examples: int, batch_size: int, score, counted: str) -> dict:
    """Evaluate ``num_examples`` split over the ranks; ``score(indices) -> (loss sum, correct, count)``, the
    count being of what is ``counted`` (tokens, examples).

    Every rank runs equally many batches: a rank out of examples scores example 0 with weight 0, so
    collectives inside the forward (ZeRO-3's parameter gathers) stay in step across ranks. Sums stay on
    the device until one all-reduce at the end."""
    engine.eval()
    device = engine.device
    mine = list(range(topo.rank, num_examples, topo.world_size))
    batches = math.ceil(math.ceil(num_examples / topo.world_size) / batch_size)
    totals = [torch.zeros((), dtype=torch.float64, device=device) for _ in range(2)]
    count = 0
    for b in range(batches):
        chunk = mine[b * batch_size : (b + 1) * batch_size]
        weight = 1.0 if chunk else 0.0
        loss_sum, correct, n = score(chunk or [0])
        totals[0] += weight * loss_sum
        totals[1] += weight * correct
        count += int(weight * n)
    engine.train()
    loss_sum, correct, count = all_reduce_sum([*totals, count], device)
    return {
        "eval_loss": loss_sum / max(count, 1.0),
        "eval_accuracy": correct / max(count, 1.0),
        f"eval_{counted}": int(count),
    }


def progress_bar(total: int, initial: int, desc: str, is_main: bool, stream=None) -> tqdm:
    """tqdm on rank 0 when stderr is a terminal; otherwise a disabled bar (plain log lines are printed)."""
    stream = stream or sys.stderr
    return tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True, disable=not is_main or not stream.isatty())


def gather_objects(value) -> list:
    """Every rank's ``value`` (picklable), in rank order; ``[value]`` without a process group. Collective."""
    if not torch.distributed.is_initialized():
        return [value]
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, value)
    return out
