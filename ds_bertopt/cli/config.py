"""``ds-bertopt config FILE [--task pretrain|finetune] [--world-size N] [--ranks-per-node M] [training flags]``.

Runs the pre-flight that training runs (``ds_bertopt.train.preflight``: our section, DeepSpeed's part through
DeepSpeed's own parser, the resume checkpoint, the task's files) for the given world size, and prints the resolved
config. It writes nothing, so it neither reads nor judges the output directory (a config is checked the same
before and after its run). Training flags are the task's own (``--max_steps``,
``-o key=value``, …), so a command line can be checked before it is launched.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

from ..config import describe, run_overrides
from ..dist import Topology
from ..errors import ConfigError
from ..train.loop import build_arg_parser
from ..train.preflight import preflight
from ..train.tasks import TASKS


def main(argv: list[str]) -> int:
    head = argparse.ArgumentParser(prog="ds-bertopt config", description=__doc__, add_help=False)
    head.add_argument("--task", choices=sorted(TASKS), default="pretrain")
    head.add_argument("--world-size", type=int, default=1)
    head.add_argument("--ranks-per-node", type=int, default=None)
    head.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="the accelerator the job will run on (precision and fp16 rules differ)",
    )
    known, rest = head.parse_known_args(argv)
    if any(a in ("-h", "--help") for a in rest) or not rest:
        head.print_help()
        return 0 if rest else 2
    task = TASKS[known.task]()
    if rest and not rest[0].startswith("-"):
        rest = ["--deepspeed_config", rest[0], *rest[1:]]
    args = build_arg_parser(task).parse_args(rest)
    world, per_node = known.world_size, known.ranks_per_node or known.world_size
    if world < 1:
        raise ConfigError(f"--world-size: must be at least 1, got {world}")
    if per_node < 1 or world % per_node:
        raise ConfigError(f"--ranks-per-node: {per_node} does not divide world size {world}")
    topo = Topology(rank=0, world_size=world, local_rank=0, ranks_per_node=per_node, node_rank=0)
    with contextlib.redirect_stdout(sys.stderr):  # the pre-flight's log lines; stdout holds the JSON only
        plan = preflight(
            task, args.deepspeed_config, run_overrides(args), topo, known.device, resume=args.resume, run_dir=False
        )
    json.dump(describe(plan.cfg), sys.stdout, indent=2)
    print()
    return 0
