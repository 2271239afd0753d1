"""The section runner's pieces: context, bounded subprocess jobs, the pretraining job, metrics."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]
ENTRY = ROOT / "bench" / "gpu_check.py"
"""The script every run of a worker mode starts (``GPU_CHECK_WORKER`` set)."""

PREFIX = "[gpu_check]"
TINY_MODEL = (
    "model.hidden_size=32",
    "model.num_hidden_layers=1",
    "model.num_attention_heads=2",
    "model.intermediate_size=64",
    "data.max_seq_length=64",
    "deepspeed.train_micro_batch_size_per_gpu=4",
)
DETERMINISTIC_CUBLAS = ":4096:8"  # what torch's deterministic mode demands of cuBLAS (CUBLAS_WORKSPACE_CONFIG)


def say(line: str) -> None:
    print(f"{PREFIX} {line}", flush=True)


class Skip(Exception):
    """The section (or a sub-check) cannot run here; the message is the reason."""


@dataclass
class Result:
    status: str  # PASS | FAIL | SKIPPED(<reason>)
    figures: str = ""


@dataclass
class Ctx:
    device: str
    tiny: bool
    gpus: int
    workdir: Path
    deadline: float
    jobs: int
    section: str = ""

    def left(self) -> float:
        return self.deadline - time.monotonic()

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    @property
    def cache_dir(self) -> Path:
        return self.workdir / "cache"

    def detail(self, text: str) -> None:
        for line in str(text).splitlines() or [""]:
            say(f"  {self.section} | {line}")

    def dir(self, *parts: str) -> Path:
        path = self.workdir.joinpath(self.section, *parts)
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def env(self, **extra: str) -> dict:
        """Environment of a subprocess: the checkout importable, offline, the accelerator pinned."""
        env = dict(os.environ)
        env.pop("DS_BERTOPT_FAULT", None)
        env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1", DS_ACCELERATOR=self.device)
        env["OMP_NUM_THREADS"] = "1" if self.device == "cpu" else env.get("GPU_CHECK_RUN_THREADS", "2")
        env.update(extra)
        return env


# ------------------------------------------------------------------------------------------------------------
# subprocess runs: many at once, each bounded, each a process group of its own
# ------------------------------------------------------------------------------------------------------------
_LIVE_GROUPS: set[int] = set()


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def on_terminate(signum, frame) -> None:  # noqa: ARG001 - signal handler
    """``timeout`` (the shell's budget) sends SIGTERM: take our runs' process trees down with us."""
    for pid in list(_LIVE_GROUPS):
        _kill_group(pid)
    raise SystemExit(124)


@dataclass
class Job:
    name: str
    cmd: list
    env: dict
    log: Path
    timeout: float
    rc: Optional[int] = None
    seconds: float = 0.0
    timed_out: bool = False
    started: bool = False
    out: Optional[Path] = None
    """The run's output directory, when it has one."""
    summary: Optional[Path] = None
    """A result file the run writes (sync counts)."""

    @property
    def ok(self) -> bool:
        return self.started and not self.timed_out and self.rc == 0

    def output(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, lines: int = 6) -> str:
        text = [x for x in self.output().splitlines() if x.strip() and "Warning" not in x[:20]]
        return " | ".join(x.strip()[:300] for x in text[-lines:])

    def status(self) -> str:
        if not self.started:
            return "not started (time budget spent)"
        if self.timed_out:
            return f"timed out after {self.seconds:.0f} s"
        return f"exit {self.rc} in {self.seconds:.0f} s"


def run_jobs(ctx: Ctx, jobs: list, parallel: int = 1) -> list:
    """Run ``jobs`` (at most ``parallel`` at a time); each gets ``min(job.timeout, time left)``."""
    pending, running = list(jobs), []
    while pending or running:
        while pending and len(running) < parallel:
            job = pending.pop(0)
            budget = min(job.timeout, ctx.left() - 2)
            if budget < 10:
                continue  # job.started stays False: reported as not run
            job.log.parent.mkdir(parents=True, exist_ok=True)
            handle = open(job.log, "w")
            proc = subprocess.Popen(
                [str(c) for c in job.cmd],
                cwd=ROOT,
                env=job.env,
                stdout=handle,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            _LIVE_GROUPS.add(proc.pid)
            job.started = True
            running.append((job, proc, handle, time.monotonic(), time.monotonic() + budget))
        time.sleep(0.2)
        for entry in list(running):
            job, proc, handle, start, stop = entry
            rc = proc.poll()
            if rc is None and time.monotonic() < stop:
                continue
            if rc is None:
                job.timed_out = True
            _kill_group(proc.pid)  # the launcher's ranks and loader workers too, also after a normal exit
            rc = proc.wait()
            _LIVE_GROUPS.discard(proc.pid)
            handle.close()
            job.rc, job.seconds = rc, time.monotonic() - start
            running.remove(entry)
    return jobs


def free_port() -> int:
    """A free loopback port (imported when needed: ``--env`` must run where ds_bertopt does not import)."""
    from ds_bertopt.testing.distributed import free_port as _free_port

    return _free_port()


def launcher(gpus: int) -> list:
    """The deepspeed launcher of this interpreter (``bench/_common.py``'s, shared by every benchmark)."""
    from bench._common import deepspeed_launcher

    return deepspeed_launcher(gpus)


def pretrain_job(
    ctx: Ctx,
    name: str,
    out: Path,
    steps: int,
    overrides=(),
    *,
    flags=(),
    gpus: int = 1,
    use_launcher: bool = False,
    config: str = "ds_configs/bert.json",
    env: Optional[dict] = None,
    timeout: float = 180,
    script: str = "launch/pretrain.py",
    prefix: Optional[list] = None,
) -> Job:
    """``launch/pretrain.py`` on the embedded corpus (300 documents), every step logged, no evaluation."""
    if prefix is None:
        prefix = launcher(gpus) if use_launcher else [sys.executable, "-u"]
    cmd = [
        *prefix,
        script,
        "--deepspeed_config",
        config,
        "--max_steps",
        str(steps),
        "--output_dir",
        str(out),
        "--eval_every",
        "0",
        *flags,
    ]
    for text in (
        "data.max_documents=300",
        f"data.cache_dir={ctx.cache_dir}",
        *(TINY_MODEL if ctx.tiny else ()),
        *overrides,
    ):
        cmd += ["-o", text]
    return Job(name, cmd, env if env is not None else ctx.env(), out.parent / f"{out.name}.log", timeout, out=out)


def tiny_flags(ctx: Ctx) -> list:
    return [x for text in (TINY_MODEL if ctx.tiny else ()) for x in ("-o", text)]


def read_metrics(out: Path) -> list:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def losses_by_step(records: list) -> dict:
    """Per-step training loss (``log_every 1``); a later line for a step (after a resume) wins."""
    return {r["step"]: r["loss"] for r in records if "loss" in r and "eval_loss" not in r}


def log_line(job: Job, marker: str) -> Optional[str]:
    for line in job.output().splitlines():
        if marker in line:
            return line.split("] ", 1)[-1].strip()
    return None
