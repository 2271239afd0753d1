"""The prepared GPU check (``bench/gpu_check.sh``; the sections are the ``bench/gpucheck`` package): its command line
and section loop, and the worker its subprocesses run (``GPU_CHECK_WORKER`` set).

    python bench/gpu_check.py --sections precision memory --budget 200     # on a CUDA machine
    python bench/gpu_check.py --device cpu --tiny                          # smoke run of the logic on a CPU
"""

import argparse
import importlib
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.gpucheck.runner import Ctx, Result, Skip, brief, on_terminate, say
from bench.gpucheck.workers import WORKERS

SECTIONS = ("conformance", "precision", "lamb_equal", "resume", "wtacrs", "memory", "syncs", "unpadded", "nccl")
"""In the order a full run takes them; each is ``section_<name>`` of the module of that name."""


def environment() -> None:
    """What the machine offers (printed once by gpu_check.sh before the sections); also warms the imports."""
    facts = {"python": sys.version.split()[0]}
    for module in ("torch", "deepspeed", "transformers", "datasets", "tokenizers", "peft", "safetensors"):
        try:
            facts[module] = importlib.import_module(module).__version__
        except Exception as exc:  # noqa: BLE001 - report what is missing
            facts[module] = f"missing ({type(exc).__name__})"
    try:
        import torch

        facts.update(cuda=torch.version.cuda, gpus=torch.cuda.device_count())
        if torch.cuda.is_available():
            facts.update(gpu=torch.cuda.get_device_name(0), bf16=torch.cuda.is_bf16_supported())
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
        facts["ds_bertopt"] = f"not importable: {brief(exc)}"
    try:
        from ds_bertopt.compat.deepspeed import problems

        gone = problems()
        if gone:  # the hooks this DeepSpeed lacks: runs that need them are refused before training
            facts["warning"] = f"DeepSpeed lacks hooks {sorted(gone)} (docs/compat.md)"
    except Exception as exc:  # noqa: BLE001
        facts["warning"] = f"compat check not run: {brief(exc)}"
    say("env: " + json.dumps(facts))


def run_section(name: str, ctx: Ctx) -> Result:
    ctx.section = name
    start = time.monotonic()
    try:
        result = getattr(importlib.import_module(f"bench.gpucheck.{name}"), f"section_{name}")(ctx)
    except Skip as why:
        result = Result(f"SKIPPED({why})")
    except BaseException as exc:  # noqa: BLE001 - a section never takes the others down
        if isinstance(exc, SystemExit):
            raise
        traceback.print_exc(limit=4, file=sys.stdout)
        result = Result("FAIL", brief(exc, 300, first_line=True))
    parts = (f"{name}: {result.status}", result.figures, f"({time.monotonic() - start:.0f} s)")
    say(" ".join(part for part in parts if part))
    return result


def cuda_gpus() -> tuple:
    """(the GPUs torch sees, None) or (None, why each section is SKIPPED) when torch does not import or sees none."""
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - a broken install is reported per section, not as a traceback
        return None, f"torch not importable: {brief(exc, 120)}"
    if torch.cuda.is_available():
        return torch.cuda.device_count(), None
    return None, f"torch {torch.__version__} sees no CUDA device; use --device cpu for a smoke run"


def main(argv: Optional[list] = None) -> int:
    worker = os.environ.pop("GPU_CHECK_WORKER", None)  # not inherited by what the worker starts (DataLoader workers)
    if worker:
        return WORKERS[worker](list(sys.argv[1:] if argv is None else argv))
    parser = argparse.ArgumentParser(description="The prepared GPU check (docs/gpu_check.md).")
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=list(SECTIONS))
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="tiny sizes and fewer runs (the CPU smoke run)")
    parser.add_argument("--budget", type=float, default=470, help="seconds for all --sections (default: 470)")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all visible; CPU: 1)")
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
    gpus, why = cuda_gpus() if args.device == "cuda" else (1, None)
    if why:
        for name in args.sections:
            say(f"{name}: SKIPPED({why})")
        return 0
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="gpu_check_"))
    workdir.mkdir(parents=True, exist_ok=True)
    jobs = max(1, min(6, (os.cpu_count() or 4) // 3)) if args.device == "cuda" else 2  # runs at once on one GPU
    ctx = Ctx(args.device, args.tiny, args.gpus or gpus, workdir, start + args.budget, jobs)
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
