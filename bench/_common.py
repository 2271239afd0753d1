"""The one harness every benchmark script shares: summary lines, timing, records, the CPU run environment, child
command lines and runs, the optional timing lock (``bench/_report.py`` draws the plots from the records).

A benchmark runs as its own process (``bench/run_all.py``): it ``say``s the lines that matter into :data:`SUMMARY`,
adds figures with :func:`figure` and hands both to :func:`record`. Timing and records are re-exported from
``ds_bertopt.testing.measure``, so that a script imports one module whatever becomes of the package's test helpers.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import platform
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ds_bertopt.testing.measure import RecordAs, environment_line, interleaved, median, ratio_line, record_name  # noqa: E402,F401
from ds_bertopt.testing.measure import record_results  # noqa: E402

SUMMARY: list[str] = []
"""The lines this benchmark said (its report section's summary)."""
FIGURES: list[dict] = []
"""The figures this benchmark recorded (``bench/_report.py`` plots them)."""
TABLES: list[str] = []
"""The markdown tables this benchmark recorded (the report prints them under its figures)."""


def say(line: str) -> None:
    """Print a line that belongs in the report's summary, and keep it there."""
    print(line, flush=True)
    SUMMARY.append(line)


def figure(kind: str, file: str, title: str, series: list, **fields) -> None:
    """Record a figure for the report (``bench/_report.py`` draws it: ``bars``, ``curves``, ``errorbars``,
    ``scatter``, each with its own ``fields``)."""
    FIGURES.append({"kind": kind, "file": file, "title": title, "series": series, **fields})


def bar_figure(file: str, title: str, key: str, values: dict, unit: str, **fields) -> None:
    """Record a ``bars`` figure of one value, ``key``, per label (``values``: label -> value)."""
    series = [{"label": label, key: value} for label, value in values.items()]
    figure("bars", file, title, series, stack=[key], unit=unit, **fields)


def record(name: str, note: str, **payload) -> None:
    """Record this benchmark's summary and figures, then ``payload``, then ``note`` (``record_results``)."""
    record_results(name, {"summary": SUMMARY, "figures": FIGURES, **payload, "note": note})


def add_record_as(parser, default: str) -> None:
    """Every bench's ``--record-as``: the record's name (``record_name``), refused before the run where nothing would be
    recorded (``RecordAs``)."""
    what = "name of the recorded results (report section; needs DS_BERTOPT_BENCH_OUT, as bench/run_all.py sets it)"
    parser.add_argument("--record-as", type=record_name, action=RecordAs, default=default, help=what)


def status(ok: bool) -> str:
    """A target's verdict word, as every benchmark prints it."""
    return "met" if ok else "NOT met"


def cpu_env(**extra: str) -> dict:
    """Environment of a benchmark's training run: the checkout importable, offline, CPU, one thread per rank."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env.update(TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
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
        yield  # closing the file releases the lock


def bert_sizes(hidden: int, layers: int, heads: int, ffn: int, **extra) -> dict:
    """A BERT's sizes as ``BertConfig`` fields, ``extra`` fields after them."""
    sizes = {"hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads, "intermediate_size": ffn}
    return {**sizes, **extra}


def bert_overrides(hidden: int, layers: int, heads: int, ffn: int) -> list[str]:
    """The config overrides (``-o``) of a BERT of these sizes."""
    return config_overrides(model=bert_sizes(hidden, layers, heads, ffn))


def config_overrides(**sections: dict) -> list[str]:
    """Config overrides (``-o``): ``section.key=value`` per key of each section, the value as JSON."""
    return [f"{section}.{key}={json.dumps(value)}" for section, keys in sections.items() for key, value in keys.items()]


def argv(*args, overrides: Iterable[str] = (), **options) -> list[str]:
    """A child's command line: ``args``, then ``--key value`` per option (``True``: the bare flag), then ``-o`` per
    config override."""
    out = [str(arg) for arg in args]
    for key, value in options.items():
        out += [f"--{key}"] if value is True else [f"--{key}", str(value)]
    for text in overrides:
        out += ["-o", text]
    return out


def run_checked(cmd: list[str], what: str, env: Optional[dict] = None, timeout: Optional[float] = None):
    """Run a child to its end in the checkout (:func:`cpu_env` unless ``env``), its output captured; a failure raises
    with the tails of both streams."""
    proc = subprocess.run(cmd, cwd=ROOT, env=env or cpu_env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        raise RuntimeError(f"{what} failed: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def run_streamed(cmd: list[str], on_line: Callable[[str], object], timeout: float, env: Optional[dict] = None) -> int:
    """Run a child in the checkout, in its own process group (:func:`cpu_env` unless ``env``), handing each line of
    its output (stderr merged) to ``on_line``; past ``timeout`` seconds a watchdog kills the whole group, a silent hang
    too. Returns the exit status (negative: killed by that signal)."""
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env or cpu_env(), start_new_session=True, **pipes)

    def kill() -> None:
        with contextlib.suppress(ProcessLookupError):  # the group ended as the watchdog fired
            os.killpg(proc.pid, signal.SIGKILL)

    watchdog = threading.Timer(timeout, kill)
    watchdog.start()
    try:
        for line in proc.stdout:
            on_line(line)
        return proc.wait()
    finally:
        watchdog.cancel()


def checkpoint_weights(path) -> dict:
    """The Hugging Face model's weights in one of our DeepSpeed checkpoint directories: ``module`` of
    ``mp_rank_00_model_states.pt`` (a file with non-tensor objects too: its config, versions), our wrapper's
    ``model.`` prefix removed."""
    import torch

    raw = torch.load(Path(path) / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
    return {k[len("model.") :]: v for k, v in raw.items() if k.startswith("model.")}


ISA = (  # CPU flags -> what ``cpu_kind`` says, the first that matches
    ({"amx_bf16", "amx_tile"}, "AMX (native bf16)"),
    ({"avx512_bf16"}, "AVX512-BF16 (native bf16)"),
    ({"avx512f"}, "AVX512 (bf16 emulated)"),
    ({"avx2"}, "AVX2 (bf16 emulated)"),
)


def cpu_kind() -> str:
    """``CPU: <model name> (family <f>, model <m>), <n> cores available, <ISA>``, from ``/proc/cpuinfo`` (Linux; bf16
    is emulated without AVX512-BF16 / AMX: ~15x slower). The family and model tell apart CPUs that a hypervisor names
    alike: two "AMD EPYC" with AVX512-BF16 here had bf16 GEMM peaks of 428 and (family 26) 981 GFLOP/s."""
    name, flags, generation = platform.processor() or platform.machine(), set(), {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                key, _, value = (part.strip() for part in line.partition(":"))
                if key == "model name" and name in ("", platform.machine(), platform.processor()):
                    name = value
                elif key in ("cpu family", "model"):
                    generation.setdefault(key.split()[-1], value)
                elif key == "flags":
                    flags = set(value.split())
    except OSError:
        pass
    isa = next((label for need, label in ISA if need & flags), "no AVX2")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if len(generation) == 2:
        name += f" (family {generation['family']}, model {generation['model']})"
    return f"CPU: {name}, {cores} cores available, {isa}"


# --- shared by time_to_train_runs.py (finetune_tasks.py writes the same Trainer config, optim_parts.py interpolates
# the same crossing) ---
def trainer_ds_config(stage: int, **extra) -> dict:
    """A DeepSpeed config for Hugging Face ``Trainer``: the batch sizes and clipping ``"auto"`` (``Trainer`` fills them
    from its arguments), fp32, ZeRO ``stage``, no step prints; ``extra`` keys after them."""
    auto = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size", "gradient_clipping")
    fixed = {"zero_optimization": {"stage": stage}, "bf16": {"enabled": False}, "steps_per_print": 1_000_000}
    return {**dict.fromkeys(auto, "auto"), **fixed, **extra}


def first_crossing(values: list[float], target: float, *axes: list[float]) -> Optional[tuple[float, ...]]:
    """Each of ``axes`` (steps, seconds, samples) where ``values`` first reach ``target``, linearly interpolated
    between that point and the one before; None if they never do."""
    for i, value in enumerate(values):
        if value >= target:
            before = i - 1 if i else 0
            w = (target - values[before]) / (value - values[before]) if i else 1.0
            return tuple(float(axis[before] + w * (axis[i] - axis[before])) for axis in axes)
    return None


# --- shared by wtacrs.py, wtacrs_frontier.py ---
def md_row(cells: Iterable) -> str:
    """One markdown table row."""
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


def md_table(columns: list[str], rows: Iterable[str]) -> list[str]:
    """A markdown table's lines: the header of ``columns``, its rule, then ``rows`` (each from :func:`md_row`)."""
    return [md_row(columns), "|" + "---|" * len(columns), *rows]


# --- shared by bench/mfu.py (gemm_peak also by bench/finetune_tasks.py), bench/unpadded_attention.py ---
def padded_batch(samples: list[dict], device="cpu") -> dict:
    """``input_ids``, ``labels`` and ``attention_mask`` of ``samples`` (``input_ids`` and ``labels`` lists each)
    padded to the longest, as the stock padded model takes them."""
    import torch

    longest = max(len(s["input_ids"]) for s in samples)
    padded = {k: torch.full((len(samples), longest), -100 if k == "labels" else 0) for k in ("input_ids", "labels")}
    padded["attention_mask"] = torch.zeros(len(samples), longest, dtype=torch.long)
    for row, s in enumerate(samples):
        n = len(s["input_ids"])
        padded["input_ids"][row, :n] = torch.tensor(s["input_ids"])
        padded["labels"][row, :n] = torch.tensor(s["labels"])
        padded["attention_mask"][row, :n] = 1
    return {k: v.to(device) for k, v in padded.items()}


def sync(device) -> None:
    """Wait for ``device`` (a CUDA device; a no-op on a CPU)."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize()


def gemm_peak(device, dtype, repeats: int) -> float:
    """The best FLOP/s of ``torch.mm`` and ``F.linear`` (the op the model's layers run) on square matrices of 512 to
    4096 in ``dtype``: on CPUs without native bf16 the two take different kernels (``mm`` a slow one)."""
    import time

    import torch
    import torch.nn.functional as F

    best = 0.0
    for n in (512, 1024, 2048, 4096) if device.type == "cuda" else (512, 1024, 2048):
        a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
        for op in (torch.mm, F.linear):
            op(a, b)
            for _ in range(repeats):
                sync(device)
                start = time.perf_counter()
                op(a, b)
                sync(device)
                best = max(best, 2.0 * n**3 / (time.perf_counter() - start))
    return best


# --- shared by balance.py, bucket_clip.py ---
def pretrain_argv(out, config: str = "ds_configs/bert.json", overrides: Iterable[str] = (), **options) -> list[str]:
    """``launch/pretrain.py`` on ``config`` into ``out``, then ``options`` and ``overrides`` (:func:`argv`)."""
    return argv("launch/pretrain.py", deepspeed_config=config, output_dir=out, overrides=overrides, **options)


def read_metrics(out, key: Optional[str] = None) -> list[dict]:
    """The records of a run's ``out/metrics.jsonl`` that hold ``key`` (all without it); none if it is absent."""
    path = Path(out, "metrics.jsonl")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return [r for r in records if key is None or key in r]


# --- shared by balance.py, corpus_scale.py ---
def failed_nodes(nodes: int, ranks: int, args: list[str], timeout: float) -> list:
    """The nodes that failed (``NodeResult``s) of ``args`` run in the checkout as ``nodes`` simulated nodes ×
    ``ranks`` (``ds_bertopt.testing.multinode``, :func:`cpu_env`)."""
    from ds_bertopt.testing.multinode import run_local_multinode

    results = run_local_multinode(nodes, ranks, args, env=cpu_env(), timeout=timeout, cwd=str(ROOT))
    return [r for r in results if r.returncode]
