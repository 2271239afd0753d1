"""``ds-bertopt config FILE [-o key=value ...] [--world-size N]``: validate and print a config."""
from __future__ import annotations

import argparse
import json

from .config import describe, load_config, resolve_batch


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ds-bertopt config", description=__doc__)
    parser.add_argument("path")
    parser.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--world-size", type=int, default=1)
    args = parser.parse_args(argv)
    cfg = load_config(args.path, args.override)
    cfg = cfg.with_deepspeed(resolve_batch(cfg.deepspeed, args.world_size))
    print(json.dumps(describe(cfg), indent=2))
    return 0
