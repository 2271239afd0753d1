"""Rank-0 printing: the one helper every module uses for user-facing lines."""

from __future__ import annotations

import os
import sys


def global_rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:  # pragma: no cover - torch is a hard dependency
        pass
    return int(os.environ.get("RANK", "0") or 0)


def is_main() -> bool:
    return global_rank() == 0


def _print_whole(*args, file=None, sep: str = " ", end: str = "\n") -> None:
    """``print`` as one write: the ranks of a launcher share its stdout pipe, and a line written in pieces, or
    behind a buffer longer than the pipe's atomic size, can come out with another rank's output inside it."""
    file = file or sys.stdout
    file.flush()  # what was pending goes first, on its own
    file.write(sep.join(map(str, args)) + end)
    file.flush()


def print0(*args, file=None, **kwargs) -> None:
    """``print`` on global rank 0 only, prefixed with ``[ds_bertopt]`` and flushed as one write."""
    if is_main():
        _print_whole("[ds_bertopt]", *args, file=file, **kwargs)


def print_all(*args, **kwargs) -> None:
    """``print`` on every rank, prefixed with the rank (for per-rank diagnostics), as one write."""
    _print_whole(f"[ds_bertopt rank {global_rank()}]", *args, **kwargs)
