"""Worker modes: what ``bench/gpu_check.py`` runs when ``GPU_CHECK_WORKER`` is set (subprocess entry points)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from .recorder import SyncRecorder
from .runner import ROOT


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

    syncs = os.environ.get("GPU_CHECK_SYNCS")
    probe = os.environ.get("GPU_CHECK_PROBE")
    if syncs:
        path, first, count = syncs.rsplit(":", 2)
        first, count = int(first), int(count)
        recorder = SyncRecorder(cuda=torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR") != "cpu")
        original_step = loop.Trainer.train_step

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
        original_init = loop.Trainer.__init__

        def init(self, plan, topo, task):
            original_init(self, plan, topo, task)
            facts = {
                "rank": topo.rank,
                "local_rank": topo.local_rank,
                "engine_device": str(self.engine.device),
                "world_size": topo.world_size,
            }
            if torch.cuda.is_available():
                current = torch.cuda.current_device()
                props = torch.cuda.get_device_properties(current)
                facts.update(
                    current_device=current,
                    name=props.name,
                    uuid=str(getattr(props, "uuid", "")),
                    pci_bus_id=getattr(props, "pci_bus_id", None),
                    visible=os.environ.get("CUDA_VISIBLE_DEVICES"),
                )
            os.makedirs(probe, exist_ok=True)
            Path(probe, f"rank{topo.rank}.json").write_text(json.dumps(facts))

        loop.Trainer.__init__ = init
    task = TASKS[os.environ.get("GPU_CHECK_TASK", "pretrain")]()
    return loop.main(task, argv)


def worker_lamb(argv: list) -> int:
    """``optim_zero_check.run_checks`` with the batches on the accelerator (the script builds them on the host,
    which the CPU accelerator takes as they are)."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--checks", nargs="+", default=None)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--local_rank", type=int, default=-1)
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT / "tests" / "scripts"))
    import deepspeed
    import optim_zero_check as ozc
    import torch
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    local_rank = int(os.environ.get("LOCAL_RANK", max(args.local_rank, 0)))
    if accelerator.device_name() != "cpu":
        accelerator.set_device(local_rank)  # before the first collective: NCCL binds to the current device
    deepspeed.init_distributed(dist_backend=accelerator.communication_backend_name(), verbose=False)
    device = accelerator.current_device_name()
    host_batch = ozc.batch
    ozc.batch = lambda step, rank: {k: v.to(device) for k, v in host_batch(step, rank).items()}
    ozc.run_checks(args.out, tuple(args.checks or ozc.ALL_CHECKS), args.steps)
    torch.distributed.destroy_process_group()
    return 0


def worker_clip(argv: list) -> int:
    """Step time of the bucket-clip hook vs DeepSpeed's ``gradient_clipping``: both engines in these processes,
    stepped interleaved (warm-up, then ``--rounds`` A/B rounds in alternating order); rank 0 writes JSON."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--stage", type=int, default=0)
    p.add_argument("--local_rank", type=int, default=-1)
    args = p.parse_args(argv)
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator
    from transformers import BertConfig, BertForMaskedLM

    from bench._common import bert_sizes
    from ds_bertopt.engine import initialize

    accelerator = get_accelerator()
    cuda = accelerator.device_name() != "cpu"
    if cuda:
        accelerator.set_device(int(os.environ.get("LOCAL_RANK", max(args.local_rank, 0))))
    deepspeed.init_distributed(dist_backend=accelerator.communication_backend_name(), verbose=False)
    device = torch.device(accelerator.current_device_name())
    sizes = bert_sizes(32, 1, 2, 64, vocab_size=200, max_position_embeddings=64) if args.tiny else {}  # {}: BERT-base
    micro, seq, bucket = (2, 16, 10_000) if args.tiny else (16, 128, 5_000_000)
    precision = "bf16" if cuda else "fp32"

    def engine(hook: bool):
        torch.manual_seed(0)
        model = BertForMaskedLM(BertConfig(**sizes, attn_implementation="sdpa"))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
        cfg = {
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 1.0,
            "steps_per_print": 10**9,
            "zero_optimization": {
                "stage": args.stage,
                "overlap_comm": True,
                "contiguous_gradients": True,
                "reduce_bucket_size": bucket,
            },
            "bertopt": {"train": {"precision": precision}},
        }
        if hook:
            cfg["bertopt"]["bucket_clip"] = {"enabled": True, "max_norm": 1.0, "bucket_size": bucket}
        return initialize(config=cfg, model=model, optimizer=optimizer)[0]

    engines = {"bucket_clip": engine(True), "deepspeed_clip": engine(False)}
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    vocab = engines["bucket_clip"].module.config.vocab_size
    ids = torch.randint(5, vocab, (micro, seq), generator=gen)
    labels = torch.where(torch.rand(micro, seq, generator=gen) < 0.15, ids, torch.full_like(ids, -100))
    batch = {
        k: v.to(device) for k, v in {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}.items()
    }

    def step(name: str) -> float:
        eng = engines[name]
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        eng.backward(eng(**batch).loss)
        eng.step()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    for name in engines:
        step(name)
    times: dict = {name: [] for name in engines}
    for r in range(args.rounds):
        for name in list(engines) if r % 2 == 0 else list(engines)[::-1]:
            times[name].append(step(name))
    if dist.get_rank() == 0:
        Path(args.out).write_text(
            json.dumps(
                {
                    "times": times,
                    "precision": precision,
                    "stage": args.stage,
                    "micro": micro,
                    "seq": seq,
                    "world": dist.get_world_size(),
                }
            )
        )
    dist.barrier()
    dist.destroy_process_group()
    return 0


def worker_conformance(argv: list) -> int:
    """The conformance matrix's rows (``tests/scripts/conformance_worker.py``) on this machine's accelerator, with
    the optimizers ``ds_bertopt.optim`` really builds here (on CUDA: DeepSpeed's FusedAdam); rank 0 writes JSON."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--rows", nargs="+", required=True)
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT / "tests" / "scripts"))
    import deepspeed
    import torch
    from conformance_worker import run_rows
    from deepspeed.accelerator import get_accelerator

    from ds_bertopt.testing.gpu_paths import all_rows

    accelerator = get_accelerator()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if accelerator.device_name() != "cpu":
        accelerator.set_device(int(os.environ.get("LOCAL_RANK", 0)))  # before the first collective
    deepspeed.init_distributed(dist_backend=accelerator.communication_backend_name(), verbose=False)
    rows = [row for row in all_rows() if row.id in set(args.rows)]
    results = run_rows(rank, world, rows, args.out, device_type=accelerator.device_name())
    if rank == 0:
        Path(args.out, "results.json").write_text(json.dumps(results))
    torch.distributed.destroy_process_group()
    return 0


WORKERS = {"loop": worker_loop, "lamb": worker_lamb, "clip": worker_clip, "conformance": worker_conformance}
