"""Train a tiny model with bucket clipping under the real ``deepspeed`` launcher and check every step.

    deepspeed --num_gpus 2 tests/scripts/bucket_clip_train.py --stages 0 1 2 --steps 3 --gas 2 --out R.json

For each ZeRO stage: ``ds_bertopt.engine.initialize`` with ``bucket_clip`` on (and DeepSpeed's
``gradient_clipping`` 1.0 in the config, which must be turned off), ``--steps`` optimizer steps of
``--gas`` micro-batches; after each step the parameters are compared with a replay that applies
AdamW to the reference clipped-and-averaged gradient. Rank 0 writes one JSON object per stage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from bucket_clip_reference import build_engine, expected_reduced, micro_batches, train_micro_batches  # noqa: E402


def run_stage(stage: int, steps: int, gas: int, max_norm: float) -> dict:
    rank = dist.get_rank()
    engine, reference = build_engine(stage, gas, {"max_norm": max_norm, "threshold": "uniform"})
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    worst, clipped, total = 0.0, 0, 0
    for step in range(steps):
        batches = micro_batches(rank, gas, step=step)
        train_micro_batches(engine, batches)
        want, _ = expected_reduced(engine, reference, batches, stage=stage, max_norm=max_norm, mode="uniform")
        coefficients = [float(c) for c in engine.bucket_clip.last_coefficients]
        clipped += sum(c < 0.999 for c in coefficients)
        total += len(coefficients)
        engine.step()
        for name, p in reference.named_parameters():
            p.grad = want[name].to(p.dtype)
        ref_opt.step()
        ours = dict(engine.module.named_parameters())
        for name, p in reference.named_parameters():
            worst = max(worst, (ours[name].detach().double() - p.detach().double()).abs().max().item())
    return {
        "stage": stage,
        "max_param_diff": worst,
        "clipped_buckets": clipped,
        "buckets": total,
        "gradient_clipping": engine.gradient_clipping(),
        "adapter": type(engine.bucket_clip).__name__,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--gas", type=int, default=2)
    parser.add_argument("--max_norm", type=float, default=0.05)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    results = [run_stage(stage, args.steps, args.gas, args.max_norm) for stage in args.stages]
    if dist.get_rank() == 0:
        with open(args.out, "w", encoding="utf-8") as fh:
            for result in results:
                fh.write(json.dumps(result) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
