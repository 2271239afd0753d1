"""The section loop and the command line behind ``bench/gpu_check.py``."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Optional

from . import conformance, lamb_equal, memory, nccl, precision, resume, syncs, unpadded, wtacrs
from .runner import Ctx, Result, Skip, on_terminate, say
from .workers import WORKERS

SECTION_FUNCTIONS: dict = {  # in the order a full run takes them
    "conformance": conformance.section_conformance,
    "precision": precision.section_precision,
    "lamb_equal": lamb_equal.section_lamb_equal,
    "resume": resume.section_resume,
    "wtacrs": wtacrs.section_wtacrs,
    "memory": memory.section_memory,
    "syncs": syncs.section_syncs,
    "unpadded": unpadded.section_unpadded,
    "nccl": nccl.section_nccl,
}
SECTIONS = tuple(SECTION_FUNCTIONS)


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
    try:
        from ds_bertopt.compat.deepspeed import problems

        gone = problems()
        if gone:  # the hooks this DeepSpeed lacks: runs that need them are refused before training
            facts["warning"] = f"DeepSpeed lacks hooks {sorted(gone)} (docs/compat.md)"
    except Exception as exc:  # noqa: BLE001
        facts["warning"] = f"compat check not run: {type(exc).__name__}: {str(exc)[:200]}"
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
    parser = argparse.ArgumentParser(description=sys.modules[__package__].__doc__.split("\n\n")[0])
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
    signal.signal(signal.SIGTERM, on_terminate)
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
