"""The section runner's pieces: context, bounded subprocess jobs, the pretraining and worker jobs, metrics."""

import contextlib
import importlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from bench._common import argv, bert_overrides, bert_sizes, cpu_env, deepspeed_launcher, read_metrics, sync

ROOT = Path(__file__).resolve().parents[2]
ENTRY = ROOT / "bench" / "gpu_check.py"
"""The script every run of a worker mode starts (``GPU_CHECK_WORKER`` set)."""
SCRIPTS = ROOT / "tests" / "scripts"
"""The tests' scripts and helpers the check runs on the accelerator (with the tests' own judgement)."""

TINY_MODEL = (*bert_overrides(32, 1, 2, 64), "data.max_seq_length=64", "deepspeed.train_micro_batch_size_per_gpu=4")
TINY_BERT = bert_sizes(32, 2, 2, 64, vocab_size=200, max_position_embeddings=64)
"""The ``--tiny`` model of the sections that build their own ``BertConfig``."""


def test_script(name: str):
    """A module of ``tests/scripts``."""
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    return importlib.import_module(name)


def say(line: str) -> None:
    print(f"[gpu_check] {line}", flush=True)


def brief(exc: BaseException, limit: int = 200, first_line: bool = False) -> str:
    """``<type>: <message>`` of an exception, the message cut to ``limit`` characters (or its first line, cut)."""
    text = (str(exc).splitlines() or [""])[0] if first_line else str(exc)
    return f"{type(exc).__name__}: {text[:limit]}"


class Skip(Exception):
    """The section (or a sub-check) cannot run here; the message is the reason."""


@dataclass
class Result:
    status: str  # PASS | FAIL | SKIPPED(<reason>)
    figures: str = ""


def judged(problems: list, figures: str, passed: Optional[str] = None) -> Result:
    """FAIL with the problems and ``[figures]``, else PASS with ``passed`` (default: the figures)."""
    if problems:
        return Result("FAIL", "; ".join(problems) + f" [{figures}]")
    return Result("PASS", figures if passed is None else passed)


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

    def detail(self, text: str) -> None:
        for line in str(text).splitlines() or [""]:
            say(f"  {self.section} | {line}")

    def verdicts(self, label: str, checks: list) -> list:
        """Print ``(name, ok, detail)`` checks as detail lines; return the names of those that failed."""
        for name, ok, detail in checks:
            self.detail(f"{label}: {'ok  ' if ok else 'FAIL'} {name}" + (f" ({detail})" if detail else ""))
        return [name for name, ok, _ in checks if not ok]

    def dir(self, *parts: str) -> Path:
        path = self.workdir.joinpath(self.section, *parts)
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def env(self, **extra: str) -> dict:
        """Environment of a subprocess: ``bench/_common.py``'s (the checkout importable, offline), on this device."""
        threads = "1" if self.device == "cpu" else "2"
        return cpu_env(DS_ACCELERATOR=self.device, OMP_NUM_THREADS=threads, **extra)


# subprocess runs: many at once, each bounded, each a process group of its own
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
    out: Optional[Path] = None  # the run's output directory, when it has one

    @property
    def ok(self) -> bool:
        return self.started and not self.timed_out and self.rc == 0

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def tail(self, lines: int = 6) -> str:
        text = [x for x in self.output().splitlines() if x.strip() and "Warning" not in x[:20]]
        return " | ".join(x.strip()[:300] for x in text[-lines:])

    def status(self) -> str:
        if not self.started:
            return "not started (time budget spent)"
        if self.timed_out:
            return f"timed out after {self.seconds:.0f} s"
        return f"exit {self.rc} in {self.seconds:.0f} s"

    def line(self, marker: str) -> Optional[str]:
        """The first line of the log holding ``marker``, without its logger prefix."""
        return next((x.split("] ", 1)[-1].strip() for x in self.output().splitlines() if marker in x), None)


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
            pipes = dict(stdout=handle, stderr=subprocess.STDOUT)
            proc = subprocess.Popen([str(c) for c in job.cmd], cwd=ROOT, env=job.env, start_new_session=True, **pipes)
            _LIVE_GROUPS.add(proc.pid)
            job.started = True
            running.append((job, proc, handle, time.monotonic(), time.monotonic() + budget))
        time.sleep(0.2)
        for entry in list(running):
            job, proc, handle, start, stop = entry
            rc = proc.poll()
            if rc is None and time.monotonic() < stop:
                continue
            job.timed_out = rc is None
            _kill_group(proc.pid)  # the launcher's ranks and loader workers too, also after a normal exit
            job.rc, job.seconds = proc.wait(), time.monotonic() - start
            _LIVE_GROUPS.discard(proc.pid)
            handle.close()
            running.remove(entry)
    return jobs


def rank0_env() -> dict:
    """What the deepspeed launcher gives the one rank of a world of 1 (a plain process, no launcher)."""
    from ds_bertopt.testing.distributed import free_port

    port = str(free_port())
    return dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)


def python(ranks: int = 0) -> list:
    """This interpreter: through the deepspeed launcher on ``ranks`` ranks, or (``ranks`` 0) a plain process."""
    return deepspeed_launcher(ranks) if ranks else [sys.executable, "-u"]


def worker_job(ctx: Ctx, name: str, mode: str, args: list, log: Path, *, ranks: int = 0, timeout: float = 200, **env):
    """``bench/gpu_check.py`` in worker ``mode`` (``GPU_CHECK_WORKER``)."""
    return Job(name, [*python(ranks), ENTRY, *args], ctx.env(GPU_CHECK_WORKER=mode, **env), log, timeout)


def pretrain_args(ctx: Ctx, steps: int, *overrides: str) -> list:
    """``launch/pretrain.py``'s arguments every run of the check shares: ``ds_configs/bert.json``, ``steps`` steps, no
    evaluation, the embedded corpus (300 documents) cached in the work directory, the tiny model with ``--tiny``."""
    shared = ("data.max_documents=300", f"data.cache_dir={ctx.workdir / 'cache'}", *(TINY_MODEL if ctx.tiny else ()))
    config = dict(deepspeed_config="ds_configs/bert.json", max_steps=steps, eval_every=0)
    return argv(**config, overrides=[*shared, *overrides])


def pretrain_job(ctx: Ctx, name: str, out: Path, steps: int, overrides=(), *, flags=(), ranks=0, env=None, timeout=180):
    """``launch/pretrain.py`` (:func:`pretrain_args`, ``overrides``) into ``out``, its log next to it."""
    cmd = [*python(ranks), "launch/pretrain.py", *pretrain_args(ctx, steps, *overrides), "--output_dir", out, *flags]
    return Job(name, cmd, env if env is not None else ctx.env(), out.parent / f"{out.name}.log", timeout, out=out)


def losses_by_step(out: Path) -> dict:
    """Per-step training loss in a run's ``metrics.jsonl`` (``log_every 1``); after a resume a later line wins."""
    return {r["step"]: r["loss"] for r in read_metrics(out, "loss") if "eval_loss" not in r}


def timed(fn, device, before=None) -> float:
    """Seconds of ``fn()`` between syncs of ``device`` (none on a CPU), ``before()`` (a barrier) outside them."""
    sync(device)
    if before is not None:
        before()
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start
