"""``ds-bertopt``: the console script. Each subcommand lives next to its capability and is imported
only when used, so ``ds-bertopt balance`` never imports DeepSpeed."""

from __future__ import annotations

import importlib
import sys

from ..errors import BertOptError

# name -> ("module", "function(argv) -> exit code", "one-line help")
COMMANDS = {
    "balance": (
        "ds_bertopt.cli.balance",
        "main",
        "plan batches for a corpus and world size; print load balance per strategy",
    ),
    "memory": (
        "ds_bertopt.cli.memory",
        "main",
        "saved-activation bytes and peak memory of fine-tuning, full vs WTA-CRS / LoRA / kit",
    ),
    "config": ("ds_bertopt.cli.config", "main", "validate a config file and print the resolved result"),
    "prepare-data": (
        "ds_bertopt.cli.prepare_data",
        "main",
        "build a pretraining config's data cache ahead of the job (which then opens it in seconds)",
    ),
    "hostfile": (
        "ds_bertopt.hostfile",
        "main",
        "check a DeepSpeed hostfile (duplicates, bad lines, unequal slots) before launching",
    ),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: ds-bertopt COMMAND [args]\n\ncommands:")
        for name, (_, _, help_text) in COMMANDS.items():
            print(f"  {name:10s} {help_text}")
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    module_name, func_name, _ = COMMANDS[argv[0]]
    func = getattr(importlib.import_module(module_name), func_name)
    try:
        return int(func(argv[1:]) or 0)
    except BertOptError as exc:
        print(f"ds-bertopt {argv[0]}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
