"""Worker modes: what ``bench/gpu_check.py`` runs when ``GPU_CHECK_WORKER`` is set (subprocess entry points)."""

import argparse
import json
import os
from pathlib import Path

from .recorder import SyncRecorder
from .runner import TINY_BERT, test_script, timed

LAMB_STEPS = 4
"""Steps of each optimizer check (``worker_lamb``; the section's judgement expects them)."""


def worker_loop(argv: list) -> int:
    """A task's ``main`` with our instrumentation patched onto ``Trainer`` (in this process only).

    ``GPU_CHECK_TASK``: ``pretrain`` | ``finetune``. ``GPU_CHECK_SYNCS=PATH:FIRST:STEPS``: count host syncs from
    the start of step FIRST to the start of step FIRST+STEPS (whole loop iterations: step, logging, the
    preemption flag, checkpoint decisions), write the summary to PATH. ``GPU_CHECK_PROBE=DIR``: after the
    engine is built, write this rank's device facts to ``DIR/rank<r>.json``.
    """
    import torch

    from ds_bertopt.train import loop
    from ds_bertopt.train.tasks import TASKS

    syncs, probe = os.environ.get("GPU_CHECK_SYNCS"), os.environ.get("GPU_CHECK_PROBE")
    original_step, original_init = loop.Trainer.train_step, loop.Trainer.__init__
    if syncs:
        path, first, count = syncs.rsplit(":", 2)
        first, count = int(first), int(count)
        recorder = SyncRecorder(cuda=torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR") != "cpu")

        def train_step(self, batches, sample_log, window):
            upcoming = self.step + 1
            if upcoming == first + count and recorder.active:
                recorder.stop()
                Path(path).write_text(json.dumps(recorder.summary(count)))
            recorder.step = upcoming
            if upcoming == first:
                recorder.start()
            return original_step(self, batches, sample_log, window)

        loop.Trainer.train_step = train_step
    if probe:

        def init(self, plan, topo, task):
            original_init(self, plan, topo, task)
            facts = dict(rank=topo.rank, local_rank=topo.local_rank, engine_device=str(self.engine.device))
            facts["world_size"] = topo.world_size
            if torch.cuda.is_available():
                props = torch.cuda.get_device_properties(current := torch.cuda.current_device())
                facts.update(current_device=current, name=props.name, pci_bus_id=getattr(props, "pci_bus_id", None))
                facts.update(uuid=str(getattr(props, "uuid", "")), visible=os.environ.get("CUDA_VISIBLE_DEVICES"))
            os.makedirs(probe, exist_ok=True)
            Path(probe, f"rank{topo.rank}.json").write_text(json.dumps(facts))

        loop.Trainer.__init__ = init
    return loop.main(TASKS[os.environ.get("GPU_CHECK_TASK", "pretrain")](), argv)


def _start(argv: list, **options: dict) -> tuple:
    """(arguments, accelerator): ``--out``, ``--local_rank`` (the launcher passes it) and ``--<name>`` per option; the
    rank's device bound before ``deepspeed.init_distributed`` (NCCL binds to the current device)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=-1)
    for name, keywords in options.items():
        parser.add_argument(f"--{name}", **keywords)
    args = parser.parse_args(argv)
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        accelerator.set_device(int(os.environ.get("LOCAL_RANK", max(args.local_rank, 0))))
    deepspeed.init_distributed(dist_backend=accelerator.communication_backend_name(), verbose=False)
    return args, accelerator


def worker_lamb(argv: list) -> int:
    """``optim_zero_check.run_checks`` with the batches on the accelerator (the script builds them on the host,
    which the CPU accelerator takes as they are)."""
    import torch

    args, accelerator = _start(argv, checks=dict(nargs="+", required=True))
    ozc = test_script("optim_zero_check")
    device, host_batch = accelerator.current_device_name(), ozc.batch
    ozc.batch = lambda step, rank: {k: v.to(device) for k, v in host_batch(step, rank).items()}
    ozc.run_checks(args.out, tuple(args.checks), LAMB_STEPS)
    torch.distributed.destroy_process_group()
    return 0


def worker_clip(argv: list) -> int:
    """Step time of the bucket-clip hook vs DeepSpeed's ``gradient_clipping``: both engines in these processes,
    stepped interleaved (warm-up, then ``--rounds`` A/B rounds in alternating order); rank 0 writes JSON."""
    args, accelerator = _start(argv, rounds=dict(type=int, required=True), tiny=dict(action="store_true"))
    import torch
    import torch.distributed as dist

    from bench._common import interleaved
    from bench.bucket_clip import VARIANTS, build_engine, mlm_batch

    device = torch.device(accelerator.current_device_name())
    sizes = {**TINY_BERT, "num_hidden_layers": 1} if args.tiny else {}  # {}: BERT-base
    micro, seq, bucket = (2, 16, 10_000) if args.tiny else (16, 128, 5_000_000)
    precision, stage = "bf16" if device.type != "cpu" else "fp32", 0
    engines = {name: build_engine(sizes, micro, stage, name, bucket, precision) for name in VARIANTS}
    batch = {k: v.to(device) for k, v in mlm_batch(engines["bucket_clip"].module.config.vocab_size, micro, seq).items()}

    def step(eng) -> None:
        eng.backward(eng(**batch).loss)
        eng.step()

    # the step's own time, between device syncs after a barrier
    steps = {name: lambda eng=eng: timed(lambda: step(eng), device, dist.barrier) for name, eng in engines.items()}
    times = interleaved(steps, repeats=args.rounds)
    if dist.get_rank() == 0:
        facts = dict(precision=precision, stage=stage, micro=micro, seq=seq, world=dist.get_world_size())
        Path(args.out).write_text(json.dumps({"times": times, **facts}))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def worker_conformance(argv: list) -> int:
    """The conformance matrix's rows (``tests/scripts/conformance_worker.py``) on this machine's accelerator, with
    the optimizers ``ds_bertopt.optim`` really builds here (on CUDA: DeepSpeed's FusedAdam); rank 0 writes JSON."""
    import torch

    from ds_bertopt.testing.gpu_paths import APEX_ROWS, all_rows

    args, accelerator = _start(argv, rows=dict(nargs="+", required=True))
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    rows = [row for row in (*all_rows(), *APEX_ROWS) if row.id in set(args.rows)]  # the apex rows are not in all_rows
    results = test_script("conformance_worker").run_rows(rank, world, rows, args.out, accelerator.device_name())
    if rank == 0:
        Path(args.out, "results.json").write_text(json.dumps(results))
    torch.distributed.destroy_process_group()
    return 0


WORKERS = {"loop": worker_loop, "lamb": worker_lamb, "clip": worker_clip, "conformance": worker_conformance}
