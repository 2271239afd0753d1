"""``ds-bertopt prepare-data``: build a pretraining job's data cache ahead of the job, e.g. on a CPU node before GPU
time starts; the job then opens it in seconds (``docs/data.md``).

    ds-bertopt prepare-data --deepspeed_config ds_configs/bert.json --train_file corpus/*.jsonl \\
        -o data.cache_dir=/shared/ds_bertopt_cache -o data.num_proc=32

It reads the config and the command line as ``launch/pretrain.py`` does (the same flags, the tokenizer of
``model.init_checkpoint``), so the stored build it writes is the one the job looks for. A cache that is already
current is only checked. Progress prints every 30 s.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Optional


def main(argv: Optional[list[str]] = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from ..config import load_config, run_overrides
    from ..errors import ConfigError
    from ..data.pipeline import build_pretrain_data
    from ..log import print0
    from ..model.pretrained import resolve_checkpoint
    from ..train.loop import build_arg_parser
    from ..train.preflight import check_dead_keys, check_keys_are_read
    from ..train.tasks.pretrain import PretrainTask

    task = PretrainTask()
    parser = build_arg_parser(task)
    parser.prog = "ds-bertopt prepare-data"
    parser.description = "Build the data cache of a pretraining config ahead of the job."
    args = parser.parse_args(argv)
    if args.resume is not None:  # a resumed job opens the cache its first run built, by that run's config
        raise ConfigError("--resume has no effect on prepare-data: a resumed job opens the cache its first run built")
    overrides = run_overrides(args)
    cfg = load_config(args.deepspeed_config, overrides)
    check_keys_are_read(task, cfg)  # the job's own refusals, before anything is built
    check_dead_keys(cfg, overrides)
    started = time.perf_counter()
    b = cfg.bertopt
    model_cfg, data_cfg, _, lines = resolve_checkpoint(b.model, b.data)
    for line in lines:
        print0(line)
    task.preflight(dataclasses.replace(cfg, bertopt=dataclasses.replace(b, data=data_cfg)), None)
    data = build_pretrain_data(dataclasses.replace(b, model=model_cfg, data=data_cfg))
    print0(f"data: {data.opened}")
    print0(
        f"prepare-data: {data.source}: {len(data.train):,} training sequences, {len(data.eval):,} held out, "
        f"vocabulary {len(data.tokenizer):,} (samples {data.fingerprint.samples}), ready in "
        f"{time.perf_counter() - started:.1f} s; a job with this config and data.cache_dir "
        f"{os.path.abspath(os.path.expanduser(data_cfg.cache_dir))} opens it"
    )
    return 0
