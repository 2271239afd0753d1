"""What the bench/wtacrs*.py modules share: the recorded lines, figures and tables, the CPU lock, a step to time."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ds_bertopt.wtacrs.memory import step_fn  # noqa: E402

LOCK = "/tmp/ds_bertopt_cpu.lock"

SUMMARY: list[str] = []  # for bench/run_all.py's report (record_results)
FIGURES: list[dict] = []


def say(line: str) -> None:
    print(line, flush=True)
    SUMMARY.append(line)


TABLES: list[str] = []


def locked(fn, *args, **kwargs):
    """Run ``fn`` holding the shared CPU lock (one measurement at a time, others interleave between)."""
    import fcntl

    with open(LOCK, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            return fn(*args, **kwargs)
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def setup_step(model_dir, spec: dict, batch: int, seq: int, model_config=None, precision: str = "fp32"):
    """One training step of setup ``spec`` (``ds_bertopt.wtacrs.memory.step_fn``), built once, to time."""
    setup = {"model": model_dir, "model_config": model_config, "wtacrs": spec, "batch": batch, "seq": seq}
    return step_fn({**setup, "precision": precision})
