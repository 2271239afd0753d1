"""The one harness every benchmark script shares: its summary lines, timing, records, the CPU run environment, the
optional timing lock (plots are drawn from the records by bench/_report.py).

A benchmark runs as its own process (``bench/run_all.py``), so the module-level :data:`SUMMARY` and :data:`FIGURES`
are that benchmark's: it ``say``s the lines that matter and hands both to ``record_results`` for the report.
Timing (:func:`interleaved`, :func:`median`, :func:`ratio_line`) and records (:func:`record_results`,
:func:`environment_line`) are re-exported here from ``ds_bertopt.testing.measure``, so that a script imports one
module whatever becomes of the package's test helpers.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
from pathlib import Path
from typing import Iterator, Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ds_bertopt.testing.measure import (  # noqa: E402, F401 - the harness's timing and records
    environment_line,
    interleaved,
    median,
    ratio_line,
    record_results,
)

SUMMARY: list[str] = []
"""The lines this benchmark said (its report section's summary)."""
FIGURES: list[dict] = []
"""The figures this benchmark recorded (``bench/_report.py`` plots them)."""


def say(line: str) -> None:
    """Print a line that belongs in the report's summary, and keep it there."""
    print(line, flush=True)
    SUMMARY.append(line)


def status(ok: bool) -> str:
    """A target's verdict word, as every benchmark prints it."""
    return "met" if ok else "NOT met"


def cpu_env(**extra: str) -> dict:
    """Environment of a benchmark's training run: the checkout importable, offline, CPU, one thread per rank."""
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    env.pop("DS_BERTOPT_FAULT", None)  # a fault injected into the caller is never the benchmark's
    env.update(extra)
    return env


def deepspeed_launcher(ranks: int, port: Optional[int] = None) -> list[str]:
    """The ``deepspeed`` launcher of this interpreter for ``ranks`` local ranks (``python -m``: the venv need not be
    on PATH), on ``port`` or a free one; the script and its arguments follow."""
    if port is None:
        from ds_bertopt.testing.distributed import free_port  # here: gpu_check --env runs without ds_bertopt

        port = free_port()
    runner = [sys.executable, "-u", "-m", "deepspeed.launcher.runner"]
    return [*runner, "--num_gpus", str(ranks), "--master_port", str(port)]


@contextlib.contextmanager
def maybe_lock(path: Optional[str]) -> Iterator[None]:
    """Hold ``flock(path)`` around a timed run (``--lock`` on a shared machine); no-op when ``path`` is empty."""
    if not path:
        yield
        return
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
