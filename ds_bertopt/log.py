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


def print0(*args, file=None, **kwargs) -> None:
    """``print`` on global rank 0 only, prefixed with ``[ds_bertopt]`` and flushed."""
    if is_main():
        print("[ds_bertopt]", *args, file=file or sys.stdout, flush=True, **kwargs)


def print_all(*args, **kwargs) -> None:
    """``print`` on every rank, prefixed with the rank (for per-rank diagnostics)."""
    print(f"[ds_bertopt rank {global_rank()}]", *args, flush=True, **kwargs)
