"""What the bench/wtacrs*.py modules share beyond bench/_common.py: their tables, the CPU lock, a step to time."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._common import FIGURES, SUMMARY, maybe_lock, say  # noqa: E402, F401 - the harness, re-exported
from ds_bertopt.wtacrs.memory import step_fn  # noqa: E402

LOCK = "/tmp/ds_bertopt_cpu.lock"
TABLES: list[str] = []


def locked(fn, *args, **kwargs):
    """Run ``fn`` holding the shared CPU lock (one measurement at a time, others interleave between)."""
    with maybe_lock(LOCK):
        return fn(*args, **kwargs)


def setup_step(model_dir, spec: dict, batch: int, seq: int, model_config=None, precision: str = "fp32"):
    """One training step of setup ``spec`` (``ds_bertopt.wtacrs.memory.step_fn``), built once, to time."""
    setup = {"model": model_dir, "model_config": model_config, "wtacrs": spec, "batch": batch, "seq": seq}
    return step_fn({**setup, "precision": precision})
